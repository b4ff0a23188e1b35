"""What a command's arguments make of the engine it runs: the model it resolves (a checkpoint, or the config-only one
an emulated profile needs), the engine's configuration with its stage budgets (from the latency profile and the SLOs,
or given), its KV cache size, and the emulated backend's options. `serve`, `worker` and the simulator (`sim/`) build
their engines with these."""

from __future__ import annotations

import logging
from pathlib import Path

from epdmesh.checkpoints import DEFAULT_MODEL_NAME, ensure_default_model, ensure_emulated_model
from epdmesh.options import DEFAULT_EMULATED_PROFILE, decoder_joins, reserved_output_tokens


def engine_config(args, roles: str = "encode,prefill,decode"):
    from common.engine.config import EngineConfig, parse_roles, resolve_dtype
    from common.scheduler import SchedulerConfig

    return EngineConfig(
        model=args.model,
        dtype=resolve_dtype(args.dtype, args.device),
        device=args.device,
        roles=parse_roles(roles),
        kv_cache_gib=kv_cache_gib(args),
        image_cache_gib=getattr(args, "image_cache_gib", EngineConfig.image_cache_gib),
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_model_len=args.max_model_len,
        attention_backend=args.attention_backend,
        enable_prefix_caching=args.enable_prefix_caching,
        share_weights=getattr(args, "share_weights", False),
        amx_tiles=getattr(args, "amx_tiles", True),
        prompt_kernel=getattr(args, "prompt_kernel", True),
        compile=compiles(args),
        cuda_graphs=not getattr(args, "enforce_eager", False),
        commit_caches=getattr(args, "device", "cpu") == "cpu" and getattr(args, "backend", "torch") == "torch",
        scheduler=SchedulerConfig(
            **budgets(args, parse_roles(roles)),
            max_num_seqs=args.max_num_seqs,
            join_first=joins_of(args)[1],
            kv_admission=args.kv_admission,
            handover_output_tokens=reserved_output_tokens(args) if args.kv_admission == "on-demand" else 0,
        ),
    )


def compiles(args) -> bool:
    """The model runs compiled unless --enforce-eager, on the CPU (on CUDA eager until a GPU has run it), with torch."""
    return (
        not getattr(args, "enforce_eager", True)
        and getattr(args, "device", "cpu") == "cpu"
        and getattr(args, "backend", "torch") == "torch"
    )


def kv_cache_gib(args) -> float | None:
    """--kv-cache-gib, else 64 GiB of the real model's pages on the emulated backend (an H20-sized cache), else on a
    GPU None (what --gpu-memory-utilization of it leaves, measured), else 1 GiB."""
    if getattr(args, "kv_cache_gib", None) is not None:
        return args.kv_cache_gib
    if getattr(args, "backend", "torch") == "emulated":
        return 64.0
    return None if getattr(args, "device", "cpu").startswith("cuda") else 1.0


def joins_of(args) -> tuple[bool, bool]:
    """(joins, join_first) of this command's --decoder-joins (commands without it: neither)."""
    return decoder_joins(getattr(args, "decoder_joins", "auto"))


def budgets(args, roles) -> dict[str, int]:
    """SchedulerConfig's budgets: τ_t and τ_e given explicitly, else derived from --latency-profile and the SLOs
    (with an image's token cost and the iteration's time limit, which come only with a derived τ_t), else 2048
    tokens and 4 images, apart."""
    token, image = getattr(args, "token_budget", None), getattr(args, "image_budget", None)
    profile_path = getattr(args, "latency_profile", None)
    if profile_path and (token is None or image is None):
        from common.latency.budgets import IterationTime, budgets_for
        from common.latency.model import encode_ms
        from common.latency.roofline import load_profile
        from common.request import Stage

        joins, join_first = joins_of(args)
        profile = load_profile(profile_path)
        derived = budgets_for(
            profile,
            Stage.DECODE in roles,
            args.slo_ttft_ms,
            args.slo_tbt_ms,
            headroom=args.budget_headroom,
            alpha=args.budget_alpha,
            joins=joins,
            join_first=join_first,
        )
        log = logging.getLogger("epdmesh")
        log.info(
            "budgets from %s for a %.0f ms iteration limit: %d tokens, %d images per iteration, an image "
            "taking %d of the tokens",
            profile_path,
            derived.limit_ms,
            derived.token_budget,
            derived.image_budget,
            derived.image_token_cost,
        )
        if not derived.tokens_fit:
            log.warning(
                "even one prompt token's iteration exceeds the %.0f ms limit on this profile: the SLOs cannot be met",
                derived.limit_ms,
            )
        elif not derived.images_fit:
            log.warning(
                "one image's encode (%.0f ms) exceeds the %.0f ms limit of an iteration here: an iteration that "
                "encodes runs past it%s",
                encode_ms(profile, 1),
                derived.limit_ms,
                " — a slow gap for every request decoding here (with gap slack, only where each can spare one)"
                if Stage.DECODE in roles
                else ", and the TTFT share it was sized to",
            )
        derived_tokens = token is None
        token = derived.token_budget if token is None else token
        image = derived.image_budget if image is None else image
        timing = IterationTime(profile, derived.limit_ms) if derived_tokens else None
        return dict(
            token_budget=token,
            image_budget=image,
            image_token_cost=derived.image_token_cost if derived_tokens else 0,
            iteration_time=timing,
            gap_slack=gap_slack(args, profile, roles) if timing else None,
        )
    return dict(token_budget=2048 if token is None else token, image_budget=4 if image is None else image)


def gap_slack(args, profile, roles):
    """--gap-slack on a worker that decodes: its long iterations run to a prefill worker's limit (α·TTFT, with the
    headroom). None: off."""
    from common.latency.budgets import GapSlack, IterationTime, budgets_for
    from common.request import Stage

    if not getattr(args, "gap_slack", False) or Stage.DECODE not in roles:
        return None
    long = budgets_for(
        profile, False, args.slo_ttft_ms, args.slo_tbt_ms, headroom=args.budget_headroom, alpha=args.budget_alpha
    )
    return GapSlack(args.slo_tbt_ms, IterationTime(profile, long.limit_ms), long.token_budget, args.gap_slack_reserve)


def resolve_model(args) -> None:
    emulated = getattr(args, "backend", "torch") == "emulated"
    if emulated and not args.profile:
        args.profile = DEFAULT_EMULATED_PROFILE
    args.kv_cache_gib = kv_cache_gib(args)
    model_dir = (
        Path(args.model) if args.model else ensure_emulated_model(args.profile) if emulated else ensure_default_model()
    )
    default_name = model_dir.name.removesuffix("-config") if emulated else DEFAULT_MODEL_NAME
    args.served_model_name = args.served_model_name or (default_name if not args.model else model_dir.name)
    args.model = str(model_dir)


def emulation(args):
    if args.backend != "emulated":
        return None
    from services.worker.server import EmulationOptions

    return EmulationOptions(args.profile, args.emulated_kv_bytes_per_token, args.emulated_image_bytes_per_token)
