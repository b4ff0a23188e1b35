"""The pulling side of a transfer, one small interface for every backend."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Protocol

from common.paged_cache import PagedBuffer, PageLayoutMismatch, PagePayload
from common.transfer.handle import PageHandle


class PullFailed(RuntimeError):
    """The pages could not be read (source gone, lease expired, backend error); the message says which."""


class PagePuller(Protocol):
    name: str

    async def pull(self, handle: PageHandle) -> PagePayload:
        """The handle's pages as bytes, in token order. Raises PullFailed; never returns partial data."""
        ...

    async def pull_into(self, handle: PageHandle, cache: PagedBuffer, block_ids: list[int]) -> None:
        """Write the handle's pages straight into `cache` blocks `block_ids` (reserved by the caller, in token
        order). Raises PullFailed or PageLayoutMismatch. Returns only when nothing writes those blocks any more,
        even when cancelled, so the caller may free them at once."""
        ...

    async def release(self, handle: PageHandle) -> bool:
        """Ack: the source may free the pages. False if the source no longer held them."""
        ...

    async def close(self) -> None: ...


def check_destination(handle: PageHandle, cache: PagedBuffer, block_ids: list[int]) -> None:
    if handle.layout != cache.layout:
        raise PageLayoutMismatch(f"pages have layout {handle.layout}, this cache {cache.layout}")
    if len(block_ids) != len(handle.block_ids):
        raise ValueError(f"{len(handle.block_ids)} pages for {len(block_ids)} destination blocks")


async def finish_even_if_cancelled(future: asyncio.Future):
    """Await work running in a thread; if we are cancelled meanwhile, still wait for it to end, then re-raise."""
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        with contextlib.suppress(BaseException):
            await future
        raise


async def pull_then_write(puller: PagePuller, handle: PageHandle, cache: PagedBuffer, block_ids: list[int]) -> None:
    """`pull_into` for backends that deliver bytes: pull them, then copy them into the blocks (off the event loop)."""
    check_destination(handle, cache, block_ids)
    payload = await puller.pull(handle)
    await finish_even_if_cancelled(asyncio.ensure_future(asyncio.to_thread(cache.write_blocks, block_ids, payload)))
