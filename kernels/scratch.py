"""A calling thread's scratch for our C kernels (`cpu_prompt`, `cpu_amx`), kept between calls.

Fresh from the allocator, a large buffer would be fresh pages each call — on these VMs ~3 ms per 2 MiB page first
written (bench/README.md, the peer section): the packed K/V of a long context are tens of MB a layer (a 7B shape at
4k tokens: 64 MB), a prompt's products a few MB. One buffer a thread, used by one call at a time, grown by half
again at least (a context that grows step by step) and never shrunk: a thread holds the most one call has needed.
"""

from __future__ import annotations

import threading

import torch

_KEPT = threading.local()


def scratch(size: int) -> torch.Tensor:
    """≥ `size` bytes (uint8, 64-byte aligned as torch's CPU allocator aligns), the calling thread's."""
    kept = getattr(_KEPT, "buffer", None)
    if kept is None or kept.numel() < size:
        with torch.inference_mode(False):  # (kept across calls, in inference mode or not)
            _KEPT.buffer = kept = torch.empty(
                max(size, int(1.5 * (0 if kept is None else kept.numel()))), dtype=torch.uint8
            )
    return kept
