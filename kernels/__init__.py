"""Attention over a paged KV cache.

Every backend has one method, `forward(q, k_cache, v_cache, meta, scale) -> out`, where
`q` is [tokens, heads, head_dim] for the flattened batch described by `meta`
(`AttentionMetadata`), the new tokens' K/V are already in the cache, and each cache is one
layer's [num_blocks, block_size, kv_heads, head_dim] view.
"""

from __future__ import annotations

import importlib.util
import logging

import torch

from kernels.metadata import AttentionMetadata, write_kv
from kernels.torch_ref import TorchPagedAttention

log = logging.getLogger(__name__)

BACKENDS = ("auto", "torch", "flash-attn", "xformers")


def available_backends(device: torch.device) -> list[str]:
    names = ["torch"]
    if device.type == "cuda":
        if importlib.util.find_spec("flash_attn") is not None:
            names.append("flash-attn")
        if importlib.util.find_spec("xformers") is not None:
            names.append("xformers")
    return names


def make_attention_backend(name: str, device: torch.device):
    """`auto` takes flash-attn, then xformers, when CUDA is present; the torch reference otherwise."""
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {BACKENDS}")
    have = available_backends(device)
    if name == "auto":
        name = next((n for n in ("flash-attn", "xformers") if n in have), "torch")
    elif name not in have:
        raise ValueError(f"attention backend {name!r} is not available on {device} (available: {have})")
    if name == "flash-attn":
        from kernels.flash import FlashPagedAttention

        backend = FlashPagedAttention()
    elif name == "xformers":
        from kernels.xformers_backend import XformersPagedAttention

        backend = XformersPagedAttention()
    else:
        backend = TorchPagedAttention()
    log.info("attention backend: %s on %s", backend.name, device)
    return backend


__all__ = ["AttentionMetadata", "BACKENDS", "available_backends", "make_attention_backend", "write_kv"]
