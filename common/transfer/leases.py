"""The source side of a transfer: which page sets are held for whom, until when."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

from common.paged_cache import PageLayout
from common.transfer.handle import PageHandle


@dataclasses.dataclass(frozen=True, slots=True)
class Lease:
    engine_request_id: str  # the handed-off request in this worker's engine that owns the blocks
    handle: PageHandle

    @property
    def lease_id(self) -> str:
        return self.handle.lease_id


class LeaseTable:
    """Leases by id. The caller frees a lease's pages when `take` (ack) or `expired` returns it."""

    def __init__(
        self,
        worker_id: str,
        address: str,
        ttl_s: float,
        clock: Callable[[], float] = time.time,
        on_change: Callable[[int], None] | None = None,
    ):
        """`on_change(n)`: called with the number of leases now (0), then whenever a lease is granted or removed."""
        if ttl_s <= 0:
            raise ValueError("lease ttl must be positive")
        self.worker_id = worker_id
        self.address = address
        self.ttl_s = ttl_s
        self.clock = clock
        self._leases: dict[str, Lease] = {}
        self._on_change = on_change
        self._changed()

    def grant(
        self,
        engine_request_id: str,
        block_ids: list[int],
        num_tokens: int,
        layout: PageLayout,
        backend: str = "grpc",
        backend_info: bytes = b"",
    ) -> PageHandle:
        if engine_request_id in self._leases:
            raise ValueError(f"pages of {engine_request_id!r} are already leased")
        handle = PageHandle(
            self.worker_id,
            self.address,
            engine_request_id,
            tuple(block_ids),
            num_tokens,
            layout,
            self.clock() + self.ttl_s,
            backend,
            backend_info,
        )
        self._leases[engine_request_id] = Lease(engine_request_id, handle)
        self._changed()
        return handle

    def get(self, lease_id: str) -> Lease | None:
        lease = self._leases.get(lease_id)
        if lease is None or lease.handle.lease_expiry < self.clock():
            return None
        return lease

    def take(self, lease_id: str) -> Lease | None:
        """Remove a lease (the puller acked); None if unknown, already taken or expired-and-collected."""
        lease = self._leases.pop(lease_id, None)
        if lease is not None:
            self._changed()
        return lease

    def expired(self) -> list[Lease]:
        """Remove and return every lease past its expiry."""
        now = self.clock()
        gone = [lease for lease in self._leases.values() if lease.handle.lease_expiry < now]
        for lease in gone:
            del self._leases[lease.lease_id]
        if gone:
            self._changed()
        return gone

    def _changed(self) -> None:
        if self._on_change is not None:
            self._on_change(len(self._leases))

    def __len__(self) -> int:
        return len(self._leases)
