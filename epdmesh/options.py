"""Options shared by several commands: routing (the toggle and a gateway that routes in-process both run
`services.routing.router`), SLO targets and stage budgets, how stage calls reach a worker, remote images, and the
model and engine options of the commands that run one."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from epdmesh.checkpoints import default_model_dir

DEFAULT_EMULATED_PROFILE = "H20"  # the analytic LLaVA-1.5-7B on H20 profile (= profiles/llava-1.5-7b-h20.json)


def profile_spec(value: str) -> str:
    """A `--profile` / `--latency-profile` value: a profile file or an analytic spec (`H20`, `H20:qwen2-vl-7b-1344`),
    loaded here so that a typo is a usage error with the reason, not a traceback from a worker. Checked where the
    command runs (`epdmesh.cli.main`, the benchmarks' parsers), not by the serve parser, which also checks argv
    written for other machines (`epdmesh deploy k8s`)."""
    from common.latency.roofline import load_profile

    try:
        load_profile(value)
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise argparse.ArgumentTypeError(f"{value}: {error}") from None
    return value


def add_routing_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--prefill-mode",
        default="auto",
        choices=["auto", "dedicated", "multiplexed"],
        help="where prefills run when decoders can prefill too (auto: short prompts on the decoder)",
    )
    p.add_argument(
        "--multiplex-max-tokens",
        type=int,
        default=256,
        help="auto mode: longest prompt prefilled on a decoder (SLO routing: when both paths fit)",
    )
    p.add_argument(
        "--routing",
        default="auto",
        choices=["auto", "least-loaded", "slo"],
        help="the toggle's policy; auto: the SLO-aware multiplexing toggle when --latency-profile is given",
    )
    p.add_argument(
        "--admission-control",
        action="store_true",
        help="SLO routing: refuse (503 + Retry-After) a request no path can serve within its SLO",
    )
    p.add_argument(
        "--cache-aware-routing",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="send a prompt to the worker predicted to hold most of it in its prefix cache (what this router "
        "sent where), within a few requests of the least loaded one's queue",
    )
    add_reserved_output_arg(p)


def add_reserved_output_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--reserved-output-tokens",
        type=int,
        help="output tokens of room a request needs on its decoder's KV beyond the prompt: booked by the route where "
        "the decoder prefills it, by the decoder before it takes handed-over pages in (default 256: decoders grow "
        "beyond them, and preempt when full; 0: the prompt only; serve --kv-admission worst-case: all of max_tokens)",
    )


def reserved_output_tokens(args) -> int:
    """--reserved-output-tokens, else all of a request's max_tokens where the workers book their worst case (so routes
    never overbook them), else the routing policy's default."""
    from common.policy.routing import RoutingConfig

    if getattr(args, "reserved_output_tokens", None) is not None:
        return args.reserved_output_tokens
    if getattr(args, "kv_admission", "on-demand") == "worst-case":
        return 1 << 30
    return RoutingConfig().reserved_output_tokens


def add_router_args(p: argparse.ArgumentParser) -> None:
    """What a router needs beyond `add_routing_args` (the toggle's; serve has its own --latency-profile)."""
    p.add_argument(
        "--latency-profile",
        help="route by the SLO-aware multiplexing policy over this profile (default: least loaded)",
    )


def decoder_joins(mode: str | None) -> tuple[bool, bool]:
    """(joins, join_first) of a --decoder-joins mode (see `budgets_for`); `auto` is resolved by `serve`."""
    return mode in ("on", "first"), mode == "first"


def routing_policy(args):
    """(RoutingConfig, SloRouting or None) from the parsed routing, router and SLO options."""
    from common.policy.routing import RoutingConfig

    routing = RoutingConfig(
        prefill_mode=args.prefill_mode,
        multiplex_max_tokens=args.multiplex_max_tokens,
        reserved_output_tokens=reserved_output_tokens(args),
        cache_aware=args.cache_aware_routing,
    )
    if args.routing == "slo" and not args.latency_profile:
        raise SystemExit("--routing slo needs --latency-profile")
    if not args.latency_profile or args.routing == "least-loaded":
        return routing, None
    from common.latency.roofline import load_profile
    from common.policy.multiplex import MultiplexConfig
    from services.routing.router import SloRouting

    # each worker's stage budgets (τ_t, join-first) come with its registration: the policy reads them there
    return routing, SloRouting(
        load_profile(args.latency_profile),
        args.slo_ttft_ms,
        args.slo_tbt_ms,
        MultiplexConfig(short_prompt_tokens=args.multiplex_max_tokens, admission_control=args.admission_control),
    )


