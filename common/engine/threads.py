"""Which thread computes: the engine thread alone runs parallel CPU regions, on all the intra-op threads.

libgomp shortens its spin-wait to almost nothing once more threads belong to OpenMP teams than the host has
cores. A serving process that loaded its model on one thread and steps it on another owns two teams: from then
on every parallel region of a step wakes its workers from sleep, and on a 2-core host a decode step takes
1.5-2x as long as the same step on the thread that loaded the model (bench/README.md). So the engine is built
on the thread that steps it, and every other thread of the process runs its tensor work (image pixels, page
copies) on one thread: only one team ever exists.
"""

from __future__ import annotations

import torch


def use_intra_op_threads(n: int) -> None:
    """This thread's parallel regions run on `n` threads from now on, and a thread that has run none yet starts
    with `n` (torch fixes a thread's count at its first parallel region, from the process-wide one)."""
    if n < 1:
        raise ValueError("need at least one thread")
    torch.set_num_threads(n)
    torch.ones(2).add_(1)  # the first parallel_for of this thread: its count is fixed
