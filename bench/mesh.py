"""What the mesh costs: TTFT and per-token gap of `E1+P1+D1` against the same engine in-process.

    python -m bench.mesh [--requests 20] [--max-tokens 32] [--topology E1+P1+D1]

Three configurations, all up at once and measured interleaved (request i on each in turn, in an order that rotates),
every process on 1 torch thread, on the real engine (torch CPU, fp32, the default tiny checkpoint, the same scheduler
settings: 256-token budget), one request at a time (no queueing), two workloads: `image` (one 320×240 image + a short
prompt: encode → prefill → decode, image and KV pages move) and `text` (the short prompt alone: the mesh's control
path with the least compute):
  engine   — AsyncEngine in this process, no HTTP, no gRPC (the baseline);
  local    — `epdmesh serve --topology local`: the same engine behind the HTTP gateway (HTTP cost);
  mesh     — `epdmesh serve --topology E1+P1+D1`: gateway (routes in-process over Redis) → encoder →
             prefill → decoder, image and KV pages pulled between processes (the transfer backend `serve`
             picks: NIXL where it loads, else the gRPC stream; --transfer to choose);
  mesh-toggle — the same mesh with `--route-in toggle`: every request's route is a gRPC call to the
             toggle (what routing in the gateway saves); --no-toggle-route leaves it out;
  mesh-unary — with `--unary`: the same mesh with `--stage-calls unary` (Encode, AwaitEncode and Prefill as
             unary rpcs, not messages on the stream kept open to each worker: what the open streams save);
  mesh-shared — with `--shared`: the same mesh with `--share-weights` (its workers map one copy of the weights);
  mesh-tls — with `--tls`: the same mesh with `--internal-tls auto` (mutual TLS on every gRPC hop, the private
             Redis over TLS with a password; pages on the encrypted gRPC stream unless --transfer nixl);
  mesh-against — with `--against DIR`: the same mesh served from another checkout, for an A/B of a change.
TTFT is taken at the first streamed token, per-token gap as the mean gap after it, by a minimal HTTP client
(bench/lean_http.py; --client httpx for httpx, whose own handling then counts as the server's). Reports p50s, the
mesh's TTFT added over engine and over local (the goal: ≤ 2 ms over the in-process engine), and ratios; each
comparison also paired (the median of per-request differences: request i is the same prompt everywhere).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import io
import itertools
import json
import statistics
import sys
import time
from pathlib import Path

if not __package__:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx  # noqa: E402
import numpy as np  # noqa: E402
from PIL import Image  # noqa: E402
from tqdm import tqdm  # noqa: E402

from bench.lean_http import LeanClient  # noqa: E402

BACKEND = "real engine (torch CPU, float32, 1 thread per process)"
SERVED_NAME = "tiny"  # the name tests.services.servers.running_server serves under


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="checkpoint dir (default: the default tiny model)")
    p.add_argument("--requests", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--topology", default="E1+P1+D1")
    p.add_argument(
        "--prefix-caching",
        action="store_true",
        help="leave prefix caching on in the servers (and turn it on in the in-process engine)",
    )
    p.add_argument("--transfer", default="auto", choices=["auto", "nixl", "grpc"])
    p.add_argument(
        "--client",
        default="lean",
        choices=["lean", "httpx"],
        help="HTTP client timing the servers: a minimal one (bench/lean_http.py), or httpx, whose own "
        "request and response handling (~1.5 ms here) then counts as the server's",
    )
    p.add_argument("--redis-url", default=None)
    p.add_argument(
        "--no-toggle-route",
        dest="toggle_route",
        action="store_false",
        help="leave out the mesh routed by the toggle's Route rpc",
    )
    p.add_argument(
        "--unary",
        action="store_true",
        help="also serve the topology with `--stage-calls unary` (Encode, AwaitEncode and Prefill as unary "
        "rpcs instead of messages on a stream kept open to each worker), measured interleaved",
    )
    p.add_argument(
        "--shared",
        action="store_true",
        help="also serve the topology with `--share-weights` (the workers map one read-only copy of the "
        "weights instead of a private copy each), measured interleaved",
    )
    p.add_argument(
        "--tls",
        action="store_true",
        help="also serve the topology with `--internal-tls auto` (mutual TLS inside the mesh), measured interleaved",
    )
    p.add_argument(
        "--against",
        metavar="DIR",
        help="also serve the topology from another checkout (e.g. `git worktree add --detach DIR REV`), "
        "measured interleaved with the rest: an A/B of a change on this noisy machine",
    )
    p.add_argument("--out", default="bench/results/mesh.json")
    args = p.parse_args(argv)
    if args.requests < 1 or args.max_tokens < 2:
        p.error("need --requests >= 1 and --max-tokens >= 2")
    return args


WORKLOADS = ("image", "text")


def conversation(seed: int, workload: str = "image"):
    """(PIL image or None, prompt text) of request `seed`."""
    text = "What is in this picture? Answer in one sentence."
    if workload == "text":
        return None, text
    pixels = (np.random.RandomState(seed).rand(240, 320, 3) * 255).astype("uint8")
    return Image.fromarray(pixels), text


def _data_uri(img) -> str:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


class InProcess:
    """The baseline: the engine in this process, called directly (no HTTP, no gRPC)."""

    def __init__(self, model_dir: str, prefix_caching: bool = False):
        import torch

        from common.engine.async_engine import AsyncEngine
        from common.engine.config import EngineConfig
        from common.engine.engine import Engine
        from common.memory import keep_freed_memory
        from common.model.processor import ChatProcessor
        from common.scheduler import SchedulerConfig

        torch.set_num_threads(1)
        keep_freed_memory()  # as the serving processes do: a like-for-like baseline
        self.processor = ChatProcessor(model_dir)
        config = EngineConfig(
            model=model_dir,
            kv_cache_gib=0.05,
            scheduler=SchedulerConfig(token_budget=256),
            enable_prefix_caching=prefix_caching,
        )
        self.engine = AsyncEngine(Engine(config, detokenize=self.processor.detokenize))
        self.count = 0

    async def measure(self, workload: str, i: int, max_tokens: int) -> tuple[float, float]:
        from common.request import Request
        from common.sampling import SamplingParams

        img, text = conversation(i, workload)
        content = ([{"type": "image", "image": img}] if img is not None else []) + [{"type": "text", "text": text}]
        start = time.perf_counter()
        ids, images = self.processor.apply([{"role": "user", "content": content}])
        self.count += 1
        request = Request(
            f"b{self.count}", ids, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True), images
        )
        times = []
        async for out in self.engine.generate(request):
            if out.new_token_ids:
                times.append(time.perf_counter())
        return _ttft_gap(start, times)

    def close(self) -> None:
        self.engine.shutdown()


async def measure_http(client, base: str, workload: str, i: int, max_tokens: int) -> tuple[float, float]:
    """`client`: an httpx.AsyncClient, or the lean client of the server at `base`."""
    img, text = conversation(i, workload)
    content = [{"type": "image_url", "image_url": {"url": _data_uri(img)}}] if img is not None else []
    body = {
        "model": SERVED_NAME,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
        "messages": [{"role": "user", "content": content + [{"type": "text", "text": text}]}],
    }
    payload = json.dumps(body).encode()  # serialized before the clock starts: client-side cost, not ours
    start, times = time.perf_counter(), []
    async for line in _post_lines(client, base, payload):
        if line.startswith("data: {"):
            choices = json.loads(line[6:])["choices"]
            if choices and choices[0].get("token_ids"):
                times.extend([time.perf_counter()] * len(choices[0]["token_ids"]))
    return _ttft_gap(start, times)


async def _post_lines(client, base: str, payload: bytes):
    if isinstance(client, LeanClient):
        async for line in client.post_lines("/v1/chat/completions", payload):
            yield line
        return
    async with client.stream(
        "POST", f"{base}/v1/chat/completions", content=payload, headers={"content-type": "application/json"}
    ) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            yield line


async def measure_interleaved(model_dir: str, bases: dict[str, str], args, bar) -> dict[str, dict[str, list]]:
    """Request i of each workload goes to engine, local and each mesh (in a rotating order) before request i + 1:
    a slow spell of this noisy machine hits all alike, so their differences hold even when absolute times drift."""
    engine = InProcess(model_dir, getattr(args, "prefix_caching", False))
    samples = {name: {w: [] for w in WORKLOADS} for name in ("engine", *bases)}
    lean = {name: LeanClient(base) for name, base in bases.items()}
    try:
        async with httpx.AsyncClient(timeout=120) as shared:
            names = list(samples)
            for i, workload in itertools.product(range(args.warmup + args.requests), WORKLOADS):
                for name in rotated(names, i):
                    if name == "engine":
                        sample = await engine.measure(workload, i, args.max_tokens)
                    else:
                        client = lean[name] if args.client == "lean" else shared
                        sample = await measure_http(client, bases[name], workload, i, args.max_tokens)
                    if i >= args.warmup:
                        samples[name][workload].append(sample)
                        bar.update()
    finally:
        engine.close()
        for client in lean.values():
            await client.close()
    return samples


def rotated(names: list[str], i: int) -> list[str]:
    """The order request i visits the configurations in: each takes every place in turn. In a fixed order the
    one right after another paid for it: an A/A run (the same checkout twice) put the second mesh 2.3 ms ahead on
    images, paired."""
    k = i % len(names)
    return names[k:] + names[:k]


def _ttft_gap(start: float, times: list[float]) -> tuple[float, float]:
    gaps = [b - a for a, b in zip(times, times[1:])]
    return (times[0] - start) * 1e3, statistics.mean(gaps) * 1e3 if gaps else 0.0


def paired(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Median of the per-request TTFT differences a − b. Request i ran on each configuration in turn, with the
    same prompt, so this pairs away most of the noise a difference of two medians keeps."""
    return statistics.median(x[0] - y[0] for x, y in zip(a, b))


