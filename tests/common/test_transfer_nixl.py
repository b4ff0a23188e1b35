"""NIXL page pulls between two processes on loopback: exact bytes, odd block orders, failures.

The source is a separate Python process holding a KV-cache-shaped tensor with known bytes and
serving its NixlTransfer metadata on stdout; this process pulls through the real NixlTransfer.
Skipped when no NIXL package is installed (pip install 'epdmesh[ucx]').
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

os.environ.setdefault("UCX_NET_DEVICES", "lo")
if not any(importlib.util.find_spec(m) for m in ("nixl_cu12", "nixl", "nixl_cu13")):
    pytest.skip("NIXL is not installed (pip install 'epdmesh[ucx]')", allow_module_level=True)

import torch  # noqa: E402

from common.paged_cache import PageLayout  # noqa: E402
from common.transfer import nixl_backend  # noqa: E402
from common.transfer.channels import ChannelPool  # noqa: E402
from common.transfer.handle import PageHandle  # noqa: E402
from common.transfer.puller import PullFailed  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
NUM_BLOCKS = 64
BLOCK_SIZE = 16
BLOCK_SHAPE = (2, 2, BLOCK_SIZE, 4, 64)  # [layers, k/v, block_size, kv_heads, head_dim]: 64 KiB of float32
LAYOUT = PageLayout("kv", "float32", BLOCK_SIZE, BLOCK_SHAPE)

SOURCE = textwrap.dedent("""
    import sys
    import torch
    from common.transfer.nixl_backend import NixlTransfer
    from tests.common.test_transfer_nixl import make_cache
    cache = make_cache(int(sys.argv[2]))
    nixl = NixlTransfer(sys.argv[1], None, None, caches={"kv": cache})
    print("READY", nixl.metadata.hex(), flush=True)
    sys.stdin.read()  # until the test closes our stdin
    import asyncio
    asyncio.run(nixl.close())
