"""A load that shifts: phases of different request shapes at one arrival rate, replayed against each configuration
in turn, with SLO attainment and the workers' role sets over time (`epdmesh bench shift`).

    epdmesh bench shift --backend emulated --time-scale 10 --rate 30 \\
        --workload 'textcaps@30,detail@30,textcaps@30' \\
        --config 'planner=--topology EP4+D4 --planner --latency-profile {profile}' \\
        --config 'EP4+D4=--topology EP4+D4 --latency-profile {profile}'

`--workload NAME@SECONDS,…`: the phases, each a shape of `bench/workloads.py` for that many seconds (the hardware's
time); arrivals are Poisson at `--rate` over the whole run — or, as `--rate A..B`, at a rate that ramps linearly
from A to B over it — and a request takes the shape of the phase it is sent in. Per request, client-side, as
`epdmesh bench goodput` measures it: TTFT and every inter-token gap; it meets its SLO when TTFT ≤ --slo-ttft-ms and
the P90 of its gaps ≤ --slo-tbt-ms; a failed request does not. Reported per configuration: the attainment over the
whole run and per phase, the attainment of the requests sent in each `--window`, failures, and every `--window` the
role sets its registry shows (and the planner's decisions, when it runs). `--time-scale` and `{profile}` as in
`epdmesh bench goodput`. Writes JSON and a PNG: arrival rate, attainment per window and the role counts over time.

`--backend sim` replays the same arrivals and bodies in the simulator (`sim/`: the emulated engine on `--profile`,
simulated time, the gateway's router, reservations and planner; docs/simulator.md) instead of a launched mesh: seconds
instead of the run's length. There `--time-scale K` shortens only the control plane's intervals K-fold, as they are
on an emulated mesh at time ×K (to compare with one); the model's time is the hardware's.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import collections
import itertools
import json
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

if not __package__:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.goodput import Result, meets_slo, run_rate  # noqa: E402
from bench.goodput_launch import launched, log_path, serve_args_of  # noqa: E402
from bench.workloads import SHAPES, request_bodies  # noqa: E402
from epdmesh.options import profile_spec  # noqa: E402


def parse_phases(text: str) -> list[tuple[str, float]]:
    """`textcaps@30,detail@30` → [("textcaps", 30.0), ("detail", 30.0)]; ValueError naming what is wrong."""
    phases = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, at, seconds = part.partition("@")
        if name not in SHAPES:
            raise ValueError(f"unknown shape {name!r} in {part!r}; choose from {', '.join(SHAPES)}")
        try:
            length = float(seconds) if at else float("nan")
        except ValueError:
            length = float("nan")
        if not length > 0:
            raise ValueError(f"{part!r}: give each phase as NAME@SECONDS with SECONDS > 0")
        phases.append((name, length))
    if not phases:
        raise ValueError("give at least one phase, e.g. textcaps@30,detail@30")
    return phases


def parse_rate(text: str) -> tuple[float, float]:
    """`30` → (30, 30); `10..30` → (10, 30): the rate at the start and at the end of the run. ValueError unless
    both are positive numbers."""
    start, dots, end = text.partition("..")
    try:
        rates = (float(start), float(end) if dots else float(start))
    except ValueError:
        rates = (0.0, 0.0)
    if min(rates) <= 0:
        raise ValueError(f"--rate {text!r}: give a positive rate R, or A..B for one that ramps from A to B")
    return rates


def schedule(phases: list[tuple[str, float]], rate: tuple[float, float], seed: int) -> list[tuple[float, int]]:
    """(send time, phase index) of Poisson arrivals over the phases, in order, at a rate going linearly from
    `rate[0]` at the start to `rate[1]` at the end (drawn at the higher one and thinned)."""
    rng, out, t = random.Random(seed), [], 0.0
    ends = list(itertools.accumulate(length for _, length in phases))
    top = max(rate)
    while (t := t + rng.expovariate(top)) < ends[-1]:
        steady = rate[0] == rate[1]  # (no thinning draw: a steady rate's arrivals stay those it always drew)
        if steady or rng.random() * top <= rate[0] + (rate[1] - rate[0]) * t / ends[-1]:
            out.append((t, bisect.bisect_right(ends, t)))
    return out


def bodies_for(phases, sends: list[tuple[float, int]], model: str, seed: int) -> list[dict]:
    """One request body per send, of its phase's shape, each image its own."""
    counts = collections.Counter(index for _, index in sends)
    pools = {
        index: iter(request_bodies(SHAPES[phases[index][0]], n, model, seed=seed, variant=index + 1))
        for index, n in counts.items()
    }
    return [next(pools[index]) for _, index in sends]


