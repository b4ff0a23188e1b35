"""`epdmesh sim goodput`: the goodput benchmark on simulated time, with the arguments of `epdmesh bench goodput`.

    epdmesh sim goodput --workload textcaps,conversation --rates 10,20,30,40 \\
        --config 'EPD8=--topology EPD8 --latency-profile {profile} --routing slo --budget-headroom 0.8' \\
        --config 'E2+P2+D4=--topology E2+P2+D4'

Each `--config` is parsed by `epdmesh serve`'s own parser and turned into workers and a router by the code `serve`
runs (`engine_config`, `routing_policy`, the launcher's join mode); each worker runs the emulated engine on
`--profile` (`sim/worker.py`), the requests are the benchmark's own bodies tokenized by the checkpoint's processor,
sent at the benchmark's arrival times, and driven as the gateway drives them (`sim/mesh.py`). The metrics, the JSON
and the plot are the benchmark's (`bench/goodput.py`, `bench/goodput_report.py`); each rate point runs on a fresh
mesh. The report's backend says `simulated`; every point carries the wall time it took. Simulated time is the
hardware's; `--time-scale K` makes only the control plane's intervals (heartbeats, the router's snapshot refresh) K×
shorter in it, as they are on an emulated mesh run at time ×K — to compare with one (`bench/sim_fidelity.py`); the
default 1 is a deployment's. `--warmup` and `--pause` do nothing here.
"""

from __future__ import annotations

import collections
import json
import sys
import tempfile
import time
from pathlib import Path

from bench import conversation, recorded
from bench.bodies import workload_of
from bench.goodput import Result, goodput_of, parse_args, summarize
from bench.goodput_launch import serve_args_of
from bench.goodput_report import add_bound, finish, instances_of
from bench.workloads import arrivals, trace_times
from common.latency.roofline import load_profile
from sim.build import Setup
from sim.events import Loop


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args([*argv, "--backend", "emulated"], prog="epdmesh sim goodput", description=__doc__)
    if args.url:
        print("epdmesh sim goodput: the simulator launches nothing; give --config NAME=SERVE_ARGS", file=sys.stderr)
        return 2
    control_scale, args.time_scale = args.time_scale, 1.0  # the model's time is never scaled here
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    gaps = trace_times(seed=args.seed) if args.arrival == "mooncake" else None
    hardware = load_profile(args.profile)
    report = {
        "backend": f"simulated: emulated engine on {Path(args.profile).stem}, simulated time"
        + (f", control plane as at time ×{control_scale:g}" if control_scale != 1 else ""),
        "arrival": args.arrival,
        "slo_ttft_ms": args.slo_ttft_ms,
        "slo_tbt_ms": args.slo_tbt_ms,
        "attainment": args.attainment,
        "num_prompts": args.num_prompts,
        "time_scale": 1.0,
        "control_scale": control_scale,
        "workloads": args.workloads,
        "configs": {},
        "serve_args": {},
        "profile": args.profile,
    }
    with tempfile.TemporaryDirectory(prefix="epdmesh-sim-") as tmp:
        profile = Path(tmp) / "profile.json"
        hardware.save(profile)
        for spec in args.config:
            name, _, config_args = spec.partition("=")
            serve_args = serve_args_of(config_args, args, profile)
            report["serve_args"][name] = serve_args
            setup = Setup.of(serve_args)
            print(f"{name}: simulating `epdmesh serve {' '.join(serve_args)}`", file=sys.stderr, flush=True)
            rates = args.rates_of.get(name, args.rate_list)
            report["configs"][name] = {
                w: sweep(setup, w, rates, args, name, gaps, control_scale) for w in args.workloads
            }
            for result in report["configs"][name].values():
                add_bound(result, hardware, instances_of(serve_args))
            out.write_text(json.dumps(report, indent=2) + "\n")
    finish(report, out, args)
    return 0


_PROMPTS: dict[tuple, list] = {}  # (model, workload, point, requests, seed) → the point's prompts


