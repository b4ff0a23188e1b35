"""Paged decode attention on the CPU in C (`cpu_paged.c`), built on first use by the host's compiler (`cbuild`).

The torch reference gathers every decoding sequence's blocks into contiguous K/V copies and runs two batched
matmuls: on a CPU the gathers, the copies and bf16 `bmm`'s per-matrix overhead cost more than the arithmetic
(bench/README.md, "Engine"). The C kernel reads each K and V row once, in place, with the reference's arithmetic
(fp32 sums, the same roundings to the cache's dtype). It is built like inductor's kernels: the host's C compiler
(`$CC`, else `cc`), `-O3 -march=native -fopenmp`, into the user's cache (`$EPDMESH_HOME/kernels`, default
~/.cache/epdmesh/kernels), keyed by the source, the compiler and the CPU; OpenMP is the runtime torch has loaded, so
the kernel runs on torch's intra-op threads. Where the compiler targets AVX-512 the passes and the softmax run on 16
lanes; `_library(scalar=True)` builds the portable loops alone (what other hosts run; the tests check both). Where
no compiler works, `available()` is False and attention stays the torch reference (logged once).
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import torch

from kernels import cbuild
from kernels.ops import define

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_paged.c")
MAX_HEAD_DIM = 256  # as cpu_paged.c


_Shape = cbuild.shape_struct(
    "_Shape",
    "num_seqs num_heads num_kv_heads head_dim block_size table_width max_len q_seq q_head o_seq o_head "
    "k_block k_token k_head v_block v_token v_head",
)


class _NewRows(ctypes.Structure):
    _fields_ = [(name, ctypes.c_int64) for name in "k_seq k_head v_seq v_head num_blocks".split()]


@functools.cache
def _library(scalar: bool = False) -> ctypes.CDLL | None:
    lib = cbuild.load(SOURCE, "CPU decode attention stays the torch reference", ("EPDMESH_SCALAR",) if scalar else ())
    if lib is None:
        return None
    for name in (
        "paged_decode_bf16",
        "paged_decode_f32",
        "write_decode_bf16",
        "write_decode_f32",
        "write_rows",
        "rotary_kv_bf16",
    ):
        getattr(lib, f"epdmesh_{name}").restype = ctypes.c_int
    return lib


def available() -> bool:
    """Whether the C kernel is built and loadable on this host (builds it on first call)."""
    return _library() is not None


def supports(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Shapes and dtypes the C kernel takes: CPU, bf16 or fp32, head_dim ≤ 256."""
    return (
        q.device.type == "cpu"
        and q.dtype in (torch.bfloat16, torch.float32)
        and k_cache.dtype == q.dtype
        and q.shape[-1] <= MAX_HEAD_DIM
        and available()
    )


def _decode(q, k_cache, v_cache, block_tables, seq_lens, scale: float, new=None, scalar: bool = False) -> torch.Tensor:
    """`new`: (k, v, slot_blocks, slot_offsets), the step's rows written into their slots first, in the same call."""
    lib = _library(scalar)
    nd, heads, dim = q.shape
    kv_heads = k_cache.shape[2]
    assert lib is not None and q.stride(-1) == k_cache.stride(-1) == v_cache.stride(-1) == 1
    tables, lens = block_tables.contiguous(), seq_lens.contiguous()
    assert tables.dtype == lens.dtype == torch.int32
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    max_len = tables.shape[1] * k_cache.shape[1]
    scratch = torch.empty(nd * heads * (max_len + 2 * dim), dtype=torch.float32)
    shape = _Shape(
        nd, heads, kv_heads, dim, k_cache.shape[1], tables.shape[1], max_len,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        scale,
    )  # fmt: skip
    bf16 = q.dtype == torch.bfloat16
    ptr = ctypes.c_void_p
    tail = [ptr(t.data_ptr()) for t in (q, k_cache, v_cache, tables, lens, out, scratch)]
    if new is None:
        fn = lib.epdmesh_paged_decode_bf16 if bf16 else lib.epdmesh_paged_decode_f32
        rc = fn(ctypes.byref(shape), *tail)
    else:
        k, v, blocks, offsets = (t if t.stride(-1) == 1 else t.contiguous() for t in new)
        assert k.dtype == v.dtype == q.dtype and blocks.dtype == offsets.dtype == torch.int64
        assert blocks.is_contiguous() and offsets.is_contiguous() and k.shape == v.shape == (nd, kv_heads, dim)
        rows = _NewRows(k.stride(0), k.stride(1), v.stride(0), v.stride(1), k_cache.shape[0])
        fn = lib.epdmesh_write_decode_bf16 if bf16 else lib.epdmesh_write_decode_f32
        rc = fn(ctypes.byref(shape), ctypes.byref(rows), *(ptr(t.data_ptr()) for t in (k, v, blocks, offsets)), *tail)
    if rc == -2:
        raise IndexError(f"paged_decode: a slot outside the cache ({k_cache.shape[0]} blocks of {k_cache.shape[1]})")
    if rc != 0:
        raise ValueError(f"paged_decode: head_dim {dim} is beyond the kernel's {MAX_HEAD_DIM}")
    return out


