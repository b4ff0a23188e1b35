"""The gateway's planner in a simulated mesh (`epdmesh serve --planner`), and the role switches it orders, run as a
worker runs them.

The planner (`common.policy.planner.Planner`) steps every interval over what arrived and finished since its last
step and the registry's workers. A switch runs `services/worker/switch.py`'s steps: the worker leaves the registry
(a stage sent to it is routed elsewhere), its decodes finish for the grace period and the rest are handed back with
their KV between two iterations (they go on elsewhere from those pages), and once idle — within the settle time, else
it keeps its roles — its engine takes the new roles' configuration and it registers again."""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Callable

from common.engine.config import EngineConfig
from common.policy import planner
from common.request import Request, Stage
from common.telemetry.metrics import slo_outcome
from common.workers import registered_budgets
from services.worker.switch import SETTLE_S
from sim.worker import SimWorker

POLL_S = 0.02  # how often a switching worker is looked at again (simulated seconds) while it drains or settles


@dataclasses.dataclass(slots=True)
class Planning:
    """The gateway's planner in a simulated mesh: the policy, each role set's engine configuration, and the
    interval and grace in simulated seconds."""

    planner: planner.Planner
    configure: Callable[[frozenset[Stage]], EngineConfig]
    interval_s: float
    grace_s: float
    ttft_s: float
    tbt_s: float


class RoleSwitches:
    """The planner's steps on a mesh's simulated clock, and the switches they order, with what they did: `decisions`
    (simulated time, what the planner decided), `switches` (done at, worker, roles before, after, decodes handed on),
    `handed_with_kv` (decodes handed back with their KV; those not decoding yet go without)."""

    def __init__(self, mesh, planning: Planning, phase: float = 0.0):
        """`mesh`: the `sim.mesh.SimMesh` it plans for (which imports this module). `phase` φ in [0, 1): the first
        step comes φ of an interval early (see `SimMesh`)."""
        self.mesh, self.planning = mesh, planning
        self.settle_s = SETTLE_S / mesh.control_scale
        self.window = planner.Window(lambda: mesh.loop.now)
        self.switching: set[str] = set()
        self.decisions: list[tuple[float, planner.Decision]] = []
        self.switches: list[tuple[float, str, str, str, int]] = []
        self.handed_with_kv = 0
        mesh.loop.after(planning.interval_s * (1 - phase), self._plan)

    def finished(self, prompt: Request, timeline) -> None:
        """A request ended with its answer whole (`timeline`: its `sim.mesh.Timeline`): the planner's window counts
        it, with its SLO outcome."""
        times = timeline.token_times
        gaps = [b - a for a, b in zip(times, times[1:])]
        outcome = slo_outcome(times[0] - timeline.arrival, gaps, self.planning.ttft_s, self.planning.tbt_s)
        self.window.done(
            prompt.num_prompt_tokens, timeline.cached_tokens, len(times), prompt.sampling.max_tokens, outcome
        )

    def _plan(self) -> None:
        mesh = self.mesh
        interval = self.window.take()
        workers = None
        if not self.switching:
            workers = [planner.PoolWorker.of(s.info, s.load) for s in mesh.registry()]
        decision = self.planning.planner.step(interval, workers)
        self.decisions.append((mesh.loop.now, decision))
        for switch in decision.switches:
            self._switch(mesh.workers[switch.worker_id], switch.after)
        mesh.loop.after(self.planning.interval_s, self._plan)

    def _switch(self, worker: SimWorker, roles: frozenset[Stage]) -> None:
        """Out of the registry, the grace for its decodes, the rest handed back between two iterations, then — once
        idle — the new configuration and a new registration."""
        worker.away = True
        self.switching.add(worker.worker_id)
        self._draining(worker, roles, self.mesh.loop.now + self.planning.grace_s, [0])

    def _draining(self, worker: SimWorker, roles, deadline: float, handed: list[int]) -> None:
        """`handed`: a one-element counter of the decodes handed back, shared with the hand-back run later."""
        loop = self.mesh.loop
        decoding = any(r.last_stage == Stage.DECODE for r in worker.engine.requests.values())
        if decoding and loop.now < deadline:
            loop.after(POLL_S, self._draining, worker, roles, deadline, handed)
            return
        if decoding:

            def hand_back() -> None:
                outputs = worker.engine.hand_back_decodes()
                handed[0] += len(outputs)
                self.handed_with_kv += sum(out.pages is not None for out in outputs)
                self.mesh.delivered(worker, outputs)

            worker.between = hand_back
            worker.kick()
        self._settling(worker, roles, loop.now + self.settle_s, handed)

    def _settling(self, worker: SimWorker, roles, deadline: float, handed: list[int]) -> None:
        mesh = self.mesh
        pages = worker.engine.pages
        busy = worker.between is not None or worker.engine.requests or pages.importing or pages.handed_off
        if busy and mesh.loop.now < deadline:
            mesh.loop.after(POLL_S, self._settling, worker, roles, deadline, handed)
            return
        before = worker.info.roles
        if not busy:  # (else it keeps its roles and registers again as it was, as a worker does)
            worker.reconfigure(self.planning.configure(roles))
            worker.info = dataclasses.replace(
                worker.info,
                roles=worker.engine.config.roles,
                instance=uuid.uuid4().hex[:12],
                **registered_budgets(worker.engine.scheduler.config),
            )
        worker.away = False
        self.switching.discard(worker.worker_id)
        mesh.reports[worker.worker_id] = (worker.load(), mesh.loop.now)
        self.switches.append(
            (mesh.loop.now, worker.worker_id, planner.label(before), planner.label(worker.info.roles), handed[0])
        )
        worker.kick()
