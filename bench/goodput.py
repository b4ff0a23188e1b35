"""Goodput under SLO: replay a workload against a mesh through its HTTP API over a sweep of request rates.

    epdmesh bench goodput --url http://127.0.0.1:8000 --workload textcaps --rates 1,2,4
    epdmesh bench goodput --backend emulated --time-scale 10 --workload textcaps,pope \\
        --config 'EPD8=--topology EPD8' --config 'E2+P2+D4=--topology E2+P2+D4' --rates 10,20,30,40

Per request, client-side: TTFT (send → first streamed token) and every inter-token gap. A request
meets its SLO when TTFT ≤ --slo-ttft-ms and the P90 of its gaps ≤ --slo-tbt-ms; a failed request
does not. SLO attainment at a rate = the fraction of requests meeting it; **goodput** = the highest
rate swept whose attainment is ≥ --attainment (0.9). The sweep runs the rates in ascending order and
stops after two consecutive rates below the target. Per-rate metrics carry the key names of
`vllm bench serve` (request_throughput, request_goodput, mean/median/p90/p99 _ttft_ms, _tpot_ms,
_itl_ms, _e2el_ms, …).

`--config NAME=ARGS` (repeatable): launch `epdmesh serve ARGS` on a free loopback port for each
configuration in turn, sweep it, stop it; `{profile}` in ARGS is the (time-scaled) latency profile.
With `--backend emulated`, every launched mesh runs the emulated backend on `--profile`; with
`--time-scale K` the profile and the SLOs given to the mesh are K× slower, requests are sent K×
less often and every measured time is divided by K, so a host that cannot keep up with the real
hardware's pace still queues exactly as it would (reported rates and times are the hardware's).
Writes JSON (every configuration, workload and rate) and a PNG of SLO attainment vs rate.

Workloads: the dataset shapes of `bench/workloads.py` (every request new to the server), and `conversation`
(`bench/conversation.py`: the trace window's own prompt and output lengths, ÷ `--trace-scale`, and its shared
prefixes — a system prompt and earlier turns —, each conversation with one image); `conversation/8` is the same
at its own scale, so one launch can compare two (`--workload conversation,conversation/8`); `trace:PATH` replays a
trace file (`bench/recorded.py`: one a gateway recorded with `serve --record-trace`, or Mooncake's), its own
arrivals, lengths, shared prefixes and pictures.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

if not __package__:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import conversation, recorded  # noqa: E402
from bench.bodies import workload_of  # noqa: E402
from bench.goodput_launch import launched, log_path, serve_args_of  # noqa: E402
from bench.goodput_report import add_bound, finish, instances_of, replot  # noqa: E402
from bench.workloads import (  # noqa: E402
    WORKLOADS,
    add_arrival_arg,
    arrivals,
    trace_scale_of,
    trace_times,
)
from epdmesh.options import profile_spec  # noqa: E402

PERCENTILES = (50, 90, 99)


@dataclasses.dataclass(slots=True)
class Result:
    ok: bool
    ttft: float = 0.0  # seconds, in the hardware's time (÷ time scale)
    itl: list[float] = dataclasses.field(default_factory=list)
    e2el: float = 0.0
    input_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0  # of the prompt, answered from the server's prefix cache (its usage says)
    error: str = ""
    request_id: str = ""  # the completion's id: the gateway's /stats names the prefill path it took


async def send(client, url: str, body: dict, scale: float) -> Result:
    """One streamed chat completion; times every content chunk as it arrives."""
    start = time.perf_counter()
    times: list[float] = []
    usage, request_id = {}, ""
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                return Result(False, error=f"HTTP {response.status_code}: {text[:200]}")
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    return Result(False, error=str(chunk["error"])[:200])
                if chunk.get("usage"):
                    usage = chunk["usage"]
                request_id = request_id or chunk.get("id", "")
                # a chunk per token: ours carry its ids (return_token_ids), elsewhere count chunks with text
                if any(c.get("token_ids") or c.get("delta", {}).get("content") for c in chunk.get("choices", [])):
                    times.append(time.perf_counter())
    except Exception as exc:  # connection trouble counts as a failed request, not a failed benchmark
        return Result(False, error=f"{type(exc).__name__}: {exc}"[:200])
    if not times:
        return Result(False, error="no tokens streamed")
    end = time.perf_counter()
    return Result(
        True,
        (times[0] - start) / scale,
        [(b - a) / scale for a, b in zip(times, times[1:])],
        (end - start) / scale,
        usage.get("prompt_tokens", 0),
        usage.get("completion_tokens", len(times)),
        (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
        request_id=request_id,
    )


def _pct(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = (len(ordered) - 1) * p / 100
    lo, hi = math.floor(k), math.ceil(k)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def meets_slo(r: Result, ttft_ms: float, tbt_ms: float) -> bool:
    return r.ok and r.ttft * 1e3 <= ttft_ms and (not r.itl or _pct(r.itl, 90) * 1e3 <= tbt_ms)


def summarize(results: list[Result], duration: float, rate: float, ttft_ms: float, tbt_ms: float) -> dict:
    """vllm bench serve's metrics (times in ms) plus SLO attainment."""
    done = [r for r in results if r.ok]
    good = [r for r in results if meets_slo(r, ttft_ms, tbt_ms)]
    out = {
        "request_rate": rate,
        "num_prompts": len(results),
        "completed": len(done),
        "failed": len(results) - len(done),
        "duration": duration,
        "total_input_tokens": sum(r.input_tokens for r in done),
        "total_output_tokens": sum(r.output_tokens for r in done),
        "total_cached_tokens": sum(r.cached_tokens for r in done),
        "request_throughput": len(done) / duration,
        "request_goodput": len(good) / duration,
        "output_throughput": sum(r.output_tokens for r in done) / duration,
        "slo_attainment": len(good) / len(results) if results else 0.0,
        "ttft_attainment": sum(r.ok and r.ttft * 1e3 <= ttft_ms for r in results) / max(1, len(results)),
        "tbt_attainment": sum(r.ok and (not r.itl or _pct(r.itl, 90) * 1e3 <= tbt_ms) for r in results)
        / max(1, len(results)),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
    }
    out["total_token_throughput"] = (out["total_input_tokens"] + out["total_output_tokens"]) / duration
    series = {
        "ttft": [r.ttft * 1e3 for r in done],
        "tpot": [(r.e2el - r.ttft) * 1e3 / (r.output_tokens - 1) for r in done if r.output_tokens > 1],
        "itl": [g * 1e3 for r in done for g in r.itl],
        "e2el": [r.e2el * 1e3 for r in done],
        # each answer's longest gap: a stall the P90 of its gaps hides (a decoder out of room takes a prompt's pages
        # only after its first token was sent)
        "max_gap": [max(r.itl) * 1e3 for r in done if r.itl],
    }
    for name, values in series.items():
        out[f"mean_{name}_ms"] = statistics.fmean(values) if values else float("nan")
        out[f"median_{name}_ms"] = statistics.median(values) if values else float("nan")
        out[f"std_{name}_ms"] = statistics.pstdev(values) if values else float("nan")
        for p in PERCENTILES:
            out[f"p{p}_{name}_ms"] = _pct(values, p)
    return out


