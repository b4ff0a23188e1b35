"""bf16 linears on the CPU with their weights packed once for oneDNN (AMX / AVX512-BF16), as inductor's freezing does.

An `nn.Linear` in bf16 hands oneDNN a plain row-major weight, which it reorders into its blocked layout on every
call: for the small batches of decode that reorder costs as much as the product (bench/README.md, "Engine").
`pack_linears` does the reorder once at load. The product is the same oneDNN kernel, so outputs are bit-identical
to `F.linear` (a test holds it to that); fp32 keeps MKL's sgemm, which packing would change in the last bits.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

log = logging.getLogger(__name__)


def can_pack(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether this host's oneDNN computes `dtype` linears natively on `device` (bf16 on AMX or AVX512-BF16 CPUs)."""
    return (
        device.type == "cpu"
        and dtype == torch.bfloat16
        and torch.backends.mkldnn.is_available()
        and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )


@torch.library.custom_op("epdmesh::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    """oneDNN's product with a packed weight, as an op of our own: inductor (`compiled.py`) calls it as it is,
    where it would try to lower the mkldnn op itself and fail on dynamic shapes."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


@packed_linear.register_fake
def _(x, weight, bias, out_features):
    return x.new_empty(*x.shape[:-1], out_features)


class PackedLinear(nn.Module):
    """`nn.Linear` with its weight in oneDNN's blocked layout; the weight is a buffer (the layout is opaque)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("packed_weight", torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach()))
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return packed_linear(x, self.packed_weight, self.bias, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def pack_linears(model: nn.Module) -> int:
    """Replace every bf16 CPU `nn.Linear` of `model` by a `PackedLinear`, in place; returns how many. Idempotent."""
    targets = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) is nn.Linear and can_pack(child.weight.dtype, child.weight.device)
    ]
    for parent, name, child in targets:
        setattr(parent, name, PackedLinear(child))
    if targets:
        log.info("packed %d bf16 linears for oneDNN", len(targets))
    return len(targets)