def _slots_shape(rows: int, heads: int, kv_heads: int, k_cache: torch.Tensor, v_cache: torch.Tensor) -> _Shape:
    """The kernel's shape for writing `rows` tokens' K/V into their slots: the caches' sizes and strides."""
    return _Shape(
        rows, heads, kv_heads, k_cache.shape[-1], k_cache.shape[1], 0, 0, 0, 0, 0, 0,
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        0.0,
    )  # fmt: skip


def write_rows(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_blocks: torch.Tensor,
    slot_offsets: torch.Tensor,
) -> bool:
    """New K/V rows ([tokens, kv_heads, head_dim]) into their slots of a layer's caches ([blocks, block_size,
    kv_heads, head_dim]) as `k_cache[slot_blocks, slot_offsets] = k` would, by memcpy in C: index_put's indexing
    costs ~25 µs a call for a 128-token prompt, a prefill's 16 of them 3–4% of its time. False (nothing written)
    where the kernel cannot take them, and for fewer than 16 rows (index_put is as fast there: the ctypes call costs
    ~7 µs): the caller writes them in torch. IndexError for a slot outside the cache."""
    n, kv_heads, dim = k.shape
    if not (
        n >= 16
        and all(t.device.type == "cpu" for t in (k, v, k_cache, v_cache, slot_blocks, slot_offsets))
        and k.dtype == v.dtype == k_cache.dtype == v_cache.dtype
        and k.dtype in (torch.bfloat16, torch.float32)
        and v.shape == k.shape
        and k_cache.shape == v_cache.shape
        and k_cache.shape[2:] == (kv_heads, dim)
        and k.stride(-1) == v.stride(-1) == k_cache.stride(-1) == v_cache.stride(-1) == 1
        and slot_blocks.dtype == slot_offsets.dtype == torch.int64
        and slot_blocks.shape == slot_offsets.shape == (n,)
        and available()
    ):
        return False
    blocks, offsets = slot_blocks.contiguous(), slot_offsets.contiguous()
    shape = _slots_shape(n, kv_heads, kv_heads, k_cache, v_cache)
    rows = _NewRows(k.stride(0), k.stride(1), v.stride(0), v.stride(1), k_cache.shape[0])
    ptr = ctypes.c_void_p
    rc = _library().epdmesh_write_rows(
        ctypes.byref(shape),
        ctypes.byref(rows),
        *(ptr(t.data_ptr()) for t in (k, v, blocks, offsets, k_cache, v_cache)),
        ctypes.c_int64(k.element_size()),
    )
    if rc == -2:
        raise IndexError(f"write_rows: a slot outside the cache ({k_cache.shape[0]} blocks of {k_cache.shape[1]})")
    return True


def rotary_kv_supported(dtype: torch.dtype, head_dim: int) -> bool:
    """Whether `rotary_kv` runs here for this dtype and head_dim: bf16, a multiple of 32, on `rotary_kv_host()`."""
    return dtype == torch.bfloat16 and head_dim % 32 == 0 and rotary_kv_host()


