"""Page pulls by one-sided NIXL READ over its UCX backend (CPU memory: cma/shared memory on one host).

Each worker owns one NIXL agent, named by its worker id, with both page caches (KV, image)
registered at start. `metadata` is what a puller needs about this worker: the agent's own
metadata (connection info + memory keys) behind a small header with, per cache kind, the base
address, bytes per block and block count. Every handle this worker leases carries it in
`backend_info`, so a puller needs no extra round trip:

  1. parse the header (cached per metadata), load the source's agent once (reloaded if the same
     worker id comes back with new metadata, i.e. a restarted worker);
  2. one descriptor per run of consecutive block ids: source base + id·block_bytes → the matching
     offset of a registered staging buffer from a small pool (grown on demand, reused);
  3. post the READ and wait for it in a thread of our own (the READ may copy inline: cma), so the
     event loop never blocks; PullFailed on ERR, on timeout, or if the lease expired meanwhile;
  4. copy the staging bytes into the payload's own `bytes` and give the buffer back to the pool,
     so no caller ever sees a buffer that is reused.

Progress: NIXL's own progress thread busy-polls a whole core (its Python API hardcodes
`pthrDelay=0`: measured 3.0 s CPU per 3 s idle), which halves transfer speed on a 2-core host
and steals the engine's CPU. It is switched off; instead a light thread ticks the agent every
`progress_interval_s` (2 ms: about 1.5% of a core), which the passive (source) side needs for
connection wire-up and for the tcp transport; once connected, cma READs need no source progress.

Every call into the agent goes through one lock (the agent is also created thread-safe), taken
in worker threads only, never on the event loop. Which network UCX uses is the environment's
(`UCX_NET_DEVICES`): `epdmesh serve` and the tests keep it on loopback (`lo`); a deployment across hosts names
its interface.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import importlib
import logging
import os
import threading
import time
from collections import OrderedDict

import numpy as np
import torch

from common.memory import block_runs, bytes_of, paired_runs
from common.paged_cache import PagedBuffer, PagePayload
from common.transfer.channels import ChannelPool
from common.transfer.grpc_stream import release_over_grpc
from common.transfer.handle import PageHandle
from common.transfer.nixl_meta import CacheRegion, PeerInfo, pack_metadata, parse_metadata
from common.transfer.nixl_staging import Staging, StagingPool
from common.transfer.puller import (
    PullFailed,
    check_destination,
    finish_even_if_cancelled,
    pull_then_write,
)


def _import_nixl():
    """nixl-cu12 (what the `ucx` extra installs) provides `nixl_cu12`; the `nixl` meta package picks a build."""
    errors = []
    for module in ("nixl_cu12", "nixl", "nixl_cu13"):
        try:
            return importlib.import_module(f"{module}._api")
        except ImportError as e:
            errors.append(f"{module}: {e}")
    raise ImportError("no NIXL Python package (" + "; ".join(errors) + ")")


_nixl = _import_nixl()  # ImportError here → the factory falls back to the gRPC stream
if not os.environ.get("NIXL_LOG_LEVEL"):
    logging.getLogger("nixl").setLevel(logging.WARNING)  # its INFO lines go to stdout

log = logging.getLogger(__name__)

KINDS = ("kv", "image")
IDLE_PROGRESS_S = 0.1  # the source ticker's period while none of its pages are leased


def _region_of(tensor: torch.Tensor) -> CacheRegion:
    if not tensor.is_contiguous():
        raise ValueError("page caches must be contiguous to be registered with NIXL")
    on_cpu = tensor.device.type == "cpu"
    return CacheRegion(
        tensor.data_ptr(),
        tensor[0].numel() * tensor.element_size(),
        tensor.shape[0],
        "DRAM" if on_cpu else "VRAM",
        0 if on_cpu else (tensor.device.index or 0),
    )


class NixlTransfer:
    """The NIXL agent of one worker: the source side (registered caches, `metadata`) and a `PagePuller`."""

    name = "nixl"

    def __init__(
        self,
        worker_id: str,
        engine,
        channels: ChannelPool,
        *,
        timeout_s: float = 30.0,
        progress_interval_s: float = 0.002,
        staging_keep_bytes: int = 256 << 20,
        max_concurrent: int = 4,
        caches: dict[str, torch.Tensor] | None = None,
    ):
        """`engine.pages.cache(kind).data` for kind in ('kv', 'image') are the tensors to serve (or pass `caches`)."""
        self.worker_id = worker_id
        self.channels = channels
        self.timeout_s = timeout_s
        self._lock = threading.Lock()  # every call into the agent
        self._pool_lock = threading.Lock()  # the parsed-metadata cache
        self._abandoned: list[tuple[object, Staging]] = []  # READs that never finished: keep their buffers alive
        self._remotes: dict[str, bytes] = {}  # loaded agent name → its metadata
        self._peers: OrderedDict[bytes, PeerInfo] = OrderedDict()  # parsed metadata, bounded
        self._closed = False

        config = _nixl.nixl_agent_config(
            enable_prog_thread=False, backends=["UCX"], sync_mode=_nixl.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT
        )
        self.agent = _nixl.nixl_agent(worker_id, config)
        self._staging = StagingPool(self.agent, self._lock, staging_keep_bytes)
        if "UCX" not in self.agent.backends:
            raise ImportError("NIXL has no UCX backend plugin here")
        if caches is None:
            caches = {kind: getattr(engine.pages.cache(kind), "data", engine.pages.cache(kind)) for kind in KINDS}
        self._tensors: dict[str, torch.Tensor] = {}
        self._cache_regs = []
        regions: dict[str, CacheRegion] = {}
        for kind, tensor in caches.items():
            if tensor is None or tensor.numel() == 0:
                continue
            regions[kind] = _region_of(tensor)
            self._cache_regs.append(self.agent.register_memory(tensor))
            self._tensors[kind] = tensor
        self.regions = regions
        self.metadata: bytes = pack_metadata(worker_id, regions, self.agent.get_agent_metadata())
        self._executor = concurrent.futures.ThreadPoolExecutor(max_concurrent, thread_name_prefix=f"nixl-{worker_id}")
        self._stop = threading.Event()
        self._serving = threading.Event()  # set while peers may read our pages; set until told otherwise
        self._serving.set()
        self._progress_interval_s = progress_interval_s
        self._ticker = threading.Thread(target=self._tick, name=f"nixl-progress-{worker_id}", daemon=True)
        self._ticker.start()
        log.info(
            "NIXL agent %s: registered %s",
            worker_id,
            ", ".join(f"{k} {r.num_blocks}×{r.block_bytes} B" for k, r in regions.items()) or "nothing",
        )

    @property
    def tensors(self) -> dict[str, torch.Tensor]:
        """The cache tensors registered, by kind."""
        return dict(self._tensors)

    # ----- the puller -----

    async def pull(self, handle: PageHandle) -> PagePayload:
        if self._closed:
            raise PullFailed("NIXL transfer is closed")
        loop = asyncio.get_running_loop()
        data = await loop.run_in_executor(self._executor, self._pull_blocking, handle)
        return PagePayload(handle.layout, handle.num_tokens, data)

    async def pull_into(self, handle: PageHandle, cache: PagedBuffer, block_ids: list[int]) -> None:
        """One READ from the source's cache straight into ours: no staging buffer, no bytes object."""
        check_destination(handle, cache, block_ids)
        if self._closed:
            raise PullFailed("NIXL transfer is closed")
        registered = self._tensors.get(handle.kind)
        if registered is None or registered.data_ptr() != cache.data.data_ptr():
            await pull_then_write(self, handle, cache, block_ids)  # not our registered cache: via bytes
            return
        loop = asyncio.get_running_loop()
        await finish_even_if_cancelled(
            loop.run_in_executor(self._executor, self._pull_into_blocking, handle, cache.data, list(block_ids))
        )

    async def release(self, handle: PageHandle) -> bool:
        return await release_over_grpc(self.channels, handle)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self._serving.set()  # wake an idle ticker, which then sees the stop
        await asyncio.to_thread(self._shutdown)

    # ----- internals (worker threads) -----

    def serving(self, leased: int) -> None:
        """How many of this worker's page sets are leased out: while any is, peers may read them, and the
        ticker progresses every `progress_interval_s`; with none it ticks every IDLE_PROGRESS_S. (A puller
        progresses its own READs.) A 2 ms ticker taking the GIL cost a decoder ~0.2–0.3 ms per 5 ms step."""
        if leased:
            self._serving.set()
        else:
            self._serving.clear()

    def _tick(self) -> None:
        """Progress the agent's UCX worker: connection wire-up and non-cma transports need the source to."""
        while True:
            if not self._serving.is_set():
                self._serving.wait(IDLE_PROGRESS_S)  # a lease wakes it at once
            if self._stop.wait(self._progress_interval_s):
                return
            try:
                with self._lock:
                    if self._stop.is_set():
                        return
                    self.agent.get_new_notifs()
            except Exception:  # never let the ticker die on a transient error
                log.exception("NIXL progress tick failed")

    def _peer(self, blob: bytes) -> PeerInfo:
        with self._pool_lock:
            peer = self._peers.get(blob)
        if peer is None:
            peer = parse_metadata(blob)
            with self._pool_lock:
                self._peers[blob] = peer
                while len(self._peers) > 256:
                    self._peers.popitem(last=False)
        return peer

    def _ensure_remote(self, peer: PeerInfo, blob: bytes) -> None:
        """Load the source's agent once; reload when its worker id comes back with new metadata. Under the lock."""
        known = self._remotes.get(peer.agent)
        if known == blob:
            return
        if known is not None:
            log.info("NIXL peer %s changed its metadata (restarted?); reloading it", peer.agent)
            try:
                self.agent.remove_remote_agent(peer.agent)
            except Exception as e:
                log.warning("dropping NIXL peer %s: %s", peer.agent, e)
            del self._remotes[peer.agent]
        name = self.agent.add_remote_agent(peer.agent_metadata)
        name = name.decode() if isinstance(name, bytes) else name
        if name != peer.agent:
            raise PullFailed(f"NIXL metadata names agent {name!r}, its header {peer.agent!r}")
        self._remotes[peer.agent] = blob

    def _source(self, handle: PageHandle) -> tuple[PeerInfo, CacheRegion]:
        """The handle's source agent and cache region, checked; PullFailed if the handle cannot be read."""
        if not handle.backend_info:
            raise PullFailed(f"handle {handle.lease_id} from {handle.worker_id} carries no NIXL metadata")
        if handle.lease_expiry < time.time():
            raise PullFailed(f"lease {handle.lease_id} from {handle.worker_id} expired before the pull")
        try:
            peer = self._peer(handle.backend_info)
        except ValueError as e:
            raise PullFailed(f"handle {handle.lease_id} from {handle.worker_id}: {e}") from None
        region = peer.caches.get(handle.kind)
        if region is None:
            raise PullFailed(f"source {peer.agent} registered no {handle.kind} cache with NIXL")
        if region.block_bytes != handle.layout.bytes_per_block:
            raise PullFailed(
                f"source {peer.agent} has {region.block_bytes} B {handle.kind} blocks, "
                f"the handle {handle.layout.bytes_per_block} B"
            )
        bad = [b for b in handle.block_ids if not 0 <= b < region.num_blocks]
        if bad:
            raise PullFailed(
                f"block ids {bad[:4]} out of range for {peer.agent}'s {region.num_blocks} {handle.kind} blocks"
            )
        return peer, region

    def _check_still_leased(self, handle: PageHandle) -> None:
        if handle.lease_expiry < time.time():  # the source may have freed and reused the pages meanwhile
            raise PullFailed(f"lease {handle.lease_id} from {handle.worker_id} expired during the pull")

    def _pull_blocking(self, handle: PageHandle) -> bytes:
        peer, region = self._source(handle)
        if peer.agent == self.worker_id:
            data = self._read_own(handle, peer)
        else:
            data = self._read_remote(handle, peer, region)
        self._check_still_leased(handle)
        return data

    def _pull_into_blocking(self, handle: PageHandle, tensor: torch.Tensor, block_ids: list[int]) -> None:
        """READ the source blocks straight into this worker's registered cache `tensor` at `block_ids`."""
        peer, region = self._source(handle)
        if peer.agent == self.worker_id:
            src = torch.tensor(handle.block_ids, dtype=torch.long, device=tensor.device)
            dst = torch.tensor(block_ids, dtype=torch.long, device=tensor.device)
            tensor[dst] = tensor.index_select(0, src)
            return
        runs = paired_runs(handle.block_ids, block_ids, region.block_bytes)
        base = tensor.data_ptr()
        remote = np.array([(region.addr + s, n, region.dev) for s, _, n in runs], dtype=np.uint64)
        local = np.array([(base + d, n, 0) for _, d, n in runs], dtype=np.uint64)
        xfer = None
        try:
            xfer = self._read(handle, peer, region, local, remote)
        except PullFailed as e:
            xfer = getattr(e, "xfer", None)
            raise
        finally:
            if not self._finish(xfer):
                log.error(
                    "NIXL READ of %s into cache blocks could not be aborted; those blocks may still change",
                    handle.lease_id,
                )
        self._check_still_leased(handle)

    def _read(self, handle: PageHandle, peer: PeerInfo, region: CacheRegion, local, remote):
        """Post one READ of `remote` into `local` descriptors and wait for it; returns the transfer (to finish)."""
        xfer = None
        try:
            with self._lock:
                self._ensure_remote(peer, handle.backend_info)
                local_descs = self.agent.get_xfer_descs(local, "DRAM")
                remote_descs = self.agent.get_xfer_descs(remote, region.mem)
                xfer = self.agent.initialize_xfer("READ", local_descs, remote_descs, peer.agent)
                state = self.agent.transfer(xfer)
            deadline = time.monotonic() + self.timeout_s
            delay = 2e-5
            while state == "PROC" and time.monotonic() < deadline:
                time.sleep(delay)
                delay = min(delay * 2, 1e-3)
                with self._lock:
                    state = self.agent.check_xfer_state(xfer)
        except PullFailed:
            raise
        except Exception as e:  # nixl raises its own binding errors (e.g. unknown memory at the source)
            self._finish(xfer)
            raise PullFailed(f"NIXL READ of {handle.lease_id} from {peer.agent}: {type(e).__name__}: {e}") from None
        if state != "DONE":
            what = "timed out after %.1f s" % self.timeout_s if state == "PROC" else "failed"
            error = PullFailed(f"NIXL READ of {handle.lease_id} ({handle.num_bytes} B) from {peer.agent} {what}")
            error.xfer = xfer
            raise error
        return xfer

    def _read_own(self, handle: PageHandle, peer: PeerInfo) -> bytes:
        """A handle on this worker's own pages (e.g. encode and prefill on one worker): a local gather."""
        if handle.backend_info != self.metadata:
            raise PullFailed(f"handle {handle.lease_id} names this worker ({peer.agent}) with other NIXL metadata")
        tensor = self._tensors[handle.kind]
        index = torch.tensor(handle.block_ids, dtype=torch.long, device=tensor.device)
        return bytes_of(tensor.index_select(0, index).cpu())

    def _read_remote(self, handle: PageHandle, peer: PeerInfo, region: CacheRegion) -> bytes:
        nbytes = handle.num_bytes
        runs = block_runs(handle.block_ids, region.block_bytes)
        try:
            staging = self._staging.take(nbytes)
        except Exception as e:  # out of memory, or NIXL refused to register it
            raise PullFailed(f"no {nbytes} B staging buffer for {handle.lease_id}: {type(e).__name__}: {e}") from None
        remote = np.array([(region.addr + s, n, region.dev) for s, _, n in runs], dtype=np.uint64)
        base = staging.tensor.data_ptr()
        local = np.array([(base + lo, n, 0) for _, lo, n in runs], dtype=np.uint64)
        xfer = None
        try:
            try:
                xfer = self._read(handle, peer, region, local, remote)
            except PullFailed as e:
                xfer = getattr(e, "xfer", None)
                raise
            data = bytes_of(staging.tensor[:nbytes])
        except BaseException:
            if not self._finish(xfer):  # still in flight: its buffer must never be reused or freed
                self._abandoned.append((xfer, staging))
                log.warning(
                    "NIXL READ of %s from %s could not be aborted; its %d B buffer is retired",
                    handle.lease_id,
                    peer.agent,
                    staging.nbytes,
                )
                raise
            self._staging.give(staging, self._closed)
            raise
        self._finish(xfer)
        self._staging.give(staging, self._closed)
        return data

    def _finish(self, xfer) -> bool:
        """Release a transfer request (aborting it if in flight); False if it could not be."""
        if xfer is None:
            return True
        try:
            with self._lock:
                xfer.release()
            return True
        except Exception as e:
            log.debug("releasing NIXL transfer: %s", e)
            return False

    def _shutdown(self) -> None:
        self._ticker.join(timeout=5)
        self._executor.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            for xfer, _ in self._abandoned:
                try:
                    xfer.release()
                except Exception:
                    pass
            # buffers of READs that never finished stay registered and referenced (see _abandoned)
            for reg in self._staging.drain() + self._cache_regs:
                try:
                    self.agent.deregister_memory(reg)
                except Exception as e:
                    log.debug("deregistering NIXL memory: %s", e)
            self._cache_regs = []
            for name in list(self._remotes):
                try:
                    self.agent.remove_remote_agent(name)
                except Exception:
                    pass
            self._remotes.clear()
