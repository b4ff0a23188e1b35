"""bf16 linears on the CPU with their weights packed once for oneDNN (AMX / AVX512-BF16), as inductor's freezing does.

An `nn.Linear` in bf16 hands oneDNN a plain row-major weight, which it reorders into its blocked layout on every
call: for the small batches of decode that reorder costs as much as the product (bench/README.md, "Engine").
`pack_linears` does the reorder once at load. The product is the same oneDNN kernel, so outputs are bit-identical
to `F.linear` at the same row count (a test holds it to that); fp32 keeps MKL's sgemm, which packing would change
in the last bits.

Row counts come in buckets (`row_bucket`). oneDNN builds (JIT-compiles) a kernel for every new shape it meets: a
prefill of a row count it has not seen pays 2–5 ms per weight shape, ~13 ms in all on a 550-token prefill of the
`small` preset (54.5 against 41.1 ms, bench/README.md), and a server's prompts are all different lengths. Above 32
rows the input is padded with zero rows to its bucket (≤ 12.5% more rows from 512 up) and the product sliced back,
so a few dozen shapes serve every prompt. A padded product can differ from the unpadded one in the last bit, where
oneDNN picks another kernel for the padded count: within bf16's rounding, which the parity tests bound.

Decode products on AMX hosts (`kernels/cpu_amx.py`). A decode step's products (a row a sequence) read every weight
once, and oneDNN reads its packed layout at ~15 GB/s (~8 at 17–32 rows) where the host streams ~36: the text
model's linears also keep their weights as AMX tiles, and a product of ≤ `cpu_amx.MAX_ROWS` (48) rows runs on them
(the same tile unit: bit-identical to oneDNN's up to 32 rows, within bf16's rounding beyond).
On hosts with AVX512-BF16 and no AMX (the EPYCs) the same tiles serve a decode step's products of ≤ 16 rows on the
vector units (`cpu_amx.linear` there: oneDNN's sums bit for bit, read at the host's streaming rate).
A prompt's products run on the same tiles (`cpu_amx.gemm`, any row count, N a multiple of 32): there oneDNN's
reach ~2 TFLOP/s of the unit's ~6, bound by loading its tiles from L2, and `gemm` blocks them to load from L1
(~1.4× on the `small` preset's products, bench/README.md); its sums are `cpu_amx.linear`'s, bit for bit, and
within bf16's rounding of oneDNN's.
That is a second copy of the text model's linear weights; `pack_linears` makes it only while it takes at most
`TILES_SHARE` of the host's memory (the `small` preset: 60 MB; a 7B model's 13 GB: not on a 24 GiB host), and not
with `--no-amx-tiles` (`EngineConfig.amx_tiles`).
"""

from __future__ import annotations

import logging
import os

import torch
from torch import nn

from kernels import cpu_amx
from kernels.ops import define

log = logging.getLogger(__name__)