@functools.cache
def rotary_kv_host() -> bool:
    """Whether this host runs `rotary_kv` at all: the kernel built with its 16-lane passes (AVX-512)."""
    lib = _library()
    if lib is None:
        return False
    shape = _Shape(0, 1, 1, 32, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0.0)
    rows = _NewRows(0, 0, 0, 0, 0)
    return lib.epdmesh_rotary_kv_bf16(ctypes.byref(shape), ctypes.byref(rows), *[None] * 10) == 0


def rotary_kv(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_blocks: torch.Tensor,
    slot_offsets: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
) -> torch.Tensor:
    """A prompt's RoPE and K/V write in one pass (where `rotary_kv_supported`): the rows of its qkv projection
    ([tokens, (num_heads + 2·num_kv_heads)·head_dim]) → q [tokens, num_heads, head_dim] with RoPE applied; K (RoPE
    applied) and V into their slots of a layer's caches ([blocks, block_size, kv_heads, head_dim]), as
    `apply_rotary` and `write_slots` would — one read of the projection instead of inductor's rotary kernel, its
    copies and the slots' writes. IndexError for a slot outside the cache."""
    n = qkv.shape[0]
    dim = k_cache.shape[-1]
    assert qkv.stride(-1) == cos.stride(-1) == sin.stride(-1) == 1 and cos.stride(0) == sin.stride(0)
    assert k_cache.stride(-1) == v_cache.stride(-1) == 1 and qkv.shape[1] == (num_heads + 2 * num_kv_heads) * dim
    blocks, offsets = slot_blocks.contiguous(), slot_offsets.contiguous()
    q = torch.empty(n, num_heads, dim, dtype=qkv.dtype)
    shape = _slots_shape(n, num_heads, num_kv_heads, k_cache, v_cache)
    rows = _NewRows(0, 0, 0, 0, k_cache.shape[0])
    ptr = ctypes.c_void_p
    rc = _library().epdmesh_rotary_kv_bf16(
        ctypes.byref(shape),
        ctypes.byref(rows),
        ptr(qkv.data_ptr()),
        ctypes.c_int64(qkv.stride(0)),
        ptr(cos.data_ptr()),
        ptr(sin.data_ptr()),
        ctypes.c_int64(cos.stride(0)),
        *(ptr(t.data_ptr()) for t in (blocks, offsets, q, k_cache, v_cache)),
    )
    if rc == -2:
        raise IndexError(f"rotary_kv: a slot outside the cache ({k_cache.shape[0]} blocks of {k_cache.shape[1]})")
    if rc != 0:
        raise ValueError(f"rotary_kv: head_dim {dim} in bf16 is not computed on this host")
    return q


def _paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q [sequences, heads, head_dim], one token each, whose K/V are already in the caches ([blocks, block_size,
    kv_heads, head_dim], head_dim contiguous); block_tables [sequences, blocks] int32, each sequence's blocks
    first; seq_lens [sequences] int32, each ≤ blocks × block_size → out like q."""
    return _decode(q, k_cache, v_cache, block_tables, seq_lens, scale)


def _paged_decode_layer(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache: torch.Tensor,
    layer: int,
    slot_blocks: torch.Tensor,
    slot_offsets: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One layer of a decode step on the whole cache ([blocks, layers, 2, block_size, kv_heads, head_dim], the
    engine's): the new tokens' k and v [sequences, kv_heads, head_dim] written to their slots (as an index_put
    would, in the kernel's call: two index_puts cost ~35 µs a layer), then `paged_decode`.
    One op that mutates the cache in place, so that a compiled step (`common/model/compiled.py`) neither copies
    the cache nor splits around the write."""
    k_cache, v_cache = cache[:, layer, 0], cache[:, layer, 1]
    return _decode(q, k_cache, v_cache, block_tables, seq_lens, scale, new=(k, v, slot_blocks, slot_offsets))


def _like_q(q, *_):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


paged_decode = define(
    "paged_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor seq_lens, float scale)"
    " -> Tensor",
    _paged_decode,
    _like_q,
)
paged_decode_layer = define(
    "paged_decode_layer(Tensor q, Tensor k, Tensor v, Tensor(a!) cache, int layer, Tensor slot_blocks,"
    " Tensor slot_offsets, Tensor block_tables, Tensor seq_lens, float scale) -> Tensor",
    _paged_decode_layer,
    _like_q,
)
