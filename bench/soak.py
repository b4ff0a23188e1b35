"""Does a mesh hold up over many requests? Memory of every process, pools and errors over a long mixed load.

    python -m bench.soak [--topology E1+P1+D1] [--requests 1000] [--concurrency 8] [--max-seconds 900]

Serves the topology on the real engine (torch CPU, fp32, the default tiny checkpoint, 1 torch thread per worker)
and sends `--requests` requests, `--concurrency` at a time, through its HTTP API: a fixed, seeded mix of chats with
and without an image, streamed and whole, clients that leave a stream after its first tokens, and requests that must
be refused (an image that is not one, a prompt past the model's limit). It samples the resident memory (VmRSS) of
every process of the mesh after a warm-up and then `--samples` times as the load goes on, and at the end checks that
every worker's KV and image pools are full again with no lease held. Reports per process: memory after the warm-up
and at the end, and its growth per 1,000 requests (a least-squares slope over the samples): a leak is a slope that
stays positive however long the run. Stops after `--requests` or `--max-seconds`, whichever comes first.

`--kill ROLE@N` (repeatable; e.g. `--kill D@500 --kill P@1200` on `E1+P2+D2`) SIGKILLs a worker of that role set
once N requests are done, under load: what a dead worker costs the clients (the mesh should route around it and
move its streams, so that with another worker of the role nothing fails), and whether the launcher's restart of it
comes back into service (the pools of every worker, the new one's too, are checked at the end).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import random
import re
import shlex
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

BACKEND = "real engine (torch CPU, float32, 1 thread per process)"
SERVED_NAME = "tiny"  # the name tests.services.servers.running_server serves under
# kind → weight in the mix; `bad-image` and `too-long` must come back as a 400
MIX = {
    "image-stream": 25,
    "text-stream": 25,
    "image-whole": 10,
    "text-whole": 15,
    "leave-stream": 15,
    "bad-image": 5,
    "too-long": 5,
    "image-again": 10,
}
REPEATED_CHATS = 4  # image-again: one of these few image chats again (prefix-cache hits, images' KV cached)
REFUSED = {"bad-image", "too-long"}
REQUEST_TIMEOUT_S = 120.0
SETTLE_WAIT_S = 60.0  # at the end: for acks, lease expiries and a killed worker's restart


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="checkpoint dir (default: the default tiny model)")
    p.add_argument("--topology", default="E1+P1+D1")
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--warmup", type=int, default=50, help="requests before the first memory sample")
    p.add_argument("--samples", type=int, default=10, help="memory samples after the warm-up")
    p.add_argument("--max-seconds", type=float, default=900.0, help="stop sending after this long, done or not")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--transfer", default="auto", choices=["auto", "nixl", "grpc"])
    p.add_argument("--redis-url", default=None)
    p.add_argument(
        "--kill",
        action="append",
        default=[],
        metavar="ROLE@N",
        help="SIGKILL a worker with these roles (as in the topology, e.g. D or EP) after N requests",
    )
    p.add_argument(
        "--serve-args",
        default="",
        help="more `epdmesh serve` options, as one string after an =: --serve-args='--no-enable-prefix-caching'",
    )
    p.add_argument("--out", default="bench/results/soak.json")
    args = p.parse_args(argv)
    if args.requests <= args.warmup or args.concurrency < 1 or args.samples < 2:
        p.error("need --requests > --warmup, --concurrency >= 1 and --samples >= 2")
    try:
        args.kills = parse_kills(args.kill, args.requests)
    except ValueError as e:
        p.error(str(e))
    return args


def parse_kills(given: list[str], num_requests: int) -> dict[int, list[str]]:
    """`ROLE@N` options → {N: [ROLE, ...]}."""
    kills: dict[int, list[str]] = {}
    for item in given:
        role, _, at = item.partition("@")
        if not role or not at.isdigit() or not 0 < int(at) < num_requests:
            raise ValueError(f"--kill {item!r}: want ROLE@N with 0 < N < --requests, e.g. D@500")
        kills.setdefault(int(at), []).append(role.upper())
    return kills


# ----- the requests -----


def plan(num: int, seed: int) -> list[tuple[str, int]]:
    """(kind, max_tokens) per request, the same for a seed."""
    rng = random.Random(seed)
    kinds, weights = zip(*MIX.items())
    return [(rng.choices(kinds, weights)[0], rng.randint(4, 32)) for _ in range(num)]


def _png(seed: int) -> str:
    rng = np.random.default_rng(seed)
    size = (int(rng.integers(64, 400)), int(rng.integers(64, 400)))
    img = Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def body_of(kind: str, max_tokens: int, i: int, max_model_len: int) -> dict:
    text = f"Request {i}: describe what you see in a few words."
    content: list[dict] = []
    if kind == "image-again":  # a block or more of text after the image: its KV is all in the cached prefix
        chat = i % REPEATED_CHATS
        content.append({"type": "image_url", "image_url": {"url": _png(10**9 + chat)}})
        text = f"Chat {chat}: describe what you see, then what it reminds you of, then what could come next."
    elif kind.startswith("image"):
        content.append({"type": "image_url", "image_url": {"url": _png(i)}})
    elif kind == "bad-image":  # base64 that decodes to bytes no image reader takes
        content.append(
            {
                "type": "image_url",
                "image_url": {"url": "data:image/png;base64," + base64.b64encode(b"not an image" * 20).decode()},
            }
        )
    elif kind == "too-long":
        text = " ".join(["word"] * (max_model_len + 50))
    content.append({"type": "text", "text": text})
    return {
        "model": SERVED_NAME,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0.7,
        "seed": i,
        "stream": kind.endswith("stream") or kind == "leave-stream",
    }


async def send(client: httpx.AsyncClient, base: str, kind: str, body: dict) -> tuple[str, str | None]:
    """('ok' | 'refused' | 'failed', what went wrong)."""
    url = f"{base}/v1/chat/completions"
    try:
        if not body["stream"]:
            resp = await client.post(url, json=body)
            return _judge(kind, resp.status_code, resp.text)
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                return _judge(kind, resp.status_code, (await resp.aread()).decode(errors="replace"))
            tokens = 0
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    return _judge(kind, 200, "")
                event = json.loads(line[6:])
                if "error" in event:
                    return "failed", f"{kind}: error event {event['error']}"
                tokens += bool(event.get("choices") and event["choices"][0].get("delta", {}).get("content"))
                if kind == "leave-stream" and tokens >= 2:
                    return "ok", None  # leaving: the context manager closes the connection mid-stream
            return "failed", f"{kind}: the stream ended without [DONE]"
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        return "failed", f"{kind}: {type(e).__name__}: {e}"


def _judge(kind: str, status: int, text: str) -> tuple[str, str | None]:
    if kind in REFUSED:
        return ("refused", None) if status == 400 else ("failed", f"{kind}: HTTP {status} (want 400): {text[:300]}")
    return ("ok", None) if status == 200 else ("failed", f"{kind}: HTTP {status}: {text[:300]}")


# ----- the processes -----


def _ppids() -> dict[int, int]:
    out = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[int(stat.parent.name)] = int(fields[1])
    return out


def backend_of(serve_args: list[str]) -> str:
    """What the launched workers run, as the report states it."""
    serve_args = [part for arg in serve_args for part in (arg.split("=", 1) if arg.startswith("--") else [arg])]
    if "--backend" in serve_args and serve_args[serve_args.index("--backend") + 1 :][:1] == ["emulated"]:
        profile = serve_args[serve_args.index("--profile") + 1] if "--profile" in serve_args[:-1] else "its default"
        return f"emulated (profile {profile}; page bytes moved for real, no model)"
    return BACKEND


def mesh_processes(port: int) -> dict[int, str]:
    """pid → a label, for the `serve` on `port` and every process under it."""
    root = None
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            argv = cmdline.read_bytes().split(b"\0")
        except OSError:
            continue
        if b"serve" in argv and str(port).encode() in argv:
            root = int(cmdline.parent.name)
    if root is None:
        raise RuntimeError(f"no `epdmesh serve` process on port {port}")
    parents = _ppids()
    found, frontier = {root}, [root]
    while frontier:
        pid = frontier.pop()
        for child, parent in parents.items():
            if parent == pid and child not in found:
                found.add(child)
                frontier.append(child)
    return {pid: _label(pid) for pid in found}


def _label(pid: int) -> str:
    try:
        argv = [a.decode() for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") if a]
    except OSError:
        return f"pid {pid}"
    if "--roles" in argv:
        return f"worker {argv[argv.index('--roles') + 1]}"
    for name in ("gateway", "toggle", "serve"):
        if name in argv:
            return name
    return Path(argv[0]).name if argv else f"pid {pid}"


def rss_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def slope_per_1000(points: list[tuple[int, float]]) -> float:
    """Least-squares MiB per 1,000 requests through (requests done, MiB) points."""
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    var = sum((x - mx) ** 2 for x in xs)
    return 1000 * sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0


# ----- the run -----


def num_workers(topology: str) -> int:
    """How many workers a topology names (`local`: its one engine)."""
    counts = [int(n) for n in re.findall(r"[A-Za-z]+(\d+)", topology)]
    return sum(counts) if counts else 1


async def settled_pools(client: httpx.AsyncClient, base: str, expected: int, wait_s: float = SETTLE_WAIT_S):
    """Every worker's pool stats once `expected` workers report and all their pools are full with no lease held
    (acks, lease expiries and a restarted worker's registration take a moment), or as they are after `wait_s`."""
    from tests.services.servers import pool_full

    deadline = time.monotonic() + wait_s
    while True:
        stats = (await client.get(f"{base}/stats")).json()
        workers = list(stats["workers"].values()) if "workers" in stats else [stats]
        full = len(workers) >= expected and all(pool_full(w) for w in workers)
        if full or time.monotonic() > deadline:
            return workers, full
        await asyncio.sleep(0.5)


def kill_worker(port: int, role: str) -> dict:
    """SIGKILL one live worker of the mesh on `port` whose role set is `role`; what was killed."""
    import os
    import signal

    label = f"worker {role}"
    pids = sorted(pid for pid, name in mesh_processes(port).items() if name == label)
    if not pids:
        return {"role": role, "pid": None, "error": f"no live {label}"}
    os.kill(pids[0], signal.SIGKILL)
    return {"role": role, "pid": pids[0]}


async def soak(base: str, port: int, args, bar) -> dict:
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S) as client:
        max_model_len = (await client.get(f"{base}/v1/models")).json()["data"][0]["max_model_len"]
        todo = plan(args.requests, args.seed)
        counts = {"ok": 0, "refused": 0, "failed": 0}
        failures: list[str] = []
        procs: dict[int, str] = {}
        memory: dict[int, list[tuple[int, float]]] = {}
        killed: list[dict] = []
        latencies: list[float] = []  # seconds, per answered request (a stream left early: until it was left)
        step = max(1, (args.requests - args.warmup) // args.samples)
        marks = {args.warmup + k * step for k in range(args.samples)} | {args.requests}
        done, next_i, started = 0, 0, time.monotonic()

        def sample() -> None:
            procs.update(mesh_processes(port))  # a restarted worker is a new process
            for pid in procs:
                mib = rss_mib(pid)
                if mib is not None:
                    memory.setdefault(pid, []).append((done, mib))

        async def worker() -> None:
            nonlocal done, next_i
            while next_i < len(todo) and time.monotonic() - started < args.max_seconds:
                i = next_i
                next_i += 1
                kind, max_tokens = todo[i]
                sent = time.monotonic()
                outcome, why = await send(client, base, kind, body_of(kind, max_tokens, i, max_model_len))
                if outcome == "ok":
                    latencies.append(time.monotonic() - sent)
                counts[outcome] += 1
                if why is not None and len(failures) < 20:
                    failures.append(why)
                done += 1
                bar.update(1)
                bar.set_postfix(counts)
                if done in marks:
                    sample()
                for role in args.kills.get(done, ()):
                    killed.append({**kill_worker(port, role), "after_requests": done})

        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
        elapsed = time.monotonic() - started
        workers, full = await settled_pools(client, base, num_workers(args.topology))
    per_process = {}
    for pid, label in procs.items():
        points = memory[pid]
        if len(points) < 2:
            continue
        lifetime = (
            "started during the run"
            if points[0][0] > args.warmup
            else "gone before the end"
            if points[-1][0] < done
            else ""
        )
        per_process[f"{label} ({pid})"] = {
            "rss_after_warmup_mib": points[0][1],
            "rss_end_mib": points[-1][1],
            "growth_mib": points[-1][1] - points[0][1],
            "growth_mib_per_1000_requests": slope_per_1000(points),
            "lifetime": lifetime,
            "samples": points,
        }
    quantiles = statistics.quantiles(latencies, n=100) if len(latencies) >= 2 else [float("nan")] * 99
    return {
        "requests_done": done,
        "seconds": elapsed,
        "requests_per_s": done / elapsed,
        "outcomes": counts,
        "latency_s": {"p50": quantiles[49], "p99": quantiles[98], "max": max(latencies, default=float("nan"))},
        "failures": failures,
        "killed": killed,
        "pools_full_at_end": full,
        "pools": workers,
        "processes": per_process,
    }


def main(argv=None) -> int:
    from epdmesh.checkpoints import ensure_default_model
    from tests.services.servers import running_server

    args = parse_args(argv)
    model_dir = args.model or str(ensure_default_model())
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    extra = (
        ["--transfer", args.transfer]
        + (["--redis-url", args.redis_url] if args.redis_url else [])
        + shlex.split(args.serve_args)
    )
    with running_server(model_dir, args.topology, out.parent / "soak-serve.log", *extra) as base:
        with tqdm(total=args.requests, desc=f"soak {args.topology}", unit="req", file=sys.stderr) as bar:
            report = asyncio.run(soak(base, int(base.rsplit(":", 1)[1]), args, bar))
    backend = backend_of(shlex.split(args.serve_args))
    report = {
        "backend": backend,
        "topology": args.topology,
        "transfer": args.transfer,
        "serve_args": args.serve_args,
        "concurrency": args.concurrency,
        "mix": MIX,
        **report,
    }
    print(
        f"\nbackend: {backend}; {args.topology} {args.serve_args}, transfer {args.transfer}; "
        f"{report['requests_done']} requests, "
        f"{args.concurrency} at a time, in {report['seconds']:.0f} s ({report['requests_per_s']:.1f} req/s)"
    )
    for k in report["killed"]:
        print(
            f"killed worker {k['role']} (pid {k['pid']}) after {k['after_requests']} requests"
            + (f": {k['error']}" if "error" in k else "")
        )
    print(
        f"outcomes: {report['outcomes']}; {len(report['pools'])} workers at the end, their pools full and no lease "
        f"held: {report['pools_full_at_end']}"
    )
    for why in report["failures"]:
        print("  failed:", why)
    lat = report["latency_s"]
    print(f"answered requests' latency: p50 {lat['p50']:.3f} s, p99 {lat['p99']:.3f} s, max {lat['max']:.3f} s")
    print(f"{'process':<28}{'RSS after warm-up':>18}{'RSS at end':>12}{'growth':>10}{'MiB / 1000 req':>16}")
    for name, p in sorted(report["processes"].items()):  # a process started or gone mid-run: its growth is not a slope
        print(
            f"{name:<28}{p['rss_after_warmup_mib']:>15.1f} MiB{p['rss_end_mib']:>8.1f} MiB{p['growth_mib']:>+8.1f}"
            f"{p['growth_mib_per_1000_requests']:>+16.2f}  {p['lifetime']}"
        )
    out.write_text(json.dumps(report, indent=2))
    missed = any("error" in k for k in report["killed"])
    return 0 if report["outcomes"]["failed"] == 0 and report["pools_full_at_end"] and not missed else 1


if __name__ == "__main__":
    sys.exit(main())
