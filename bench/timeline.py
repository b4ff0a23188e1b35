"""Where a request's time goes in the mesh: the median timeline of its spans, from real traces.

    python -m bench.timeline [--topology E1+P1+D1] [--workload image|text] [--requests 20] [--against DIR]

Starts `epdmesh serve` with OpenTelemetry tracing into an OTLP receiver in this process, sends --requests
chats one at a time (after --warmup ones), and prints, for every span of a request's trace (gateway, each
worker, each gRPC call on both sides, queue and execute of each stage, page pulls), the median of its start and
end relative to the request's root span (`chat.completions`, at the gateway) and of its duration; the client's
TTFT p50 too. Spans are matched across requests by service, name and occurrence in the trace. `--against DIR`
serves the code of another checkout (a `git worktree` of an older commit) instead. Backend: the real engine
(torch CPU). Tracing itself costs a little (bench/tracing.py); compare timelines with timelines. Loopback only.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

if not __package__:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.lean_http import LeanClient  # noqa: E402
from bench.mesh import measure_http  # noqa: E402

BACKEND = "real engine (torch CPU, float32, 1 thread per process), OpenTelemetry tracing on"
ROOT = "chat.completions"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="checkpoint dir (default: the default tiny model)")
    p.add_argument("--topology", default="E1+P1+D1")
    p.add_argument("--workload", default="image", choices=["image", "text"])
    p.add_argument("--requests", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--against", metavar="DIR", help="serve this checkout's code instead of this one's")
    p.add_argument("--out", default="bench/results/timeline.json")
    args = p.parse_args(argv)
    if args.requests < 1 or args.warmup < 0 or args.max_tokens < 1:
        p.error("need --requests >= 1, --warmup >= 0, --max-tokens >= 1")
    return args


@dataclass(frozen=True)
class Row:
    service: str
    name: str
    occurrence: int  # the n-th span of this service and name in its trace
    start_ms: float  # medians, relative to the root span's start
    end_ms: float
    duration_ms: float
    count: int  # traces that had it


def timeline(spans) -> tuple[list[Row], int]:
    """Median timeline of the request traces among `spans` (objects with service, name, trace_id, start_ns,
    end_ns); traces without a `chat.completions` root (heartbeats, registrations) are left out. Rows in order
    of their median start; and how many request traces there were."""
    traces = collections.defaultdict(list)
    for s in spans:
        traces[s.trace_id].append(s)
    cells = collections.defaultdict(list)
    requests = 0
    for members in traces.values():
        root = next((s for s in members if s.name == ROOT), None)
        if root is None:
            continue
        requests += 1
        seen: collections.Counter = collections.Counter()
        for s in sorted(members, key=lambda s: s.start_ns):
            key = (s.service, s.name, seen[(s.service, s.name)])
            seen[(s.service, s.name)] += 1
            cells[key].append(((s.start_ns - root.start_ns) / 1e6, (s.end_ns - root.start_ns) / 1e6))
    rows = [
        Row(
            service,
            name,
            n,
            statistics.median(a for a, _ in v),
            statistics.median(b for _, b in v),
            statistics.median(b - a for a, b in v),
            len(v),
        )
        for (service, name, n), v in cells.items()
    ]
    return sorted(rows, key=lambda r: (r.start_ms, r.end_ms)), requests


async def send(base: str, args, first: int, count: int) -> list[float]:
    """`count` chats one at a time, as bench/mesh.py sends them; the client's TTFT of each, ms."""
    client = LeanClient(base)
    try:
        return [
            (await measure_http(client, base, args.workload, i, args.max_tokens))[0]
            for i in range(first, first + count)
        ]
    finally:
        await client.close()


def main(argv=None) -> int:
    from epdmesh.checkpoints import ensure_default_model
    from tests.services.otlp import OtlpReceiver
    from tests.services.servers import running_server

    args = parse_args(argv)
    model_dir = args.model or str(ensure_default_model())
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with OtlpReceiver() as receiver:
        env = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, "OTEL_BSP_SCHEDULE_DELAY": "100"}
        with running_server(
            model_dir, args.topology, out.parent / "timeline-serve.log", env=env, source=args.against
        ) as base:
            print(
                f"{args.topology} up; {args.warmup} warm-up then {args.requests} {args.workload} requests",
                file=sys.stderr,
            )
            asyncio.run(send(base, args, 0, args.warmup))
            time.sleep(1.0)  # the warm-ups' spans arrive (batch export every 100 ms)
            warm = {s.trace_id for s in receiver.spans}
            ttfts = asyncio.run(send(base, args, args.warmup, args.requests))
            time.sleep(2.0)
        rows, traced = timeline([s for s in receiver.spans if s.trace_id not in warm])
    print(
        f"\nbackend: {BACKEND}; {args.topology}, {args.workload}, {traced} traced requests of {args.requests}; "
        f"client TTFT p50 {statistics.median(ttfts):.2f} ms" + (f"; code of {args.against}" if args.against else "")
    )
    print(f"{'service':<22}{'span':<40}{'start ms':>10}{'end ms':>10}{'duration':>10}{'n':>5}")
    for r in rows:
        name = r.name if not r.occurrence else f"{r.name} #{r.occurrence + 1}"
        print(f"{r.service:<22}{name[:39]:<40}{r.start_ms:>10.2f}{r.end_ms:>10.2f}{r.duration_ms:>10.2f}{r.count:>5}")
    report = {
        "backend": BACKEND,
        "topology": args.topology,
        "workload": args.workload,
        "requests": args.requests,
        "traced": traced,
        "against": args.against,
        "client_ttft_ms": ttfts,
        "rows": [r.__dict__ for r in rows],
    }
    out.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
