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

    @property
    def num_sequences(self) -> int:
        return len(self.query_lens)


def write_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata
) -> None:
    """Store the new tokens' K/V ([tokens, kv_heads, head_dim]) into their paged slots."""
    k_cache[meta.slot_blocks, meta.slot_offsets] = k
    v_cache[meta.slot_blocks, meta.slot_offsets] = v


def gather_context(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """One sequence's first `length` cached tokens as a contiguous [length, kv_heads, head_dim]."""
    block_size = cache.shape[1]
    num_blocks = -(-length // block_size)
    return cache.index_select(0, block_table[:num_blocks]).flatten(0, 1)[:length]