""")


def make_cache(seed: int) -> torch.Tensor:
    """[NUM_BLOCKS, *BLOCK_SHAPE] float32 with bytes that differ in every block and every seed."""
    n = NUM_BLOCKS * LAYOUT.bytes_per_block // 4
    values = (torch.arange(n, dtype=torch.int64) * 2654435761 + seed * 97) % (1 << 23)
    return values.to(torch.float32).view(NUM_BLOCKS, *BLOCK_SHAPE)


class Source:
    def __init__(self, worker_id: str, seed: int):
        env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        self.proc = subprocess.Popen(
            [sys.executable, "-c", SOURCE, worker_id, str(seed)],
            cwd=ROOT,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        deadline = time.monotonic() + 60
        for line in self.proc.stdout:
            if line.startswith("READY "):
                self.metadata = bytes.fromhex(line.split()[1])
                break
            if time.monotonic() > deadline:
                break
        else:
            raise RuntimeError(f"NIXL source exited with {self.proc.wait()}")

    def stop(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def handle(
    worker_id: str,
    metadata: bytes,
    block_ids,
    ttl_s: float = 60.0,
    layout: PageLayout = LAYOUT,
    lease_id: str = "req-1",
) -> PageHandle:
    num_tokens = len(block_ids) * layout.block_size - 3  # the last block partly filled
    return PageHandle(
        worker_id, "127.0.0.1:9", lease_id, tuple(block_ids), num_tokens, layout, time.time() + ttl_s, "nixl", metadata
    )


def expected(seed: int, block_ids) -> bytes:
    return make_cache(seed)[list(block_ids)].contiguous().view(torch.uint8).numpy().tobytes()


@pytest.fixture(scope="module")
def source():
    src = Source("nixl-src", seed=1)
    yield src
    src.stop()


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


def test_pull_exact_bytes_concurrently_and_from_itself(source):
    async def main():
        own = make_cache(7)
        puller = nixl_backend.NixlTransfer("nixl-dst", None, ChannelPool(), caches={"kv": own})
        try:
            orders = [(5, 6, 7, 2, 63, 0, 31), (40,), tuple(range(10, 30)), (3, 1, 2, 9, 8)]
            for ids in orders:
                payload = await puller.pull(handle("nixl-src", source.metadata, ids))
                assert payload.layout == LAYOUT and payload.num_tokens == len(ids) * BLOCK_SIZE - 3
                assert payload.data == expected(1, ids), f"wrong bytes for blocks {ids}"
            many = [handle("nixl-src", source.metadata, ids, lease_id=f"r{i}") for i, ids in enumerate(orders * 3)]
            payloads = await asyncio.gather(*(puller.pull(h) for h in many))
            for h, p in zip(many, payloads):
                assert p.data == expected(1, h.block_ids)
            # a handle on this worker's own pages is read locally
            mine = await puller.pull(handle("nixl-dst", puller.metadata, (4, 2, 60)))
            assert mine.data == expected(7, (4, 2, 60))
        finally:
            await puller.close()

    run(main())


def test_the_source_ticker_runs_often_only_while_its_pages_are_leased():
    """Progress every 2 ms takes the GIL from the engine thread; a worker with nothing leased needs little."""

    async def main():
        transfer = nixl_backend.NixlTransfer("nixl-tick", None, ChannelPool(), caches={})
        agent, ticks = transfer.agent, []

        class Counting:
            def __getattr__(self, name):
                return getattr(agent, name)

            def get_new_notifs(self):
                ticks.append(1)
                return agent.get_new_notifs()

        transfer.agent = Counting()
        counts = {}
        try:
            for phase, leased in (("untold", None), ("idle", 0), ("serving", 2)):
                if leased is not None:
                    transfer.serving(leased)
                await asyncio.sleep(0.05)
                ticks.clear()
                await asyncio.sleep(0.5)
                counts[phase] = len(ticks)
        finally:
            transfer.agent = agent
            await transfer.close()
        assert counts["untold"] >= 25 and counts["serving"] >= 25, counts  # every 2 ms, as a source must
        assert counts["idle"] <= 8, counts  # every 100 ms

    run(main())


def test_pull_failures_are_pull_failed(source):
    async def main():
        puller = nixl_backend.NixlTransfer("nixl-dst2", None, ChannelPool(), caches={})
        try:
            with pytest.raises(PullFailed, match="out of range"):
                await puller.pull(handle("nixl-src", source.metadata, (1, NUM_BLOCKS)))
            other = PageLayout("kv", "float32", BLOCK_SIZE, (1, 2, BLOCK_SIZE, 4, 64))
            with pytest.raises(PullFailed, match="B kv blocks"):
                await puller.pull(handle("nixl-src", source.metadata, (1, 2), layout=other))
            with pytest.raises(PullFailed, match="registered no image cache"):
                await puller.pull(
                    handle("nixl-src", source.metadata, (1,), layout=PageLayout("image", "float32", 4, (4, 8)))
                )
            with pytest.raises(PullFailed, match="expired"):
                await puller.pull(handle("nixl-src", source.metadata, (1, 2), ttl_s=-1))
            with pytest.raises(PullFailed, match="metadata"):
                await puller.pull(handle("nixl-src", b"garbage", (1, 2)))
            with pytest.raises(PullFailed, match="no NIXL metadata"):
                await puller.pull(handle("nixl-src", b"", (1, 2)))
            # still usable after all that; the ack goes over gRPC and reports a gone source as False
            assert (await puller.pull(handle("nixl-src", source.metadata, (8, 3)))).data == expected(1, (8, 3))
            assert await puller.release(handle("nixl-src", source.metadata, (8, 3))) is False
        finally:
            await puller.close()
        with pytest.raises(PullFailed, match="closed"):
            await puller.pull(handle("nixl-src", source.metadata, (1,)))

    run(main())


def test_restarted_source_is_reloaded():
    """The same worker id with new metadata (a restarted worker): the puller drops the old agent."""

    async def main():
        puller = nixl_backend.NixlTransfer("nixl-dst3", None, ChannelPool(), caches={})
        try:
            for seed in (2, 3):
                src = Source("nixl-again", seed=seed)
                try:
                    payload = await puller.pull(handle("nixl-again", src.metadata, (9, 4, 5)))
                    assert payload.data == expected(seed, (9, 4, 5))
                finally:
                    src.stop()
        finally:
            await puller.close()

    run(main())


def test_metadata_round_trip_and_runs():
    caches = {"kv": nixl_backend.CacheRegion(4096, 1024, 8)}
    info = nixl_backend.parse_metadata(nixl_backend.pack_metadata("w", caches, b"\x00agent"))
    assert info.agent == "w" and info.caches == caches and info.agent_metadata == b"\x00agent"
    assert nixl_backend.block_runs((3, 4, 5, 1, 2, 7), 10) == [(30, 0, 30), (10, 30, 20), (70, 50, 10)]


def test_importing_the_backend_leaves_ucx_network_choice_to_the_environment():
    """A deployment across hosts names its interface; an import must not pin UCX to loopback behind its back."""
    env = {k: v for k, v in os.environ.items() if k != "UCX_NET_DEVICES"}
    code = "import os, common.transfer.nixl_backend; print(os.environ.get('UCX_NET_DEVICES'))"
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "None"
