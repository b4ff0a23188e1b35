"""Host buffers for the paged caches: zeroed, writable, the right shape, on huge pages where the kernel allows."""

import mmap
import sys

import pytest
import torch

from common.memory import HUGE_PAGE, host_zeros
from common.paged_cache import PagedKVCache


def _anon_huge_kib() -> int:
    with open("/proc/self/smaps_rollup") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("AnonHugePages:"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8])
def test_a_large_buffer_is_zeroed_writable_and_shaped(dtype):
    t = host_zeros((4, 3, 1 << 18), dtype)
    assert t.shape == (4, 3, 1 << 18) and t.dtype == dtype and t.is_contiguous()
    assert not t.any()
    t[2, 1, 7] = 3
    assert t.sum().item() == 3 and t.view(-1).nonzero().tolist() == [[(2 * 3 + 1) * (1 << 18) + 7]]


def test_small_buffers_and_the_opt_out_get_plain_torch_memory(monkeypatch):
    small = host_zeros((16, 16), torch.float32)
    assert small.shape == (16, 16) and not small.any()
    monkeypatch.setenv("EPDMESH_HUGE_PAGES", "0")
    plain = host_zeros((HUGE_PAGE,), torch.uint8)
    assert plain.shape == (HUGE_PAGE,) and not plain.any()


def test_a_buffer_outlives_every_name_but_its_views():
    view = host_zeros((8, HUGE_PAGE // 8), torch.uint8)[3]
    import gc

    gc.collect()
    view.fill_(5)  # the mapping is still there: freed memory would crash or read back garbage
    assert int(view.sum()) == 5 * (HUGE_PAGE // 8)


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_HUGEPAGE"),
    reason="transparent huge pages are a Linux feature",
)
def test_a_written_cache_is_backed_by_huge_pages_where_the_kernel_offers_them():
    try:
        mode = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        pytest.skip("no transparent huge page support here")
    if "[never]" in mode:
        pytest.skip("transparent huge pages are switched off on this host")
    before = _anon_huge_kib()
    cache = PagedKVCache(64, 16, 4, 2, 8 << 10, torch.float32, "cpu")  # 64 blocks of 4 MiB
    cache.data.fill_(1.0)
    assert _anon_huge_kib() - before >= 64 * 4 * 1024 // 4  # the kernel may fall back to small pages for some


_FAULTS = """
import ctypes, resource, sys
from common.memory import keep_freed_memory
applied = keep_freed_memory() if sys.argv[1] == "keep" else False
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
counts = []
for _ in range(6):  # a forward's worth of activations, 40 MiB (over glibc's 32 MiB dynamic mmap limit), freed
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    p = libc.malloc(40 << 20)
    ctypes.memset(p, 1, 40 << 20)
    libc.free(ctypes.c_void_p(p))
    counts.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(applied, counts[0], sum(counts[1:]))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_kept_freed_memory_is_reused_without_page_faults():
    import os
    import subprocess

    env = {
        k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k not in ("LD_PRELOAD", "GLIBC_TUNABLES")
    }
    runs = {}
    for mode in ("default", "keep"):
        out = subprocess.run([sys.executable, "-c", _FAULTS, mode], capture_output=True, text=True, env=env, check=True)
        applied, first, later = out.stdout.split()
        runs[mode] = (applied == "True", int(first), int(later))
    pages = (40 << 20) // 4096
    assert runs["keep"][0] and not runs["default"][0]
    assert runs["default"][2] >= 5 * pages // 2  # each of the 5 later rounds faulted its 10,240 pages in again
    assert runs["keep"][1] >= pages // 2 and runs["keep"][2] < pages // 4  # in once, then reused
    env["EPDMESH_KEEP_FREED_MEMORY"] = "0"
    out = subprocess.run([sys.executable, "-c", _FAULTS, "keep"], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.split()[0] == "False"  # switched off


def _faults_of(write) -> int:
    import resource

    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    write()
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def test_a_committed_buffer_is_written_without_page_faults_and_stays_zeroed():
    from common.memory import commit

    size = 16 << 20
    fresh = host_zeros((size,), torch.uint8)
    faults_fresh = _faults_of(lambda: fresh.fill_(1))  # 8 huge pages, or 4,096 small ones
    committed = host_zeros((size // 2,), torch.bfloat16)
    commit(committed)
    assert not committed.any()
    faults_committed = _faults_of(lambda: committed.fill_(1))
    assert faults_fresh >= size // HUGE_PAGE and faults_committed < faults_fresh // 4
    with pytest.raises(ValueError, match="contiguous"):
        commit(committed.view(2, -1)[:, ::2])


_FREEZE = """
import gc, sys, weakref
from common.memory import freeze_heap
class Node:
    pass
kept = [Node() for _ in range(50_000)]  # what a process holds when it is up: frozen, never walked again
for a, b in zip(kept, kept[1:]):
    a.next = b
dropped = Node()  # garbage in a cycle, made before: collected first, not frozen with the rest
dropped.me = dropped
gone = weakref.ref(dropped)
del dropped
frozen = freeze_heap()
later = Node()  # garbage made after: still collected
later.me = later
after = weakref.ref(later)
del later
gc.collect()
print(frozen >= len(kept), gone() is None, after() is None)
"""


def test_a_frozen_heap_keeps_what_it_held_and_still_collects_what_comes_after():
    import subprocess

    out = subprocess.run([sys.executable, "-c", _FREEZE], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True"] * 3
