"""`epdmesh plan`: the deployments of N instances ranked by goodput, each simulated on the workload and its SLOs.

    epdmesh plan --instances 8 --profile profiles/llava-1.5-7b-h20.json --workload textcaps,pope,conversation \\
        --slo-ttft-ms 1000 --slo-tbt-ms 100

1. enumerates the deployments of `--space` (`common.topology.deployments`; `pools` by default: each stage on one
   pool — 43 deployments at N = 8; `pairs` adds every two-role-set deployment such as EP4+EPD4 — 106; `all`: every
   deployment over the seven role sets — 2,871), each under every routing of `--routing` (default: `slo`, the
   SLO-aware toggle, and `least-loaded`); every worker gets the stage budgets `serve` derives from the profile and
   the SLOs (`--latency-profile`), and `--serve-args` go to all;
2. finds each one's goodput on the simulator (`sim/`): `--duration` seconds of the workload's requests at rates
   chosen by bisection between 0 and the workload's goodput bound on N instances (`--steps` simulations; the same
   requests and arrival times for every deployment), goodput being the 90% crossing interpolated between the two
   closest. A run that overloads the mesh misses its SLOs only once its queue has grown past them: a longer
   `--duration` finds a crossing closer to the load the mesh sustains;
3. runs TriInfer's heuristic (Algorithm 2, `common.policy.placement`): stage loads → stage capacities at the SLO
   budgets → an E+P+D split of N and the EP+D and ED+P deployments derived from it; of those three the one the
   simulator finds best is its pick, and its rank among every deployment simulated is reported (TriInfer's Table 3);
4. writes the ranking (JSON, with every point simulated) and a plot, and prints the top of each workload's ranking.

The backend is the simulator over the emulated engine of `--profile`: hardware time, not this host's.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import itertools
import json
import logging
import math
import multiprocessing
import os
import sys
import time
from pathlib import Path

from bench import conversation, recorded
from bench.bodies import workload_of
from bench.goodput import crossing
from bench.workloads import add_arrival_arg, arrivals, phase_sizes, phases_of, trace_scale_of, trace_times
from common import trace
from common.latency.model import request_cost_ms
from common.latency.roofline import load_profile
from common.policy import placement
from common.request import Stage
from common.topology import SPACES, deployments, parse_topology
from epdmesh.options import profile_spec
from sim.build import Setup
from sim.goodput import run_point

ROUTINGS = ("slo", "least-loaded")
SAMPLE = 200  # requests the workload's loads and bound are taken from
MIN_REQUESTS = 20  # a simulated point sends at least this many
# colocated as vLLM ships it: chunked prefill at a fixed token budget (its encoder budget the same tokens), least-loaded
VLLM_STYLE = (("vLLM-style 2048", 2048), ("vLLM-style 8192", 8192))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="epdmesh plan", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--instances", type=int, required=True, help="N: the workers of every deployment")
    p.add_argument(
        "--profile",
        required=True,
        type=profile_spec,
        help="latency profile (a JSON file, or h20 / h100 / h200, or h20:qwen2-vl-7b-1344)",
    )
    p.add_argument("--workload", default="textcaps", help="comma-separated: bench goodput's workloads")
    p.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    p.add_argument("--slo-tbt-ms", type=float, default=100.0)
    p.add_argument("--attainment", type=float, default=0.9)
    p.add_argument("--space", default="pools", choices=sorted(SPACES), help="which deployments (see above)")
    p.add_argument("--topologies", help="comma-separated deployments to rank instead of a --space (e.g. E3+P3+D2,EPD8)")
    p.add_argument("--routing", default=",".join(ROUTINGS), help="comma-separated routing policies to try")
    p.add_argument(
        "--budgets",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="stage budgets sized from the profile and the SLOs (--latency-profile); --no-budgets: serve's fixed "
        "2048 tokens and 4 images (TriInfer's ablation without stage-level scheduling)",
    )
    p.add_argument("--serve-args", default="", help="more `epdmesh serve` arguments for every deployment")
    p.add_argument(
        "--duration", type=float, default=10.0, help="seconds of arrivals per simulated point (rate × this requests)"
    )
    p.add_argument("--steps", type=int, default=6, help="simulated rates per deployment (bisection)")
    add_arrival_arg(p)
    p.add_argument(
        "--trace-scale", type=int, default=16, help="conversation: the trace's lengths ÷ this (bench goodput's)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", help="checkpoint whose processor makes the prompts (default: serve's)")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="deployments simulated at once")
    p.add_argument(
        "--baselines",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also colocated as vLLM ships it (EPD·N, least-loaded, 2048- and 8192-token chunks)",
    )
    p.add_argument("--top", type=int, default=10, help="rows of each ranking printed")
    p.add_argument("--out", default="bench/results/plan.json")
    args = p.parse_args(argv)
    args.workloads = [w.strip() for w in args.workload.split(",") if w.strip()]
    args.routings = [r.strip() for r in args.routing.split(",") if r.strip()]
    if not args.budgets and "slo" in args.routings:
        p.error("--no-budgets: the SLO-aware routing needs the profile's budgets; give --routing least-loaded")
    if args.topologies:
        args.topologies = [t.strip() for t in args.topologies.split(",") if t.strip()]
        for t in args.topologies:
            try:
                groups = parse_topology(t)
            except ValueError as e:
                p.error(f"--topologies: {e}")
            if sum(g.count for g in groups) != args.instances:
                p.error(f"--topologies: {t} has {sum(g.count for g in groups)} workers, not --instances")
    for w in args.workloads:
        try:
            trace_scale_of(w, args.trace_scale)
        except ValueError as e:
            p.error(f"--workload: {e}")
    for r in args.routings:
        if r not in ROUTINGS:
            p.error(f"--routing: {r!r} is not one of {', '.join(ROUTINGS)}")
    if args.instances < 1 or args.steps < 1 or args.duration <= 0:
        p.error("--instances and --steps must be at least 1, --duration positive")
    return args


def serve_args(topology: str, routing: str, args, profile: bool = True) -> list[str]:
    """What `epdmesh serve` would be given for this deployment (the profile's path filled in by the caller);
    `profile`: stage budgets sized from it and the SLOs (else serve's fixed ones, or those given)."""
    extra = args.serve_args.split() if args.serve_args else []
    model = ["--model", args.model] if args.model else []
    return [
        *("--topology", topology, "--routing", routing),
        *(("--latency-profile", "{profile}") if profile else ()),
        *("--backend", "emulated", "--profile", "{profile}"),
        *("--slo-ttft-ms", str(args.slo_ttft_ms), "--slo-tbt-ms", str(args.slo_tbt_ms)),
        *model,
        *extra,
    ]


# ----- one deployment, in a worker process -----

_PROMPTS: dict[str, list[list]] = {}  # workload → its prompts, a run per phase (set in each process by `_init`)


class _Once(logging.Filter):
    """Each distinct warning once per process: every deployment whose workers share a role set derives the same
    budgets, and would repeat the same warning about them dozens of times."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        fresh = message not in self.seen
        self.seen.add(message)
        return fresh


def _quiet() -> _Once | None:
    """The filter it added to the package's logger, None where one was there already."""
    log = logging.getLogger("epdmesh")
    log.setLevel(logging.WARNING)  # each deployment's budgets: in the report, not the log
    if any(isinstance(f, _Once) for f in log.filters):
        return None
    once = _Once()
    log.addFilter(once)
    return once


def _init(prompts: dict[str, list]) -> None:
    _quiet()
    _PROMPTS.update(prompts)


def goodput_search(job: dict) -> dict:
    """One deployment's goodput on one workload: bisection over the rate between 0 and the bound."""
    start = time.perf_counter()
    setup = Setup.of(job["serve_args"])
    prompts = _PROMPTS[job["workload"]]
    target, ns = (
        job["attainment"],
        argparse.Namespace(
            slo_ttft_ms=job["slo_ttft_ms"], slo_tbt_ms=job["slo_tbt_ms"], arrival=job["arrival"], seed=job["seed"]
        ),
    )
    own = job.get("arrivals")  # a trace file's: its window's own, each run their first as many as it sends
    gaps = trace_times(seed=job["seed"]) if job["arrival"] == "mooncake" and own is None else None
    points = []

    def attained(rate: float) -> float:
        sent = sent_at(prompts, max(MIN_REQUESTS, math.ceil(rate * job["duration"])))
        times = arrivals(len(sent), rate, job["arrival"], job["seed"], own[: len(sent)] if own else gaps)
        point = run_point(setup, sent, times, rate, ns)
        points.append({k: point[k] for k in _KEPT})
        return point["slo_attainment"]

    lo, hi = 0.0, job["bound"]
    if attained(hi) >= target:
        lo = hi  # meets the SLOs at the bound: its goodput is the bound (no deployment can do more)
    else:
        for _ in range(job["steps"] - 1):
            mid = (lo + hi) / 2
            if attained(mid) >= target:
                lo = mid
            else:
                hi = mid
    with_zero = [{"request_rate": 0.0, "slo_attainment": 1.0}, *points]
    return {
        "topology": job["topology"],
        "routing": job["routing"],
        "workload": job["workload"],
        "goodput": crossing(with_zero, target),
        "points": sorted(points, key=lambda p: p["request_rate"]),
        "wall_s": time.perf_counter() - start,
        **({"baseline": job["baseline"]} if "baseline" in job else {}),
    }


def sent_at(runs: list[list], count: int) -> list:
    """The `count` prompts a point sends: the first of each phase's run, each phase its share (one run: a prefix)."""
    return [p for run, share in zip(runs, phase_sizes(count, len(runs))) for p in run[:share]]


_KEPT = (
    "request_rate",
    "slo_attainment",
    "ttft_attainment",
    "tbt_attainment",
    "p90_ttft_ms",
    "p90_itl_ms",
    "failed",
    "prefill_paths",
    "sim_speed",
)


# ----- the command -----


def main(argv=None) -> int:
    once = _quiet()  # for this search only: a process that goes on (a test run, say) logs as before
    try:
        return _plan(argv)
    finally:
        if once is not None:
            logging.getLogger("epdmesh").removeFilter(once)


def _plan(argv) -> int:
    from tqdm import tqdm

    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    profile_path = out.with_suffix(".profile.json")
    hardware = load_profile(args.profile)
    hardware.save(profile_path)
    fill = lambda argv: [a.replace("{profile}", str(profile_path)) for a in argv]  # noqa: E731
    topologies = args.topologies or deployments(args.instances, args.space)
    probe = Setup.of(fill(serve_args("EPD1", args.routings[0], args)))
    prompts, loads, bounds, trace_gaps = {}, {}, {}, {}
    for workload in args.workloads:
        held = recorded.requests_in(workload) or math.inf  # a trace file's requests: a run sends at most those
        args.num_prompts = min(SAMPLE, held)  # the bound from a sample, then as many as a run at the bound sends
        loads[workload], bounds[workload] = load_and_bound(workload, probe, hardware, args)
        args.num_prompts = min(max(SAMPLE, math.ceil(bounds[workload] * args.duration)), held)
        trace_gaps[workload] = recorded.arrivals_of(workload, args.num_prompts, args.seed, None)
        bodies_of, _ = workload_of(workload, lambda: conversation.calibrate_with(probe.count_tokens), probe.model, args)
        made = iter([probe.prompt(body) for body in bodies_of(0)])
        runs = phase_sizes(args.num_prompts, len(phases_of(workload) or [workload]))
        prompts[workload] = [list(itertools.islice(made, size)) for size in runs]
    common = {
        "steps": args.steps,
        "attainment": args.attainment,
        "slo_ttft_ms": args.slo_ttft_ms,
        "slo_tbt_ms": args.slo_tbt_ms,
        "arrival": args.arrival,
        "seed": args.seed,
        "duration": args.duration,
    }
    jobs = [
        {"topology": t, "routing": r, "workload": w, "bound": bounds[w], "arrivals": trace_gaps[w]}
        | {"serve_args": fill(serve_args(t, r, args, profile=args.budgets))}
        | common
        for w in args.workloads
        for t in topologies
        for r in args.routings
    ]
    colocated = f"EPD{args.instances}"
    for label, tokens in VLLM_STYLE if args.baselines else ():
        vllm_args = serve_args(colocated, "least-loaded", args, profile=False)
        vllm_args += ["--token-budget", str(tokens), "--image-budget", str(max(tokens // hardware.image_tokens, 1))]
        jobs += [
            {"topology": colocated, "routing": "least-loaded", "workload": w, "serve_args": fill(vllm_args)}
            | {"bound": bounds[w], "baseline": label, "arrivals": trace_gaps[w]}
            | common
            for w in args.workloads
        ]
    print(
        f"epdmesh plan: {len(topologies)} deployments of {args.instances} "
        f"({'given' if args.topologies else f'{args.space}: {SPACES[args.space]}'}) × "
        f"{len(args.routings)} routings × {len(args.workloads)} workloads = {len(jobs)} searches of {args.steps} "
        f"simulated rates, {args.jobs} at a time",
        file=sys.stderr,
    )
    results: dict[str, list[dict]] = {w: [] for w in args.workloads}
    baselines: dict[str, list[dict]] = {w: [] for w in args.workloads}
    with tqdm(total=len(jobs), desc="plan", unit="deployment") as bar:
        for result in _searched(jobs, prompts, args.jobs):
            (baselines if "baseline" in result else results)[result["workload"]].append(result)
            bar.update(1)
    kv_tokens = decoder_kv_tokens(probe)
    report = {
        "backend": f"simulated: emulated engine on {Path(args.profile).stem}, simulated time",
        "instances": args.instances,
        "space": "given" if args.topologies else args.space,
        "space_means": "--topologies" if args.topologies else SPACES[args.space],
        "budgets": "from the profile and the SLOs" if args.budgets else "serve's fixed (2048 tokens, 4 images)",
        "deployments": len(topologies),
        "routings": args.routings,
        "slo_ttft_ms": args.slo_ttft_ms,
        "slo_tbt_ms": args.slo_tbt_ms,
        "attainment": args.attainment,
        "duration_s": args.duration,
        "steps": args.steps,
        "seed": args.seed,
        "profile": args.profile,
        "serve_args": serve_args("{topology}", "{routing}", args, profile=args.budgets),
        "workloads": {},
    }
    for workload in args.workloads:
        ranked = sorted(results[workload], key=lambda r: (-r["goodput"], r["topology"], r["routing"]))
        for row in ranked:
            row["rank"] = 1 + sum(other["goodput"] > row["goodput"] for other in ranked)
        seconds = placement.stage_seconds(hardware, loads[workload], args.slo_ttft_ms, args.slo_tbt_ms, kv_tokens)
        heuristic = _heuristic(args.instances, seconds, ranked)
        report["workloads"][workload] = {
            "goodput_bound": bounds[workload],
            "stage_load": dataclasses.asdict(loads[workload]),
            "heuristic": heuristic,
            "baselines": _against_best(baselines[workload], ranked),
            "ranking": ranked,
        } | _recorded_rates(workload)
    out.write_text(json.dumps(report, indent=2) + "\n")
    _print(report, args.top)
    _plot(report, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}", file=sys.stderr)
    return 0


def decoder_kv_tokens(setup: Setup) -> int:
    """The KV tokens one worker's cache holds (every worker of a simulated mesh has the same)."""
    from sim.events import Loop

    kv = next(iter(setup.mesh(Loop()).workers.values())).engine.scheduler.kv
    return kv.pool.num_blocks * kv.block_size


def _searched(jobs: list[dict], prompts: dict[str, list], processes: int):
    """Each job's search, in this process or in `processes` fresh ones (spawned: a process forked from one with
    threads, as grpc's, may inherit a lock held and hang)."""
    if processes <= 1:
        _init(prompts)
        yield from map(goodput_search, jobs)
        return
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(processes, context, _init, (prompts,)) as pool:
        yield from pool.map(goodput_search, jobs, chunksize=1)


def load_and_bound(workload: str, probe: Setup, hardware, args) -> tuple[placement.StageLoad, float]:
    """The workload's stage loads, and its goodput bound on N instances: a conversation's requests each without
    the prefix an earlier one shares with it (nor its image then), as `bench goodput` bounds them."""
    bodies_of, meta = workload_of(workload, lambda: conversation.calibrate_with(probe.count_tokens), probe.model, args)
    if "requests" in meta:
        requests = [(n - shared, image, output) for n, shared, output, image in meta["requests"]]
    else:
        prompts = [probe.prompt(body) for body in bodies_of(0)]
        requests = [(len(p.token_ids), len(p.image_digests), p.max_tokens) for p in prompts]
    cost_ms = sum(request_cost_ms(hardware, *r) for r in requests) / len(requests)
    return placement.StageLoad.of(requests), args.instances * 1e3 / cost_ms


def _against_best(baselines: list[dict], ranked: list[dict]) -> list[dict]:
    """Each baseline, and the best deployment's goodput over its own; tuned colocation (EPD·N with the SLO-aware
    routing) and the best static split come from the ranking itself."""
    best = ranked[0]["goodput"] if ranked else 0.0
    for row in baselines:
        row["best_over_this"] = best / row["goodput"] if row["goodput"] else None
    return sorted(baselines, key=lambda r: r["baseline"])


def _heuristic(n: int, seconds: dict[str, float], ranked: list[dict]) -> dict:
    """TriInfer's three candidates, the best of them by simulation (its pick), and the pick's rank."""
    if n < 3:
        return {"stage_seconds": seconds, "candidates": [], "note": "an E+P+D split needs 3 instances"}
    names = placement.candidates(n, seconds)
    found = [r for r in ranked if r["topology"] in names]
    pick = max(found, key=lambda r: r["goodput"], default=None)
    return {
        "stage_seconds": seconds,
        "candidates": names,
        "pick": None if pick is None else {k: pick[k] for k in ("topology", "routing", "goodput", "rank")},
        "of": len(ranked),
        "note": "" if pick is not None else "its candidates are not in the space simulated",
    }


def _print(report: dict, top: int) -> None:
    for workload, entry in report["workloads"].items():
        ranked = entry["ranking"]
        print(
            f"\n{workload}: {len(ranked)} (deployment, routing) on {report['instances']} instances, TTFT "
            f"{report['slo_ttft_ms']:g} ms, P90 TBT {report['slo_tbt_ms']:g} ms; bound {entry['goodput_bound']:.2f} "
            "req/s"
        )
        print(f"  {'rank':>4}  {'deployment':<16} {'routing':<13} {'goodput':>8}  paths at the crossing")
        for row in ranked[:top]:
            name, routing = row["topology"], row["routing"]
            print(f"  {row['rank']:>4}  {name:<16} {routing:<13} {row['goodput']:8.2f}  {_paths(row)}")
        best = ranked[0]["goodput"] if ranked else 0.0
        named = [(row["baseline"], row["goodput"]) for row in entry["baselines"]]
        named += [(f"{r['topology']} {r['routing']}", r["goodput"]) for r in _references(ranked, report["instances"])]
        for name, goodput in named:
            ratio = f"{best / goodput:.2f}×" if goodput else "∞"
            print(f"  {name:<30} {goodput:8.2f}  (best: {ratio})")
        if entry.get("recorded"):  # a trace file: the load it recorded against what the best deployment holds
            r = entry["recorded"]
            busiest = r["busiest_minute_rate"]
            peak = f", its busiest minute {busiest:.2f}" if busiest else ""
            verdict = (
                f"{best / r['mean_rate']:.2f}× its mean rate"
                + (f", {best / busiest:.2f}× the busiest minute's" if busiest else "")
                if r["mean_rate"]
                else ""
            )
            print(f"  the trace arrived at {r['mean_rate'] or 0:.2f} req/s{peak}: the best holds {verdict}")
        pick = entry["heuristic"].get("pick")
        if pick:
            stage_s = ", ".join(f"{k} {v * 1e3:.1f}" for k, v in entry["heuristic"]["stage_seconds"].items())
            print(
                f"  TriInfer's heuristic (instance-ms per request: {stage_s}): "
                f"{', '.join(entry['heuristic']['candidates'])} → {pick['topology']} "
                f"({pick['routing']}) {pick['goodput']:.2f} req/s, rank {pick['rank']} of {entry['heuristic']['of']}"
            )


def _recorded_rates(workload: str) -> dict:
    """A trace file's own rates (its mean and its busiest minute's), to read the ranking's goodputs against; {} for
    any other workload."""
    path = recorded.path_of(workload)
    if path is None:
        return {}
    summary = trace.summary(recorded.rows_of(path))
    return {"recorded": {k: summary[k] for k in ("requests", "span_s", "mean_rate", "busiest_minute_rate")}}


def _references(ranked: list[dict], n: int) -> list[dict]:
    """The rows a reader compares against: colocated (EPD·N) with each routing, and the best static split (prefill
    and decode on separate workers: no worker does both)."""
    rows = [r for r in ranked if r["topology"] == f"EPD{n}"]
    split = next((r for r in ranked if not any(_prefills_and_decodes(g) for g in parse_topology(r["topology"]))), None)
    return rows + ([split] if split else [])


def _prefills_and_decodes(group) -> bool:
    return {Stage.PREFILL, Stage.DECODE} <= group.roles


def _paths(row: dict) -> str:
    met = [p for p in row["points"] if p["request_rate"] <= row["goodput"]]
    if not met:
        return ""
    return " ".join(f"{k} {v}" for k, v in met[-1]["prefill_paths"].items() if v)


def _plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(report["workloads"])
    fig, axes = plt.subplots(len(workloads), 1, figsize=(11, 3.6 * len(workloads)), squeeze=False)
    for ax, workload in zip(axes[:, 0], workloads):
        entry = report["workloads"][workload]
        shown = entry["ranking"][:30]
        candidates = set(entry["heuristic"].get("candidates", []))
        colors = ["tab:orange" if r["topology"] in candidates else "tab:blue" for r in shown]
        ax.bar(range(len(shown)), [r["goodput"] for r in shown], color=colors)
        ax.set_xticks(range(len(shown)))
        ax.set_xticklabels(
            [f"{r['topology']}\n{'slo' if r['routing'] == 'slo' else 'l-l'}" for r in shown], rotation=90, fontsize=7
        )
        ax.axhline(entry["goodput_bound"], color="gray", linestyle=":", label="bound (no scheduler exceeds)")
        ax.set_ylabel("goodput (req/s)")
        ax.set_title(
            f"{workload}: top {len(shown)} of {len(entry['ranking'])}, {report['instances']} instances "
            "(orange: TriInfer's candidates)",
            fontsize=9,
        )
        ax.legend(fontsize=7)
    fig.suptitle(f"epdmesh plan — {report['backend']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
