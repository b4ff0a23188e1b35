"""bf16 products on Intel AMX (`cpu_amx.c`), weights laid out as tiles: a decode step's few rows, a prompt's many.

oneDNN computes these products on the same tile unit, bit for bit up to 32 rows, but reads its packed weights at
~15 GB/s (~8 at 17–32 rows) where the host streams ~36 (2-core Xeon, 2026-12-06): at a decode batch every weight
is read once a step, so the read is the step. `pack` lays a weight out as the tiles the kernel reads, in order;
`linear` computes with them. A prompt's products (`gemm`, rows above `MAX_ROWS`) are bound by the tile unit's loads
instead: oneDNN's run at ~2 TFLOP/s where the unit computes ~6 from L1; `gemm` copies the rows into tiles too and
blocks the product so that most loads hit L1 (~1.4× oneDNN's on the `small` preset's products, bench/README.md).
Built like the decode attention (`kernels/cbuild.py`); `available()` is False where
the compiler does not target AMX, the kernel is not built, or Linux refuses the process the tiles' state.
On a host with AVX512-BF16 and no AMX (`vector_available()`: the EPYCs), `linear` reads the same tiles with vector
dot products instead (`epdmesh_vec_linear`, up to `VECTOR_ROWS` rows: a decode step); the prompt kernels (`gemm`,
`mlp`, `swiglu_rows`) are AMX's alone.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from kernels import cbuild
from kernels.scratch import scratch

SOURCE = Path(__file__).with_name("cpu_amx.c")
# Products of up to this many rows go to `linear` (`packed_linear`), more to `gemm`: `linear` takes any count, but
# at 49–64 rows it runs as fast as oneDNN, and from ~96 rows oneDNN's blocking wins over it (bench/README.md).
MAX_ROWS = 48
# Products of more rows go to `gemm` while this is True (`use_gemm`; `bench/engine.py --without prefill-tiles`).
GEMM = True


class _RopeOut(ctypes.Structure):
    """cpu_amx.c's `rope_out`: where `qkv_rope` writes q, K and V."""

    _fields_ = [
        *((name, ctypes.c_int64) for name in ("heads", "kv_heads", "dim")),
        ("cos", ctypes.c_void_p),
        ("sin", ctypes.c_void_p),
        ("cs_stride", ctypes.c_int64),
        *((name, ctypes.c_void_p) for name in ("blocks", "offsets", "q", "kc", "vc")),
        *((name, ctypes.c_int64) for name in ("k_block", "k_token", "k_head", "v_block", "v_token", "v_head")),
    ]


@functools.cache
def _library() -> ctypes.CDLL | None:
    lib = cbuild.load(SOURCE, "bf16 decode products stay oneDNN's")
    if lib is None:
        return None
    lib.epdmesh_amx_init.restype = ctypes.c_int
    lib.epdmesh_amx_gemm_scratch.restype = ctypes.c_int64
    lib.epdmesh_amx_gemm_scratch.argtypes = [ctypes.c_int64, ctypes.c_int64]
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    rows_args = [ptr, i64, i64, i64, ptr, i64, ptr, i64]  # x, rows, row stride, K, tiles, N, y, y's row stride
    for name, extra in (
        ("amx_linear", []),
        ("amx_swiglu_rows", []),
        ("amx_gemm", [ptr, i64, ctypes.c_int]),
        ("vec_linear", []),
    ):
        fn = getattr(lib, f"epdmesh_{name}")
        fn.restype, fn.argtypes = ctypes.c_int, rows_args + extra  # gemm: scratch, its bytes, swiglu
    lib.epdmesh_swiglu.restype = ctypes.c_int
    lib.epdmesh_swiglu.argtypes = [ptr, i64, i64, i64, ptr, i64]
    lib.epdmesh_amx_qkv_rope.restype = ctypes.c_int
    lib.epdmesh_amx_qkv_rope.argtypes = [ptr, i64, i64, i64, ptr, i64, ctypes.POINTER(_RopeOut), i64, i64, ptr, i64]
    return lib


@functools.cache
def available() -> bool:
    """Whether this host runs the AMX kernels (AMX compiled in and granted); builds them on first call."""
    lib = _library()
    return lib is not None and lib.epdmesh_amx_init() == 0