def attainment(results: list[Result], ttft_ms: float, tbt_ms: float) -> float | None:
    return sum(meets_slo(r, ttft_ms, tbt_ms) for r in results) / len(results) if results else None


def summarize(
    phases, sends: list[tuple[float, int]], results: list[Result], window: float, ttft_ms: float, tbt_ms: float
) -> dict:
    by_phase = [[r for (_, i), r in zip(sends, results) if i == k] for k in range(len(phases))]
    total = sum(length for _, length in phases)
    windows = []
    for start in [k * window for k in range(int(total // window) + (total % window > 0))]:
        mine = [r for (t, _), r in zip(sends, results) if start <= t < start + window]
        windows.append({"t": start, "arrivals": len(mine), "attainment": attainment(mine, ttft_ms, tbt_ms)})
    return {
        "attainment": attainment(results, ttft_ms, tbt_ms),
        "requests": len(results),
        "failed": sum(not r.ok for r in results),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "by_phase": [
            {"shape": name, "seconds": length, "requests": len(mine), "attainment": attainment(mine, ttft_ms, tbt_ms)}
            for (name, length), mine in zip(phases, by_phase)
        ],
        "windows": windows,
    }


class RolePoller:
    """Every `every` wall seconds: the role sets in the gateway's /stats, and the planner's recent decisions."""

    def __init__(self, base: str, every: float, scale: float):
        self.base, self.every, self.scale = base, every, scale
        self.samples: list[dict] = []
        self.decisions: dict[float, dict] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self):
        self.start = time.perf_counter()
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(30)

    def _run(self) -> None:
        import httpx

        while not self._stop.wait(0 if not self.samples else self.every):
            try:
                stats = httpx.get(f"{self.base}/stats", timeout=10).json()
            except (httpx.HTTPError, ValueError):
                continue
            t = (time.perf_counter() - self.start) / self.scale
            roles = collections.Counter(w.get("roles", "?") for w in stats.get("workers", {}).values())
            self.samples.append({"t": round(t, 3), "roles": dict(sorted(roles.items()))})
            for decision in stats.get("planner", {}).get("recent", []):
                self.decisions.setdefault(decision["at_unix_s"], decision)


def run_config(base: str, model: str, phases, args) -> dict:
    sends = schedule(phases, args.rates, args.seed)
    bodies = bodies_for(phases, sends, model, args.seed)
    warm = [request_bodies(SHAPES[name], 1, model, seed=args.seed + 1)[0] for name in dict(phases)]
    asyncio.run(run_rate(base, warm, [0.0] * len(warm), args.time_scale))  # every path and shape once
    from tqdm import tqdm

    with RolePoller(base, args.window * args.time_scale, args.time_scale) as poller:
        with tqdm(total=len(bodies), desc="requests", unit="req", file=sys.stderr, leave=False) as bar:
            results, duration = asyncio.run(run_rate(base, bodies, [t for t, _ in sends], args.time_scale, bar))
    out = summarize(phases, sends, results, args.window, args.slo_ttft_ms, args.slo_tbt_ms)
    out["duration_s"] = duration
    out["roles"] = poller.samples
    out["planner"] = [d for _, d in sorted(poller.decisions.items()) if d.get("action") == "switch"]
    return out


def planner_phases(first: float, count: int, planned: bool) -> list[float]:
    """Where a configuration's planner steps start, as fractions of its interval: `count` spread evenly over [0, 1)
    from `first` — or `first` alone for a configuration without a planner, which has none to place."""
    if not planned:
        return [first]
    return [round((first + k / count) % 1, 6) for k in range(count)]


def simulate_phases(serve_args: list[str], phases, args) -> dict:
    """`simulate_config` at each planner phase (`planner_phases`): the run of the median attainment, with every
    phase's attainment beside it (`planner_phases`) — where a planner's steps fall against the shifts is chance on a
    mesh, so one phase alone can be ten points off its median."""
    runs = [
        (phase, simulate_config(serve_args, phases, args, phase))
        for phase in planner_phases(args.planner_phase, args.planner_phases, "--planner" in serve_args)
    ]
    ranked = sorted(runs, key=lambda run: run[1]["attainment"])
    phase, median = ranked[(len(ranked) - 1) // 2]
    if len(runs) > 1:
        median["planner_phase"] = phase
        median["planner_phases"] = [
            {"phase": f, "attainment": r["attainment"], "by_phase": [p["attainment"] for p in r["by_phase"]]}
            for f, r in runs
        ]
    return median


def simulate_config(serve_args: list[str], phases, args, planner_phase: float | None = None) -> dict:
    """`run_config` in the simulator: the same sends and bodies on a simulated mesh, the role sets its registry
    holds sampled every window, the planner's switches as it made them (its first step `planner_phase` of an
    interval early; default `--planner-phase`)."""
    from sim.build import Setup
    from sim.events import Loop
    from sim.goodput import result_of

    setup = Setup.of(serve_args)
    sends = schedule(phases, args.rates, args.seed)
    prompts = [setup.prompt(body) for body in bodies_for(phases, sends, setup.model, args.seed)]
    loop = Loop()
    phase = args.planner_phase if planner_phase is None else planner_phase
    mesh = setup.mesh(loop, control_scale=args.time_scale, planner_phase=phase)
    timelines = [mesh.submit(t, prompt) for (t, _), prompt in zip(sends, prompts)]
    samples: list[dict] = []

    def sample() -> None:
        roles = collections.Counter(w.info.role_label for w in mesh.workers.values() if not w.away)
        samples.append({"t": round(loop.now, 3), "roles": dict(sorted(roles.items()))})
        if mesh.unfinished:
            loop.after(args.window, sample)

    loop.at(0.0, sample)
    start = time.perf_counter()
    loop.run(until=lambda: mesh.unfinished == 0)
    results = [result_of(t) for t in timelines]
    out = summarize(phases, sends, results, args.window, args.slo_ttft_ms, args.slo_tbt_ms)
    out["duration_s"] = max((t.token_times[-1] for t in timelines if t.token_times), default=loop.now)
    out["sim_wall_s"] = time.perf_counter() - start
    out["roles"] = samples
    out["planner"] = [
        {"at_s": round(at, 3), "action": "switch", "worker_id": w, "from": a, "to": b, "handed_back": n}
        for at, w, a, b, n in (mesh.planner.switches if mesh.planner is not None else [])
    ]
    return out


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="epdmesh bench shift", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--config", action="append", default=[], metavar="NAME=SERVE_ARGS", required=True)
    p.add_argument("--workload", default="textcaps@30,detail@30,textcaps@30", help="phases: SHAPE@SECONDS,…")
    p.add_argument(
        "--rate", required=True, help="arrivals per second (the hardware's time), Poisson; A..B: ramping from A to B"
    )
    p.add_argument("--window", type=float, default=5.0, help="seconds (the hardware's time) per attainment window")
    p.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    p.add_argument("--slo-tbt-ms", type=float, default=100.0)
    p.add_argument(
        "--backend",
        default="torch",
        choices=["torch", "emulated", "sim"],
        help="sim: the simulator, the emulated engine on --profile, instead of a launched mesh",
    )
    p.add_argument(
        "--profile", default="H20", type=profile_spec, help="emulated backend: the latency profile the workers run"
    )
    p.add_argument("--time-scale", type=float, default=1.0)
    p.add_argument(
        "--planner-phase",
        type=float,
        default=0.0,
        help="sim: the planner's first step this fraction of its interval early, in [0, 1) (where its steps fall "
        "against the load's shifts is chance on a mesh; run several to see the spread)",
    )
    p.add_argument(
        "--planner-phases",
        type=int,
        default=1,
        help="sim: each configuration with a planner at this many phases spread evenly from --planner-phase; the "
        "run of the median attainment is reported, every phase's attainment beside it",
    )
    p.add_argument("--model", help="checkpoint directory for launched meshes (default: serve's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--pause", type=float, default=2.0, help="seconds between configurations")
    p.add_argument("--out", default="bench/results/shift.json")
    args = p.parse_args(argv)
    try:
        args.phases = parse_phases(args.workload)
    except ValueError as e:
        p.error(str(e))
    try:
        args.rates = parse_rate(args.rate)
    except ValueError as e:
        p.error(str(e))
    if not 0 <= args.planner_phase < 1 or (args.planner_phase and args.backend != "sim"):
        p.error("--planner-phase takes a fraction in [0, 1), with --backend sim")
    if args.planner_phases < 1 or (args.planner_phases > 1 and args.backend != "sim"):
        p.error("--planner-phases takes a count of at least 1, more than one with --backend sim")
    if args.window <= 0:
        p.error("--window must be positive")
    if args.time_scale != 1 and args.backend == "torch":
        p.error("--time-scale applies to --backend emulated (and sim: its control plane)")
    return args


def main(argv=None) -> int:
    import logging

    args = parse_args(argv)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    scaled_by = f", time ×{args.time_scale:g}" if args.time_scale != 1 else ""
    report = {
        "backend": (
            f"emulated: {Path(args.profile).stem}{scaled_by}"
            if args.backend == "emulated"
            else f"simulated: emulated engine on {Path(args.profile).stem}, simulated time"
            + (f", control plane as at time ×{args.time_scale:g}" if args.time_scale != 1 else "")
            if args.backend == "sim"
            else "real engine (torch CPU)"
        ),
        "phases": [{"shape": n, "seconds": s} for n, s in args.phases],
        "rate": args.rates[0] if args.rates[0] == args.rates[1] else list(args.rates),
        "window_s": args.window,
        "slo_ttft_ms": args.slo_ttft_ms,
        "slo_tbt_ms": args.slo_tbt_ms,
        "time_scale": args.time_scale,
        "seed": args.seed,
        **({"planner_phase": args.planner_phase} if args.backend == "sim" else {}),
        "serve_args": {},
        "configs": {},
    }
    with tempfile.TemporaryDirectory(prefix="epdmesh-shift-") as tmp:
        profile = None
        simulated = args.backend == "sim"
        # the simulator's model time is the hardware's: neither the profile nor the SLOs are scaled there
        launch = argparse.Namespace(**{**vars(args), "backend": "emulated", "time_scale": 1.0}) if simulated else args
        if launch.backend == "emulated" or any("{profile}" in c for c in args.config):
            from common.latency import scaled
            from common.latency.roofline import load_profile

            profile = Path(tmp) / "profile.json"
            scaled(load_profile(args.profile), launch.time_scale).save(profile)
        for k, spec in enumerate(args.config):
            name, _, config_args = spec.partition("=")
            serve_args = serve_args_of(config_args, launch, profile)
            report["serve_args"][name] = serve_args
            print(f"{name}: epdmesh serve {' '.join(serve_args)}", file=sys.stderr, flush=True)
            if simulated:
                report["configs"][name] = result = simulate_phases(serve_args, args.phases, args)
            else:
                with launched(serve_args, log_path(out, name)) as (base, model):
                    report["configs"][name] = result = run_config(base, model, args.phases, args)
            print_row(name, result)
            out.write_text(json.dumps(report, indent=2) + "\n")  # partial results survive a later failure
            if k + 1 < len(args.config) and not simulated:
                time.sleep(args.pause)
    plot(report, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}", file=sys.stderr)
    return 0


def print_row(name: str, result: dict) -> None:
    phases = "  ".join(f"{p['shape']} {_pct(p['attainment'])}" for p in result["by_phase"])
    spread = result.get("planner_phases")
    over = (
        f"; over {len(spread)} planner phases {_pct(min(r['attainment'] for r in spread))}–"
        f"{_pct(max(r['attainment'] for r in spread))}, the median's shown (phase {result['planner_phase']:g})"
        if spread
        else ""
    )
    print(
        f"  {name:>16}: attainment {_pct(result['attainment'])} ({phases}), failed {result['failed']} of "
        f"{result['requests']}, {len(result['planner'])} planner switches{over}",
        file=sys.stderr,
        flush=True,
    )


def _rate(rate) -> str:
    return f"{rate[0]:g} → {rate[1]:g}" if isinstance(rate, list) else f"{rate:g}"


def _pct(value: float | None) -> str:
    return "  -  " if value is None else f"{value:5.1%}"


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    configs = report["configs"]
    changing = {n: c for n, c in configs.items() if len({tuple(s["roles"].items()) for s in c["roles"]}) > 1}
    rows = 3 if changing else 2
    fig, axes = plt.subplots(rows, 1, figsize=(9, 2.6 * rows), sharex=True)
    edges, start = [], 0.0
    for phase in report["phases"]:
        edges.append((start, start + phase["seconds"], phase["shape"]))
        start += phase["seconds"]
    for ax in axes:
        for k, (a, b, shape) in enumerate(edges):
            ax.axvspan(a, b, color="0.93" if k % 2 else "white", zorder=0)
    for a, b, shape in edges:
        axes[0].text((a + b) / 2, 1.02, shape, ha="center", va="bottom", transform=axes[0].get_xaxis_transform())
    first = next(iter(configs.values()))
    w = report["window_s"]
    axes[0].step([x["t"] for x in first["windows"]], [x["arrivals"] / w for x in first["windows"]], where="post")
    axes[0].set_ylabel("arrivals (req/s)")
    for name, c in configs.items():
        points = [(x["t"] + w / 2, x["attainment"]) for x in c["windows"] if x["attainment"] is not None]
        axes[1].plot(*zip(*points), marker="o", ms=3, label=f"{name} ({_pct(c['attainment']).strip()})")
    axes[1].axhline(0.9, color="0.5", ls=":", lw=1)
    axes[1].set_ylabel("SLO attainment")
    axes[1].set_ylim(0, 1.05)
    axes[1].legend(fontsize=8, loc="lower left")
    if changing:
        for i, (name, c) in enumerate(changing.items()):
            labels = sorted({r for s in c["roles"] for r in s["roles"]})
            style = ("-", "--", ":", "-.")[i % 4]  # configurations that switch alike stay apart
            for role in labels:
                axes[2].step(
                    [s["t"] for s in c["roles"]],
                    [s["roles"].get(role, 0) for s in c["roles"]],
                    where="post",
                    ls=style,
                    lw=1.5 if i == 0 else 2.0,
                    label=f"{name}: {role}",
                )
        axes[2].set_ylabel("workers")
        axes[2].legend(fontsize=8, loc="upper left")
    axes[-1].set_xlabel("time (s, the hardware's)")
    fig.suptitle(
        f"{report['backend']}; {_rate(report['rate'])} req/s; TTFT ≤ {report['slo_ttft_ms']:g} ms, "
        f"P90 TBT ≤ {report['slo_tbt_ms']:g} ms",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