async def run_rate(
    base: str, bodies: list[dict], times: list[float], scale: float, bar=None
) -> tuple[list[Result], float]:
    """Send `bodies` at `times` (hardware seconds; × scale on the wall clock) and wait for all of them."""
    import httpx

    url = f"{base}/v1/chat/completions"
    limits = httpx.Limits(max_connections=4096, max_keepalive_connections=256)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        start = time.perf_counter()

        async def one(body: dict, at: float) -> Result:
            delay = start + at * scale - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            result = await send(client, url, body, scale)
            if bar is not None:
                bar.update()
            return result

        results = await asyncio.gather(*(one(b, t) for b, t in zip(bodies, times)))
        return list(results), (time.perf_counter() - start) / scale


def gateway_stats(base: str) -> dict | None:
    """The gateway's /stats (None: a one-process server has no mesh statistics)."""
    import httpx

    try:
        stats = httpx.get(f"{base}/stats", timeout=10).json()
    except (httpx.HTTPError, ValueError):
        return None
    return stats if isinstance(stats.get("paths"), dict) else None


def prediction_report(
    before: dict,
    after: dict,
    scale: float,
    results: list[Result] | None = None,
    ttft_ms: float = 0.0,
    tbt_ms: float = 0.0,
) -> dict:
    """Per prefill path, how the SLO-aware policy's predicted TTFT compared with the gateway's measured one for
    the requests routed between two /stats reads (ms, divided by the time scale): error = actual − predicted.
    With the client's `results`, also each path's SLO attainment (which path's requests missed, and on what)."""
    seen = max((row[0] for row in before.get("ttft_predictions", {}).get("recent", [])), default=0)
    rows = [r for r in after.get("ttft_predictions", {}).get("recent", []) if r[0] > seen]
    report = {}
    for path in sorted({r[1] for r in rows}):
        errors = sorted((r[3] - r[2]) / scale for r in rows if r[1] == path)
        pick = lambda q: errors[min(len(errors) - 1, int(q * len(errors)))]  # noqa: E731
        report[path] = {
            "count": len(errors),
            "p10_error_ms": pick(0.1),
            "median_error_ms": pick(0.5),
            "p90_error_ms": pick(0.9),
            "late_fraction": sum(e > 0 for e in errors) / len(errors),
        }
    out = {"by_path": report, "requests": [[r[1], r[2] / scale, r[3] / scale] for r in rows]}
    if results is not None:
        out["attainment_by_path"] = path_attainment(rows, results, ttft_ms, tbt_ms)
    return out


