"""A step's prompt chunks in one attention call per layer: torch's own flash-attention varlen kernel (CUDA).

The torch reference otherwise runs one SDPA call and two gathers per chunk and layer — on a GPU a batch-32 prefill
of LLaVA-1.5-7B's shape is then ~3,000 small launches and runs below transformers' speed. Here each layer gathers
every chunk's context (cached prefix and new tokens) in one indexing op (`ContextPack`, built once a step) and
calls the FlashAttention-2 kernel that ships inside torch's CUDA build (`aten::_flash_attention_forward`, the op
under `torch.nn.attention.varlen`), causal from the bottom right, grouped-query heads as they are. No extra wheel:
where flash-attn's own wheel is missing or broken, this still runs. fp16/bf16 only (the kernel's types); a probe
checks it once per device and head shape against attention computed plainly, and where it fails or differs the
per-chunk path stays.
"""

from __future__ import annotations

import functools
import logging

import torch

from kernels.metadata import AttentionMetadata, ContextPack

log = logging.getLogger(__name__)

DTYPES = (torch.float16, torch.bfloat16)
# the most context tokens packed at once (7B: 256 MiB of gathered K/V a layer); a step whose chunks read more (long
# cached prefixes) runs them one by one, as the memory profile's largest step (τ_t whole prompts) does not show it
MAX_PACKED_TOKENS = 16384


def flash_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pack: ContextPack, scale: float) -> torch.Tensor:
    """q [queries, heads, D], k/v the packed contexts [context tokens, kv_heads, D] → [queries, heads, D]."""
    out = torch.ops.aten._flash_attention_forward(
        q, k, v, pack.cu_q, pack.cu_k, pack.max_q, pack.max_k, 0.0, True, False, scale=scale
    )
    return out[0]


def attend(q, k_cache, v_cache, pack: ContextPack, scale: float) -> torch.Tensor:
    """The queries of the pack's sequences (q: exactly those rows) over their contexts in one layer's cache."""
    return flash_varlen(q, pack.gather(k_cache), pack.gather(v_cache), pack, scale)


def usable(q: torch.Tensor, k_cache: torch.Tensor, context_tokens: int) -> bool:
    """True where the varlen kernel runs and agreed with plain attention on this device and these heads, for
    chunks whose contexts sum to `context_tokens`."""
    if not (q.is_cuda and q.dtype in DTYPES and context_tokens <= MAX_PACKED_TOKENS):
        return False
    return _probe(str(q.device), q.shape[1], k_cache.shape[2], q.shape[2]) is None


@functools.cache
def _probe(device: str, heads: int, kv_heads: int, dim: int) -> str | None:
    """None when the kernel computes a tiny step with these heads (a whole 3-token prompt, a 2-token chunk after 5
    cached tokens) as plain attention does; else why not (logged once)."""
    try:
        dev, g = torch.device(device), torch.Generator().manual_seed(0)
        block_size = 4
        k_cache = torch.randn(4, block_size, kv_heads, dim, generator=g).to(dev, torch.bfloat16)
        v_cache = torch.randn(4, block_size, kv_heads, dim, generator=g).to(dev, torch.bfloat16)
        tables = torch.tensor([[2, 0], [3, 1]], dtype=torch.int32, device=dev)
        meta = AttentionMetadata(
            num_decodes=0,
            query_lens=[3, 2],
            seq_lens=[3, 7],
            block_tables=tables,
            seq_lens_t=torch.tensor([3, 7], dtype=torch.int32, device=dev),
            query_start_loc=torch.tensor([0, 3, 5], dtype=torch.int32, device=dev),
            slot_blocks=torch.tensor([2, 2, 2, 1, 1], device=dev),
            slot_offsets=torch.tensor([0, 1, 2, 1, 2], device=dev),
        )
        q = torch.randn(5, heads, dim, generator=g).to(dev, torch.bfloat16)
        out = attend(q, k_cache, v_cache, meta.packed(0, block_size), dim**-0.5)
        for start, qlen, slen, table in ((0, 3, 3, [2]), (3, 2, 7, [3, 1])):
            k = k_cache[table].flatten(0, 1)[:slen]
            v = v_cache[table].flatten(0, 1)[:slen]
            want = _causal_reference(q[start : start + qlen], k, v, dim**-0.5)
            if not torch.allclose(out[start : start + qlen].float(), want.float(), atol=2e-2, rtol=2e-2):
                raise ValueError("differs from plain attention")
    except Exception as e:  # no kernel for this GPU or torch build, an older op signature...
        why = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        log.warning(
            "torch's varlen flash attention does not run on %s with %d heads (%d for K/V) of %d (%s): one call per "
            "prompt chunk",
            *(device, heads, kv_heads, dim, why),
        )
        return why
    return None


def _causal_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention in fp32 of q [n, heads, D] as the last n positions of k/v [L, kv_heads, D], causal from the bottom
    right (what the kernel must give)."""
    n, length = q.shape[0], k.shape[0]
    groups = q.shape[1] // k.shape[1]
    k, v = k.float().repeat_interleave(groups, 1), v.float().repeat_interleave(groups, 1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    allowed = (
        torch.arange(length, device=q.device)[None, :] <= torch.arange(length - n, length, device=q.device)[:, None]
    )
    return torch.einsum("hqk,khd->qhd", scores.masked_fill(~allowed, float("-inf")).softmax(-1), v)
