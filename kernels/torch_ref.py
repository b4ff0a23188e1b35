"""Reference paged attention in plain torch: the CPU path and the yardstick for every other backend."""

from __future__ import annotations

import torch

from kernels import cpu_paged, cpu_prompt, varlen
from kernels.metadata import AttentionMetadata, gather_context


class TorchPagedAttention:
    """`use_c`: decodes on the CPU through the C kernel (`kernels/cpu_paged.py`) where it is built; False keeps
    them in torch (the yardstick the kernel is tested against). On the CPU a step's prompt chunks go to the C prompt
    kernel in one call a layer, K/V read from the cache in place (`kernels/cpu_prompt.py`, unless its `ENABLED` is
    off); elsewhere, or where it does not run, one SDPA call per chunk on its gathered context. `varlen`: on CUDA,
    a step's prompt chunks in one flash-attention call per layer (`kernels/varlen.py`) where it runs; False: one SDPA
    call per chunk."""

    name = "torch"

    def __init__(self, use_c: bool = True, varlen: bool = True):
        self.use_c = use_c
        self.varlen = varlen

    def forward(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        """q [tokens, heads, head_dim] (K/V of these tokens already written) → [tokens, heads, head_dim]."""
        out = torch.empty_like(q)
        nd = meta.num_decodes
        if nd and self.use_c and cpu_paged.supports(q, k_cache):
            tables, lens = meta.block_tables[:nd], meta.seq_lens_t[:nd]
            out[:nd] = cpu_paged.paged_decode(q[:nd], k_cache, v_cache, tables, lens, scale)
        elif nd:
            out[:nd] = self._decode(q[:nd], k_cache, v_cache, meta, scale)
        if meta.num_sequences > nd and cpu_prompt.ENABLED and cpu_prompt.supports(q) and k_cache.dtype == q.dtype:
            starts = meta.query_start_loc[nd:]  # the prompt chunks in one call, K/V read in place
            out[nd:] = cpu_prompt.paged_prompt_attention(
                q[nd:], k_cache, v_cache, meta.block_tables[nd:], starts, meta.seq_lens_t[nd:], scale
            )
            return out
        if meta.num_sequences > nd and self.varlen and varlen.usable(q, k_cache, sum(meta.seq_lens[nd:])):
            out[nd:] = varlen.attend(q[nd:], k_cache, v_cache, meta.packed(nd, k_cache.shape[1]), scale)
            return out
        start = nd
        for i in range(nd, meta.num_sequences):
            qlen, slen = meta.query_lens[i], meta.seq_lens[i]
            k = gather_context(k_cache, meta.block_tables[i], slen)
            v = gather_context(v_cache, meta.block_tables[i], slen)
            out[start : start + qlen] = causal_attention(q[start : start + qlen], k, v, scale)
            start += qlen
        return out

    @staticmethod
    def _decode(q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        nd = meta.num_decodes
        width = -(-max(meta.seq_lens[:nd]) // k_cache.shape[1])
        return paged_decode(q, k_cache, v_cache, meta.block_tables[:nd, :width], meta.seq_lens_t[:nd], scale)


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One query per sequence (q [n, heads, D]) over the first `seq_lens` cached tokens of the blocks in
    `block_tables` [n, width] (every id a valid block; positions past a sequence's length are masked), as two
    batched matmuls over [sequence, kv head] with the softmax in fp32 (the arithmetic of transformers' eager
    attention). No host reads: a CUDA graph can hold it (`common/model/cuda_graphs.py`). SDPA takes ~3x longer on
    the CPU here: with one query row it runs its generic path, and on the gathered cache's strided views."""
    nd = q.shape[0]
    block_size, kv_heads, head_dim = k_cache.shape[1:]
    flat = block_tables.flatten()  # index_select: ~9x faster than advanced indexing on these strided views
    k = _heads_first(k_cache.index_select(0, flat).view(nd, -1, kv_heads, head_dim))  # [nd, kv_heads, L, D]
    v = _heads_first(v_cache.index_select(0, flat).view(nd, -1, kv_heads, head_dim))
    group = q.shape[1] // kv_heads  # query heads per kv head (GQA)
    scores = torch.matmul(q.view(nd, kv_heads, group, head_dim), k.transpose(-1, -2)).float() * scale
    padding = torch.arange(k.shape[2], device=q.device)[None, :] >= seq_lens[:, None]
    scores.masked_fill_(padding[:, None, None, :], float("-inf"))
    probs = scores.softmax(-1).to(q.dtype)
    return torch.matmul(probs, v).view(nd, kv_heads * group, head_dim)


def _heads_first(x: torch.Tensor) -> torch.Tensor:
    """[n, L, H, D] → a contiguous [n, H, L, D] (matmul on the strided view would copy it anyway, more slowly)."""
    return torch.empty(x.shape[0], x.shape[2], x.shape[1], x.shape[3], dtype=x.dtype, device=x.device).copy_(
        x.transpose(1, 2)
    )


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, whole: bool | None = None
) -> torch.Tensor:
    """q [n, H, D] are the last n positions of k/v [L, Hkv, D]; causal, aligned bottom-right (`cpu_prompt.attend`:
    the C kernel on the CPU). `whole`: n == L is known (a compiled graph, where the sizes are symbols)."""
    return cpu_prompt.attend(q[None], k[None], v[None], scale, True, whole)[0]
