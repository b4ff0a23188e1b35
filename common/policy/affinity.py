"""Prefix-cache affinity: which worker likely holds a prompt's prefix in its KV cache (no torch).

The router cannot see the workers' caches; like SGLang's cache-aware router it remembers what it sent where.
Every route records the block hashes of the request's prompt (chained, so a hash stands for its whole prefix; the
images' identities salt them, as the engine's own cache does) under the worker that prefills it, most recent
last, at most as many blocks as that worker's KV cache holds — a worker evicts its least recently used cached
blocks first, and so does the index. A later prompt's predicted cache hit on a worker is the run of its leading
block hashes found there. It is a prediction: the worker's cache may have evicted sooner (it also holds running
requests' blocks), and another router's routes are not seen; what a miss costs is a prefill, never a wrong answer.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict

from common.block_pool import chain_hashes
from common.policy.routing import PrefillPath, RoutePlan, RouteSummary
from common.request import Request, Stage, image_end, image_marks
from common.workers import WorkerSnapshot

BLOCK_TOKENS = 16  # the index's granularity (the engines' default KV block)
ROUTING_KEY_MASK = (1 << 63) - 1


def summary_fields(token_ids: list[int], image_keys: list[str], model, salt: str = "") -> dict:
    """A route summary's prefix-cache fields for a prompt: its block hashes (each image's identity — the digest of its
    file, which the processor also gives the engine as its content hash, so a first route and a retry key the same
    prompt alike — mixed in where it begins) and where its images end. `model`: its config (`image_token_id`, and
    `image_tokens_per_image`, which every image of it fills); `salt`: the request's `cache_salt`."""
    images = [(key, model.image_tokens_per_image) for key in image_keys]
    return {
        "prefix_hashes": prompt_hashes(token_ids, images, model.image_token_id, salt=salt),
        "image_end": image_end(token_ids, model.image_token_id),
    }


def request_fields(request: Request, model) -> dict:
    """`summary_fields` of an engine request, as each of its routes is made with them: a first route's prompt, or a
    continuation's (the prompt and the tokens sent before, prefilled again where the cache may still hold them)."""
    return summary_fields(
        request.prompt_token_ids, [image.content_hash for image in request.images], model, request.cache_salt
    )


def prompt_hashes(
    token_ids: list[int],
    images: list[tuple[str, int]],
    image_token_id: int | None = None,
    block_tokens: int = BLOCK_TOKENS,
    salt: str = "",
) -> tuple[int, ...]:
    """The chained hashes of the prompt's full blocks, as the engine's cache keys them (`request.image_marks`), cut to
    63 bits for the route's wire (int64): a prediction's key, which the engine checks against its own whole ones."""
    hashes = chain_hashes(token_ids, block_tokens, image_marks(token_ids, image_token_id, images), salt)
    return tuple(h & ROUTING_KEY_MASK for h in hashes)


