"""Fixed pools of cache blocks, and the KV block manager on top of one (no torch).

`BlockPool` hands out block ids with reference counts. A freed block that holds nothing
reusable is handed out again first, the most recently freed first (a request's blocks come
back in the order it held them): the pool's working set stays as small as the most blocks
ever in use at once, and its memory is warm in the CPU's caches and already faulted in, where
cycling through every block would commit the whole cache page by page and read it cold
(bench/README.md, `bench/soak.py`). Freed blocks that carry a content hash stay findable until
they are reused, only once no other block is free, least recently freed first, so a prefix
that was computed once can be shared by later requests. Every operation is O(1) per block.
Callers ask before they act: `can_allocate(n)` then `allocate(n)`; `allocate` raises when
asked for more than is free.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence

HASH_BYTES = 16  # of a block's chained hash, and of an image identity's key mixed into it


class NoFreeBlocksError(RuntimeError):
    pass


class BlockPool:
    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"a block pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        # free blocks without a hash: a stack (dict.popitem takes the last in), block 0 on top at the start
        self._plain: dict[int, None] = dict.fromkeys(reversed(range(num_blocks)))
        self._cached: OrderedDict[int, None] = OrderedDict()  # free blocks with a hash, least recently freed first
        self._refs = [0] * num_blocks
        self._hash_of: dict[int, int] = {}
        self._block_of: dict[int, int] = {}

    @property
    def num_free(self) -> int:
        return len(self._plain) + len(self._cached)

    def ref_count(self, block_id: int) -> int:
        return self._refs[block_id]

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free

    def allocate(self, n: int) -> list[int]:
        if n > self.num_free:
            raise NoFreeBlocksError(f"asked for {n} blocks, {self.num_free} free")
        ids = []
        for _ in range(n):
            if self._plain:
                block_id, _ = self._plain.popitem()
            else:  # evict the least recently freed cached block
                block_id, _ = self._cached.popitem(last=False)
            self._forget_hash(block_id)  # (a plain block holds none, unless one was set on it while free)
            self._refs[block_id] = 1
            ids.append(block_id)
        return ids

    def share(self, block_ids: list[int]) -> None:
        """Take one more reference on blocks in use, or revive cached free ones."""
        for block_id in block_ids:
            if self._refs[block_id] == 0:
                if self._cached.pop(block_id, False) is False:
                    del self._plain[block_id]
            self._refs[block_id] += 1

    def free(self, block_ids: list[int]) -> None:
        plain = []
        try:
            for block_id in block_ids:
                if self._refs[block_id] <= 0:
                    raise ValueError(f"block {block_id} freed more often than allocated")
                self._refs[block_id] -= 1
                if self._refs[block_id] == 0:
                    if block_id in self._hash_of:
                        self._cached[block_id] = None
                    else:
                        plain.append(block_id)
        finally:
            for block_id in reversed(plain):  # the first of them on top: handed out again in the same order
                self._plain[block_id] = None

    def set_hash(self, block_id: int, content_hash: int) -> None:
        """Mark a full, in-use block as holding `content_hash` (first writer wins)."""
        if content_hash in self._block_of or block_id in self._hash_of:
            return
        self._hash_of[block_id] = content_hash
        self._block_of[content_hash] = block_id

    def lookup(self, content_hash: int) -> int | None:
        """The block holding `content_hash`, in use or cached free; None when it is not cached."""
        return self._block_of.get(content_hash)

    def _forget_hash(self, block_id: int) -> None:
        content_hash = self._hash_of.pop(block_id, None)
        if content_hash is not None:
            del self._block_of[content_hash]


def chain_hashes(
    token_ids: list[int], block_size: int, marks: Sequence[tuple[int, int]] = (), salt: str = ""
) -> list[int]:
    """Hash of each full block of `token_ids`, each chained on the one before (a prefix identity). `marks`:
    (position, key) pairs mixed into the block holding the position — an image's identity at its first
    placeholder (`request.image_marks`), so the blocks before an image are shared with prompts that have another
    image there, and none from it on. `salt` (a request's `cache_salt`, vLLM's): the chain starts from its digest, so
    prompts of different salts share no block.

    Each hash is a 128-bit BLAKE2b digest of the one before, the block's tokens and its marks. Python's `hash()` of
    the same tuple (what this was) is no cryptographic hash: a client can make a prompt whose blocks hash like
    another's, and the cache would then serve it that prompt's KV (vLLM's advisory GHSA-rm76-4mrf-v9r8; it keys its
    cache with SHA-256 by default since v0.10.2)."""
    extra: dict[int, list[int]] = {}
    for position, key in marks:
        extra.setdefault(position // block_size, []).append(key)
    hashes = []
    previous = hashlib.blake2b(b"salt:" + salt.encode(), digest_size=HASH_BYTES).digest() if salt else bytes(HASH_BYTES)
    for block, start in enumerate(range(0, len(token_ids) - block_size + 1, block_size)):
        digest = hashlib.blake2b(previous, digest_size=HASH_BYTES)
        digest.update(array("q", token_ids[start : start + block_size]).tobytes())  # a fixed length per block size
        for key in extra.get(block, ()):
            digest.update(key.to_bytes(HASH_BYTES, "little"))
        previous = digest.digest()
        hashes.append(int.from_bytes(previous, "little"))
    return hashes
