"""Numerics shared by the vision tower and the decoder, written to match transformers op for op."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


ACTIVATIONS = {
    "gelu": F.gelu,
    "quick_gelu": quick_gelu,
    "silu": F.silu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


def activation(name: str):
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise ValueError(f"activation {name!r} is not supported (have {sorted(ACTIVATIONS)})") from None


class RotaryEmbedding:
    """Llama's default RoPE: cos/sin computed in float32 from integer positions, then cast. Given the dtype they are
    cast to and `max_positions`, they are computed once for every position (the table; in slices of positions that
    the vectorised kernel computes whole, as it does one call's) and gathered by position after: the same values
    without evaluating them per call — which inductor otherwise does inside each layer's rotary kernel of a compiled
    step, for every head (~51 µs a layer of a 128-token prompt on a Zen 4, on one thread)."""

    TABLE_SLICE = 256  # positions computed at once when the table is made

    def __init__(
        self,
        head_dim: int,
        theta: float,
        device: torch.device,
        dtype: torch.dtype | None = None,
        max_positions: int = 0,
    ):
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).to(torch.float32) / head_dim
        self.inv_freq = 1.0 / (theta**exponents)
        self.dtype = dtype
        self.table: tuple[torch.Tensor, torch.Tensor] | None = None
        if dtype is not None and max_positions > 0:
            with torch.inference_mode(False):  # (a plain tensor, whatever mode the model is first run in)
                parts = [
                    self.computed(
                        torch.arange(start, min(start + self.TABLE_SLICE, max_positions), device=device), dtype
                    )
                    for start in range(0, max_positions, self.TABLE_SLICE)
                ]
                self.table = torch.cat([c for c, _ in parts]), torch.cat([s for _, s in parts])

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if self.table is not None and dtype == self.dtype:
            cos, sin = self.table
            return cos[positions], sin[positions]
        return self.computed(positions, dtype)

    def computed(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [tokens, heads, head_dim]; cos/sin: [tokens, head_dim]. transformers' `x·cos + rotate_half(x)·sin`, each
    half written out (the same products and sums, so the same roundings): compiled, the rotated copy of x that the
    `cat` of rotate_half made was filled by single-threaded loops, ~20 µs a layer of a 128-token prompt."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * c[..., :half] - x2 * s[..., :half], x2 * c[..., half:] + x1 * s[..., half:]), dim=-1)