def router_argv(args, latency_profile: str | None) -> list[str]:
    """The command-line options that give a toggle or gateway process this launch's routing policy."""
    return [
        "--prefill-mode",
        args.prefill_mode,
        "--multiplex-max-tokens",
        str(args.multiplex_max_tokens),
        "--reserved-output-tokens",
        str(reserved_output_tokens(args)),
        "--routing",
        args.routing,
        "--slo-ttft-ms",
        str(args.slo_ttft_ms),
        "--slo-tbt-ms",
        str(args.slo_tbt_ms),
        *([] if args.cache_aware_routing else ["--no-cache-aware-routing"]),
        *(["--latency-profile", latency_profile] if latency_profile else []),
        *(["--admission-control"] if args.admission_control else []),
    ]


def add_planner_args(p: argparse.ArgumentParser) -> None:
    """The planner (`common/policy/planner.py`), run by the gateway: it switches workers' roles as the load moves."""
    p.add_argument(
        "--planner",
        action="store_true",
        help="re-balance the workers' role sets to the load every --planner-interval seconds (needs a latency "
        "profile; plans meshes whose role sets split the stages: EP+D, E+P+D, ED+P, E+PD)",
    )
    p.add_argument("--planner-interval", type=float, default=10.0, help="seconds between plans")
    p.add_argument(
        "--planner-margin", type=float, default=0.1, help="switch when the bottleneck's load falls by this share"
    )
    p.add_argument("--planner-max-switches", type=int, default=1, help="workers switched per interval")
    p.add_argument(
        "--planner-reshape",
        action="store_true",
        help="weigh TriInfer's shapes (E+P+D, EP+D, ED+P) beside the mesh's own and move between them",
    )
    p.add_argument(
        "--planner-grace",
        type=float,
        default=2.0,
        help="seconds a switching worker's running decodes may finish before they go on elsewhere",
    )


def planner_argv(args) -> list[str]:
    """The planner's options, for the gateway process `serve` starts."""
    if not args.planner:
        return []
    return [
        "--planner",
        "--planner-interval",
        str(args.planner_interval),
        "--planner-margin",
        str(args.planner_margin),
        "--planner-max-switches",
        str(args.planner_max_switches),
        "--planner-grace",
        str(args.planner_grace),
        *(["--planner-reshape"] if args.planner_reshape else []),
    ]


def planner_config(args):
    from common.policy.planner import PlannerConfig

    try:
        return PlannerConfig(
            interval_s=args.planner_interval,
            margin=args.planner_margin,
            max_switches=args.planner_max_switches,
            grace_s=args.planner_grace,
            reshape=args.planner_reshape,
        )
    except ValueError as e:
        raise SystemExit(f"--planner: {e}") from None


def add_trace_args(p: argparse.ArgumentParser) -> None:
    """The gateway's recorded trace (`services/gateway/trace_record.py`), which the simulator and the topology search
    replay (`--workload trace:PATH`)."""
    p.add_argument(
        "--record-trace",
        metavar="PATH|redis",
        help="record every request (arrival, prompt and answer lengths, prefix blocks and pictures as hashes — no "
        "text) as a line of a Mooncake-format trace: appended to the file PATH, or `redis`: to a Redis stream that "
        "every gateway of a mesh shares (`epdmesh trace export` writes it to a file); replay it with "
        "`epdmesh plan --workload trace:PATH`",
    )
    p.add_argument(
        "--record-trace-key", default="epdmesh:trace", help="with --record-trace redis: the stream's Redis key"
    )
    p.add_argument(
        "--record-trace-max",
        type=int,
        default=50_000,
        help="with --record-trace redis: the requests the stream keeps (its oldest trimmed past that, roughly; a "
        "request's line is ~1 KB at 1,000 prompt tokens)",
    )
    p.add_argument(
        "--record-trace-block",
        type=int,
        default=16,
        help="prompt tokens per prefix id: 16, the engines' KV block, shows every prefix they can share; 512 is "
        "Mooncake's (shorter lines, shared prefixes only in whole 512-token blocks)",
    )


def trace_argv(args) -> list[str]:
    """The recorded trace's options, for the gateway process `serve` starts (a file's path made absolute)."""
    if not args.record_trace:
        return []
    import os

    spec = args.record_trace if args.record_trace == "redis" else os.path.abspath(args.record_trace)
    return [
        "--record-trace",
        spec,
        "--record-trace-key",
        args.record_trace_key,
        "--record-trace-max",
        str(args.record_trace_max),
        "--record-trace-block",
        str(args.record_trace_block),
    ]


