"""What the gateway says about the mesh: `/health` from the registry, per-worker statistics for `/stats`."""

from __future__ import annotations

import grpc

from common.request import Stage
from common.transfer.channels import ChannelPool
from epdmesh.v1 import mesh_pb2 as pb
from epdmesh.v1 import mesh_pb2_grpc as pb_grpc
from services import wire
from services.gateway.mesh.route_client import HEALTHY_HEARTBEAT_AGE_S, RouteClient


class MeshStatus:
    """The mesh as the toggle's registry and the workers' own statistics show it."""

    def __init__(self, routes: RouteClient, channels: ChannelPool):
        self.routes = routes
        self.channels = channels

    @property
    def toggle(self) -> pb_grpc.ToggleStub:
        return self.routes.toggle

    async def worker_stats(self) -> dict:
        reply = await self.toggle.ListWorkers(pb.ListWorkersRequest(), timeout=5)
        stats = {}
        for entry in reply.workers:
            info = wire.info_from_pb(entry.info)
            registered = {
                "roles": info.role_label,
                "address": info.address,
                "pid": info.pid,
                "heartbeat_age_s": entry.age_s,
                "token_budget": info.token_budget,
                "image_budget": info.image_budget,
                "join_first": info.join_first,
            }
            try:
                load = await pb_grpc.WorkerStub(self.channels.get(info.address)).Stats(pb.StatsRequest(), timeout=5)
            except grpc.aio.AioRpcError as e:
                stats[info.worker_id] = {**registered, "error": e.code().name}
                continue
            stats[info.worker_id] = {
                **registered,
                "metrics_port": info.metrics_port,
                **{f.name: getattr(load, f.name) for f in pb.WorkerLoad.DESCRIPTOR.fields},
            }
        return stats

    async def health(self) -> dict:
        """ok when the toggle answers and workers with recent heartbeats cover every role; degraded (still a 200:
        text is served) when only the encode role is missing; else an error naming what is missing."""
        try:
            reply = await self.toggle.ListWorkers(pb.ListWorkersRequest(), timeout=2)
        except grpc.aio.AioRpcError as e:
            return {"status": "error", "reason": f"toggle unreachable: {e.code().name}"}
        live = [w for w in reply.workers if w.age_s <= HEALTHY_HEARTBEAT_AGE_S]
        roles = {stage for w in live for stage in wire.info_from_pb(w.info).roles}
        body = {"workers": len(live), "silent_workers": len(reply.workers) - len(live)}
        missing = [stage.name.lower() for stage in (Stage.PREFILL, Stage.DECODE) if stage not in roles]
        if missing:
            return {"status": "error", "reason": f"no live worker has the {' or '.join(missing)} role", **body}
        if Stage.ENCODE not in roles:
            return {
                "status": "degraded",
                "reason": "no live worker has the encode role: requests with images fail",
                **body,
            }
        return {"status": "ok", **body}