def sweep(setup: Setup, workload: str, rates: list[float], args, label: str, gaps, control_scale: float = 1.0) -> dict:
    """The benchmark's sweep (ascending rates, stopping after two points below the target), each point on a fresh
    simulated mesh."""
    from tqdm import tqdm

    bodies_of, shape = workload_of(workload, lambda: conversation.calibrate_with(setup.count_tokens), setup.model, args)
    trace_gaps = recorded.arrivals_of(workload, args.num_prompts, args.seed, gaps)
    points, below = [], 0
    for k, rate in enumerate(sorted(rates)):
        key = (setup.args.model, workload, k, args.num_prompts, args.seed)  # each point its own images, as the bench's
        if key not in _PROMPTS:  # the same for every configuration of the model: made once
            _PROMPTS[key] = [setup.prompt(body) for body in bodies_of(k + 1)]
        prompts = _PROMPTS[key]
        times = arrivals(args.num_prompts, rate, args.arrival, args.seed, trace_gaps)
        with tqdm(total=len(prompts), desc=f"{label} {workload} @ {rate:g} req/s", unit="req", leave=False) as bar:
            point = run_point(setup, prompts, times, rate, args, bar, control_scale)
        points.append(point)
        print(
            f"  {label:>12} {workload:<9} rate {rate:6.2f}  attainment {point['slo_attainment']:5.1%} "
            f"(TTFT {point['ttft_attainment']:5.1%}, TBT {point['tbt_attainment']:5.1%})  p90 TTFT "
            f"{point['p90_ttft_ms']:7.1f} ms  p90 ITL {point['p90_itl_ms']:6.1f} ms  failed {point['failed']}  "
            f"paths: {' '.join(f'{p} {n}' for p, n in point['prefill_paths'].items() if n)}  "
            f"({point['sim_wall_s']:.1f} s wall, {point['sim_speed']:.0f}x the hardware's time)",
            file=sys.stderr,
            flush=True,
        )
        below = below + 1 if point["slo_attainment"] < args.attainment else 0
        if below >= 2:
            break
    return {"workload": workload, **shape, "goodput": goodput_of(points, args.attainment), "points": points}


def run_point(setup: Setup, prompts, times: list[float], rate: float, args, bar=None, control_scale=1.0) -> dict:
    start = time.perf_counter()
    loop = Loop()
    mesh = setup.mesh(loop, control_scale)
    timelines = [mesh.submit(at, prompt) for at, prompt in zip(times, prompts)]
    done = 0

    def finished() -> bool:
        nonlocal done
        if bar is not None and len(timelines) - mesh.unfinished > done:
            bar.update(len(timelines) - mesh.unfinished - done)
            done = len(timelines) - mesh.unfinished
        return mesh.unfinished == 0

    loop.run(until=finished)
    wall = time.perf_counter() - start
    results = [result_of(t) for t in timelines]
    duration = max((t.token_times[-1] for t in timelines if t.token_times), default=loop.now)
    point = summarize(results, duration, rate, args.slo_ttft_ms, args.slo_tbt_ms)
    paths: dict[str, int] = {}
    for t in timelines:
        if t.path is not None:
            paths[t.path.value] = paths.get(t.path.value, 0) + 1
    point["prefill_paths"] = paths
    if mesh.planner is not None:  # what the planner did, as `/stats` shows it on a mesh (simulated seconds)
        point["planner"] = {
            "decisions": dict(collections.Counter(d.action for _, d in mesh.planner.decisions)),
            "switches": [
                {"at_s": round(at, 3), "worker_id": w, "from": a, "to": b, "handed_back": n}
                for at, w, a, b, n in mesh.planner.switches
            ],
        }
    point["sim_wall_s"] = wall
    point["sim_speed"] = duration / wall if wall else float("inf")
    point["sim_events"] = loop.events
    return point


def result_of(t) -> Result:
    """A simulated request's timeline as the benchmark's client would have measured it."""
    if t.error or not t.token_times:
        return Result(False, error=t.error or "no tokens")
    times = t.token_times
    return Result(
        True,
        times[0] - t.arrival,
        [b - a for a, b in zip(times, times[1:])],
        times[-1] - t.arrival,
        t.num_prompt_tokens,
        len(times),
        t.cached_tokens,
    )