def add_slo_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--slo-ttft-ms", type=float, default=2000.0, help="default TTFT target (SLO attainment metrics)")
    p.add_argument("--slo-tbt-ms", type=float, default=200.0, help="default P90 time-between-tokens target")


def add_budget_args(p: argparse.ArgumentParser) -> None:
    """How a worker sizes its stage budgets from the SLOs and its latency profile (what it registers; routers read
    them from the registry)."""
    p.add_argument(
        "--budget-headroom",
        type=float,
        default=1.0,
        help="stage budgets fill this fraction of their iteration-time limit (α·TTFT or TBT); < 1 leaves "
        "room for what the latency profile does not predict",
    )
    p.add_argument(
        "--budget-alpha",
        type=float,
        default=0.5,
        help="α: instances without the decode role size their iterations to α·TTFT (TriInfer: 0.5)",
    )
    p.add_argument(
        "--decoder-joins",
        default="auto",
        choices=["auto", "on", "first", "off"],
        help="decoders take requests handed over by dedicated prefill workers. on: size their iterations to "
        "TBT/2 (a request that joins waits for the iteration in flight, then its own); first: give a "
        "joining request's first decode a decode-only iteration, and size the others to TBT less one "
        "such iteration. serve: auto = first where decoders also prefill beside dedicated prefill "
        "workers; elsewhere auto = off",
    )
    p.add_argument(
        "--gap-slack",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="with budgets from a latency profile (serve's own or --latency-profile): a decoder whose running "
        "requests can each spare a gap past the TBT target (their P90 gap still within it) runs that iteration "
        "to α·TTFT, taking whole prompts (default: on; --no-gap-slack keeps every iteration within the TBT)",
    )
    p.add_argument(
        "--gap-slack-reserve",
        type=int,
        default=0,
        help="with --gap-slack: slow gaps each request keeps for delays its decoder does not see",
    )


def add_tls_arg(p) -> None:
    p.add_argument(
        "--tls-dir",
        default=os.environ.get("EPDMESH_TLS_DIR"),
        help="mutual TLS on every gRPC hop of the mesh (and to a rediss:// Redis): a directory with ca.crt, "
        "tls.crt and tls.key (a Kubernetes TLS secret's layout; `epdmesh tls init DIR` writes one); "
        "default: $EPDMESH_TLS_DIR, else plaintext",
    )


def add_stage_calls_arg(p) -> None:
    p.add_argument(
        "--stage-calls",
        default="stream",
        choices=["stream", "unary"],
        help="how Encode, AwaitEncode and Prefill reach a worker: on one gRPC stream kept open to it (a "
        "message each way) or as unary rpcs",
    )


def add_first_token_hold_arg(p) -> None:
    p.add_argument(
        "--first-token-hold",
        action="store_true",
        help="send the first token of a request handed over by its prefill worker together with its second "
        "(from the decoder), at most until 90%% of its TTFT target: a later first token, within the target, "
        "and no stall after it (common/policy/first_token.py); requests prefilled where they decode are "
        "never held",
    )


def add_remote_image_args(p) -> None:
    """The gateway's (`epdmesh serve`, `epdmesh gateway`): whether it fetches http(s) image URLs, and from where."""
    p.add_argument(
        "--allow-remote-images",
        action="store_true",
        help="fetch http(s) image URLs (off by default: images come inline as base64 data URIs)",
    )
    p.add_argument(
        "--allowed-image-domains",
        default="",
        help="with --allow-remote-images: comma-separated hosts images may come from (a domain allows its "
        "subdomains); default: any",
    )


