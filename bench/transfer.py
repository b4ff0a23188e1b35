"""Page-pull bandwidth per transfer backend: 1 / 4 / 16 / 64 / 256 MiB of KV-cache blocks.

    python -m bench.transfer [--sizes-mib 1,4,16,64,256] [--block-kib 256] [--repeats 5] [--order shuffled]

Backends, each measured on the code path the workers run:
  memcpy      baseline, one process: a plain memcpy (`ctypes.memmove`, one thread) of the same number of
              bytes into a preallocated buffer (torch's `copy_` would split it over both cores)
  gather      one process: `PagedBuffer.read_blocks` (index the blocks, copy them into new bytes); what a
              source does per gRPC pull, and the in-process ceiling for a pull that must return new bytes
  grpc        `GrpcStreamPuller.pull` against a real grpc.aio server in another process that mounts the
              real `WorkerServicer` over a real `WorkerRuntime` (its lease table, `read_lease`), 4 MiB chunks
  nixl        `NixlTransfer.pull` against the same source process's NIXL agent (one-sided UCX READ, loopback),
              into a staging buffer, then copied out to new bytes
  grpc-into   `GrpcStreamPuller.pull_into`: the same pull, then written into blocks of a destination cache —
              what a worker does with a handle it is given
  nixl-into   `NixlTransfer.pull_into`: one READ straight into the blocks of this process's registered
              destination cache (shuffled destination ids too) — what a worker does with a NIXL handle

The source process holds a paged cache of (largest size × 1.25) in blocks of --block-kib and leases
one page set per size (block ids a random sample, so runs are non-contiguous unless --order contiguous).
Each (backend, size) cell gets one warm-up pull, then --repeats timed pulls, cut short by a per-cell and
a whole-run time budget; the first pull of every cell is checked byte for byte. GB/s = bytes / median
time. Ratios are to memcpy at the same size. Everything binds 127.0.0.1; UCX stays on `lo`.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import datetime
import importlib.metadata
import json
import multiprocessing
import os
import platform
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("UCX_NET_DEVICES", "lo")  # before anything loads UCX (here or in the spawned source)

if not __package__:  # run as `python bench/transfer.py`: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

from common.paged_cache import PagedBuffer  # noqa: E402

MiB = 1 << 20
BLOCK_SIZE = 16  # tokens per block (only the layout's bookkeeping; bytes per block is what matters)
DESCRIPTIONS = {
    "memcpy": "plain memcpy (ctypes.memmove, 1 thread) into a preallocated buffer, 1 process (baseline)",
    "gather": "PagedBuffer.read_blocks → new bytes, 1 process",
    "grpc": "GrpcStreamPuller ↔ WorkerServicer.PullPages (grpc.aio, 2 processes, 4 MiB chunks)",
    "nixl": "NixlTransfer.pull: NIXL one-sided READ over UCX (2 processes, UCX_NET_DEVICES=lo) → new bytes",
    "grpc-into": "GrpcStreamPuller.pull_into: gRPC pull, then written into destination cache blocks",
    "nixl-into": "NixlTransfer.pull_into: one NIXL READ straight into registered destination cache blocks",
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes-mib", default="1,4,16,64,256", help="comma-separated pull sizes in MiB")
    p.add_argument("--block-kib", type=int, default=256, help="bytes per page block, KiB")
    p.add_argument("--repeats", type=int, default=5, help="timed pulls per cell, after one warm-up")
    p.add_argument("--order", choices=("shuffled", "contiguous"), default="shuffled", help="block ids of a page set")
    p.add_argument("--backends", default="memcpy,gather,grpc,nixl,grpc-into,nixl-into", help="comma-separated subset")
    p.add_argument("--cell-budget-s", type=float, default=8.0, help="stop repeating a cell after this long")
    p.add_argument("--budget-s", type=float, default=100.0, help="skip the cells left after this long")
    p.add_argument("--out", default="bench/results/transfer.json")
    args = p.parse_args(argv)
    args.sizes = [int(float(s) * MiB) for s in args.sizes_mib.split(",") if s.strip()]
    args.backends = [b for b in args.backends.split(",") if b.strip()]
    block = args.block_kib * 1024
    if args.repeats < 1 or args.block_kib < 1 or not args.sizes or any(s < block or s % block for s in args.sizes):
        p.error("need --repeats >= 1 and sizes that are positive multiples of the block size")
    if unknown := set(args.backends) - set(DESCRIPTIONS):
        p.error(f"unknown backends {sorted(unknown)}")
    return args


def fill_cache(num_blocks: int, block_bytes: int) -> PagedBuffer:
    """A uint8 paged cache with the same pseudo-random bytes in every process that builds it."""
    cache = PagedBuffer("kv", num_blocks, BLOCK_SIZE, (block_bytes,), torch.uint8, "cpu")
    words = cache.data.view(-1).view(torch.int64)
    torch.arange(words.numel(), dtype=torch.int64, out=words)
    words.mul_(-7046029254386353131).add_(0x2545F4914F6CDD1D)  # wrapping int64 multiply: every block differs
    return cache


def block_ids_for(
    sizes: list[int], block_bytes: int, num_blocks: int, order: str, seed: int = 1234
) -> dict[int, list[int]]:
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for size in sizes:
        n = size // block_bytes
        out[size] = list(range(n)) if order == "contiguous" else torch.randperm(num_blocks, generator=gen)[:n].tolist()
    return out


# ----- the source process: a real WorkerServicer + WorkerRuntime, and a NIXL agent, over one paged cache -----


class _Pages:
    """The two things WorkerRuntime's source side asks of the engine's pages: a cache by kind, and releasing a
    request."""

    def __init__(self, cache: PagedBuffer):
        self.kv_cache = cache

    def cache(self, kind: str) -> PagedBuffer:
        if kind != "kv":
            raise KeyError(kind)
        return self.kv_cache

    def release(self, request_id: str) -> None:
        pass


class _Engine:
    def __init__(self, cache: PagedBuffer):
        self.pages = _Pages(cache)


class _AsyncEngine:
    def __init__(self, engine: _Engine):
        self.engine = engine

    async def call(self, fn):
        return fn(self.engine)

    def now(self, fn):  # the runtime frees an acked lease's blocks through this
        return fn(self.engine)


def _source_main(conn, sizes: list[int], block_bytes: int, num_blocks: int, order: str, with_nixl: bool) -> None:
    import uvloop

    uvloop.run(_serve(conn, sizes, block_bytes, num_blocks, order, with_nixl))


async def _serve(conn, sizes, block_bytes, num_blocks, order, with_nixl) -> None:
    import grpc

    from common.transfer.channels import CHANNEL_OPTIONS
    from epdmesh.v1 import mesh_pb2_grpc as pb_grpc
    from services.worker.runtime import WorkerRuntime
    from services.worker.servicer import WorkerServicer

    cache = fill_cache(num_blocks, block_bytes)
    engine = _Engine(cache)
    nixl = None
    if with_nixl:
        from common.transfer.nixl_backend import NixlTransfer

        nixl = NixlTransfer("bench-source", None, None, caches={"kv": cache.data})
    server = grpc.aio.server(options=CHANNEL_OPTIONS)
    port = server.add_insecure_port("127.0.0.1:0")
    runtime = WorkerRuntime(
        "bench-source",
        f"127.0.0.1:{port}",
        _AsyncEngine(engine),
        puller=None,
        lease_ttl_s=3600,
        offer_backend="nixl" if nixl else "grpc",
        backend_info=nixl.metadata if nixl else b"",
    )
    pb_grpc.add_WorkerServicer_to_server(WorkerServicer(runtime), server)
    await server.start()
    ids = block_ids_for(sizes, block_bytes, num_blocks, order)
    handles = {
        size: runtime.leases.grant(
            f"lease-{size}",
            ids[size],
            len(ids[size]) * BLOCK_SIZE,
            cache.layout,
            runtime.offer_backend,
            runtime.backend_info,
        )
        for size in sizes
    }
    conn.send(handles)
    await asyncio.get_running_loop().run_in_executor(None, conn.recv)  # until the bench says stop
    conn.send(len(runtime.leases))  # leases still held: 0 if every ack arrived
    await server.stop(1)
    if nixl is not None:
        await nixl.close()


# ----- the bench process -----


async def _time_cell(pull, size: int, expect: bytes | None, repeats: int, cell_budget_s: float, bar) -> list[float]:
    data = await pull()  # warm-up (connection set-up, staging buffers), checked byte for byte
    if isinstance(expect, tuple):  # pulled into destination blocks: read those back
        _, block_ids, expect = expect
        data = data.read_blocks(block_ids, len(block_ids) * BLOCK_SIZE).data
    if expect is not None and data != expect:
        raise AssertionError(f"pulled bytes differ from the source's ({size} B)")
    del data
    bar.update(1)
    times: list[float] = []
    start = time.perf_counter()
    for i in range(repeats):
        t0 = time.perf_counter()
        data = await pull()
        times.append(time.perf_counter() - t0)
        del data
        bar.update(1)
        if time.perf_counter() - start > cell_budget_s:
            bar.update(repeats - i - 1)
            break
    return times


async def _run(args, handles: dict[int, object], local: PagedBuffer, ids: dict[int, list[int]], bar) -> list[dict]:
    from common.transfer.channels import ChannelPool
    from common.transfer.grpc_stream import GrpcStreamPuller

    channels = ChannelPool()
    pullers = {"grpc": GrpcStreamPuller(channels)}
    pullers["grpc-into"] = pullers["grpc"]
    dest = fill_cache(local.num_blocks, local.layout.bytes_per_block)  # where pull_into writes
    dest_ids = block_ids_for(args.sizes, local.layout.bytes_per_block, local.num_blocks, args.order, seed=99)
    if {"nixl", "nixl-into"} & set(args.backends):
        from common.transfer.nixl_backend import NixlTransfer

        pullers["nixl"] = pullers["nixl-into"] = NixlTransfer("bench-puller", None, channels, caches={"kv": dest.data})
    rows: list[dict] = []
    deadline = time.perf_counter() + args.budget_s
    try:
        for size in args.sizes:
            src = local.data.view(-1)[:size]
            dst = torch.empty(size, dtype=torch.uint8)
            dst.copy_(src)
            expect = local.read_blocks(ids[size], len(ids[size]) * BLOCK_SIZE).data
            for backend in args.backends:
                if time.perf_counter() > deadline:
                    bar.update(args.repeats + 1)
                    rows.append({"backend": backend, "size_bytes": size, "skipped": "run budget spent"})
                    continue
                if backend == "memcpy":

                    async def pull(src=src, dst=dst):
                        ctypes.memmove(dst.data_ptr(), src.data_ptr(), src.numel())

                    check = None
                elif backend == "gather":

                    async def pull(size=size):
                        return local.read_blocks(ids[size], len(ids[size]) * BLOCK_SIZE).data

                    check = expect
                elif backend.endswith("-into"):

                    async def pull(puller=pullers[backend], handle=handles[size], size=size):
                        await puller.pull_into(handle, dest, dest_ids[size])
                        return dest

                    check = ("into", dest_ids[size], expect)
                else:

                    async def pull(puller=pullers[backend], handle=handles[size]):
                        return (await puller.pull(handle)).data

                    check = expect
                times = await _time_cell(pull, size, check, args.repeats, args.cell_budget_s, bar)
                med = statistics.median(times)
                rows.append(
                    {
                        "backend": backend,
                        "size_bytes": size,
                        "median_s": med,
                        "gbps": size / med / 1e9,
                        "min_gbps": size / max(times) / 1e9,
                        "max_gbps": size / min(times) / 1e9,
                        "samples_s": times,
                    }
                )
            del expect
        # the ack every backend uses (Worker.ReleasePages over gRPC): the source frees each lease
        released = [await pullers.get("nixl", pullers["grpc"]).release(h) for h in handles.values()]
        if not all(released):
            raise AssertionError(f"acks not taken: {released}")
    finally:
        for puller in pullers.values():
            await puller.close()
        await channels.close()
    base = {r["size_bytes"]: r["gbps"] for r in rows if r["backend"] == "memcpy" and "gbps" in r}
    for r in rows:
        if "gbps" in r and r["size_bytes"] in base:
            r["ratio_to_memcpy"] = r["gbps"] / base[r["size_bytes"]]
    return rows


def print_report(meta: dict, rows: list[dict]) -> None:
    print(
        f"\npage pulls, blocks of {meta['block_bytes'] // 1024} KiB ({meta['order']} ids), median of "
        f"{meta['repeats']} after a warm-up; {meta['cpus']} CPUs, torch {meta['torch']}, nixl {meta['nixl'] or '-'}"
    )
    for b in meta["backends"]:
        print(f"  {b:<7} {DESCRIPTIONS[b]}")
    backends = meta["backends"]
    print("\n" + f"{'size':>8}  " + "  ".join(f"{b + ' GB/s':>12} {'×memcpy':>8}" for b in backends))
    for size in meta["sizes"]:
        cells = []
        for b in backends:
            r = next((r for r in rows if r["backend"] == b and r["size_bytes"] == size), None)
            if r is None or "gbps" not in r:
                cells.append(f"{'skipped':>12} {'':>8}")
            else:
                ratio = r.get("ratio_to_memcpy")
                cells.append(f"{r['gbps']:>12.2f} {f'{ratio:.2f}×' if ratio is not None else '-':>8}")
        print(f"{size // MiB:>5} MiB  " + "  ".join(cells))


def plot(meta: dict, rows: list[dict], path: Path) -> Path | None:
    """GB/s against pull size, one line per backend (log scales); None when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(7.5, 4.5), dpi=120)
    for backend in meta["backends"]:
        points = sorted((r["size_bytes"] / MiB, r["gbps"]) for r in rows if r["backend"] == backend and "gbps" in r)
        if points:
            style = {"linestyle": "--", "color": "black"} if backend == "memcpy" else {"marker": "o"}
            ax.plot(*zip(*points), label=backend, **style)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("pull size (MiB)")
    ax.set_ylabel("GB/s (median)")
    ax.set_title(f"page pulls, {meta['block_bytes'] // 1024} KiB blocks ({meta['order']} ids), {meta['cpus']} CPUs")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    block_bytes = args.block_kib * 1024
    num_blocks = max(args.sizes) * 5 // 4 // block_bytes
    try:
        nixl_version = importlib.metadata.version("nixl-cu12")
    except importlib.metadata.PackageNotFoundError:
        nixl_version = None
    if {"nixl", "nixl-into"} & set(args.backends):
        try:
            import common.transfer.nixl_backend  # noqa: F401
        except ImportError as e:
            print(f"NIXL unavailable ({e}); skipping the nixl backends", file=sys.stderr)
            args.backends = [b for b in args.backends if not b.startswith("nixl")]
    with_nixl = any(b.startswith("nixl") for b in args.backends)
    needs_source = with_nixl or any(b.startswith("grpc") for b in args.backends)
    local = fill_cache(num_blocks, block_bytes)
    ids = block_ids_for(args.sizes, block_bytes, num_blocks, args.order)
    meta = {
        "bench": "transfer",
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "cpus": os.cpu_count(),
        "machine": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "nixl": nixl_version,
        "ucx_env": {k: v for k, v in os.environ.items() if k.startswith("UCX_")},
        "block_bytes": block_bytes,
        "order": args.order,
        "repeats": args.repeats,
        "sizes": args.sizes,
        "backends": args.backends,
        "descriptions": {b: DESCRIPTIONS[b] for b in args.backends},
    }
    ctx = multiprocessing.get_context("spawn")
    conn = proc = None
    handles: dict[int, object] = {}
    started = time.perf_counter()
    try:
        if needs_source:
            conn, child = ctx.Pipe()
            proc = ctx.Process(
                target=_source_main,
                args=(child, args.sizes, block_bytes, num_blocks, args.order, with_nixl),
                daemon=True,
            )
            proc.start()
            if not conn.poll(120):
                raise RuntimeError("the source process did not come up in 120 s")
            handles = conn.recv()
        total = len(args.sizes) * len(args.backends) * (args.repeats + 1)
        with tqdm(total=total, desc="transfer bench", unit="pull", file=sys.stderr) as bar:
            import uvloop

            rows = uvloop.run(_run(args, handles, local, ids, bar))
        if conn is not None:
            conn.send("stop")
            meta["leases_left_at_source"] = conn.recv() if conn.poll(30) else None
    finally:
        if proc is not None:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
    meta["wall_s"] = round(time.perf_counter() - started, 1)
    print_report(meta, rows)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(meta, rows=rows), indent=2) + "\n")
    png = plot(meta, rows, out.with_suffix(".png"))
    print(f"\nwrote {out}{f' and {png}' if png else ''} ({meta['wall_s']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
