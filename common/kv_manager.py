"""Per-request block tables over a `BlockPool` (no torch).

On demand (the default, as vLLM does): a request is admitted with blocks for what its prefill
computes (plus the first decode's token when it decodes here), and a running decode's table grows a
block at a time (`can_grow` / `grow`); the scheduler preempts when the pool runs out. Worst case
(`worst_case=True`, as TGI does): admission takes prompt + `max_tokens` at once, so a decode never
grows and nothing is ever preempted, at the price of concurrency. With prefix caching on, full prompt
blocks whose chained hash is cached are shared instead of recomputed.
"""

from __future__ import annotations

from common.block_pool import BlockPool, chain_hashes
from common.request import Request, Stage, image_marks


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class KVBlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = False,
        worst_case: bool = False,
        image_token_id: int | None = None,
    ):
        """`image_token_id`: the model's image placeholder, so a cached prefix may end where an image begins (None:
        a prompt with images shares no block with one with other images)."""
        self.pool = BlockPool(num_blocks)
        self.image_token_id = image_token_id
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.worst_case = worst_case
        # blocks an admission leaves free for the running requests to grow into (vLLM's 1%): a request admitted
        # into the last blocks would be the next one preempted
        self.watermark = num_blocks // 100
        # prompt tokens admitted with prefix caching on, and how many of them were cached (vLLM's prefix_cache_queries
        # and prefix_cache_hits)
        self.num_queried_tokens = self.num_hit_tokens = 0

    def admission_tokens(self, request: Request) -> int:
        """KV tokens a request's blocks cover when it is admitted: what its prefill computes, plus, when it
        decodes here, the slot of the token that prefill samples (on demand) or all `max_tokens` (worst case).
        A request that starts at decode counts its prompt as computed."""
        if request.last_stage < Stage.DECODE:
            return request.num_prefill_tokens
        if self.worst_case:
            return request.num_prompt_tokens + request.sampling.max_tokens
        return request.num_prefill_tokens + 1

    def can_allocate(self, request: Request, headroom_tokens: int = 0, owed_blocks: int = 0) -> bool:
        """Room to admit it and `headroom_tokens` more of its growth, beside `owed_blocks` promised to others, leaving
        the watermark free — unless the pool is empty (a lone request always goes)."""
        needed = blocks_for(self.admission_tokens(request) + headroom_tokens, self.block_size) + owed_blocks
        free = self.pool.num_free
        return needed <= free and (free - needed >= self.watermark or free == self.pool.num_blocks)

    def allocate(self, request: Request) -> int:
        """Give `request` its block table; returns how many leading prompt tokens are already cached."""
        needed = blocks_for(self.admission_tokens(request), self.block_size)
        cached = self._cached_prefix(request) if self.enable_prefix_caching else []
        self.pool.share(cached)
        request.block_table = cached + self.pool.allocate(needed - len(cached))
        request.num_cached_tokens = len(cached) * self.block_size
        if self.enable_prefix_caching:
            self.num_queried_tokens += request.num_prompt_tokens
            self.num_hit_tokens += request.num_cached_tokens
        return request.num_cached_tokens

    def cached_prefix_tokens(self, request: Request) -> int:
        """Leading prompt tokens `allocate` would find cached now (0 with prefix caching off); takes nothing."""
        return len(self._cached_prefix(request)) * self.block_size if self.enable_prefix_caching else 0

    def commit_prompt(self, request: Request) -> None:
        """Publish the hashes of the prompt's computed full blocks so later requests can share them."""
        if not self.enable_prefix_caching:
            return
        computed = min(request.num_computed_tokens, request.num_prompt_tokens)
        for block_id, h in zip(request.block_table, self._hashes(request, computed)):
            self.pool.set_hash(block_id, h)

    def blocks_to_grow(self, request: Request) -> int:
        """Blocks a running request still needs before its next decode, which computes the KV of the last token
        it sampled: its table must cover every token it has."""
        return max(0, blocks_for(request.num_tokens, self.block_size) - len(request.block_table))

    def can_grow(self, request: Request) -> bool:
        return self.pool.can_allocate(self.blocks_to_grow(request))

    def grow(self, request: Request) -> None:
        request.block_table += self.pool.allocate(self.blocks_to_grow(request))

    def free(self, request: Request) -> None:
        self.pool.free(request.block_table)
        request.block_table = []

    def _cached_prefix(self, request: Request) -> list[int]:
        # Never reuse the block holding the last prompt token: it must be computed for its logits.
        usable = request.num_prompt_tokens - 1
        blocks = []
        for h in self._hashes(request, usable):
            block_id = self.pool.lookup(h)
            if block_id is None:
                break
            blocks.append(block_id)
        return blocks

    def _hashes(self, request: Request, num_tokens: int) -> list[int]:
        """The chained hashes of the prompt's first `num_tokens // block_size` blocks (computed once a request: a
        waiting image request is looked up at every step)."""
        if request.prompt_hashes is None or request.prompt_hashes[0] != self.block_size:
            marks = image_marks(
                request.prompt_token_ids, self.image_token_id, [(i.content_hash, i.num_tokens) for i in request.images]
            )
            request.prompt_hashes = (
                self.block_size,
                chain_hashes(request.prompt_token_ids, self.block_size, marks, request.cache_salt),
            )
        return request.prompt_hashes[1][: num_tokens // self.block_size]


class ImageBlockManager:
    """Image-cache blocks of a request: all its images' embeddings, token after token."""

    def __init__(self, num_blocks: int, block_size: int):
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size

    def can_allocate(self, request: Request) -> bool:
        return self.pool.can_allocate(blocks_for(request.num_image_tokens, self.block_size))

    def could_hold(self, request: Request) -> bool:
        """The whole cache holds the request's images (an engine without the encode or prefill role has 1 block)."""
        return self.pool.num_blocks >= blocks_for(request.num_image_tokens, self.block_size)

    def allocate(self, request: Request) -> None:
        request.image_block_table = self.pool.allocate(blocks_for(request.num_image_tokens, self.block_size))

    def free(self, request: Request) -> None:
        self.pool.free(request.image_block_table)
        request.image_block_table = []
