"""One worker's stage logic over its engine: pulls pages in, leases pages out.

Life of a request in a worker:
  1. a stage rpc (Encode / Prefill / Decode) arrives with a spec and, maybe, handles on pages
     that another worker holds;
  2. blocks are reserved in this engine and those pages pulled straight into them through the
     transfer backend, then acked at once (the source frees them);
  3. the request runs in the engine up to its last stage here, under an id suffixed by the stage,
     so one worker can hold the same request at two stages (ED: encode, later decode);
  4. a handed-off request's pages are leased: the handle goes back to the caller, and the pages
     are freed when the next stage acks (ReleasePages) or the lease expires.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from common.engine.async_engine import AsyncEngine
from common.engine.engine import NoRoomForPages
from common.engine.outputs import RequestOutput
from common.paged_cache import PagedBuffer, PagePayload
from common.request import Request, Stage
from common.telemetry.metrics import WorkerMetrics
from common.telemetry.tracing import Tracing
from common.transfer import LeaseTable, PageHandle, PagePuller, PullFailed
from common.workers import WorkerLoad, load_of
from services.encoder.awaited import AwaitedEncodes
from services.errors import NotHeld, ShuttingDown

IMPORT_WAIT_S = 10.0  # how long handed-over pages wait for cache room here (other requests free theirs as they run)
IMPORT_POLL_S = 0.1  # while pages wait for room, the first in line tries again this often (and whenever blocks free)
ACK_DELAY_S = 0.002  # pulled pages are acked this long after (the source frees them then; its lease holds them)
KV_PRESSURE = 0.1  # free KV blocks under this share of the cache: freeing some is worth a heartbeat at once

log = logging.getLogger(__name__)


class WorkerRuntime:
    def __init__(
        self,
        worker_id: str,
        address: str,
        engine: AsyncEngine,
        puller: PagePuller,
        lease_ttl_s: float = 30.0,
        offer_backend: str = "grpc",
        backend_info: bytes = b"",
        metrics: WorkerMetrics | None = None,
        tracing: Tracing | None = None,
        on_leases: Callable[[int], None] | None = None,
        registered: dict[str, int] | None = None,
    ):
        """`on_leases(n)`: told the number of this worker's leases when it changes (the transfer's source side).
        `registered`: the cache memory (kind → data pointer) `offer_backend` serves; pages elsewhere go by gRPC."""
        self.worker_id = worker_id
        self.metrics = metrics
        self.tracing = tracing or Tracing()
        self.engine = engine
        self.puller = puller
        self.leases = LeaseTable(worker_id, address, lease_ttl_s, on_change=on_leases)
        self.awaited = AwaitedEncodes(lease_ttl_s)  # encodes whose next stage asks this worker for the handle
        self.offer_backend = offer_backend
        self.backend_info = backend_info
        self.registered = registered or {}
        self.accepting = True
        # set when pages are freed while the KV cache was nearly full at the last report: the next heartbeat goes out
        # at once, so a request waiting in a gateway for room here is routed within a refresh, not an interval
        self.freed = asyncio.Event()
        self._pressed = False
        self.in_flight = 0
        self.admitted: set[str] = set()
        self._background: set[asyncio.Task] = set()
        self.imports = ImportQueue(
            lambda r: self.engine.now(lambda e: e.pages.reserve_import(r)),  # not after the step under way
            lambda r: self.engine.now(lambda e: e.pages.cancel_import(r.request_id)),
        )

    @property
    def roles(self) -> frozenset[Stage]:
        return self.engine.engine.config.roles

    # ----- the stages -----

    async def encode(self, request: Request) -> PageHandle:
        with self._admitted(request):
            last = await self._run_to_handoff(request)
            handle = await self.lease_pages(request.request_id, last.pages)  # leased first: pages never left unowned
            self._observe_stage("encode", request)
            return handle

    async def prefill(
        self, request: Request, image_pages: PageHandle | None, pinned: bool = False
    ) -> tuple[RequestOutput, PageHandle | None]:
        """The first token, and a lease on the KV pages (None when the first token finished the request).
        `pinned`: its images' KV is cached here and its blocks taken (`pin_cached_images`); no pages come."""
        try:
            with self._admitted(request):
                preloaded = pinned or await self._import(request, image_pages)
                last = await self._run_to_handoff(request, preloaded)
                handle = await self.lease_pages(request.request_id, last.pages) if last.handed_off else None
                self._observe_stage("prefill", request)
                return last, handle
        except BaseException:
            if pinned:
                self._unpin(request)
            raise

    async def decode(
        self, request: Request, kv_pages: PageHandle | None, image_pages: PageHandle | None, pinned: bool = False
    ) -> AsyncIterator[RequestOutput]:
        try:
            async with contextlib.aclosing(self._decode(request, kv_pages, image_pages, pinned)) as outputs:
                async for out in outputs:  # (closed with this one: a caller gone aborts the request at once)
                    yield out
        except BaseException:
            if pinned:
                self._unpin(request)
            raise

    async def _decode(
        self, request: Request, kv_pages: PageHandle | None, image_pages: PageHandle | None, pinned: bool
    ) -> AsyncIterator[RequestOutput]:
        with self._admitted(request):
            try:
                try:
                    await self.engine.prepare(request)  # before its pages are reserved under the engine's lock
                except BaseException:
                    if kv_pages or image_pages:  # never pulled: let the source free them now
                        self._spawn(self.puller.release(kv_pages or image_pages))
                    raise
                preloaded = pinned or await self._import(request, kv_pages or image_pages)
                async for out in self.engine.generate(request, preloaded=preloaded):
                    if out.finished:
                        self._observe_stage("decode", request)
                    yield out
            finally:  # finished, handed back, or its caller gone: its blocks are free
                self._note_freed()

    async def pin_cached_images(self, request: Request, awaited: Callable[[], Awaitable[PageHandle]] | None) -> bool:
        """A request whose images are still being encoded elsewhere (pending): when this worker's prefix cache holds
        their KV, take its blocks now (`PageHandover.pin_cached`) and say True — it starts without the image pages, and
        `awaited()` (their handle, once the encode is done) is let go of in the background, unpulled; the caller
        passes `pinned=True` to `prefill`/`decode`, which give the blocks back if the request never gets going.
        False: the pages are needed (then the caller waits for them as before)."""
        if not self.engine.engine.config.enable_prefix_caching:
            return False
        try:
            await self.engine.prepare(request)  # before blocks are taken: nothing to cancel between the two
            self._check_takes(request)  # (the stage's `_admitted` would refuse it right after the pin)
            pinned = self.engine.now(lambda e: e.pages.pin_cached(request))
        except BaseException:
            if awaited is not None:  # the stage fails here: the encoder's pages will never be pulled
                self._spawn(self._let_go(awaited))
            raise
        if pinned and awaited is not None:
            self._spawn(self._let_go(awaited))
        return pinned

    async def _let_go(self, awaited: Callable[[], Awaitable[PageHandle]]) -> None:
        """Release an awaited encode's pages unpulled, once its handle comes."""
        with contextlib.suppress(PullFailed):  # the gateway cancels an Encode it no longer needs
            await self.puller.release(await awaited())

    def _unpin(self, request: Request) -> None:
        """A pinned request that failed before its engine took it in: its blocks go back (a no-op once taken in)."""
        self.engine.now(lambda e: e.pages.cancel_import(request.request_id))

    async def _import(self, request: Request, handle: PageHandle | None) -> bool:
        """Reserve blocks for the handle's pages, pull them straight in, ack the source. False: no pages to bring."""
        if handle is None:
            return False
        try:
            kind, block_ids, num_tokens = await self._reserve_import(request, handle)
        except BaseException:
            self._spawn(self.puller.release(handle))  # we will never pull them: let the source free them now
            raise
        done = False
        attributes = {
            "epdmesh.transfer.backend": handle.backend,
            "epdmesh.transfer.kind": handle.kind,
            "epdmesh.transfer.bytes": handle.num_bytes,
            "epdmesh.transfer.blocks": len(handle.block_ids),
            "epdmesh.transfer.source": handle.worker_id,
        }
        start = time.perf_counter()
        try:
            if kind != handle.kind or num_tokens != handle.num_tokens:
                raise ValueError(
                    f"the {handle.kind} pages of {handle.lease_id} hold {handle.num_tokens} tokens; "
                    f"request {request.request_id} needs {num_tokens} tokens of {kind} pages"
                )
            with self.tracing.span("page_pull", attributes):
                await self.puller.pull_into(handle, self.engine.engine.pages.cache(kind), block_ids)
                emulated = self.engine.engine.transfer_delay_s(kind, num_tokens) - (time.perf_counter() - start)
                if emulated > 0:  # an emulated engine's pages stand in for bigger ones: take their time
                    await asyncio.sleep(emulated)
            done = True
        finally:
            if self.metrics is not None:
                self.metrics.transfer(
                    handle.backend, handle.kind, handle.num_bytes, time.perf_counter() - start if done else None
                )  # we have the pages, or gave up on them: either way the source may free them
            # the ack a moment later: its client side (~0.3 ms of this loop, holding the GIL) would otherwise delay
            # the engine thread's taking the request in (seen: 0.26-0.36 ms from generate() to the engine's add)
            asyncio.get_running_loop().call_later(ACK_DELAY_S, lambda: self._spawn(self.puller.release(handle)))
            if not done:  # free the reserved blocks before the error goes back
                self.engine.now(lambda e: e.pages.cancel_import(request.request_id))
        return True

    async def _reserve_import(self, request: Request, handle: PageHandle) -> tuple[str, list[int], int]:
        """Blocks for the handle's pages. While the cache is full, wait for the requests here to free theirs (a
        burst queues instead of failing), up to IMPORT_WAIT_S and never past the source's lease; then
        NoRoomForPages (the gateway answers 503 + Retry-After)."""
        deadline = min(time.time() + IMPORT_WAIT_S, handle.lease_expiry - 1.0)
        return await self.imports.take(request, deadline)

    async def _run_to_handoff(self, request: Request, preloaded: bool = False) -> RequestOutput:
        last = None
        stream = self.engine.generate(request, preloaded=preloaded)
        try:
            async for out in stream:
                last = out
        except asyncio.CancelledError:
            self._post_release(request.request_id)  # it may have been handed off just now
            raise
        return last

    async def supersede(self, engine_request_id: str) -> None:
        """A stage sent again for a request whose earlier attempt's pages this worker still leases out — the gateway
        gave that attempt up (no room on its decoder) and routed the request here again before the attempt's release
        arrived: those pages go now, as the release would free them, so the new attempt is not refused as a
        duplicate."""
        if self.engine.engine.pages.holds(engine_request_id) and await self.release_lease(engine_request_id):
            log.info("request %s sent here again: its earlier attempt's pages freed", engine_request_id)

    async def lease_pages(self, engine_request_id: str, pages: tuple[str, list[int], int]) -> PageHandle:
        """A lease on the pages a request handed off (or back, with its KV) keeps here, for the next worker. `pages`:
        what its last output says it keeps (kind, block ids, tokens)."""
        try:
            kind, block_ids, num_tokens = pages
            cache = self.engine.engine.pages.cache(kind)
            offer, info = self.offer_backend, self.backend_info
            if self.registered and self.registered.get(kind) != cache.data.data_ptr():
                offer, info = "grpc", b""  # a cache allocated after the backend registered its memory (role switch)
            return self.leases.grant(engine_request_id, block_ids, num_tokens, cache.layout, offer, info)
        except BaseException:
            self._post_release(engine_request_id)
            raise

    # ----- the source side of transfers -----

    def _live_lease(self, lease_id: str):
        lease = self.leases.get(lease_id)
        if lease is None:
            raise KeyError(f"worker {self.worker_id} holds no lease {lease_id!r} (acked, expired or never granted)")
        return lease

    def leased_blocks(self, lease_id: str) -> tuple[PagedBuffer, list[int]]:
        """The cache and block ids (token order) a live lease holds; KeyError if there is no such lease."""
        handle = self._live_lease(lease_id).handle
        return self.engine.engine.pages.cache(handle.kind), list(handle.block_ids)

    async def read_lease(self, lease_id: str) -> PagePayload:
        handle = self._live_lease(lease_id).handle
        cache = self.engine.engine.pages.cache(handle.kind)
        return PagePayload(
            cache.layout, handle.num_tokens, await asyncio.to_thread(cache.gather_bytes, list(handle.block_ids))
        )

    async def release_lease(self, lease_id: str) -> bool:
        lease = self.leases.take(lease_id)
        if lease is None:
            return False
        self.engine.now(lambda e: e.pages.release(lease.engine_request_id))
        self._note_freed()
        return True

    def _note_freed(self) -> None:
        self.imports.poke()
        if self._pressed:
            self.freed.set()

    async def expire_leases(self, interval_s: float = 0.5) -> None:
        while True:
            await asyncio.sleep(interval_s)
            try:
                self._expire_leases_now()
            except Exception:  # a bug of ours must not end lease expiry for good: that would leak every lease after it
                log.exception("expiring leases failed; trying again in %.1f s", interval_s)

    def _expire_leases_now(self) -> None:
        self.awaited.expire()
        for lease in self.leases.expired():
            if self.metrics is not None:
                self.metrics.leases_expired.labels(**self.metrics.labels).inc()
            log.warning(
                "lease %s expired unacked; freeing its %d %s blocks",
                lease.lease_id,
                len(lease.handle.block_ids),
                lease.handle.kind,
            )
            self.engine.now(lambda e, rid=lease.engine_request_id: e.pages.release(rid))

    # ----- bookkeeping -----

    def _observe_stage(self, stage: str, request: Request) -> None:
        """Queue wait and execution of `request`'s stage here, as metrics and as spans under the current one."""
        scheduled, done = request.first_scheduled_time, request.done_time
        if scheduled is None or done is None:
            return
        queue_s, execute_s = scheduled - request.arrival_time, done - scheduled
        if self.metrics is not None:
            self.metrics.stage(stage, queue_s, execute_s)
        if self.tracing.enabled:
            attributes = {
                "epdmesh.worker_id": self.worker_id,
                "epdmesh.stage": stage,
                "gen_ai.usage.input_tokens": request.num_prompt_tokens,
            }
            self.tracing.record_span(f"{stage}.queue", wall_ns(request.arrival_time), wall_ns(scheduled), attributes)
            self.tracing.record_span(f"{stage}.execute", wall_ns(scheduled), wall_ns(done), attributes)

    def load(self) -> WorkerLoad:
        s = self.engine.stats()
        self._pressed = s.kv_blocks_free < KV_PRESSURE * s.kv_blocks_total
        block_size = self.engine.engine.config.block_size
        return load_of(
            s,
            block_size,
            self.engine.last_iteration_ms,
            self.engine.iterations,
            self.engine.iteration_elapsed_ms,
            len(self.leases),
        )

    def take_admitted(self) -> list[str]:
        """Request ids admitted since the last call (the toggle ends their reservations)."""
        admitted, self.admitted = sorted(self.admitted), set()
        return admitted

    def _check_takes(self, request: Request) -> None:
        """ShuttingDown while the worker drains or switches roles; NotHeld for stages it does not run now (a route
        made before its roles changed): either way the caller routes around it."""
        if not self.accepting:
            raise ShuttingDown(f"worker {self.worker_id} is shutting down or switching roles")
        needed = {s for s in Stage if request.first_stage <= s <= request.last_stage}
        if not needed <= self.roles:
            missing = ", ".join(sorted(s.name.lower() for s in needed - self.roles))
            raise NotHeld(f"worker {self.worker_id} does not hold the role(s) {missing} now")

    @contextlib.contextmanager
    def _admitted(self, request: Request):
        self._check_takes(request)
        self.admitted.add(request.request_id.split("@", 1)[0])
        self.in_flight += 1
        try:
            yield
        finally:
            self.in_flight -= 1

    async def drain(self, grace_s: float) -> None:
        """Stop taking work; wait up to `grace_s` for what is in flight and for leases to be acked."""
        self.accepting = False
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace_s
        while (self.in_flight or len(self.leases)) and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if self.in_flight or len(self.leases):
            log.warning(
                "drain timed out with %d requests in flight and %d leases held", self.in_flight, len(self.leases)
            )

    async def quiesce(self, grace_s: float, settle_s: float) -> int:
        """Stop taking work (`accepting` stays False), let what runs finish for up to `grace_s`, then hand the
        decodes still running back to their callers; wait up to `settle_s` more for the rest (prefills, encodes,
        hand-backs going out) to end and for leased pages to be acked. Returns the decodes handed back; the caller
        checks the engine came idle."""
        self.accepting = False
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace_s
        while self.in_flight and loop.time() < deadline:
            await asyncio.sleep(0.02)
        handed_back = 0
        if self.in_flight:
            handed_back = await self.engine.hand_back_decodes()
        deadline = loop.time() + settle_s
        while (self.in_flight or len(self.leases)) and loop.time() < deadline:
            await asyncio.sleep(0.02)
        return handed_back

    def _post_release(self, engine_request_id: str) -> None:
        self._spawn(self.engine.call(lambda e: e.abort(engine_request_id)))

    def _spawn(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)


