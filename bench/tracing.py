"""What tracing costs: requests/s and TTFT of the same mesh with OpenTelemetry tracing off and on.

    python -m bench.tracing [--topology E1+P1+D1] [--requests 48] [--concurrency 4] [--rounds 2]

Each round starts the mesh twice — tracing off (no OTLP endpoint: nothing of OpenTelemetry's SDK
loaded), then on (`OTEL_EXPORTER_OTLP_ENDPOINT` → an OTLP/gRPC receiver in this process, batch
export every 100 ms) — and sends the same closed-loop load: --concurrency clients, --requests
chats in all (one image + a short prompt, --max-tokens tokens each, greedy). Reports the median over
rounds of req/s and p50 TTFT, and the on/off ratio; states the backend. Loopback only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

if not __package__:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx  # noqa: E402
from tqdm import tqdm  # noqa: E402

from bench.mesh import SERVED_NAME, _data_uri, conversation  # noqa: E402

BACKEND = "real engine (torch CPU, float32, 1 thread per worker process)"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="checkpoint dir (default: the default tiny model)")
    p.add_argument("--topology", default="E1+P1+D1")
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", default="bench/results/tracing.json")
    args = p.parse_args(argv)
    if min(args.requests, args.concurrency, args.rounds, args.max_tokens) < 1:
        p.error("counts must be positive")
    return args


async def load(base: str, args, bar) -> dict:
    bodies = []
    for i in range(args.requests):
        img, text = conversation(i)
        bodies.append(
            json.dumps(
                {
                    "model": SERVED_NAME,
                    "max_tokens": args.max_tokens,
                    "temperature": 0,
                    "ignore_eos": True,
                    "stream": True,
                    "return_token_ids": True,
                    "messages": [
                        {
                            "role": "user",
                            "content": [
                                {"type": "image_url", "image_url": {"url": _data_uri(img)}},
                                {"type": "text", "text": text},
                            ],
                        }
                    ],
                }
            ).encode()
        )
    queue: asyncio.Queue = asyncio.Queue()
    for body in bodies:
        queue.put_nowait(body)
    ttfts: list[float] = []

    async def client(http: httpx.AsyncClient) -> None:
        while not queue.empty():
            body = queue.get_nowait()
            start, first = time.perf_counter(), None
            async with http.stream(
                "POST", f"{base}/v1/chat/completions", content=body, headers={"content-type": "application/json"}
            ) as resp:
                resp.raise_for_status()
                async for line in resp.aiter_lines():
                    if first is None and '"token_ids": [' in line and '"token_ids": []' not in line:
                        first = time.perf_counter()
            ttfts.append((first - start) * 1e3)
            bar.update()

    async with httpx.AsyncClient(timeout=120) as http:
        await client_warmup(http, base, bodies[0])
        start = time.perf_counter()
        await asyncio.gather(*(client(http) for _ in range(args.concurrency)))
        elapsed = time.perf_counter() - start
    return {"requests_per_s": args.requests / elapsed, "p50_ttft_ms": statistics.median(ttfts)}


async def client_warmup(http: httpx.AsyncClient, base: str, body: bytes) -> None:
    for _ in range(2):
        (
            await http.post(
                f"{base}/v1/chat/completions",
                content=body.replace(b'"stream": true', b'"stream": false'),
                headers={"content-type": "application/json"},
            )
        ).raise_for_status()


def main(argv=None) -> int:
    from epdmesh.checkpoints import ensure_default_model
    from tests.services.otlp import OtlpReceiver
    from tests.services.servers import running_server

    args = parse_args(argv)
    model_dir = args.model or str(ensure_default_model())
    results = {"off": [], "on": []}
    spans = 0
    logs = Path(args.out).parent
    logs.mkdir(parents=True, exist_ok=True)
    with (
        OtlpReceiver() as receiver,
        tqdm(total=2 * args.rounds * args.requests, desc="tracing bench", unit="req", file=sys.stderr) as bar,
    ):
        for r in range(args.rounds):
            for mode in ("off", "on"):
                bar.set_postfix_str(f"round {r + 1}, tracing {mode} (starting)")
                env = (
                    {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, "OTEL_BSP_SCHEDULE_DELAY": "100"}
                    if mode == "on"
                    else {"OTEL_SDK_DISABLED": "true"}
                )
                with running_server(model_dir, args.topology, logs / f"tracing-{mode}.log", env=env) as base:
                    bar.set_postfix_str(f"round {r + 1}, tracing {mode}")
                    results[mode].append(asyncio.run(load(base, args, bar)))
        time.sleep(1)
        spans = len(receiver.spans)
    summary = {
        mode: {key: statistics.median(run[key] for run in runs) for key in runs[0]} for mode, runs in results.items()
    }
    ratio = summary["on"]["requests_per_s"] / summary["off"]["requests_per_s"]
    report = {
        "backend": BACKEND,
        "topology": args.topology,
        "requests": args.requests,
        "concurrency": args.concurrency,
        "max_tokens": args.max_tokens,
        "rounds": results,
        "median": summary,
        "on_over_off_throughput": ratio,
        "spans_received": spans,
    }
    print(
        f"\nbackend: {BACKEND}; mesh {args.topology}; {args.requests} requests × {args.rounds} rounds, "
        f"{args.concurrency} concurrent, {args.max_tokens} tokens each, 1 image per request"
    )
    print(f"{'tracing':<10}{'req/s':>10}{'p50 TTFT ms':>14}")
    for mode in ("off", "on"):
        print(f"{mode:<10}{summary[mode]['requests_per_s']:>10.2f}{summary[mode]['p50_ttft_ms']:>14.1f}")
    print(f"throughput with tracing on: {ratio:.3f}x of off ({(1 - ratio) * 100:+.1f}% cost); {spans} spans exported")
    Path(args.out).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
