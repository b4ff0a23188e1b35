"""The planner's task in the gateway (`epdmesh serve --planner`): every interval, what the gateway saw (arrivals,
finished requests and their SLO outcomes) goes into the policy (`common/policy/planner.py`) with the registry's
workers, and the switches it decides go to the workers (`Worker.SwitchRoles`). Decisions are logged, traced (span
`planner.decide`, one `planner.switch` per switch), kept for `/stats` and counted on `/metrics`
(`epdmesh:planner_decisions_total{action}`, `epdmesh:role_switches_total{from,to}`).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import AsyncIterator

import grpc

from common.engine.outputs import RequestOutput
from common.latency.model import LatencyProfile
from common.policy import planner
from common.request import Request
from common.telemetry.metrics import GatewayMetrics, slo_outcome
from common.telemetry.tracing import Tracing, set_attributes
from epdmesh.v1 import mesh_pb2 as pb
from epdmesh.v1 import mesh_pb2_grpc as pb_grpc
from services import wire

log = logging.getLogger(__name__)

RECENT = 64  # decisions /stats shows
SWITCH_TIMEOUT_S = 120.0


class PlannerTask:
    def __init__(
        self,
        status,
        channels,
        profile: LatencyProfile,
        ttft_ms: float,
        tbt_ms: float,
        config: planner.PlannerConfig = planner.PlannerConfig(),
        metrics: GatewayMetrics | None = None,
        tracing: Tracing | None = None,
    ):
        """`status`: the mesh's registry view (`MeshStatus`: its toggle lists the workers); `channels` to them."""
        self.status = status
        self.channels = channels
        self.ttft_ms, self.tbt_ms = ttft_ms, tbt_ms
        self.config = config
        self.metrics = metrics
        self.tracing = tracing or Tracing()
        self.window = planner.Window()
        self.planner = planner.Planner(profile, ttft_ms, tbt_ms, config)
        self.recent: collections.deque[dict] = collections.deque(maxlen=RECENT)
        self.switches = 0
        self.failed_switches = 0
        self._switching: set[asyncio.Task] = set()
        self._addresses: dict[str, str] = {}  # worker id → address, as the last plan saw the registry
        self._task: asyncio.Task | None = None

    # ----- what the gateway saw -----

    async def observe(self, request: Request, outputs: AsyncIterator[RequestOutput]) -> AsyncIterator[RequestOutput]:
        """The request's outputs, passed through; its arrival, work and SLO outcome go into the window."""
        max_tokens = request.sampling.max_tokens
        self.window.arrived(request.num_prompt_tokens, len(request.images), max_tokens)
        first_at = last_at = None
        gaps: list[float] = []
        final = None
        async for out in outputs:
            if out.new_token_ids:
                now = time.monotonic()
                if first_at is None:
                    first_at = now
                else:
                    gaps.append(now - last_at)
                last_at = now
            final = out
            yield out
        if final is None or first_at is None:
            return
        ttft = first_at - request.arrival_time
        outcome = slo_outcome(ttft, gaps, self.ttft_ms / 1e3, self.tbt_ms / 1e3)
        self.window.done(
            final.num_prompt_tokens, final.num_cached_tokens, len(final.output_token_ids), max_tokens, outcome
        )

    # ----- the loop -----

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.ensure_future(self._run())

    async def stop(self) -> None:
        for task in [self._task, *self._switching]:
            if task is not None:
                task.cancel()

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.config.interval_s)
            try:
                await self.step()
            except Exception:  # a bug of ours, or the toggle away: plan again next interval
                log.exception("the planner's step failed; planning again in %.0f s", self.config.interval_s)

    async def step(self) -> planner.Decision:
        interval = self.window.take()
        decision = self.planner.step(interval, None if self._switching else await self._workers())
        self._record(interval, decision)
        for switch in decision.switches:
            task = asyncio.ensure_future(self._switch(switch))
            self._switching.add(task)
            task.add_done_callback(self._switching.discard)
        return decision

    async def _workers(self) -> list[planner.PoolWorker]:
        reply = await self.status.toggle.ListWorkers(pb.ListWorkersRequest(), timeout=5)
        workers, self._addresses = [], {}
        for entry in reply.workers:
            info, load = wire.info_from_pb(entry.info), wire.load_from_pb(entry.load)
            self._addresses[info.worker_id] = info.address
            workers.append(planner.PoolWorker.of(info, load))
        return workers

    def _record(self, interval: planner.Interval, decision: planner.Decision) -> None:
        f = self.planner.forecast
        entry = {
            "at_unix_s": round(time.time(), 3),
            "arrivals": len(interval.arrivals),
            "finished": len(interval.finished),
            "rate": round(len(interval.arrivals) / interval.seconds, 3) if interval.seconds else 0.0,
            "forecast_rate": round(f.rate, 3) if f is not None else None,
            **decision.as_dict(),
        }
        self.recent.append(entry)
        if self.metrics is not None:
            self.metrics.planner_decisions.labels(self.metrics.model, decision.action).inc()
        with self.tracing.span("planner.decide") as span:
            set_attributes(
                span,
                {
                    "epdmesh.planner.action": decision.action,
                    "epdmesh.planner.reason": decision.reason,
                    "epdmesh.planner.current": str(decision.current),
                    "epdmesh.planner.target": str(decision.target),
                    "epdmesh.planner.forecast_rate": f.rate if f is not None else None,
                },
            )
        level = logging.INFO if decision.action == "switch" else logging.DEBUG
        log.log(
            level,
            "planner: %s (%s); pools %s, target %s",
            decision.action,
            decision.reason,
            decision.current,
            decision.target,
        )

    async def _switch(self, switch: planner.Switch) -> None:
        before, after = planner.label(switch.before), planner.label(switch.after)
        address = self._addresses[switch.worker_id]
        request = pb.SwitchRolesRequest(roles=wire.roles_to_pb(switch.after), grace_s=self.config.grace_s)
        with self.tracing.span(
            "planner.switch", {"epdmesh.worker_id": switch.worker_id, "epdmesh.from": before, "epdmesh.to": after}
        ):
            try:
                reply = await pb_grpc.WorkerStub(self.channels.get(address)).SwitchRoles(
                    request, timeout=SWITCH_TIMEOUT_S
                )
            except grpc.aio.AioRpcError as e:
                self.failed_switches += 1
                log.warning("planner: %s could not switch %s -> %s: %s", switch.worker_id, before, after, e.details())
                return
        self.switches += 1
        if self.metrics is not None:
            self.metrics.role_switches.labels(self.metrics.model, before, after).inc()
        log.info(
            "planner: %s switched %s -> %s in %.2f s (%d decodes handed back)",
            switch.worker_id,
            before,
            after,
            reply.seconds,
            reply.handed_back,
        )

    def as_dict(self) -> dict:
        f = self.planner.forecast
        return {
            "interval_s": self.config.interval_s,
            "forecast": None
            if f is None
            else {
                "rate": round(f.rate, 3),
                "prompt_tokens": round(f.load.prompt_tokens, 1),
                "images": round(f.load.images, 3),
                "output_tokens": round(f.load.output_tokens, 1),
                "ttft_miss": round(f.ttft_miss, 3),
                "tbt_miss": round(f.tbt_miss, 3),
                "cached": round(f.cached, 3),
                "used": round(f.used, 3),
            },
            "switches": self.switches,
            "failed_switches": self.failed_switches,
            "switching": len(self._switching),
            "recent": list(self.recent),
        }
