"""`epdmesh trace`: a recorded trace's file (`serve --record-trace`, `common/trace.py`) — export a gateways' Redis
stream to one, summarize one, cut one to a window."""

from __future__ import annotations

import os
import sys

from common import tls
from epdmesh.options import add_tls_arg


def add_parser(sub) -> None:
    """`epdmesh trace {export,stats,cut}` under the command's subparsers."""
    traces = sub.add_parser("trace", help="a recorded trace (serve --record-trace): epdmesh trace export --help")
    traces_sub = traces.add_subparsers(dest="trace_command", required=True)
    exporting = traces_sub.add_parser(
        "export",
        help="write the requests of a Redis stream that gateways record (--record-trace redis) to a trace file, "
        "oldest first, for `--workload trace:PATH`",
    )
    exporting.add_argument(
        "--redis-url",
        default=os.environ.get("EPDMESH_REDIS_URL") or os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"),
        help="default: $EPDMESH_REDIS_URL, else $REDIS_URL, else redis://127.0.0.1:6379/0",
    )
    exporting.add_argument("--key", default="epdmesh:trace", help="the stream (the gateways' --record-trace-key)")
    exporting.add_argument("--last", type=int, default=0, metavar="N", help="only the N most recent requests")
    exporting.add_argument("--out", required=True, help="the trace file to write (JSON lines)")
    add_tls_arg(exporting)
    exporting.set_defaults(func=export)
    summing = traces_sub.add_parser(
        "stats", help="what a trace file holds: span, rates, lengths, pictures, shared prefixes, finish reasons, TTFT"
    )
    summing.add_argument("path")
    summing.add_argument("--json", action="store_true", help="print the summary as JSON")
    summing.set_defaults(func=stats)
    cutting = traces_sub.add_parser(
        "cut", help="a part of a trace file, by time or its busiest window, as a file of its own (for trace:PATH)"
    )
    cutting.add_argument("path")
    cutting.add_argument("--from", dest="start", type=float, help="seconds after the trace's first arrival")
    cutting.add_argument("--to", dest="end", type=float, help="seconds after the trace's first arrival (excluded)")
    cutting.add_argument("--busiest", type=float, metavar="S", help="the S-second window with the most arrivals")
    cutting.add_argument("--out", required=True)
    cutting.set_defaults(func=cut)


def export(args) -> int:
    from services.gateway.trace_record import export

    if args.last < 0:
        raise SystemExit("--last must be ≥ 0")
    count, first, last = export(args.redis_url, args.key, args.out, args.last, tls.load(args.tls_dir))
    if not count:
        print(f"{args.key}: no requests recorded; nothing written", file=sys.stderr)
        return 1
    print(f"wrote {count} requests to {args.out} (arrivals over {(last - first) / 1e3:.1f} s)")
    return 0


def stats(args) -> int:
    import json

    from common import trace

    try:
        rows = trace.read(args.path)
    except (OSError, ValueError) as e:
        raise SystemExit(f"epdmesh trace stats: {e}") from None
    s = trace.summary(rows)
    if args.json:
        print(json.dumps(s, indent=2))
        return 0

    def spread(q: dict, unit: str = "") -> str:
        if not q:
            return "not recorded"
        return ", ".join(f"{k} {q[k]:.1f}{unit}" if unit else f"{k} {q[k]:.0f}" for k in ("mean", "p50", "p90", "p99"))

    rate = f"{s['mean_rate']:.2f} req/s" if s["mean_rate"] else "—"
    busiest = f", busiest minute {s['busiest_minute_rate']:.2f} req/s" if s["busiest_minute_rate"] else ""
    print(f"{args.path}: {s['requests']} requests over {s['span_s']:.1f} s ({rate}{busiest})")
    print(f"  prompt tokens  {spread(s['prompt_tokens'])}")
    print(f"  output tokens  {spread(s['output_tokens'])}")
    print(f"  pictures       {s['images_per_request']:.2f} a request")
    print(
        f"  shared prefix  {s['shared_prefix_fraction']:.1%} of prompt tokens an earlier request of the trace holds "
        f"(blocks of {', '.join(str(b) for b in s['block_tokens'])} tokens)"
    )
    print(f"  finished       {', '.join(f'{k} {v}' for k, v in sorted(s['finish_reasons'].items()))}")
    print(f"  TTFT           {spread(s['ttft_ms'], ' ms')}")
    return 0


def cut(args) -> int:
    from common import trace

    if args.busiest is not None and (args.start is not None or args.end is not None):
        raise SystemExit("epdmesh trace cut: --busiest or --from/--to, not both")
    if args.busiest is not None and args.busiest <= 0:
        raise SystemExit("epdmesh trace cut: --busiest takes a positive number of seconds")
    try:
        rows = trace.read(args.path)
    except (OSError, ValueError) as e:
        raise SystemExit(f"epdmesh trace cut: {e}") from None
    start, end = trace.busiest(rows, args.busiest) if args.busiest is not None else (args.start, args.end)
    kept = trace.cut(rows, start, end)
    if not kept:
        raise SystemExit(f"epdmesh trace cut: no request of {args.path} arrived in that window")
    trace.write(kept, args.out)
    first, last = kept[0].timestamp_ms / 1e3, kept[-1].timestamp_ms / 1e3
    print(f"wrote {len(kept)} of {len(rows)} requests to {args.out} (arrivals {first:.1f}-{last:.1f} s)")
    return 0
