"""Fallback transfer backend: the source streams a lease's bytes over its gRPC `Worker.PullPages`."""

from __future__ import annotations

import asyncio

import grpc

from common.paged_cache import PagedBuffer, PagePayload
from common.transfer.channels import ChannelPool
from common.transfer.handle import PageHandle
from common.transfer.puller import PullFailed, check_destination, finish_even_if_cancelled
from epdmesh.v1 import mesh_pb2 as pb
from epdmesh.v1 import mesh_pb2_grpc as pb_grpc

DEFAULT_CHUNK_BYTES = 4 * 2**20


class GrpcStreamPuller:
    name = "grpc"

    def __init__(self, channels: ChannelPool, chunk_bytes: int = DEFAULT_CHUNK_BYTES, timeout_s: float = 60.0):
        self.channels = channels
        self.chunk_bytes = chunk_bytes
        self.timeout_s = timeout_s

    async def pull(self, handle: PageHandle) -> PagePayload:
        stub = pb_grpc.WorkerStub(self.channels.get(handle.address))
        buffer = bytearray(handle.num_bytes)
        offset = 0
        try:
            call = stub.PullPages(
                pb.PullPagesRequest(lease_id=handle.lease_id, chunk_bytes=self.chunk_bytes), timeout=self.timeout_s
            )
            async for chunk in call:
                end = offset + len(chunk.data)
                if end > len(buffer):
                    raise PullFailed(f"source {handle.worker_id} sent more than the {len(buffer)} bytes of its handle")
                buffer[offset:end] = chunk.data
                offset = end
        except grpc.aio.AioRpcError as e:
            raise PullFailed(
                f"pulling {handle.lease_id} from {handle.worker_id} at {handle.address}: {e.code().name}: {e.details()}"
            ) from None
        if offset != len(buffer):
            raise PullFailed(f"source {handle.worker_id} sent {offset} of {len(buffer)} bytes")
        return PagePayload(handle.layout, handle.num_tokens, bytes(buffer))

    async def pull_into(self, handle: PageHandle, cache: PagedBuffer, block_ids: list[int]) -> None:
        """Each chunk (whole blocks) goes into its destination blocks as it arrives: one copy, no assembly."""
        check_destination(handle, cache, block_ids)
        stub = pb_grpc.WorkerStub(self.channels.get(handle.address))
        block_bytes, written = cache.layout.bytes_per_block, 0
        try:
            call = stub.PullPages(
                pb.PullPagesRequest(lease_id=handle.lease_id, chunk_bytes=self.chunk_bytes), timeout=self.timeout_s
            )
            async for chunk in call:
                count, rest = divmod(len(chunk.data), block_bytes)
                if rest or written + count > len(block_ids):
                    raise PullFailed(
                        f"source {handle.worker_id} sent a chunk of {len(chunk.data)} B that is not "
                        f"whole blocks of the {len(block_ids) - written} still expected"
                    )
                target = block_ids[written : written + count]
                await finish_even_if_cancelled(
                    asyncio.ensure_future(asyncio.to_thread(cache.write_raw, target, chunk.data))
                )
                written += count
        except grpc.aio.AioRpcError as e:
            raise PullFailed(
                f"pulling {handle.lease_id} from {handle.worker_id} at {handle.address}: {e.code().name}: {e.details()}"
            ) from None
        if written != len(block_ids):
            raise PullFailed(f"source {handle.worker_id} sent {written} of {len(block_ids)} blocks")

    async def release(self, handle: PageHandle) -> bool:
        return await release_over_grpc(self.channels, handle)

    async def close(self) -> None:
        pass


async def release_over_grpc(channels: ChannelPool, handle: PageHandle, timeout_s: float = 10.0) -> bool:
    """The ack every backend uses: `Worker.ReleasePages` on the source. False if it is gone or forgot the lease."""
    stub = pb_grpc.WorkerStub(channels.get(handle.address))
    try:
        reply = await stub.ReleasePages(pb.ReleasePagesRequest(lease_id=handle.lease_id), timeout=timeout_s)
    except grpc.aio.AioRpcError:
        return False
    return reply.released
