"""flash-attn backend (CUDA only).

Decodes use `flash_attn_with_kvcache` with block tables; prefill chunks use
`flash_attn_varlen_func` (bottom-right causal). Upstream flash-attn only accepts paged K/V
whose block size is a multiple of 256, so with smaller blocks the prefill context is
gathered into contiguous K/V first, and decodes do the same.
"""

from __future__ import annotations

import torch

from kernels.metadata import AttentionMetadata


class FlashPagedAttention:
    name = "flash-attn"

    def __init__(self) -> None:
        from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache

        self._varlen = flash_attn_varlen_func
        self._with_kvcache = flash_attn_with_kvcache

    def forward(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        paged = k_cache.shape[1] % 256 == 0
        out = torch.empty_like(q)
        nd = meta.num_decodes
        if nd and paged:
            out[:nd] = self._with_kvcache(
                q[:nd, None],
                k_cache,
                v_cache,
                cache_seqlens=meta.seq_lens_t[:nd],
                block_table=meta.block_tables[:nd],
                softmax_scale=scale,
                causal=True,
            )[:, 0]
        first = 0 if (nd and not paged) else nd
        if first < meta.num_sequences:
            out[first:] = self._contiguous(q[first:], k_cache, v_cache, meta, first, scale)
        return out

    def _contiguous(self, q, k_cache, v_cache, meta: AttentionMetadata, first: int, scale: float) -> torch.Tensor:
        pack = meta.packed(first, k_cache.shape[1])  # every context gathered in one op a layer
        return self._varlen(
            q,
            pack.gather(k_cache),
            pack.gather(v_cache),
            cu_seqlens_q=pack.cu_q,
            cu_seqlens_k=pack.cu_k,
            max_seqlen_q=pack.max_q,
            max_seqlen_k=pack.max_k,
            softmax_scale=scale,
            causal=True,
        )
