"""A worker's registration with the toggle, and live role switching (`Worker.SwitchRoles`).

A switch, one at a time:
  1. the worker leaves the registry (routers stop choosing it) and takes no new stage call (a call routed before
     is refused as DOWN: its caller routes around this registration);
  2. what runs here finishes for up to the grace period; decodes still running then are handed back to their
     callers, which go on elsewhere from the tokens they have (as after a preemption); prefills and encodes
     finish, and the pages they leased out are pulled and acked;
  3. on the idle engine the caches and the scheduler are built again for the new roles, with the budgets those
     roles get from the worker's own flags; the weights stay;
  4. it registers again under a new instance (its prefix cache is gone, as after a restart) and serves.
If the engine does not come idle in time, the worker keeps its old roles and registers again as it was.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import uuid
from collections.abc import Callable

import grpc
from grpc_health.v1 import health_pb2

from common.engine.async_engine import AsyncEngine
from common.engine.config import EngineConfig
from common.request import Stage
from common.workers import HEARTBEAT_INTERVAL_S, WorkerInfo, registered_budgets
from epdmesh.v1 import mesh_pb2 as pb
from services import wire
from services.errors import ShuttingDown, SwitchFailed
from services.worker.runtime import WorkerRuntime

log = logging.getLogger(__name__)

SETTLE_S = 30.0  # after the grace: how long prefills, encodes, hand-backs and leased pages may take to end
EARLY_BEAT_S = 0.05  # heartbeats are never closer than this


def services_of(roles: frozenset[Stage]) -> list[str]:
    """The stage services a worker of these roles serves (a prefill-capable worker also serves Decode without KV
    pages: its prefill path for the decoder role)."""
    names = []
    if Stage.ENCODE in roles:
        names.append("epdmesh.v1.Encoder")
    if Stage.PREFILL in roles:
        names.append("epdmesh.v1.Prefiller")
    if roles & {Stage.PREFILL, Stage.DECODE}:
        names.append("epdmesh.v1.Decoder")
    return names


ALL_SERVICES = services_of(frozenset(Stage))


class Registration:
    """What the worker is registered as, and its heartbeat: it registers, beats its load, registers again when the
    toggle forgot it; `leave` takes it out of the registry until `join`."""

    def __init__(self, toggle, info: WorkerInfo, runtime: WorkerRuntime):
        self.toggle = toggle  # None: the worker runs unregistered
        self.info = info
        self.runtime = runtime
        self.registered = False
        self._ever = False  # registered once
        self.away = False
        self._call = asyncio.Lock()  # one registry call at a time: a beat in flight cannot undo a `leave`

    async def run(self) -> None:
        interval, warned = HEARTBEAT_INTERVAL_S, False
        while True:
            try:
                async with self._call:
                    if not self.away:
                        interval = await self._beat(interval)
                warned = False
            except grpc.aio.AioRpcError as e:
                self.registered = False
                if not warned:
                    log.warning("toggle unreachable (%s); retrying", e.code().name)
                    warned = True
            except Exception:  # a bug of ours must not stop the heartbeat: the registry would drop a healthy worker
                log.exception("heartbeat failed; trying again in %.1f s", interval)
            await _until_next_beat(self.runtime.freed, interval)

    async def _beat(self, interval: float) -> float:
        if not self.registered:
            reply = await self.toggle.Register(
                pb.RegisterRequest(info=wire.info_to_pb(self.info), load=wire.load_to_pb(self.runtime.load())),
                timeout=5,
                wait_for_ready=not self._ever,  # the first: a toggle started beside this worker may not answer yet
            )
            self.registered = self._ever = True
            log.info("registered %s (%s) with the toggle", self.info.worker_id, self.info.role_label)
            return reply.heartbeat_interval_s or interval
        beat = pb.HeartbeatRequest(
            worker_id=self.info.worker_id,
            load=wire.load_to_pb(self.runtime.load()),
            admitted_request_ids=self.runtime.take_admitted(),
        )
        self.registered = (await self.toggle.Heartbeat(beat, timeout=5)).known
        return interval

    async def leave(self) -> None:
        """Out of the registry: no router chooses this worker until `join`."""
        async with self._call:
            self.away, self.registered = True, False
            if self.toggle is not None:
                with contextlib.suppress(grpc.aio.AioRpcError):
                    await self.toggle.Deregister(pb.DeregisterRequest(worker_id=self.info.worker_id), timeout=2)

    def join(self, info: WorkerInfo) -> None:
        """Register as `info` at the next beat, which goes out at once."""
        self.info, self.away, self.registered = info, False, False
        self.runtime.freed.set()


async def _until_next_beat(freed: asyncio.Event, interval: float) -> None:
    """The interval, or less when the runtime freed pages while its cache was nearly full (a request waiting in a
    gateway for room goes on sooner) or the worker joins the registry again."""
    await asyncio.sleep(EARLY_BEAT_S)
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(freed.wait(), max(0.0, interval - EARLY_BEAT_S))
    freed.clear()


@dataclasses.dataclass(frozen=True, slots=True)
class Switched:
    info: WorkerInfo
    handed_back: int
    seconds: float


@dataclasses.dataclass(frozen=True, slots=True)
class Drained:
    handed_back: int
    seconds: float
    idle: bool


class RoleSwitch:
    """Switches the worker's roles (module docstring). `configure(roles)`: the engine configuration a worker of
    those roles gets from this worker's flags (its budgets)."""

    def __init__(
        self,
        runtime: WorkerRuntime,
        registration: Registration,
        health,
        configure: Callable[[frozenset[Stage]], EngineConfig],
        settle_s: float = SETTLE_S,
    ):
        self.runtime = runtime
        self.registration = registration
        self.health = health
        self.configure = configure
        self.settle_s = settle_s
        self.draining = False  # set by `drain` for good: no switch runs after it, nor rejoins the registry
        self._one = asyncio.Lock()

    @property
    def engine(self) -> AsyncEngine:
        return self.runtime.engine

    async def switch(self, roles: frozenset[Stage], grace_s: float) -> Switched:
        """ValueError for a role set this worker cannot take; SwitchFailed when its engine did not come idle."""
        if not roles:
            raise ValueError("a worker needs at least one role")
        if grace_s < 0:
            raise ValueError(f"grace_s must be ≥ 0, got {grace_s}")
        if self.draining:
            raise ShuttingDown(f"worker {self.registration.info.worker_id} is draining: it takes no new roles")
        async with self._one:
            if self.draining:  # a drain came first while this switch waited
                raise ShuttingDown(f"worker {self.registration.info.worker_id} is draining: it takes no new roles")
            start = time.monotonic()
            old = self.registration.info
            if roles == old.roles:
                return Switched(old, 0, 0.0)
            config = self.configure(roles)  # the new budgets; a bad role set fails here, before anything changed
            log.info("worker %s switching roles %s -> %s", old.worker_id, old.role_label, role_label(roles))
            self.runtime.accepting = False
            await self.registration.leave()
            await self._set_health(frozenset())
            try:
                handed_back = await self.runtime.quiesce(grace_s, self.settle_s)
                try:
                    await self.engine.reconfigure(config)
                except RuntimeError as e:
                    raise SwitchFailed(f"worker {old.worker_id} keeps its roles {old.role_label}: {e}") from None
                info = dataclasses.replace(
                    old,
                    roles=config.roles,
                    instance=uuid.uuid4().hex[:12],
                    **registered_budgets(self.engine.engine.scheduler.config),
                )
            except BaseException:
                await self._resume(old)
                raise
            if self.runtime.metrics is not None:
                self.runtime.metrics.relabel(info.role_label)
            await self._resume(info)
            seconds = time.monotonic() - start
            log.info(
                "worker %s now %s (%d decodes handed back, %.2f s)",
                old.worker_id,
                info.role_label,
                handed_back,
                seconds,
            )
            return Switched(info, handed_back, seconds)

    async def drain(self, grace_s: float) -> Drained:
        """Leave the mesh for good (a switch up to its hand-back; `Worker.Drain`): out of the registry, no new
        stage call, running decodes handed back with their KV after `grace_s`; the worker stays out until it
        stops. Draining again waits for what is left."""
        if grace_s < 0:
            raise ValueError(f"grace_s must be ≥ 0, got {grace_s}")
        self.draining = True  # a switch waiting for the lock will not run, nor rejoin the registry after
        async with self._one:
            start = time.monotonic()
            log.info("worker %s draining: leaving the registry", self.registration.info.worker_id)
            self.runtime.accepting = False
            await self.registration.leave()
            await self._set_health(frozenset())
            handed_back = await self.runtime.quiesce(grace_s, self.settle_s)
            idle = not self.runtime.in_flight and not len(self.runtime.leases)
            seconds = time.monotonic() - start
            log.info(
                "worker %s drained (%d decodes handed back, %.2f s, idle %s)",
                *(self.registration.info.worker_id, handed_back, seconds, idle),
            )
            return Drained(handed_back, seconds, idle)

    async def _resume(self, info: WorkerInfo) -> None:
        if self.draining:  # a switch under way when the drain came: it stays out
            return
        await self._set_health(info.roles)
        self.runtime.accepting = True
        self.registration.join(info)

    async def _set_health(self, roles: frozenset[Stage]) -> None:
        serving = set(services_of(roles))
        for name in ALL_SERVICES:
            serves = health_pb2.HealthCheckResponse.SERVING if name in serving else None
            await self.health.set(name, serves or health_pb2.HealthCheckResponse.NOT_SERVING)


def role_label(roles: frozenset[Stage]) -> str:
    return "".join(s.name[0] for s in sorted(roles))
