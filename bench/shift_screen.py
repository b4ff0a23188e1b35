"""Which shifting loads could a planner win on? A screen by the planner's own load model, before any simulation.

For each workload (a dataset shape or `conversation`), its stage loads on the given profile and SLOs
(`common.policy.placement.stage_seconds`: each stage at the throughput of its largest batch within its limit) give
every split of N instances its capacity — the rate at which its busiest pool is full — over the role sets the
planner plans (`EP·+D·`, `ED·+P·`, `E·+P·+D·`). For a load that shifts `A>B>A` at one rate, equal runs of each:

- a planner that always runs each phase's best split sustains min(best(A), best(B)) — switches taken as free and
  instant, so this is an upper bound on what a planner can sustain;
- the best static split sustains max over splits of min(capacity(A), capacity(B)).

Their ratio is what the model says a planner could gain over the best static split. A pair whose phases need the
same split gains nothing; a pair whose capacities differ much is held by its weaker phase, on which the static
split can simply be that phase's best. The screen does not price colocation or vLLM-style chunking (the model has
no interference term): for those, simulate (`epdmesh sim goodput --workload 'A>B>A'`).

    python -m bench.shift_screen --instances 8 --profile h20 --slo-tbt-ms 100 \
        --workloads conversation,textcaps,pope,detail,document,multiimage
"""

from __future__ import annotations

import argparse
import itertools
import logging
import sys
import tempfile
from pathlib import Path

from common.latency.roofline import load_profile
from common.policy import placement
from epdmesh.options import profile_spec

SAMPLE = 400  # requests each workload's loads are taken from
STAGES = {"E": "encode", "P": "prefill", "D": "decode"}


def splits(n: int) -> list[tuple[str, tuple[int, ...]]]:
    """Every split of `n` instances over the planner's role sets: (shape, pool sizes), each pool at least one."""
    out = [(kind, (a, n - a)) for kind in ("EP+D", "ED+P") for a in range(1, n)]
    out += [("E+P+D", (e, p, n - e - p)) for e in range(1, n - 1) for p in range(1, n - e)]
    return out


def capacity(split: tuple[str, tuple[int, ...]], seconds: dict[str, float]) -> float:
    """Requests per second the split sustains: each pool's instances over the instance-seconds a request needs of
    its stages; the busiest pool decides."""
    kind, sizes = split
    pools = [[STAGES[c] for c in pool] for pool in kind.split("+")]
    return min(n / max(sum(seconds[s] for s in pool), 1e-12) for n, pool in zip(sizes, pools))


def label(split: tuple[str, tuple[int, ...]]) -> str:
    kind, sizes = split
    return "+".join(f"{pool}{n}" for pool, n in zip(kind.split("+"), sizes))


def best_splits(seconds: dict[str, dict[str, float]], n: int) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Each workload's best split of `n` instances (the most it sustains)."""
    options = splits(n)
    return {w: max(options, key=lambda s: capacity(s, sec)) for w, sec in seconds.items()}


def screen(seconds: dict[str, dict[str, float]], n: int) -> list[dict]:
    """Every pair of workloads as `A>B>A` (the model is the same for `B>A>B`), best first: the planner's and the
    static split's capacities."""
    options = splits(n)
    best = best_splits(seconds, n)
    rows = []
    for a, b in itertools.combinations(seconds, 2):
        static = max(options, key=lambda s: min(capacity(s, seconds[a]), capacity(s, seconds[b])))
        held = min(capacity(static, seconds[a]), capacity(static, seconds[b]))
        planner = min(capacity(best[a], seconds[a]), capacity(best[b], seconds[b]))
        rows.append(
            {
                "shift": f"{a}>{b}>{a}",
                "planner": planner,
                "static": held,
                "static_split": label(static),
                "best_split": {w: label(best[w]) for w in (a, b)},
                "ratio": planner / held,
            }
        )
    return sorted(rows, key=lambda r: -r["ratio"])


def main(argv=None) -> int:
    from sim.build import Setup
    from sim.plan import decoder_kv_tokens, load_and_bound, serve_args

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--instances", type=int, default=8)
    p.add_argument("--profile", type=profile_spec, default="h20")
    p.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    p.add_argument("--slo-tbt-ms", type=float, default=100.0)
    p.add_argument("--workloads", default="conversation,textcaps,pope,mme,textvqa,detail,document,multiimage")
    p.add_argument("--trace-scale", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.instances < 3:
        p.error("--instances: a split of three pools needs at least 3")
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    logging.getLogger("epdmesh").setLevel(logging.WARNING)
    hardware = load_profile(args.profile)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "profile.json"
        hardware.save(path)
        plan_args = argparse.Namespace(
            instances=args.instances,
            num_prompts=SAMPLE,
            seed=args.seed,
            trace_scale=args.trace_scale,
            arrival="poisson",
            slo_ttft_ms=args.slo_ttft_ms,
            slo_tbt_ms=args.slo_tbt_ms,
            model=None,
            budgets=True,
            serve_args="",
        )
        probe = Setup.of([a.replace("{profile}", str(path)) for a in serve_args("EPD1", "slo", plan_args)])
        kv_tokens = decoder_kv_tokens(probe)
        seconds = {}
        for w in workloads:
            load, _ = load_and_bound(w, probe, hardware, plan_args)
            seconds[w] = placement.stage_seconds(hardware, load, args.slo_ttft_ms, args.slo_tbt_ms, kv_tokens)
    print(f"{args.instances} instances, {hardware.name}, TTFT {args.slo_ttft_ms:g} ms, P90 TBT {args.slo_tbt_ms:g} ms")
    for w, best in best_splits(seconds, args.instances).items():
        print(f"  {w:>14}: best split {label(best):>10} sustains {capacity(best, seconds[w]):6.1f} req/s")
    print(f"{'shift':>36} {'planner':>8} {'static':>7} {'ratio':>6}  static split; each phase's best")
    for r in screen(seconds, args.instances):
        phases = ", ".join(r["best_split"].values())
        print(
            f"{r['shift']:>36} {r['planner']:8.1f} {r['static']:7.1f} {r['ratio']:5.2f}×  {r['static_split']}; {phases}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
