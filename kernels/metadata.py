"""What an attention backend needs to know about one flattened batch.

Sequences are ordered decodes first (one query token each), then prefill chunks. Tensors
live on the compute device; the python lists are the same values for host-side loops.
"""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(slots=True)
class AttentionMetadata:
    num_decodes: int  # the first num_decodes sequences have exactly one query token
    query_lens: list[int]  # per sequence: new tokens computed this step
    seq_lens: list[int]  # per sequence: context length including the new tokens
    block_tables: torch.Tensor  # [sequences, max_blocks] int32 KV block ids, padded with 0
    seq_lens_t: torch.Tensor  # [sequences] int32, = seq_lens
    query_start_loc: torch.Tensor  # [sequences + 1] int32 offsets into the flattened tokens
    slot_blocks: torch.Tensor  # [tokens] int64 block id where each new token's K/V is written
    slot_offsets: torch.Tensor  # [tokens] int64 offset inside that block
    _packs: dict = dataclasses.field(default_factory=dict, init=False, repr=False)  # (first, block_size) → its pack

    @property
    def num_sequences(self) -> int:
        return len(self.query_lens)

    def packed(self, first: int, block_size: int) -> ContextPack:
        """Sequences `first`… laid end to end for one varlen attention call; built once a step, shared by the
        layers."""
        key = (first, block_size)
        if key not in self._packs:
            self._packs[key] = _pack(self, first, block_size)
        return self._packs[key]


@dataclasses.dataclass(slots=True, frozen=True)
class ContextPack:
    """Sequences `first`… of a step, end to end: their queries are rows `q_start`… of the step's q, in order;
    their contexts (cached prefix and new tokens) sit in a layer's cache at (`blocks`, `offsets`)."""

    first: int
    q_start: int  # the first sequence's first query row
    cu_q: torch.Tensor  # [sequences + 1] int32: where each sequence's queries start, from q_start
    cu_k: torch.Tensor  # [sequences + 1] int32: where each sequence's context starts in the packed K/V
    blocks: torch.Tensor  # [context tokens] int64: each context token's block…
    offsets: torch.Tensor  # … and its offset inside the block
    max_q: int
    max_k: int

    def gather(self, cache: torch.Tensor) -> torch.Tensor:
        """One layer's cache [blocks, block_size, kv_heads, D] → the packed context [context tokens, kv_heads, D]."""
        return cache[self.blocks, self.offsets]


def _pack(meta: AttentionMetadata, first: int, block_size: int) -> ContextPack:
    """Built on the device from the step's tensors, with no host sync (the sizes come from the host lists)."""
    lens, tables = meta.seq_lens_t[first:], meta.block_tables[first:]
    n, total, dev = lens.shape[0], sum(meta.seq_lens[first:]), lens.device
    cu_k = torch.zeros(n + 1, dtype=torch.int32, device=dev)
    torch.cumsum(lens, 0, out=cu_k[1:])
    seq = torch.repeat_interleave(torch.arange(n, device=dev), lens, output_size=total)
    pos = torch.arange(total, device=dev) - cu_k[seq]
    starts = meta.query_start_loc[first:]
    return ContextPack(
        first=first,
        q_start=sum(meta.query_lens[:first]),
        cu_q=starts - starts[0],
        cu_k=cu_k,
        blocks=tables[seq, pos // block_size].long(),
        offsets=pos % block_size,
        max_q=max(meta.query_lens[first:]),
        max_k=max(meta.seq_lens[first:]),
    )


def write_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata
) -> None:
    """Store the new tokens' K/V ([tokens, kv_heads, head_dim]) into their paged slots."""
    write_slots(k, v, k_cache, v_cache, meta.slot_blocks, meta.slot_offsets)


def write_slots(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_blocks: torch.Tensor,
    slot_offsets: torch.Tensor,
) -> None:
    """K/V rows into the slots (block, offset) of a layer's caches: on the CPU by the C kernel's memcpy where it can
    (`cpu_paged.write_rows`), else by indexing."""
    from kernels import cpu_paged

    if cpu_paged.write_rows(k, v, k_cache, v_cache, slot_blocks, slot_offsets):
        return
    k_cache[slot_blocks, slot_offsets] = k
    v_cache[slot_blocks, slot_offsets] = v


def gather_context(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """One sequence's first `length` cached tokens as a contiguous [length, kv_heads, head_dim]."""
    block_size = cache.shape[1]
    num_blocks = -(-length // block_size)
    return cache.index_select(0, block_table[:num_blocks]).flatten(0, 1)[:length]