def path_attainment(rows: list[list], results: list[Result], ttft_ms: float, tbt_ms: float) -> dict:
    """SLO attainment of the requests of each prefill path (matched by completion id; rows from /stats carry it
    fifth), and the P90 over those requests of each one's P90 gap — what fails a path, TTFT or TBT. Where some
    missed the TBT, which of their gaps were slow: how many had their first gap slow (for a request handed over to
    a decoder, the KV pull and the wait to join), and the median count of slow gaps and of gaps among them."""
    path_of = {r[4]: r[1] for r in rows if len(r) > 4}
    out = {}
    for path in sorted(set(path_of.values())):
        mine = [r for r in results if r.ok and path_of.get(r.request_id) == path]
        if not mine:
            continue
        gaps = [_pct(r.itl, 90) * 1e3 for r in mine if r.itl]
        out[path] = {
            "count": len(mine),
            "ttft_attainment": sum(r.ttft * 1e3 <= ttft_ms for r in mine) / len(mine),
            "tbt_attainment": sum(not r.itl or _pct(r.itl, 90) * 1e3 <= tbt_ms for r in mine) / len(mine),
            "slo_attainment": sum(meets_slo(r, ttft_ms, tbt_ms) for r in mine) / len(mine),
            "p90_of_p90_gap_ms": _pct(gaps, 90),
        }
        missed = [r for r in mine if r.itl and _pct(r.itl, 90) * 1e3 > tbt_ms]
        if missed:
            slow = [[g * 1e3 > tbt_ms for g in r.itl] for r in missed]
            out[path]["tbt_missed"] = {
                "count": len(missed),
                "first_gap_slow": sum(s[0] for s in slow),
                "median_slow_gaps": statistics.median(sum(s) for s in slow),
                "median_gaps": statistics.median(len(s) for s in slow),
            }
    return out


def sweep(base: str, model: str, workload: str, rates: list[float], args, label: str, gaps) -> dict:
    from tqdm import tqdm

    bodies_of, shape = workload_of(workload, lambda: conversation.calibrate(base), model, args)
    trace_gaps = recorded.arrivals_of(workload, args.num_prompts, args.seed, gaps)
    bodies = bodies_of(0)
    asyncio.run(run_rate(base, bodies[: args.warmup], [0.0] * args.warmup, args.time_scale))  # warm every path once
    points, below = [], 0
    for k, rate in enumerate(sorted(rates)):
        # each point's images (and a conversation's words) are its own: a server that caches prefixes must not
        # answer a point from what an earlier one left in its cache
        bodies = bodies_of(k + 1)
        times = arrivals(args.num_prompts, rate, args.arrival, args.seed, trace_gaps)
        with tqdm(
            total=len(bodies), desc=f"{label} {workload} @ {rate:g} req/s", unit="req", file=sys.stderr, leave=False
        ) as bar:
            before = gateway_stats(base)
            results, duration = asyncio.run(run_rate(base, bodies, times, args.time_scale, bar))
        point = summarize(results, duration, rate, args.slo_ttft_ms, args.slo_tbt_ms)
        after = gateway_stats(base)
        if before is not None and after is not None:  # where the prefills ran (mesh gateways count them)
            point["prefill_paths"] = {path: n - before["paths"].get(path, 0) for path, n in after["paths"].items()}
            point["ttft_prediction"] = prediction_report(
                before, after, args.time_scale, results, args.slo_ttft_ms, args.slo_tbt_ms
            )
        points.append(point)
        paths = " ".join(f"{k} {v}" for k, v in point.get("prefill_paths", {}).items() if v)
        errors = " ".join(
            f"{k} {v['median_error_ms']:+.0f}/{v['p90_error_ms']:+.0f}"
            for k, v in point.get("ttft_prediction", {}).get("by_path", {}).items()
        )
        by_path = " ".join(
            f"{k} {v['ttft_attainment']:.0%}/{v['tbt_attainment']:.0%}"
            + (
                f" (TBT missed {m['count']}, {m['first_gap_slow']} first gap slow)"
                if (m := v.get("tbt_missed"))
                else ""
            )
            for k, v in point.get("ttft_prediction", {}).get("attainment_by_path", {}).items()
        )
        print(
            f"  {label:>12} {workload:<9} rate {rate:6.2f}  attainment {point['slo_attainment']:5.1%} "
            f"(TTFT {point['ttft_attainment']:5.1%}, TBT {point['tbt_attainment']:5.1%})  p90 TTFT "
            f"{point['p90_ttft_ms']:7.1f} ms  p90 ITL {point['p90_itl_ms']:6.1f} ms  failed {point['failed']}"
            + (
                f"  cached {point['total_cached_tokens'] / point['total_input_tokens']:.1%}"
                if point["total_cached_tokens"]
                else ""
            )
            + (f"  paths: {paths}" if paths else "")
            + (f"  TTFT late by (p50/p90 ms): {errors}" if errors else "")
            + (f"  TTFT/TBT met by path: {by_path}" if by_path else ""),
            file=sys.stderr,
            flush=True,
        )
        below = below + 1 if point["slo_attainment"] < args.attainment else 0
        if below >= 2:
            break
        time.sleep(args.pause)
    return {"workload": workload, **shape, "goodput": goodput_of(points, args.attainment), "points": points}


