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

import hashlib
from collections import OrderedDict

from common.block_pool import chain_hashes

BLOCK_TOKENS = 16  # the index's granularity (the engines' default KV block)


def prompt_hashes(token_ids: list[int], image_keys: list[str], block_tokens: int = BLOCK_TOKENS) -> tuple[int, ...]:
    """The chained hashes of the prompt's full blocks, salted by its images' identities (their content hashes)."""
    digest = hashlib.blake2b("|".join(image_keys).encode(), digest_size=8).digest()
    return tuple(chain_hashes(token_ids, block_tokens, int.from_bytes(digest, "little")))


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
