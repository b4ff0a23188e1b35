"""xformers backend (CUDA only): one memory-efficient attention call over the whole batch.

The contexts of the sequences are gathered from their pages in one op and are laid end to
end under a block-diagonal, bottom-right-causal mask; grouped-query heads use xformers'
5-D [batch, tokens, groups, heads, dim] form without copying K/V per query head.
"""

from __future__ import annotations

import torch

from kernels.metadata import AttentionMetadata


class XformersPagedAttention:
    name = "xformers"

    def __init__(self) -> None:
        from xformers.ops import fmha

        self._fmha = fmha

    def forward(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        pack = meta.packed(0, k_cache.shape[1])  # every context gathered in one op a layer
        k, v = pack.gather(k_cache), pack.gather(v_cache)
        mask = self._fmha.attn_bias.BlockDiagonalCausalFromBottomRightMask.from_seqlens(
            q_seqlen=list(meta.query_lens), kv_seqlen=list(meta.seq_lens)
        )
        tokens, heads, dim = q.shape
        kv_heads = k.shape[1]
        groups = heads // kv_heads
        q5 = q.view(1, tokens, kv_heads, groups, dim)
        k5 = k[None, :, :, None, :].expand(1, k.shape[0], kv_heads, groups, dim)
        v5 = v[None, :, :, None, :].expand(1, v.shape[0], kv_heads, groups, dim)
        out = self._fmha.memory_efficient_attention_forward(q5, k5, v5, attn_bias=mask, scale=scale)
        return out.reshape(tokens, heads, dim)
