"""In-process transfer backend for unit tests: sources attach to a fabric by address; pulls call them directly."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from common.paged_cache import PagedBuffer, PagePayload
from common.transfer.handle import PageHandle
from common.transfer.puller import PullFailed, pull_then_write

ReadFn = Callable[[str], Awaitable[PagePayload]]  # lease id → pages; KeyError for an unknown lease
ReleaseFn = Callable[[str], Awaitable[bool]]  # lease id → whether the source held it


class FakeFabric:
    """The 'network' of the fake backend: one per test, shared by its sources and pullers."""

    def __init__(self):
        self.sources: dict[str, tuple[ReadFn, ReleaseFn]] = {}
        self.bytes_moved = 0
        self.pulls = 0

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
        try:
            payload = await source[0](handle.lease_id)
        except KeyError as e:
            raise PullFailed(str(e.args[0] if e.args else e)) from None
        self.fabric.bytes_moved += len(payload.data)
        self.fabric.pulls += 1
        return payload

    async def pull_into(self, handle: PageHandle, cache: PagedBuffer, block_ids: list[int]) -> None:
        await pull_then_write(self, handle, cache, block_ids)

    async def release(self, handle: PageHandle) -> bool:
        source = self.fabric.sources.get(handle.address)
        return source is not None and await source[1](handle.lease_id)

    async def close(self) -> None:
        pass