@functools.cache
def vector_available() -> bool:
    """Whether this host, without AMX, runs `linear` on its vector units instead (AVX512-BF16: the EPYCs)."""
    lib = _library()
    return lib is not None and not available() and lib.epdmesh_vec_linear(None, 0, 0, 32, None, 16, None, 16) == -1


VECTOR_ROWS = 16  # without AMX, products of up to this many rows go to `linear` (beyond, oneDNN's blocking wins)


def linear_rows() -> int:
    """The most rows `linear` computes here, where `packed_linear` sends a product to it: `MAX_ROWS` on AMX,
    `VECTOR_ROWS` on the vector units."""
    return MAX_ROWS if available() else VECTOR_ROWS


def supports(weight: torch.Tensor) -> bool:
    """Weights `linear` takes: bf16 [N, K] on the CPU with N a multiple of 16 and K of 32, on a host with AMX or
    AVX512-BF16."""
    n, k = weight.shape
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.bfloat16
        and n % 16 == 0
        and k % 32 == 0
        and (available() or vector_available())
    )


def pack(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] → the kernel's tiles [N/16, K/32, 16, 16, 2]: per 16 output columns and 32 of K, 16 pairs of k, each
    row the 16 columns' pair (the layout TDPBF16PS reads its second operand in)."""
    n, k = weight.shape
    return weight.detach().view(n // 16, 16, k // 32, 16, 2).permute(0, 2, 3, 1, 4).contiguous()


def _as_rows(x: torch.Tensor, k: int) -> torch.Tensor:
    """x [..., K] as [rows, K] with contiguous columns (a view where it can be)."""
    x2 = x if x.dim() == 2 else x.reshape(-1, k)
    return x2 if x2.stride(1) == 1 else x2.contiguous()


def _rows_call(fn, x: torch.Tensor, tiles: torch.Tensor, n: int, extra=lambda rows, k: ()) -> tuple:
    """Calls a kernel of ours on x's rows: fn(x, rows, row stride, K, tiles, n, y, n, *extra(rows, K)) with y a fresh
    [rows, n] bf16 → (y shaped as x's leading dimensions, its return code, rows)."""
    k = tiles.shape[1] * 32
    x2 = _as_rows(x, k)
    rows = x2.shape[0]
    y = torch.empty(rows, n, dtype=torch.bfloat16)
    rc = fn(x2.data_ptr(), rows, x2.stride(0), k, tiles.data_ptr(), n, y.data_ptr(), n, *extra(rows, k))
    return (y if x.dim() == 2 else y.view(*x.shape[:-1], n)), rc, rows


def linear(x: torch.Tensor, tiles: torch.Tensor) -> torch.Tensor:
    """x [..., K] bf16 (≥ 1 row) → x · Wᵀ [..., N], W the weight `tiles` was packed from: on the AMX tiles, or on a
    host without them on its AVX512-BF16 vector units (`vector_available`)."""
    n, k = tiles.shape[0] * 16, tiles.shape[1] * 32
    lib = _library()
    y, rc, rows = _rows_call(lib.epdmesh_amx_linear if available() else lib.epdmesh_vec_linear, x, tiles, n)
    if rc != 0:
        raise ValueError(f"linear: {rows} rows of {k} against [{n}, {k}] (≥ 1 row, K % 32, N % 16; rc {rc})")
    return y


def use_gemm(want: bool) -> bool:
    """A prompt's products (> `MAX_ROWS` rows) on `gemm` (the default) or oneDNN's, for A/B runs; returns whether
    they now run on `gemm`."""
    global GEMM
    GEMM = want
    return want and available()


def gemm_supports(tiles: torch.Tensor) -> bool:
    """Whether `gemm` takes this packed weight: N a multiple of 32 (two column blocks at a time), on AMX."""
    return tiles.shape[0] % 2 == 0 and available()


def gemm(x: torch.Tensor, tiles: torch.Tensor, swiglu: bool = False) -> torch.Tensor:
    """x [..., K] bf16 (any number of rows) → x · Wᵀ [..., N] for a packed W with N a multiple of 32 (`gemm_supports`):
    the same sums as `linear` (fp32 along K in chunks of 32, in order), rounded by the hardware's conversion.
    `swiglu`: W is a SwiGLU's gate and up projections stacked ([2N, K], N a multiple of 16), and the result
    silu(gate) · up [..., N] (as `silu_mul` below), computed as the products' blocks finish."""
    n, k = tiles.shape[0] * 16 // (2 if swiglu else 1), tiles.shape[1] * 32
    lib = _library()

    def extra(rows: int, k: int) -> tuple:
        buffer = scratch(lib.epdmesh_amx_gemm_scratch(rows, k))
        return buffer.data_ptr(), buffer.numel(), SWIGLU if swiglu else 0

    y, rc, rows = _rows_call(lib.epdmesh_amx_gemm, x, tiles, n, extra)
    if rc != 0:
        raise ValueError(f"amx_gemm: {rows} rows of {k} against [{n}, {k}] (K % 32, N % 32; rc {rc})")
    return y


SWIGLU, PACKED_IN, PACKED_OUT = 1, 2, 4  # epdmesh_amx_gemm's flags


def mlp(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """A SwiGLU MLP's products for a prompt's rows: down(silu(gate) · up) for the tiles of a stacked gate and up
    projection ([2I, H]) and of the down projection ([H, I]), I and H multiples of 32 (`mlp_supports`). The first
    product writes silu(gate) · up as the second's copy of its input into tiles would (`gemm` flags PACKED_OUT /
    PACKED_IN): no [rows, I] intermediate, no second copy. The same results as `gemm(x, gate_up, swiglu=True)`
    then `gemm(…, down)`."""
    i, k, h = gate_up.shape[0] * 8, gate_up.shape[1] * 32, down.shape[0] * 16
    lib = _library()
    x2 = _as_rows(x, k)
    rows = x2.shape[0]
    middle = -(-rows // 32) * 32 * i * 2  # bytes: whole pairs of 16-row slabs, a multiple of 64
    work = max(lib.epdmesh_amx_gemm_scratch(rows, k), lib.epdmesh_amx_gemm_scratch(rows, i))
    buffer = scratch(middle + work)
    mid, rest = buffer.data_ptr(), buffer.data_ptr() + middle
    rc = lib.epdmesh_amx_gemm(x2.data_ptr(), rows, x2.stride(0), k, gate_up.data_ptr(), i, mid, i, rest, work,
                              SWIGLU | PACKED_OUT)  # fmt: skip
    y = torch.empty(rows, h, dtype=torch.bfloat16)
    if rc == 0:
        rc = lib.epdmesh_amx_gemm(mid, rows, 0, i, down.data_ptr(), h, y.data_ptr(), h, rest, work, PACKED_IN)
    if rc != 0:
        raise ValueError(f"amx mlp: {rows} rows, hidden {k}, intermediate {i} (multiples of 32; rc {rc})")
    return y if x.dim() == 2 else y.view(*x.shape[:-1], h)


def mlp_supports(gate_up: torch.Tensor, down: torch.Tensor) -> bool:
    """Whether `mlp` takes these tiles: a stacked gate and up projection and a down projection whose intermediate
    and hidden sizes are multiples of 32, one's output the other's input."""
    return (
        gate_up.shape[0] % 4 == 0
        and down.shape[0] % 2 == 0
        and gate_up.shape[0] * 8 == down.shape[1] * 32
        and available()
    )


SWIGLU_ROWS = 16  # a SwiGLU of up to this many rows runs as one call of `swiglu_rows`


def swiglu_rows(x: torch.Tensor, tiles: torch.Tensor) -> torch.Tensor:
    """x [..., K] bf16, ≤ `SWIGLU_ROWS` rows (a decode step's) → silu(gate) · up [..., N] for `tiles` packed from a
    stacked gate and up projection ([2N, K], N a multiple of 16) in one call: `linear`'s products, then what
    `silu_mul` computes, without the [rows, 2N] intermediate (`gemm(..., swiglu=True)` for a prompt's rows)."""
    n, k = tiles.shape[0] * 8, tiles.shape[1] * 32
    y, rc, rows = _rows_call(_library().epdmesh_amx_swiglu_rows, x, tiles, n)
    if rc != 0:
        raise ValueError(f"swiglu_rows: {rows} rows of {k} against [{2 * n}, {k}] (1–{SWIGLU_ROWS} rows, N % 16)")
    return y


def silu_mul(both: torch.Tensor) -> torch.Tensor:
    """[rows, 2N] bf16 (a SwiGLU's gate and up products side by side, N a multiple of 16) → silu(gate) · up [rows, N]:
    gate / (1 + exp(−gate)) · up in fp32 (as torch's silu and inductor's fused code compute it), rounded once — what
    `gemm(..., swiglu=True)` applies to its blocks, for products computed otherwise (a decode step's few rows)."""
    rows, n = both.shape[0], both.shape[1] // 2
    if both.stride(1) != 1:
        both = both.contiguous()
    y = torch.empty(rows, n, dtype=torch.bfloat16)
    if _library().epdmesh_swiglu(both.data_ptr(), rows, both.stride(0), n, y.data_ptr(), n) != 0:
        raise ValueError(f"silu_mul: {n} columns (a multiple of 16)")
    return y


def swiglu_supports(tiles: torch.Tensor) -> bool:
    """Whether `gemm(..., swiglu=True)`, `swiglu_rows` and `silu_mul` take these tiles: the gate's and the up's
    columns each a multiple of 16 (a shape check alone: compiled graphs trace it; `available()` is the caller's)."""
    return tiles.shape[0] % 2 == 0


# A prompt's qkv projection, RoPE and K/V write in one pass (`qkv_rope`) where it runs; False for A/B runs
# (`bench/engine.py --without qkv-rope`: the product, then `cpu_paged.rotary_kv` on its rows).
QKV_ROPE = True


def qkv_rope_supports(tiles: torch.Tensor, head_dim: int, num_heads: int, num_kv_heads: int) -> bool:
    """Whether `qkv_rope` takes this projection: its columns q's heads, k's and v's, head_dim 32, 64 or 128, on AMX."""
    return (
        head_dim in (32, 64, 128) and tiles.shape[0] * 16 == (num_heads + 2 * num_kv_heads) * head_dim and available()
    )


def qkv_rope(
    x: torch.Tensor,
    tiles: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_blocks: torch.Tensor,
    slot_offsets: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
) -> torch.Tensor:
    """A prompt's qkv projection (x [rows, K] bf16 against the projection's tiles: q's heads, then k's, then v's)
    with RoPE applied to q and k (cos, sin [rows, head_dim]) and K and V written into their slots of a layer's caches
    ([blocks, block_size, kv_heads, head_dim]) → q [rows, num_heads, head_dim]: what `cpu_paged.rotary_kv` makes of
    `gemm(x, tiles)`, bit for bit, as each block of the product finishes — no [rows, N] between. Where
    `qkv_rope_supports`; IndexError for a slot outside the cache."""
    n, k, dim = tiles.shape[0] * 16, tiles.shape[1] * 32, k_cache.shape[-1]
    x2 = _as_rows(x, k)
    rows = x2.shape[0]
    assert cos.stride(-1) == sin.stride(-1) == 1 and cos.stride(0) == sin.stride(0)
    assert k_cache.stride(-1) == v_cache.stride(-1) == 1
    blocks, offsets = slot_blocks.contiguous(), slot_offsets.contiguous()
    q = torch.empty(rows, num_heads, dim, dtype=torch.bfloat16)
    ptrs = [t.data_ptr() for t in (cos, sin, blocks, offsets, q, k_cache, v_cache)]
    out = _RopeOut(
        num_heads, num_kv_heads, dim, ptrs[0], ptrs[1], cos.stride(0), *ptrs[2:], *k_cache.stride()[:3],
        *v_cache.stride()[:3],
    )  # fmt: skip
    lib = _library()
    work = scratch(lib.epdmesh_amx_gemm_scratch(rows, k))
    rc = lib.epdmesh_amx_qkv_rope(
        x2.data_ptr(), rows, x2.stride(0), k, tiles.data_ptr(), n, ctypes.byref(out), k_cache.shape[0],
        k_cache.shape[1], work.data_ptr(), work.numel(),
    )  # fmt: skip
    if rc == -2:
        raise IndexError(f"qkv_rope: a slot outside the cache ({k_cache.shape[0]} blocks of {k_cache.shape[1]})")
    if rc != 0:
        raise ValueError(f"qkv_rope: {rows} rows of {k} against [{n}, {k}], head_dim {dim} (rc {rc})")
    return q