def wall_ns(monotonic_s: float) -> int:
    """A time.monotonic() reading as wall-clock nanoseconds (what span timestamps are)."""
    return time.time_ns() - int((time.monotonic() - monotonic_s) * 1e9)


class ImportQueue:
    """Handed-over pages waiting for KV room here, first come first served. The first in line tries again whenever
    blocks are freed here (`poke`: a request ended, a lease was released) and every IMPORT_POLL_S besides; the rest
    wait their turn without trying (a burst of hundreds polling each would cost the decoder's loop, and its engine's
    lock, work in proportion to the queue). `reserve(request)` reserves the blocks or raises NoRoomForPages;
    `cancel(request)` gives back blocks reserved for a request that stopped waiting at that very moment."""

    def __init__(self, reserve: Callable[[Request], tuple], cancel: Callable[[Request], None]):
        self._reserve, self._cancel = reserve, cancel
        self._waiting: collections.deque[tuple[Request, asyncio.Future]] = collections.deque()
        self._timer: asyncio.TimerHandle | None = None

    def __len__(self) -> int:
        return len(self._waiting)

    async def take(self, request: Request, deadline: float) -> tuple:
        """The blocks' reservation, at once when none waits before it and there is room, else in turn; NoRoomForPages
        at `deadline` (unix seconds) if its turn found no room by then."""
        if not self._waiting:
            try:
                return self._reserve(request)
            except NoRoomForPages as e:
                if time.time() >= deadline:
                    raise
                why = str(e)
        else:
            why = f"{len(self._waiting)} handed-over requests wait before it"
        log.info("request %s waits up to %.1f s for room here: %s", request.request_id, deadline - time.time(), why)
        turn = asyncio.get_running_loop().create_future()
        entry = (request, turn)
        self._waiting.append(entry)
        self._arm()
        try:
            await asyncio.wait([turn], timeout=max(0.0, deadline - time.time()))
        except BaseException:  # its caller gone: blocks reserved for it meanwhile go back
            if turn.done() and not turn.cancelled() and turn.exception() is None:
                self._cancel(request)
            raise
        finally:
            with contextlib.suppress(ValueError):
                self._waiting.remove(entry)
            if not turn.done():
                turn.cancel()
        if turn.cancelled():  # its wait is over: a last try, which says why there is no room
            return self._reserve(request)
        return turn.result()

    def poke(self) -> None:
        """Blocks may have been freed: the first in line tries, and each one after it while they fit."""
        while self._waiting:
            request, turn = self._waiting[0]
            if turn.done():
                self._waiting.popleft()
                continue
            try:
                reserved = self._reserve(request)
            except NoRoomForPages:
                break
            except Exception as e:  # refused outright (a duplicate id, no longer this worker's role…): its own error
                self._waiting.popleft()
                turn.set_exception(e)
                continue
            self._waiting.popleft()
            turn.set_result(reserved)

    def _arm(self) -> None:
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(IMPORT_POLL_S, self._tick)

    def _tick(self) -> None:
        self._timer = None
        self.poke()
        if self._waiting:
            self._arm()
