"""How an engine's pages move between stages: a request's handed-over pages written in (imported) as it arrives —
or blocks reserved for a transfer to fill directly —, and a handed-off request's pages read out (exported) for the
next stage, then released. An `Engine` owns one (`engine.pages`), over its scheduler and caches."""

from __future__ import annotations

from collections.abc import Callable

from common.engine.errors import NoRoomForPages, RequestRejected
from common.kv_manager import blocks_for
from common.paged_cache import PagedImageCache, PagedKVCache, PagePayload
from common.request import Request, RequestStatus, Stage
from common.scheduler import Scheduler


class PageHandover:
    """The pages of requests between stages on one engine: `importing` (blocks reserved, being filled by a transfer)
    and `handed_off` (finished here, pages kept for the next stage). `admit` checks a request as the engine's
    intake does (roles, limits, grammar) before any of its blocks are taken."""

    def __init__(
        self,
        scheduler: Scheduler,
        kv_cache: PagedKVCache,
        image_cache: PagedImageCache,
        block_size: int,
        admit: Callable[[Request], None],
    ):
        self.scheduler, self.kv_cache, self.image_cache = scheduler, kv_cache, image_cache
        self.block_size = block_size
        self._admit = admit
        self.importing: dict[str, Request] = {}
        scheduler.incoming = self.importing  # (the scheduler's gap slack looks at who is joining)
        self.handed_off: dict[str, Request] = {}

    def holds(self, request_id: str) -> bool:
        return request_id in self.importing or request_id in self.handed_off

    def reserve_import(self, request: Request) -> tuple[str, list[int], int]:
        """Allocate the blocks that `request`'s handed-over pages go into, for a transfer to fill directly.

        Returns (cache kind, block ids in token order, tokens they must hold). Then either
        `add_request(request, preloaded=True)` once they are written, or `cancel_import`.
        """
        self._admit(request)
        if request.request_id in self.importing:
            raise RequestRejected(f"request id {request.request_id!r} is already in use")
        if request.first_stage == Stage.DECODE:
            self._allocate_kv_import(request)
            kind, n = "kv", request.num_prompt_tokens
            blocks = request.block_table[: blocks_for(n, self.block_size)]
        elif request.first_stage == Stage.PREFILL and request.images:
            self._allocate_image_import(request)
            kind, n, blocks = "image", request.num_image_tokens, request.image_block_table
        else:
            raise RequestRejected(
                f"request {request.request_id} starts at {request.first_stage.name}: no pages to import"
            )
        self.importing[request.request_id] = request
        return kind, list(blocks), n

    def pin_cached(self, request: Request) -> bool:
        """A request that starts at prefill with images it has no pages for (they are still being encoded
        elsewhere): when the prefix cache holds its images' KV, take its KV blocks now — the cached ones shared,
        so nothing evicts them — and say True; then `add_request(request, preloaded=True)` (it needs no image
        pages) or `cancel_import`. False: the cache does not hold them (or there is no room now); wait for the
        pages."""
        self._admit(request)
        if request.request_id in self.importing:
            raise RequestRejected(f"request id {request.request_id!r} is already in use")
        scheduler = self.scheduler
        if (
            request.first_stage != Stage.PREFILL
            or not scheduler.covers_images(request)
            or scheduler.preempted_waiting
            or not scheduler.kv.can_allocate(request)
        ):
            return False
        request.num_computed_tokens = scheduler.kv.allocate(request)
        scheduler.num_encodes_skipped += 1
        self.importing[request.request_id] = request
        return True

    def cancel_import(self, request_id: str) -> bool:
        request = self.importing.pop(request_id, None)
        if request is None:
            return False
        self.scheduler.kv.free(request)
        self.scheduler.images.free(request)
        return True

    def _allocate_image_import(self, request: Request) -> None:
        if not self.scheduler.images.can_allocate(request):
            raise NoRoomForPages("no free image-cache blocks for the handed-over image pages")
        self.scheduler.images.allocate(request)

    def _allocate_kv_import(self, request: Request) -> None:
        if len(request.output_token_ids) != 1:
            raise RequestRejected("a request that starts at decode carries exactly its first sampled token")
        kv = self.scheduler.kv
        wanted = 0 if kv.worst_case else self.scheduler.config.handover_output_tokens  # growth room, booked here
        headroom = min(request.sampling.max_tokens, wanted)
        if self.scheduler.preempted_waiting or not kv.can_allocate(request, headroom, self._owed_blocks(wanted)):
            raise NoRoomForPages("no free KV blocks for the handed-over KV pages and the first output tokens")
        request.block_table = kv.pool.allocate(blocks_for(kv.admission_tokens(request), kv.block_size))

    def _owed_blocks(self, wanted: int) -> int:
        """Blocks the requests decoding here may still take before each has its first `wanted` output tokens: room a
        handed-over prompt is not given (the route booked none on path ①; the decoder books it as the pages come)."""
        if not wanted:
            return 0
        scheduler, owed = self.scheduler, 0
        for r in (*scheduler.running, *scheduler.prefilling, *self.importing.values()):
            if r.last_stage == Stage.DECODE:
                target = blocks_for(r.num_prompt_tokens + min(r.sampling.max_tokens, wanted), self.block_size)
                owed += max(0, target - len(r.block_table))
        return owed

    def import_image_pages(self, request: Request, pages: PagePayload | None) -> None:
        if pages is None or pages.num_tokens != request.num_image_tokens:
            raise RequestRejected(
                f"request {request.request_id} starts at prefill with images but no matching image pages"
            )
        self._allocate_image_import(request)
        try:
            self.image_cache.write_blocks(request.image_block_table, pages)
        except ValueError:
            self.scheduler.images.free(request)
            raise

    def import_kv_pages(self, request: Request, pages: PagePayload | None) -> None:
        if pages is None or pages.num_tokens != request.num_prompt_tokens:
            raise RequestRejected(f"request {request.request_id} starts at decode but has no KV pages for its prompt")
        self._allocate_kv_import(request)
        try:
            self.kv_cache.write_blocks(request.block_table[: pages.num_blocks], pages)
        except ValueError:
            self.scheduler.kv.free(request)
            raise

    def export_image_pages(self, request_id: str) -> PagePayload:
        request = self._handed_off(request_id, Stage.ENCODE)
        return self.image_cache.read_blocks(request.image_block_table, request.num_image_tokens)

    def export_kv_pages(self, request_id: str) -> PagePayload:
        request = self._handed_off(request_id, Stage.PREFILL)
        n = request.num_prompt_tokens
        return self.kv_cache.read_blocks(request.block_table[: blocks_for(n, self.block_size)], n)

    def handoff_pages(self, request_id: str) -> tuple[str, list[int], int]:
        """(cache kind, block ids in token order, valid tokens) a handed-off request keeps for the next stage."""
        request = self.handed_off.get(request_id)
        if request is None:
            raise KeyError(f"request {request_id!r} holds no handed-off pages")
        if request.last_stage == Stage.ENCODE:
            return "image", list(request.image_block_table), request.num_image_tokens
        # a prefill's KV is its prompt's; a decode handed back with its KV has computed all but its last token too
        n = request.num_computed_tokens if request.last_stage == Stage.DECODE else request.num_prompt_tokens
        return "kv", list(request.block_table[: blocks_for(n, self.block_size)]), n

    def cache(self, kind: str) -> PagedKVCache | PagedImageCache:
        return self.kv_cache if kind == "kv" else self.image_cache

    def keep(self, request: Request) -> tuple[str, list[int], int]:
        """`request` finished its last stage here: keep its pages for the next stage; what `handoff_pages` says."""
        self.handed_off[request.request_id] = request
        return self.handoff_pages(request.request_id)

    def release(self, request_id: str) -> bool:
        """Free a handed-off request's pages (the next stage has them, or gave up)."""
        request = self.handed_off.pop(request_id, None)
        if request is None:
            return False
        self.scheduler.finish(request, RequestStatus.HANDED_OFF)
        return True

    def _handed_off(self, request_id: str, stage: Stage) -> Request:
        request = self.handed_off.get(request_id)
        if request is None or request.last_stage != stage:
            raise KeyError(f"no {stage.name.lower()} pages held for request {request_id!r}")
        return request
