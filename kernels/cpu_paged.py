"""Paged decode attention on the CPU in C (`cpu_paged.c`), built on first use by the host's compiler.

The torch reference gathers every decoding sequence's blocks into contiguous K/V copies and runs two batched
matmuls: on a CPU the gathers, the copies and bf16 `bmm`'s per-matrix overhead cost more than the arithmetic
(bench/README.md, "Engine"). The C kernel reads each K and V row once, in place, with the reference's arithmetic
(fp32 sums, the same roundings to the cache's dtype). It is built like inductor's kernels: the host's C compiler
(`$CC`, else `cc`), `-O3 -march=native -fopenmp`, into the user's cache (`$EPDMESH_HOME/kernels`, default
~/.cache/epdmesh/kernels), keyed by the source, the compiler and the CPU; OpenMP is the runtime torch has loaded, so
the kernel runs on torch's intra-op threads. Where no compiler works, `available()` is False and attention stays
the torch reference (logged once).
"""

from __future__ import annotations

import ctypes
import fcntl
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_paged.c")
MAX_HEAD_DIM = 256  # as cpu_paged.c


class _Shape(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_int64)
        for name in (
            "num_seqs num_heads num_kv_heads head_dim block_size table_width max_len q_seq q_head o_seq o_head "
            "k_block k_token k_head v_block v_token v_head"
        ).split()
    ] + [("scale", ctypes.c_float)]


def cache_dir() -> Path:
    return Path(os.environ.get("EPDMESH_HOME", Path.home() / ".cache" / "epdmesh")) / "kernels"


def _cpu_id() -> str:
    """What -march=native compiles for: the model name and flags of the first CPU."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    return "\n".join(line for line in text.split("\n\n", 1)[0].splitlines() if line.startswith(("model name", "flags")))


def _build(compiler: str) -> Path:
    source = SOURCE.read_bytes()
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    key = hashlib.sha256(b"\0".join([source, version.encode(), _cpu_id().encode()])).hexdigest()[:16]
    target = cache_dir() / f"cpu_paged-{key}.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.with_suffix(".lock"), "w") as lock:  # one build per host; the others wait and reuse it
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not target.is_file():
            partial = target.with_suffix(f".{os.getpid()}.partial")
            flags = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11"]
            subprocess.run([compiler, *flags, str(SOURCE), "-o", str(partial), "-lm"], check=True, capture_output=True)
            partial.rename(target)
    return target


@functools.cache
def _library() -> ctypes.CDLL | None:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        log.warning("no C compiler (set CC): CPU decode attention stays the torch reference")
        return None
    try:
        lib = ctypes.CDLL(str(_build(compiler)))
    except (OSError, subprocess.CalledProcessError) as e:
        detail = getattr(e, "stderr", None) or e
        detail = detail.decode(errors="replace")[-500:] if isinstance(detail, bytes) else detail
        log.warning("building the CPU decode attention failed (torch reference kept): %s", detail)
        return None
    for name in ("epdmesh_paged_decode_bf16", "epdmesh_paged_decode_f32"):
        getattr(lib, name).restype = ctypes.c_int
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


def _decode(q, k_cache, v_cache, block_tables, seq_lens, scale: float) -> torch.Tensor:
    lib = _library()
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
    fn = lib.epdmesh_paged_decode_bf16 if q.dtype == torch.bfloat16 else lib.epdmesh_paged_decode_f32
    ptr = ctypes.c_void_p
    rc = fn(
        ctypes.byref(shape),
        *(ptr(t.data_ptr()) for t in (q, k_cache, v_cache, tables, lens, out, scratch)),
    )
    if rc != 0:
        raise ValueError(f"paged_decode: head_dim {dim} is beyond the kernel's {MAX_HEAD_DIM}")
    return out


@torch.library.custom_op("epdmesh::paged_decode", mutates_args=())
def paged_decode(
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


@torch.library.custom_op("epdmesh::paged_decode_layer", mutates_args=("cache",))
def paged_decode_layer(
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
    engine's): the new tokens' k and v [sequences, kv_heads, head_dim] written to their slots, then `paged_decode`.
    One op that mutates the cache in place, so that a compiled step (`common/model/compiled.py`) neither copies
    the cache nor splits around the write."""
    k_cache, v_cache = cache[:, layer, 0], cache[:, layer, 1]
    k_cache[slot_blocks, slot_offsets] = k
    v_cache[slot_blocks, slot_offsets] = v
    return _decode(q, k_cache, v_cache, block_tables, seq_lens, scale)


@paged_decode_layer.register_fake
def _(q, k, v, cache, layer, slot_blocks, slot_offsets, block_tables, seq_lens, scale):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


@paged_decode.register_fake
def _(q, k_cache, v_cache, block_tables, seq_lens, scale):
    return torch.empty_like(q, memory_format=torch.contiguous_format)
