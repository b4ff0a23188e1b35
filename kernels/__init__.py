"""Attention over a paged KV cache.

Every backend has one method, `forward(q, k_cache, v_cache, meta, scale) -> out`, where
`q` is [tokens, heads, head_dim] for the flattened batch described by `meta`
(`AttentionMetadata`), the new tokens' K/V are already in the cache, and each cache is one
layer's [num_blocks, block_size, kv_heads, head_dim] view.
"""

from __future__ import annotations

import functools
import importlib.util
import logging

import torch

from kernels.metadata import AttentionMetadata, write_kv
from kernels.torch_ref import TorchPagedAttention

log = logging.getLogger(__name__)

BACKENDS = ("auto", "torch", "flash-attn", "xformers")


def available_backends(device: torch.device) -> list[str]:
    """torch everywhere; on CUDA each installed kernel library that also runs there (one that imports but was built
    for another torch or CUDA, say, is left out with a warning instead of failing a server's first request)."""
    names = ["torch"]
    if device.type == "cuda":
        for name, module in (("flash-attn", "flash_attn"), ("xformers", "xformers")):
            if importlib.util.find_spec(module) is not None and _runs(name, str(device)) is None:
                names.append(name)
    return names


@functools.cache
def _runs(name: str, device: str) -> str | None:
    """None when backend `name` computes a tiny batch (a decode and a 3-token prompt) on `device`, else why not."""
    try:
        backend = _backend(name)
        dev = torch.device(device)
        k_cache = torch.randn(2, 16, 1, 64, dtype=torch.bfloat16, device=dev)
        meta = AttentionMetadata(
            num_decodes=1,
            query_lens=[1, 3],
            seq_lens=[5, 3],
            block_tables=torch.tensor([[0], [1]], dtype=torch.int32, device=dev),
            seq_lens_t=torch.tensor([5, 3], dtype=torch.int32, device=dev),
            query_start_loc=torch.tensor([0, 1, 4], dtype=torch.int32, device=dev),
            slot_blocks=torch.tensor([0, 1, 1, 1], device=dev),
            slot_offsets=torch.tensor([4, 0, 1, 2], device=dev),
        )
        q = torch.randn(4, 2, 64, dtype=torch.bfloat16, device=dev)
        backend.forward(q, k_cache, k_cache.clone(), meta, 0.125)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
    except Exception as e:  # an import error, no kernel for this GPU, torch or CUDA version...
        why = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        log.warning("attention backend %s is installed but does not run on %s (%s); not used", name, device, why)
        return why
    return None


def _backend(name: str):
    if name == "flash-attn":
        from kernels.flash import FlashPagedAttention

        return FlashPagedAttention()
    if name == "xformers":
        from kernels.xformers_backend import XformersPagedAttention

        return XformersPagedAttention()
    return TorchPagedAttention()


def make_attention_backend(name: str, device: torch.device):
    """`auto` takes flash-attn, then xformers, when CUDA is present; the torch reference otherwise."""
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {BACKENDS}")
    have = available_backends(device)
    if name == "auto":
        name = next((n for n in ("flash-attn", "xformers") if n in have), "torch")
    elif name not in have:
        broken = _runs(name, str(device)) if device.type == "cuda" and name != "torch" else None
        why = f": {broken}" if broken else ""
        raise ValueError(f"attention backend {name!r} is not available on {device}{why} (available: {have})")
    backend = _backend(name)
    log.info("attention backend: %s on %s", backend.name, device)
    return backend


__all__ = ["AttentionMetadata", "BACKENDS", "available_backends", "make_attention_backend", "write_kv"]