class PrefixIndex:
    def __init__(self, block_tokens: int = BLOCK_TOKENS):
        self.block_tokens = block_tokens
        self._blocks: dict[str, OrderedDict[int, None]] = {}  # by worker registration: hashes, least recent first

    def record(self, worker: str, hashes: tuple[int, ...], capacity_tokens: int) -> None:
        """`worker` prefills a prompt of these block hashes; it holds at most `capacity_tokens` (0: unknown, then
        as many as the prompt has)."""
        if not hashes:
            return
        blocks = self._blocks.setdefault(worker, OrderedDict())
        for h in hashes:
            blocks[h] = None
            blocks.move_to_end(h)
        limit = max(capacity_tokens // self.block_tokens, len(hashes))
        while len(blocks) > limit:
            blocks.popitem(last=False)

    def matched_tokens(self, worker: str, hashes: tuple[int, ...]) -> int:
        """Leading prompt tokens `worker` is predicted to hold (whole blocks)."""
        blocks = self._blocks.get(worker)
        if not blocks:
            return 0
        n = 0
        for h in hashes:
            if h not in blocks:
                break
            n += 1
        return n * self.block_tokens

    def keep_only(self, workers: set[str]) -> None:
        """Forget workers that are gone (a restarted one comes back under a new registration, its cache empty)."""
        for worker in set(self._blocks) - workers:
            del self._blocks[worker]

    def __len__(self) -> int:
        return sum(map(len, self._blocks.values()))


AWAITING_KEPT = 4096  # routes whose prefill may still end (`prefilled`), the oldest forgotten first


class PrefixAffinity:
    """A router's prefix-cache bookkeeping: what it sent where (`routed`), which of those prefills finished
    (`prefilled`), and from them the predictions a route is made with."""

    def __init__(self, block_tokens: int = BLOCK_TOKENS):
        self.routed = PrefixIndex(block_tokens)  # the prompts routed to each worker that caches prefixes
        self.prefilled = PrefixIndex(block_tokens)  # of those, the ones whose prefill finished there
        self._awaiting: dict[str, tuple[str, tuple[int, ...], int]] = {}  # request id → (worker, hashes, room)

    def _reusable(self, summary: RouteSummary) -> int:
        """A worker never reuses the block holding a prompt's last token (its logits are computed again)."""
        block = self.routed.block_tokens
        return (summary.num_prompt_tokens - 1) // block * block

    def predicted(self, workers: list[WorkerSnapshot], summary: RouteSummary) -> RouteSummary:
        """`summary` with what each prefill worker that caches prefixes is predicted to hold of its prompt."""
        reusable = self._reusable(summary)
        hits = (
            (w.info.registration, min(reusable, self.routed.matched_tokens(w.info.registration, summary.prefix_hashes)))
            for w in workers
            if w.has(Stage.PREFILL) and w.info.prefix_caching
        )
        return dataclasses.replace(summary, cached_tokens=tuple((reg, n) for reg, n in hits if n))

    def needs_no_encode(self, plan: RoutePlan, summary: RouteSummary) -> bool:
        """The plan's prefill worker, not its encoder, has *finished* a prefill covering the request's images (routed
        is not yet cached: a burst of one image would all be told so, and each then encode after a refusal)."""
        p = plan.prefill
        if (
            not summary.num_images
            or plan.encoder is None
            or plan.encoder.worker_id == p.worker_id
            or not p.info.prefix_caching
        ):
            return False
        done = self.prefilled.matched_tokens(p.info.registration, summary.prefix_hashes)
        return min(self._reusable(summary), done) >= summary.image_end > 0

    def chosen(self, plan: RoutePlan, summary: RouteSummary) -> None:
        """The plan is the request's: its prefill worker will hold the prompt, and so will a path-① decoder that
        prefills too (it keeps the KV it is handed)."""
        if not summary.prefix_hashes:
            return
        p, d = plan.prefill, plan.decoder
        if p.info.prefix_caching:
            self.routed.record(p.info.registration, summary.prefix_hashes, p.load.kv_tokens_total)
            self._awaiting[summary.request_id] = (p.info.registration, summary.prefix_hashes, p.load.kv_tokens_total)
            while len(self._awaiting) > AWAITING_KEPT:  # a router nobody tells (the toggle's Route rpc)
                del self._awaiting[next(iter(self._awaiting))]
        if plan.path == PrefillPath.DEDICATED and d.has(Stage.PREFILL) and d.info.prefix_caching:
            self.routed.record(d.info.registration, summary.prefix_hashes, d.load.kv_tokens_total)

    def prefill_done(self, request_id: str) -> None:
        if (awaiting := self._awaiting.pop(request_id, None)) is not None:
            self.prefilled.record(*awaiting)

    def forget(self, request_id: str) -> None:
        self._awaiting.pop(request_id, None)

    def keep_only(self, workers: set[str]) -> None:
        self.routed.keep_only(workers)
        self.prefilled.keep_only(workers)
