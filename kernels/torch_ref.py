"""Reference paged attention in plain torch: the CPU path and the yardstick for every other backend."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.metadata import AttentionMetadata, gather_context


class TorchPagedAttention:
    name = "torch"

    def forward(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        """q [tokens, heads, head_dim] (K/V of these tokens already written) → [tokens, heads, head_dim]."""
        out = torch.empty_like(q)
        nd = meta.num_decodes
        if nd:
            out[:nd] = self._decode(q[:nd], k_cache, v_cache, meta, scale)
        start = nd
        for i in range(nd, meta.num_sequences):
            qlen, slen = meta.query_lens[i], meta.seq_lens[i]
            k = gather_context(k_cache, meta.block_tables[i], slen)
            v = gather_context(v_cache, meta.block_tables[i], slen)
            out[start : start + qlen] = _causal_attention(q[start : start + qlen], k, v, scale)
            start += qlen
        return out

    @staticmethod
    def _decode(q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        nd = meta.num_decodes
        block_size = k_cache.shape[1]
        max_len = max(meta.seq_lens[:nd])
        tables = meta.block_tables[:nd, : -(-max_len // block_size)]
        flat = tables.flatten()  # index_select: ~9x faster than advanced indexing on these strided views
        k = k_cache.index_select(0, flat).view(nd, -1, *k_cache.shape[2:]).transpose(1, 2)  # [nd, kv_heads, L, D]
        v = v_cache.index_select(0, flat).view(nd, -1, *v_cache.shape[2:]).transpose(1, 2)
        positions = torch.arange(k.shape[2], device=q.device)
        mask = (positions[None, :] < meta.seq_lens_t[:nd, None])[:, None, None, :]
        out = F.scaled_dot_product_attention(
            q[:, :, None, :], k, v, attn_mask=mask, scale=scale, enable_gqa=k.shape[1] != q.shape[1]
        )
        return out[:, :, 0, :]


def _causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [n, H, D] are the last n positions of k/v [L, Hkv, D]; causal, aligned bottom-right."""
    n, length = q.shape[0], k.shape[0]
    # [1, heads, n, D]: with a batch dimension SDPA takes its fused CPU kernel (3-D inputs fall back to the math path)
    qh, kh, vh = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    gqa = kh.shape[1] != qh.shape[1]
    if n == length:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=gqa)
    else:
        rows = torch.arange(length - n, length, device=q.device)[:, None]
        mask = torch.arange(length, device=q.device)[None, :] <= rows
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=gqa)
    return out[0].transpose(0, 1)
