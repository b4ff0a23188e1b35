"""Registered CPU buffers that NIXL READs land in when a pull must return bytes (`NixlTransfer.pull`).

Sizes are powers of two up to 64 MiB (reusable across sizes), then whole 16 MiB steps. Given back,
the pool keeps its largest buffers up to `keep_bytes` (a big one serves small pulls) and deregisters
the rest. Every call into the agent goes through the agent lock its owner passes in.
"""

from __future__ import annotations

import threading

import torch

MIN_STAGING_BYTES = 1 << 20


class Staging:
    """A registered CPU buffer the READs land in before being copied out."""

    __slots__ = ("tensor", "reg", "nbytes")

    def __init__(self, tensor: torch.Tensor, reg):
        self.tensor = tensor
        self.reg = reg
        self.nbytes = tensor.numel()


class StagingPool:
    def __init__(self, agent, agent_lock: threading.Lock, keep_bytes: int):
        self.agent = agent
        self.agent_lock = agent_lock
        self.keep_bytes = keep_bytes
        self._lock = threading.Lock()
        self._free: list[Staging] = []

    def take(self, nbytes: int) -> Staging:
        with self._lock:
            fits = [s for s in self._free if s.nbytes >= nbytes]
            if fits:
                best = min(fits, key=lambda s: s.nbytes)
                self._free.remove(best)
                return best
        if nbytes <= 64 << 20:
            size = max(MIN_STAGING_BYTES, 1 << (nbytes - 1).bit_length())
        else:
            size = -(-nbytes // (16 << 20)) * (16 << 20)
        tensor = torch.empty(size, dtype=torch.uint8)
        with self.agent_lock:
            reg = self.agent.register_memory(tensor)
        return Staging(tensor, reg)

    def give(self, staging: Staging, closed: bool = False) -> None:
        with self._lock:
            self._free.append(staging)
            self._free.sort(key=lambda s: s.nbytes, reverse=True)
            kept, total = [], 0
            for s in self._free:
                if not closed and total + s.nbytes <= self.keep_bytes:
                    kept.append(s)
                    total += s.nbytes
            dropped = [s for s in self._free if s not in kept]
            self._free = kept
        if dropped:
            with self.agent_lock:
                for s in dropped:
                    self.agent.deregister_memory(s.reg)

    def drain(self) -> list:
        """Empty the pool; returns the registrations of its buffers (for the owner to deregister)."""
        with self._lock:
            free, self._free = self._free, []
        return [s.reg for s in free]
