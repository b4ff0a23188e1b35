"""The pulling side of a transfer, one small interface for every backend."""

from __future__ import annotations

from typing import Protocol

from common.paged_cache import PagePayload
from common.transfer.handle import PageHandle


class PullFailed(RuntimeError):
    """The pages could not be read (source gone, lease expired, backend error); the message says which."""


class PagePuller(Protocol):
    name: str

    async def pull(self, handle: PageHandle) -> PagePayload:
        """The handle's pages as bytes, in token order. Raises PullFailed; never returns partial data."""
        ...

    async def release(self, handle: PageHandle) -> bool:
        """Ack: the source may free the pages. False if the source no longer held them."""
        ...

    async def close(self) -> None:
        ...