def goodput_of(points: list[dict], attainment: float) -> float:
    """The highest rate swept whose SLO attainment is at least `attainment` (0: none)."""
    return max((p["request_rate"] for p in points if p["slo_attainment"] >= attainment), default=0.0)


def crossing(points: list[dict], attainment: float = 0.9) -> float:
    """The rate at which attainment falls through `attainment`, linear between the swept rates around it: the last
    rate at or above it when the next one is below; the highest rate when none is below; 0 when the first is."""
    ordered = sorted(points, key=lambda p: p["request_rate"])
    if not ordered or ordered[0]["slo_attainment"] < attainment:
        return 0.0
    for lo, hi in zip(ordered, ordered[1:]):
        if hi["slo_attainment"] < attainment <= lo["slo_attainment"]:
            a, b = lo["slo_attainment"], hi["slo_attainment"]
            return lo["request_rate"] + (a - attainment) / (a - b) * (hi["request_rate"] - lo["request_rate"])
    return ordered[-1]["request_rate"]


# ----- main -----


def parse_args(argv=None, prog: str = "epdmesh bench goodput", description: str = __doc__):
    """The benchmark's arguments (`epdmesh sim goodput` takes the same)."""
    p = argparse.ArgumentParser(
        prog=prog, description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--url", help="a running mesh's base URL (instead of --config)")
    p.add_argument(
        "--config",
        action="append",
        default=[],
        metavar="NAME=SERVE_ARGS",
        help="launch `epdmesh serve SERVE_ARGS` per configuration (repeatable)",
    )
    p.add_argument(
        "--workload",
        default="textcaps",
        help=f"comma-separated: {', '.join(WORKLOADS)} (conversation: "
        "the trace's own lengths and shared prefixes, bench/conversation.py; conversation/8: with its "
        "own --trace-scale, so one launch can sweep two; document>detail>document: a load that shifts, the "
        "requests in equal runs of those shapes, conversation[/N] among them, bench/workloads.phases_of; "
        "trace:PATH: a trace file's requests and arrivals, bench/recorded.py)",
    )
    p.add_argument(
        "--trace-scale",
        type=int,
        default=16,
        help="conversation: the trace's prompt and output lengths ÷ this (a divisor of 512)",
    )
    p.add_argument("--rates", default="1,2,4,8", help="comma-separated request rates (req/s, the hardware's time)")
    p.add_argument(
        "--rates-of",
        action="append",
        default=[],
        metavar="NAME=RATES",
        help="this configuration's own rates instead of --rates (repeatable): a split that saturates at "
        "20 req/s need not be run at 80, nor one that holds 70 at 20",
    )
    p.add_argument("--num-prompts", type=int, default=100, help="requests per rate")
    p.add_argument("--warmup", type=int, default=4)
    add_arrival_arg(p)
    p.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    p.add_argument("--slo-tbt-ms", type=float, default=100.0)
    p.add_argument("--attainment", type=float, default=0.9)
    p.add_argument(
        "--backend",
        default="torch",
        choices=["torch", "emulated"],
        help="of the launched meshes (with --url: what the running mesh runs, for the report)",
    )
    p.add_argument(
        "--profile",
        default="H20",
        type=profile_spec,
        help="emulated backend: the latency profile the workers run (a file, or H20 / H100 / H200: analytic; "
        "H20:qwen2-vl-7b-1344: an encode-heavy shape)",
    )
    p.add_argument("--time-scale", type=float, default=1.0, help="time dilation of an emulated mesh (see above)")
    p.add_argument("--model", help="checkpoint directory for launched meshes (default: serve's)")
    p.add_argument("--pause", type=float, default=2.0, help="seconds between rates (queues drain)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench/results/goodput.json")
    p.add_argument("--plot", help="PNG path (default: the --out path with .png)")
    p.add_argument(
        "--replot",
        metavar="JSON",
        help="measure nothing: add the goodput bounds to a saved report "
        "(emulated runs, on --profile), rewrite it, plot it and print its table",
    )
    args = p.parse_args(argv)
    if args.replot:
        return args
    if bool(args.url) == bool(args.config):
        p.error("give either --url or one or more --config NAME=SERVE_ARGS")
    if args.time_scale != 1 and (args.url or args.backend != "emulated"):
        p.error("--time-scale applies to meshes this benchmark launches with --backend emulated")
    args.workloads = [w.strip() for w in args.workload.split(",") if w.strip()]
    for w in ["conversation", *args.workloads]:  # the first: --trace-scale itself
        try:
            trace_scale_of(w, args.trace_scale)
        except ValueError as e:
            p.error(str(e))
    args.rate_list = _rates(args.rates)
    args.rates_of = {name: _rates(rates) for name, _, rates in (spec.partition("=") for spec in args.rates_of)}
    names = {spec.partition("=")[0] for spec in args.config}
    unknown = sorted(set(args.rates_of) - names)
    if unknown:
        p.error(f"--rates-of names no --config: {', '.join(unknown)}")
    if any(not r or min(r) <= 0 for r in [args.rate_list, *args.rates_of.values()]) or args.num_prompts < 2:
        p.error("need positive --rates and --num-prompts >= 2")
    return args


def _rates(text: str) -> list[float]:
    try:
        return [float(r) for r in text.split(",") if r.strip()]
    except ValueError:
        return []


def real_device(configs: list[str]) -> str:
    """CUDA where a served config runs on the GPU (`--device cuda…`), else CPU: what the report says it measured."""
    cuda = any(re.search(r"--device[= ]cuda", spec) for spec in configs)
    return "CUDA" if cuda else "CPU"


def main(argv=None) -> int:
    import logging

    args = parse_args(argv)
    if args.replot:
        return replot(args)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    gaps = trace_times(seed=args.seed) if args.arrival == "mooncake" else None
    backend = (
        "emulated: " + Path(args.profile).stem + (f", time ×{args.time_scale:g}" if args.time_scale != 1 else "")
        if args.backend == "emulated"
        else f"real engine (torch {real_device(args.config or [])})"
    )
    report = {
        "backend": backend,
        "arrival": args.arrival,
        "slo_ttft_ms": args.slo_ttft_ms,
        "slo_tbt_ms": args.slo_tbt_ms,
        "attainment": args.attainment,
        "num_prompts": args.num_prompts,
        "time_scale": args.time_scale,
        "workloads": args.workloads,
        "configs": {},
        "serve_args": {},
        "profile": args.profile if args.backend == "emulated" else None,
    }
    with tempfile.TemporaryDirectory(prefix="epdmesh-goodput-") as tmp:
        profile, hardware = None, None
        if args.backend == "emulated" or any("{profile}" in c for c in args.config):
            from common.latency import scaled
            from common.latency.roofline import load_profile

            hardware = load_profile(args.profile)  # rates are in its (unscaled) time
            profile = Path(tmp) / "profile.json"
            scaled(hardware, args.time_scale).save(profile)
        if args.url:
            import httpx

            model = httpx.get(f"{args.url}/v1/models", timeout=10).json()["data"][0]["id"]
            report["configs"]["mesh"] = {
                w: sweep(args.url, model, w, args.rate_list, args, "mesh", gaps) for w in args.workloads
            }
        for spec in args.config:
            name, _, config_args = spec.partition("=")
            serve_args = serve_args_of(config_args, args, profile)
            report["serve_args"][name] = serve_args
            print(f"{name}: epdmesh serve {' '.join(serve_args)}", file=sys.stderr, flush=True)
            with launched(serve_args, log_path(out, name)) as (base, model):
                rates = args.rates_of.get(name, args.rate_list)
                report["configs"][name] = {w: sweep(base, model, w, rates, args, name, gaps) for w in args.workloads}
            for result in report["configs"][name].values():
                add_bound(result, hardware if args.backend == "emulated" else None, instances_of(serve_args))
            out.write_text(json.dumps(report, indent=2) + "\n")  # partial results survive a later failure
    out.write_text(json.dumps(report, indent=2) + "\n")
    finish(report, out, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