def summarize(samples: list[tuple[float, float]]) -> dict:
    ttft = sorted(s[0] for s in samples)
    gap = sorted(s[1] for s in samples)
    return {
        "p50_ttft_ms": statistics.median(ttft),
        "p90_ttft_ms": ttft[int(0.9 * (len(ttft) - 1))],
        "p50_tpot_ms": statistics.median(gap),
        "num_requests": len(samples),
    }


def main(argv=None) -> int:
    from epdmesh.checkpoints import ensure_default_model
    from tests.services.servers import running_server

    args = parse_args(argv)
    model_dir = args.model or str(ensure_default_model())
    redis = ["--redis-url", args.redis_url] if args.redis_url else []
    logs = Path(args.out).parent
    logs.mkdir(parents=True, exist_ok=True)
    configs = [("local", "local", (), None), ("mesh", args.topology, (), None)]
    if args.toggle_route:
        configs.append(("mesh-toggle", args.topology, ("--route-in", "toggle"), None))
    if args.unary:
        configs.append(("mesh-unary", args.topology, ("--stage-calls", "unary"), None))
    if args.shared:
        configs.append(("mesh-shared", args.topology, ("--share-weights",), None))
    if args.tls:
        configs.append(("mesh-tls", args.topology, ("--internal-tls", "auto"), None))
    if args.against:
        configs.append(("mesh-against", args.topology, (), args.against))
    with (
        tqdm(
            total=(1 + len(configs)) * len(WORKLOADS) * args.requests, desc="mesh bench", unit="req", file=sys.stderr
        ) as bar,
        contextlib.ExitStack() as servers,
    ):
        bar.set_postfix_str("starting " + ", ".join(name for name, *_ in configs))
        # every request of a workload sends the same text: with prefix caching (serve's default) the servers would
        # compute a cached prompt where the in-process engine computes it whole (an older checkout has it off anyway)
        cache = () if args.prefix_caching else ("--no-enable-prefix-caching",)
        bases = {
            name: servers.enter_context(
                running_server(
                    model_dir,
                    topology,
                    logs / f"mesh-{name}.log",
                    "--transfer",
                    args.transfer,
                    *(() if name == "mesh-tls" else redis),
                    *more,
                    *(cache if source is None else ()),
                    source=source,
                    # the TLS mesh starts its own Redis: TLS only, with a password, as `--internal-tls auto` makes it
                    **({"redis_url": None} if name == "mesh-tls" else {}),
                )
            )
            for name, topology, more, source in configs
        }
        bar.set_postfix_str("interleaved")
        samples = asyncio.run(measure_interleaved(model_dir, bases, args, bar))
    results = {name: {w: summarize(s) for w, s in per.items()} for name, per in samples.items()}
    report = {
        "backend": BACKEND,
        "topology": args.topology,
        "transfer": args.transfer,
        "client": args.client,
        "against": args.against,
        "max_tokens": args.max_tokens,
        "requests": args.requests,
        "results": results,
        "mesh_added": {},
        "samples_ttft_gap_ms": samples,
    }
    print(
        f"\nbackend: {BACKEND}; {args.requests} requests per workload, one at a time, {args.max_tokens} tokens each; "
        f"transfer {args.transfer}; HTTP client {args.client}"
    )
    print(f"{'workload':<8}{'config':<28}{'p50 TTFT ms':>12}{'p90 TTFT ms':>12}{'p50 gap ms':>12}")
    for workload in WORKLOADS:
        labels = {
            "engine": "engine (in-process)",
            "local": "local (HTTP, one process)",
            "mesh": f"mesh {args.topology}",
            "mesh-toggle": f"mesh {args.topology}, toggle rpc",
            "mesh-against": f"mesh {args.topology}, --against",
            "mesh-unary": f"mesh {args.topology}, unary",
            "mesh-shared": f"mesh {args.topology}, shared weights",
            "mesh-tls": f"mesh {args.topology}, mutual TLS",
        }
        for name in results:
            label, r = labels[name], results[name][workload]
            print(
                f"{workload:<8}{label:<28}{r['p50_ttft_ms']:>12.2f}{r['p90_ttft_ms']:>12.2f}{r['p50_tpot_ms']:>12.2f}"
            )
        e, lo, m = (results[n][workload] for n in ("engine", "local", "mesh"))
        added = report["mesh_added"][workload] = {
            "ttft_over_engine_ms": m["p50_ttft_ms"] - e["p50_ttft_ms"],
            "ttft_over_local_ms": m["p50_ttft_ms"] - lo["p50_ttft_ms"],
            "ttft_ratio_over_engine": m["p50_ttft_ms"] / e["p50_ttft_ms"],
            "tpot_over_engine_ms": m["p50_tpot_ms"] - e["p50_tpot_ms"],
            "tpot_ratio_over_engine": m["p50_tpot_ms"] / e["p50_tpot_ms"],
            "paired_ttft_over_engine_ms": paired(samples["mesh"][workload], samples["engine"][workload]),
            "paired_ttft_over_local_ms": paired(samples["mesh"][workload], samples["local"][workload]),
        }
        print(
            f"  {workload}: mesh TTFT p50 {added['ttft_over_engine_ms']:+.2f} ms over the in-process engine "
            f"({added['ttft_ratio_over_engine']:.2f}x; goal ≤ +2 ms), {added['ttft_over_local_ms']:+.2f} ms over one "
            f"HTTP process; per-token gap {added['tpot_over_engine_ms']:+.2f} ms "
            f"({added['tpot_ratio_over_engine']:.2f}x)"
        )
        print(
            f"  {workload}: paired (median of per-request differences): "
            f"TTFT {added['paired_ttft_over_engine_ms']:+.2f} ms over the engine, "
            f"{added['paired_ttft_over_local_ms']:+.2f} ms over one HTTP process"
        )
        if "mesh-toggle" in results:
            saved = added["routing_in_gateway_saves_ms"] = (
                results["mesh-toggle"][workload]["p50_ttft_ms"] - m["p50_ttft_ms"]
            )
            print(f"  {workload}: routing in the gateway instead of by the toggle's rpc: TTFT p50 {-saved:+.2f} ms")
        for other, key, what in (
            ("mesh-unary", "streamed_over_unary", "stage calls on open streams over unary rpcs"),
            ("mesh-shared", "private_over_shared", "private weight copies over --share-weights"),
            ("mesh-tls", "plaintext_over_tls", "plaintext over mutual TLS"),
            ("mesh-against", "change_over_against", "this checkout over --against"),
        ):
            if other in results:
                o = results[other][workload]
                change = added[key] = {
                    "ttft_ms": m["p50_ttft_ms"] - o["p50_ttft_ms"],
                    "tpot_ms": m["p50_tpot_ms"] - o["p50_tpot_ms"],
                    "paired_ttft_ms": paired(samples["mesh"][workload], samples[other][workload]),
                }
                print(
                    f"  {workload}: {what}: TTFT p50 {change['ttft_ms']:+.2f} ms (paired "
                    f"{change['paired_ttft_ms']:+.2f} ms), per-token gap {change['tpot_ms']:+.2f} ms"
                )
    Path(args.out).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
