"""The `Worker` service every worker mounts: page pulls and acks (source side), its stats, role switches."""

from __future__ import annotations

import asyncio

from epdmesh.v1 import mesh_pb2 as pb
from epdmesh.v1 import mesh_pb2_grpc as pb_grpc
from services import wire
from services.errors import SwitchFailed, grpc_errors
from services.worker.runtime import WorkerRuntime
from services.worker.switch import RoleSwitch

DEFAULT_CHUNK_BYTES = 4 * 2**20
MAX_CHUNK_BYTES = 32 * 2**20


class WorkerServicer(pb_grpc.WorkerServicer):
    def __init__(self, runtime: WorkerRuntime, switch: RoleSwitch | None = None):
        self.runtime = runtime
        self.switch = switch

    @grpc_errors
    async def PullPages(self, request: pb.PullPagesRequest, context):
        """The lease's blocks in token order, each chunk whole blocks (so a puller can place them as they come)."""
        cache, block_ids = self.runtime.leased_blocks(request.lease_id)
        size = min(request.chunk_bytes or DEFAULT_CHUNK_BYTES, MAX_CHUNK_BYTES)
        per_chunk = max(1, size // cache.layout.bytes_per_block)
        for start in range(0, len(block_ids), per_chunk):
            yield pb.PageChunk(data=await asyncio.to_thread(cache.gather_bytes, block_ids[start : start + per_chunk]))

    @grpc_errors
    async def ReleasePages(self, request: pb.ReleasePagesRequest, context) -> pb.ReleasePagesResponse:
        return pb.ReleasePagesResponse(released=await self.runtime.release_lease(request.lease_id))

    @grpc_errors
    async def Stats(self, request: pb.StatsRequest, context) -> pb.WorkerLoad:
        return wire.load_to_pb(self.runtime.load())

    @grpc_errors
    async def SwitchRoles(self, request: pb.SwitchRolesRequest, context) -> pb.SwitchRolesResponse:
        if self.switch is None:
            raise SwitchFailed("this worker cannot switch roles")
        roles = wire.roles_from_pb(request.roles)
        done = await self.switch.switch(roles, request.grace_s)
        return pb.SwitchRolesResponse(
            info=wire.info_to_pb(done.info), handed_back=done.handed_back, seconds=done.seconds
        )

    @grpc_errors
    async def Drain(self, request: pb.DrainRequest, context) -> pb.DrainResponse:
        if self.switch is None:
            raise SwitchFailed("this worker cannot drain")
        done = await self.switch.drain(request.grace_s)
        return pb.DrainResponse(handed_back=done.handed_back, seconds=done.seconds, idle=done.idle)
