"""In-process transfer backend for unit tests: sources register by address, pulls read them directly."""

from __future__ import annotations

from collections.abc import Callable

from common.paged_cache import PagePayload
from common.transfer.handle import PageHandle
from common.transfer.puller import PullFailed

# a source: lease id → the pages (None: unknown lease), and lease id → released?
ReadFn = Callable[[str], PagePayload | None]
ReleaseFn = Callable[[str], bool]


class FakeFabric:
    """The 'network' of the fake backend: one per test, shared by its sources and pullers."""

    def __init__(self):
        self.sources: dict[str, tuple[ReadFn, ReleaseFn]] = {}
        self.bytes_moved = 0

    def attach(self, address: str, read: ReadFn, release: ReleaseFn) -> None:
        self.sources[address] = (read, release)

    def detach(self, address: str) -> None:
        self.sources.pop(address, None)


class FakePuller:
    name = "fake"

    def __init__(self, fabric: FakeFabric):
        self.fabric = fabric

    async def pull(self, handle: PageHandle) -> PagePayload:
        source = self.fabric.sources.get(handle.address)
        if source is None:
            raise PullFailed(f"no source at {handle.address}")
        payload = source[0](handle.lease_id)
        if payload is None:
            raise PullFailed(f"source {handle.worker_id} holds no lease {handle.lease_id!r}")
        self.fabric.bytes_moved += len(payload.data)
        return payload

    async def release(self, handle: PageHandle) -> bool:
        source = self.fabric.sources.get(handle.address)
        return source is not None and source[1](handle.lease_id)

    async def close(self) -> None:
        pass