def can_pack(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether this host's oneDNN computes `dtype` linears natively on `device` (bf16 on AMX or AVX512-BF16 CPUs)."""
    return (
        device.type == "cpu"
        and dtype == torch.bfloat16
        and torch.backends.mkldnn.is_available()
        and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )


def row_bucket(rows: int) -> int:
    """The row count a product of `rows` rows runs at: itself up to 32 (decode batches), then the next multiple of
    32 up to 512, of 64 up to 1024, of 128 up to 2048, of 256 beyond."""
    if rows <= 32:
        return rows
    step = 32 if rows <= 512 else 64 if rows <= 1024 else 128 if rows <= 2048 else 256
    return -(-rows // step) * step


TILES_SHARE = 0.1  # of the host's memory, at most, for the decode products' second copy of the weights


def _packed_linear(
    x: torch.Tensor, weight: torch.Tensor, tiles: torch.Tensor | None, bias: torch.Tensor | None, out_features: int
) -> torch.Tensor:
    """oneDNN's product with a packed weight, rows padded to their bucket; on the AMX tiles if given (≤ 48 rows
    `cpu_amx.linear`, more `cpu_amx.gemm` where N is a multiple of 32)."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if tiles is not None and 0 < rows <= cpu_amx.linear_rows():
        return cpu_amx.linear(x, tiles)
    if tiles is not None and rows and cpu_amx.GEMM and cpu_amx.gemm_supports(tiles):
        return cpu_amx.gemm(x, tiles)
    bucket = row_bucket(rows)
    if bucket == rows:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    padded = x.new_empty(bucket, x.shape[-1])
    padded[:rows] = x.reshape(rows, x.shape[-1])
    padded[rows:] = 0
    out = torch.ops.mkldnn._linear_pointwise(padded, weight, bias, "none", [], "")
    return out[:rows].view(*x.shape[:-1], out_features)


def _fake(x, weight, tiles, bias, out_features):
    return x.new_empty(*x.shape[:-1], out_features)


# An op of our own, so that inductor (`compiled.py`) calls it as it is, where it would try to lower the mkldnn op
# itself and fail on dynamic shapes.
packed_linear = define(
    "packed_linear(Tensor x, Tensor weight, Tensor? tiles, Tensor? bias, int out_features) -> Tensor",
    _packed_linear,
    _fake,
)


def _packed_swiglu(x: torch.Tensor, weight: torch.Tensor, tiles: torch.Tensor, out_features: int) -> torch.Tensor:
    """silu(gate) · up of a stacked gate and up projection with AMX tiles: a decode step's (≤ 16 rows) in one call of
    `cpu_amx.swiglu_rows`, a prompt's (> 48 rows) in one pass of `cpu_amx.gemm`, whose blocks apply it as they
    finish; otherwise the product as `_packed_linear` computes it, then `cpu_amx.silu_mul`."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if 0 < rows <= cpu_amx.SWIGLU_ROWS:
        return cpu_amx.swiglu_rows(x, tiles)
    if rows > cpu_amx.MAX_ROWS and cpu_amx.GEMM:
        return cpu_amx.gemm(x, tiles, swiglu=True)
    both = _packed_linear(x, weight, tiles, None, out_features)
    return cpu_amx.silu_mul(both.reshape(-1, out_features)).view(*x.shape[:-1], out_features // 2)


def _packed_mlp(
    x: torch.Tensor,
    gate_up_weight: torch.Tensor,
    gate_up_tiles: torch.Tensor,
    down_weight: torch.Tensor,
    down_tiles: torch.Tensor,
    gate_up_features: int,
    down_features: int,
) -> torch.Tensor:
    """down(silu(gate) · up) of linears with AMX tiles: a prompt's rows (> 48) through `cpu_amx.mlp` (the two
    products, the activation applied as the first's blocks finish, its output written as the second's input);
    otherwise `_packed_swiglu`, then the down projection as `_packed_linear` computes it."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if rows > cpu_amx.MAX_ROWS and cpu_amx.GEMM and cpu_amx.mlp_supports(gate_up_tiles, down_tiles):
        return cpu_amx.mlp(x, gate_up_tiles, down_tiles)
    middle = _packed_swiglu(x, gate_up_weight, gate_up_tiles, gate_up_features)
    return _packed_linear(middle, down_weight, down_tiles, None, down_features)


def _mlp_fake(x, gate_up_weight, gate_up_tiles, down_weight, down_tiles, gate_up_features, down_features):
    return x.new_empty(*x.shape[:-1], down_features)


packed_mlp = define(
    "packed_mlp(Tensor x, Tensor gate_up_weight, Tensor gate_up_tiles, Tensor down_weight, Tensor down_tiles,"
    " int gate_up_features, int down_features) -> Tensor",
    _packed_mlp,
    _mlp_fake,
)


class PackedLinear(nn.Module):
    """`nn.Linear` with its weight in oneDNN's blocked layout; the weight is a buffer (the layout is opaque).
    `tiles`: also as AMX tiles (a bias-free weight the kernels take), for decode's products and a prompt's."""

    def __init__(self, linear: nn.Linear, tiles: bool = False):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        self.register_buffer("packed_weight", torch.ops.mkldnn._reorder_linear_weight(weight))
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach())
        tiles = tiles and linear.bias is None and cpu_amx.supports(weight)
        self.register_buffer("tiles", cpu_amx.pack(weight) if tiles else None)
        # AMX's kernels take the tiles (a decode step's SwiGLU, a prompt's products and MLP); where only the vector
        # units read them, `mlp` offers nothing. A plain attribute: compiled graphs read it as a constant, where a
        # call into the kernels' library would break them
        self.amx = self.tiles is not None and cpu_amx.available()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return packed_linear(x, self.packed_weight, self.tiles, self.bias, self.out_features)

    def mlp(self, x: torch.Tensor, down: nn.Module) -> torch.Tensor | None:
        """down(silu(gate) · up) for this linear as a SwiGLU's stacked gate and up projections, in one op where it
        and `down` have AMX tiles (`_packed_mlp`); None otherwise (the caller computes the products and the
        activation)."""
        if (
            self.tiles is None
            or not self.amx
            or not isinstance(down, PackedLinear)
            or down.tiles is None
            or not cpu_amx.swiglu_supports(self.tiles)
        ):
            return None
        return packed_mlp(
            x, self.packed_weight, self.tiles, down.packed_weight, down.tiles, self.out_features, down.out_features
        )

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"tiles={self.tiles is not None}"
        )


def _host_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def pack_linears(model: nn.Module, tiles: bool = True, tiles_under: str = "text") -> int:
    """Replace every bf16 CPU `nn.Linear` of `model` by a `PackedLinear`, in place; returns how many. Idempotent.
    With `tiles`, the linears under `tiles_under` (the decoder's, which decode steps run) also get AMX tiles, where
    the host has AMX — or AVX512-BF16, whose vector units then read them (`cpu_amx.vector_available`) — and the copy
    takes ≤ `TILES_SHARE` of its memory."""
    targets = [
        (f"{prefix}.{name}" if prefix else name, parent, name, child)
        for prefix, parent in model.named_modules()
        for name, child in parent.named_children()
        if type(child) is nn.Linear and can_pack(child.weight.dtype, child.weight.device)
    ]
    decode = [t for t in targets if t[0].startswith(f"{tiles_under}.") and t[3].bias is None]
    copy = sum(t[3].weight.numel() * t[3].weight.element_size() for t in decode)
    wanted = tiles and bool(decode) and (cpu_amx.available() or cpu_amx.vector_available())
    tiles = wanted and copy <= TILES_SHARE * _host_memory()
    if wanted and not tiles:
        log.info("decode products stay oneDNN's: their AMX tiles (%.1f GiB) would take over %d%% of this host's "
                 "memory", copy / 2**30, TILES_SHARE * 100)  # fmt: skip
    for path, parent, name, child in targets:
        setattr(parent, name, PackedLinear(child, tiles=tiles and path.startswith(f"{tiles_under}.")))
    if targets:
        log.info("packed %d bf16 linears for oneDNN%s", len(targets), f", {len(decode)} as AMX tiles too" * tiles)
    return len(targets)
