"""Memory helpers: a process's malloc settings for serving, and for moving pages: zeroed host buffers on huge
pages, GIL-free copies out of tensors, and runs of consecutive block ids."""

from __future__ import annotations

import ctypes
import logging
import math
import mmap
import os
import platform

import torch

log = logging.getLogger(__name__)


def _bytes_copier():
    """A copy of raw memory into a new `bytes` that lets go of the GIL while it copies (CPython), else None.

    numpy's `tobytes` copies holding the GIL: a 64 MiB payload stalled the event loop ~35 ms, 256 MiB ~145 ms
    (the copy into fresh pages runs at ~1.9 GB/s here). Instead: allocate the bytes object uninitialised,
    as C code does, and fill it with ctypes' memmove, which drops the GIL, before anyone else can see it.
    """
    if platform.python_implementation() != "CPython":
        return None
    try:
        new = ctypes.pythonapi.PyBytes_FromStringAndSize
        new.restype = ctypes.py_object
        new.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t)
        offset = bytes.__basicsize__ - 1  # where ob_sval starts
        probe = bytes(range(7, 40))
        if ctypes.string_at(id(probe) + offset, len(probe)) != probe:
            return None
    except (AttributeError, TypeError, ValueError):
        return None

    def copy(address: int, nbytes: int) -> bytes:
        out = new(None, nbytes)
        ctypes.memmove(id(out) + offset, address, nbytes)
        return out

    return copy


_copy_bytes = _bytes_copier()

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters
KEEP_FREED_BYTES = 1 << 30
OLD_GLIBC_MMAP_MAX = 32 << 20  # HEAP_MAX_SIZE / 2: the highest mmap threshold some glibc versions accept


def freeze_heap() -> int:
    """A serving process that is built and about to serve: what it holds so far (modules, the model, its compiled
    graphs: ~0.5 M objects in a `small`-preset engine's process) collected once, then moved out of the garbage
    collector's sight, as vLLM does after start-up. A full collection walks every tracked object: ~0.3 s there, a
    stall in whatever step it falls in, against a 100 ms TBT (bench/README.md). What the process makes later is
    collected as before. Called by the serving commands once their engine is up; returns the objects frozen."""
    import gc

    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def keep_freed_memory(nbytes: int = KEEP_FREED_BYTES) -> bool:
    """Have glibc's malloc keep up to `nbytes` of freed memory for reuse instead of giving it back to the kernel.

    Every forward allocates and frees megabytes of activations. By default glibc unmaps a large freed chunk,
    or trims the heap's free top, and the next forward faults each page in again: ~2,100 page faults per
    image request on a prefill worker here (~6,400 with the gRPC pull), against ~5 with both thresholds at
    1 GiB (bench/README.md); resident memory did not grow. Called by the serving commands at start; skipped
    where malloc is not glibc's or its settings were chosen already (`MALLOC_*` variables, GLIBC_TUNABLES, an
    allocator in LD_PRELOAD), and with EPDMESH_KEEP_FREED_MEMORY=0. True when applied.
    """
    chosen = [k for k in os.environ if k.startswith("MALLOC_") or k in ("GLIBC_TUNABLES", "LD_PRELOAD")]
    if platform.libc_ver()[0] != "glibc" or os.environ.get("EPDMESH_KEEP_FREED_MEMORY", "1") == "0" or chosen:
        log.info("malloc keeps its own settings (%s)", ", ".join(chosen) or "EPDMESH_KEEP_FREED_MEMORY=0 or not glibc")
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    mmap_ok = libc.mallopt(M_MMAP_THRESHOLD, nbytes) or libc.mallopt(M_MMAP_THRESHOLD, min(nbytes, OLD_GLIBC_MMAP_MAX))
    trim_ok = libc.mallopt(M_TRIM_THRESHOLD, nbytes)
    if not (mmap_ok and trim_ok):
        log.warning(
            "glibc refused to keep freed memory (mmap threshold %s, trim threshold %s)",
            "set" if mmap_ok else "refused",
            "set" if trim_ok else "refused",
        )
    return bool(mmap_ok and trim_ok)


HUGE_PAGE = 2 << 20


def host_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor whose memory the kernel may back with transparent huge pages.

    Pages pulled from another process are copied by the kernel one page at a time (UCX's cma transport,
    `process_vm_readv`); with 2 MiB pages instead of 4 KiB ones a NIXL READ of 16–256 MiB ran 13–23% faster
    here (bench/README.md). Like `torch.zeros`, the memory is committed as it is first written, here in
    2 MiB steps. Buffers under 2 MiB, hosts without `madvise` and `EPDMESH_HUGE_PAGES=0` get `torch.zeros`.
    """
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    advise = getattr(mmap, "MADV_HUGEPAGE", None)
    if nbytes < HUGE_PAGE or advise is None or os.environ.get("EPDMESH_HUGE_PAGES", "1") == "0":
        return torch.zeros(shape, dtype=dtype)
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # zero-filled by the kernel
    try:
        region.madvise(advise)
    except OSError:  # transparent huge pages switched off: plain pages, still correct
        pass
    return torch.frombuffer(region, dtype=torch.uint8).view(dtype).view(shape)  # the tensor keeps `region` alive


def commit(tensor: torch.Tensor) -> None:
    """Fault in every page of a CPU tensor now (one write of zero per 4 KiB page) instead of at its first writes.

    `host_zeros` memory is committed as it is first written, and on this host kind (a VM) that first write is slow:
    ~3 ms per 2 MiB page (1 GiB took 1.5 s here), against ~0.1 ms for a page the VM had touched before. A served
    prefill of an image request writes ~10 MiB of KV into blocks it may be the first to use: 52 ms became 69-80 ms
    until the whole cache had been written once (bench/README.md). Only for zeroed memory: it writes zeros.
    """
    if tensor.device.type != "cpu" or not tensor.numel():
        return
    if not tensor.is_contiguous():
        raise ValueError("commit() takes a contiguous tensor")
    tensor.view(-1).view(torch.uint8)[::4096].zero_()


def bytes_of(tensor: torch.Tensor) -> bytes:
    """A contiguous CPU tensor's bytes, copied without holding the GIL where possible."""
    nbytes = tensor.numel() * tensor.element_size()
    if _copy_bytes is not None and tensor.is_contiguous() and tensor.device.type == "cpu" and nbytes:
        return _copy_bytes(tensor.data_ptr(), nbytes)
    return tensor.contiguous().cpu().view(torch.uint8).numpy().tobytes()


def block_runs(block_ids, block_bytes: int) -> list[tuple[int, int, int]]:
    """(source offset, local offset, length) per run of consecutive block ids, in token order."""
    runs: list[tuple[int, int, int]] = []
    local = 0
    for b in block_ids:
        src = b * block_bytes
        if runs and runs[-1][0] + runs[-1][2] == src:
            s, l0, n = runs[-1]
            runs[-1] = (s, l0, n + block_bytes)
        else:
            runs.append((src, local, block_bytes))
        local += block_bytes
    return runs


def paired_runs(src_ids, dst_ids, block_bytes: int) -> list[tuple[int, int, int]]:
    """(source offset, destination offset, length) per run where both sides' block ids are consecutive."""
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src_ids, dst_ids):
        so, do = s * block_bytes, d * block_bytes
        if runs and runs[-1][0] + runs[-1][2] == so and runs[-1][1] + runs[-1][2] == do:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + block_bytes)
        else:
            runs.append((so, do, block_bytes))
    return runs
