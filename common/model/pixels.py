"""Pixels that travel as bytes (uint8) and are finished where they are encoded.

An image processor like CLIP's resizes and crops (whole-number pixel values, 0..255), then rescales (× 1/255)
and normalizes ((x − mean[c]) / std[c]) into float32. Those last two steps are cheap arithmetic but make the
pixels 4× bigger, so the gateway of a mesh leaves them to the worker that encodes: the message that carries
an image to the encoder holds 1 byte per value instead of 4 (a 224² image: 150 KB instead of 600 KB).

`finish` redoes the two steps as transformers' NumPy image transforms do (rescale in float64, then
float32; normalize in float32). `ChatProcessor` uses this only after checking, on probe images, that the
finished pixels are bit-for-bit the processor's own; otherwise pixels travel finished, as float32.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch


@dataclasses.dataclass(frozen=True, slots=True)
class PixelScaling:
    """The image processor's rescale and normalize steps, left to the encoding worker."""

    rescale: float
    mean: tuple[float, ...]
    std: tuple[float, ...]


def finish(raw: torch.Tensor, scaling: PixelScaling) -> torch.Tensor:
    """uint8 pixels [channels, H, W] (or [images, channels, H, W]) → the processor's float32 pixel values.

    A uint8 value has 256 possible values per channel, so the two steps are done once per (channel, value)
    into a table and the pixels are looked up in it: the same arithmetic on the same inputs, so the same bits,
    at a fifth of the time or less (a 336² image, one thread here: 0.18 ms; 0.34 ms by `gather`, whose int64
    indices cost a conversion of their own; ~0.9 ms elementwise for a 224² one)."""
    if raw.dtype != torch.uint8:
        raise ValueError(f"unfinished pixels must be uint8, not {raw.dtype}")
    channels = raw.shape[-3]
    if len(scaling.mean) != channels or len(scaling.std) != channels:
        raise ValueError(f"{channels}-channel pixels with {len(scaling.mean)} means and {len(scaling.std)} stds")
    table = _table(scaling)  # [channels, 256]
    planes = raw.movedim(-3, 0).reshape(channels, -1)
    out = torch.empty(planes.shape, dtype=torch.float32)
    for c in range(channels):
        torch.index_select(table[c], 0, planes[c].int(), out=out[c])
    return out.view(channels, *raw.shape[:-3], *raw.shape[-2:]).movedim(0, -3).contiguous()


@functools.lru_cache(maxsize=16)
def _table(scaling: PixelScaling) -> torch.Tensor:
    """The finished value of every uint8 value in every channel: [channels, 256] float32."""
    if not all(math.isfinite(v) for v in (scaling.rescale, *scaling.mean, *scaling.std)) or 0 in scaling.std:
        raise ValueError(f"pixel scaling must be finite with non-zero stds, got {scaling}")
    values = torch.arange(256, dtype=torch.uint8).expand(len(scaling.mean), 1, 256)
    return finish_elementwise(values, scaling).view(len(scaling.mean), 256)


def finish_elementwise(raw: torch.Tensor, scaling: PixelScaling) -> torch.Tensor:
    """`finish` step by step, value by value: what the table is made of (and what tests compare it with)."""
    x = (raw.to(torch.float64) * scaling.rescale).to(torch.float32)
    mean = torch.tensor(scaling.mean, dtype=torch.float32).view(-1, 1, 1)
    std = torch.tensor(scaling.std, dtype=torch.float32).view(-1, 1, 1)
    return (x - mean) / std
