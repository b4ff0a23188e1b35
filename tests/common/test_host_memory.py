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


@pytest.mark.skipif(not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_HUGEPAGE"),
                    reason="transparent huge pages are a Linux feature")
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