def allowed_image_domains(args) -> tuple[str, ...]:
    return tuple(d.strip() for d in args.allowed_image_domains.split(",") if d.strip())


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model", help=f"Hugging Face llava-1.5 directory (default: the tiny model in {default_model_dir()})"
    )
    p.add_argument("--served-model-name")
    p.add_argument("--max-model-len", type=int)


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "bfloat16", "float32"],
        help="auto: bfloat16 on CUDA and on CPUs that compute it natively (AMX, AVX512-BF16), else float32",
    )
    p.add_argument("--device", default="cpu")
    p.add_argument(
        "--kv-cache-gib",
        type=float,
        help="KV cache size per worker (default: on a GPU, what "
        "--gpu-memory-utilization leaves; on the CPU 1; emulated: 64, "
        "counted in the model's real page bytes)",
    )
    p.add_argument(
        "--image-cache-gib",
        type=float,
        default=0.25,
        help="image cache per worker that encodes or prefills: encoded images held until their prompt is prefilled, "
        "or for a prefix cache's reuse (a worker that only decodes has one block)",
    )
    p.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.9,
        help="fraction of the GPU's memory for the weights, activations and caches (serve: split among "
        "the workers that share a GPU)",
    )
    p.add_argument(
        "--token-budget", type=int, help="τ_t: tokens per iteration (default: from --latency-profile, else 2048)"
    )
    p.add_argument(
        "--image-budget", type=int, help="τ_e: images per iteration (default: from --latency-profile, else 4)"
    )
    p.add_argument(
        "--latency-profile",
        help="a latency profile (epdmesh profile; or H20/H100/H200, H20:qwen2-vl-7b-1344): τ_t and τ_e are the "
        "largest batches within α·TTFT (instances without decode) or TBT (with decode)",
    )
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument(
        "--kv-admission",
        default="on-demand",
        choices=["on-demand", "worst-case"],
        help="on-demand: KV blocks as requests grow, the newest preempted when the cache runs out (vLLM); "
        "worst-case: prompt + max_tokens booked at admission, never preempted, fewer requests at once",
    )
    p.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "flash-attn", "xformers"])
    p.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reuse the KV of a prompt's cached full blocks (images included, by content), as vLLM and "
        "SGLang do by default; a request whose cached prefix covers its images skips the vision tower "
        "(--no-enable-prefix-caching: compute every prompt in full)",
    )
    p.add_argument(
        "--share-weights",
        action="store_true",
        help="CPU: the workers on this host map one read-only copy of the weights from /dev/shm instead "
        "of a copy each (common/model/shared_weights.py)",
    )
    p.add_argument(
        "--enforce-eager",
        action=argparse.BooleanOptionalAction,
        default=os.environ.get("EPDMESH_ENFORCE_EAGER", "") not in ("", "0"),
        help="run the model eagerly; by default a CPU worker compiles its dense path (torch.compile, a few "
        "seconds at start from a warm cache) and a CUDA worker replays its decode steps as CUDA graphs (captured "
        "at start); default from $EPDMESH_ENFORCE_EAGER",
    )
    p.add_argument(
        "--amx-tiles",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="CPU with AMX: keep the decoder's linear weights a second time as AMX tiles, on which decode steps of "
        "up to 48 sequences run their products (~1.4x oneDNN's speed, the same bits) and prompts theirs and their "
        "SwiGLU (~1.4x); on a CPU with AVX512-BF16 and no AMX, decode steps of up to 16 sequences run theirs on the "
        "vector units from the same tiles (1.2-1.4x a step on a Zen 4); made only while the copy takes <= 10%% of "
        "the host's memory. --no-amx-tiles: one copy, oneDNN for every product",
    )
    p.add_argument(
        "--prompt-kernel",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="CPU with AVX-512: prompts' and images' attention through our C kernel (kernels/cpu_prompt.c), "
        "3.4-4.7x torch's SDPA at 128-1024 tokens on a Zen 5, 1.0-1.4x on a Xeon (its products on the AMX tiles). "
        "--no-prompt-kernel: SDPA (process-wide)",
    )
    p.add_argument("--threads", type=int, help="torch intra-op threads (serve: default cores / workers)")
    p.add_argument(
        "--backend",
        default="torch",
        choices=["torch", "emulated"],
        help="emulated: iterations wait the --profile's predicted time and emit deterministic tokens; "
        "everything else (batching, caches, transfers, routing) is the real code",
    )
    p.add_argument(
        "--profile",
        help="emulated backend: the latency profile to run, a file or H20 / H100 / H200 for the "
        "analytic LLaVA-1.5-7B one (H20:qwen2-vl-7b-1344: an encode-heavy model's shapes; "
        f"default {DEFAULT_EMULATED_PROFILE})",
    )
    p.add_argument(
        "--emulated-kv-bytes-per-token",
        type=int,
        default=256,
        help="emulated backend: real KV bytes per token in the pages (the transfer waits for the model's)",
    )
    p.add_argument("--emulated-image-bytes-per-token", type=int, default=64)


def add_chat_template_arg(p) -> None:
    p.add_argument(
        "--chat-template",
        help="a Jinja chat template to use instead of the checkpoint's: a file, or the "
        "template itself (e.g. one that renders tools)",
    )


def chat_template(args) -> str | None:
    """The template `--chat-template` names: a file's text, or the value itself when it is a template."""
    value = args.chat_template
    if value is None:
        return None
    path = Path(value).expanduser()
    if path.is_file():
        return path.read_text()
    if "{{" in value or "{%" in value:
        return value
    raise SystemExit(f"--chat-template: {value} is neither a file nor a Jinja template")
