"""Simulated time: a heap of timed callbacks, run in time order (ties in the order they were scheduled)."""

from __future__ import annotations

import contextlib
import heapq
import itertools
from collections.abc import Callable, Iterator


class Loop:
    def __init__(self) -> None:
        self.now = 0.0  # seconds of the simulated hardware's time
        self._heap: list[tuple[float, int, Callable, tuple]] = []
        self._order = itertools.count()
        self.events = 0  # callbacks run so far

    def at(self, when: float, fn: Callable, *args) -> None:
        heapq.heappush(self._heap, (max(when, self.now), next(self._order), fn, args))

    def after(self, delay: float, fn: Callable, *args) -> None:
        self.at(self.now + delay, fn, *args)

    def run(self, until: Callable[[], bool] | None = None) -> None:
        """Run callbacks until none is left, or `until()` says so (checked after each)."""
        with one_torch_thread():
            while self._heap:
                when, _, fn, args = heapq.heappop(self._heap)
                self.now = when
                self.events += 1
                fn(*args)
                if until is not None and until():
                    return


@contextlib.contextmanager
def one_torch_thread() -> Iterator[None]:
    """torch's intra-op threads set to one meanwhile, then back. A simulated mesh's tensors are the emulated
    engine's small caches (a page pull copies a few hundred KiB): split over threads, each copy waits for the
    slowest, and with another process on the cores (`epdmesh plan --jobs 2`, two runs side by side) a thread
    descheduled for a time slice made a 160 KiB copy take ~12 ms instead of 0.05."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
