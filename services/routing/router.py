"""Per-request routing over the Redis registry: what the toggle's `Route` runs, and what a gateway runs in-process.

Life of a route:
  1. the registry snapshot (refreshed from Redis every `refresh_s` off the request path while routes are
     being made, every `idle_refresh_s` after `IDLE_AFTER_S` without one; the last good one is kept when
     Redis is unreachable, so routing degrades instead of failing);
  2. `common.policy.routing.route` (least loaded) or `common.policy.multiplex.route_slo` (the SLO-aware
     multiplexing toggle) picks encoder, prefill path and worker, decoder — given what each worker is predicted to
     hold of the prompt in its prefix cache (`common.policy.affinity`: the prompts this router sent it before);
  3. the request's KV tokens are reserved on the chosen workers in Redis, atomically (a Lua script), so
     several routers — toggles or gateways — cannot overbook a worker; a worker without room is routed around;
  4. the route is remembered as pending and the chosen workers' loads in the local snapshot are bumped, so a
     burst between two refreshes spreads instead of piling onto one worker. A worker's load in Redis is its
     last heartbeat's (every 0.5 s): each refresh adds back the pending routes made after that heartbeat,
     which it cannot include yet. A gateway that routes in-process tells the router when a request's prefill
     is done (`prefilled`: its queued tokens and images are gone) and when it ends (`forget`).
A gateway that routes in-process saves the gRPC hop to the toggle on every request's path to its first token
(the toggle still keeps the registry: workers register and heartbeat there, and it releases reservations).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time

import redis.exceptions

from common.latency import LatencyProfile
from common.policy.affinity import PrefixAffinity
from common.policy.multiplex import MultiplexConfig, route_slo
from common.policy.routing import PrefillPath, RoutePlan, RouteSummary, RoutingConfig, route
from common.request import Stage
from common.telemetry.tracing import Tracing
from common.workers import WorkerSnapshot
from services.failure import Reason
from services.routing.registry import RedisRegistry
from services.routing.reservations import Reservations, needs

MAX_RESERVE_ATTEMPTS = 4  # plans tried when workers have no KV room left
IDLE_AFTER_S = 2.0  # no route for this long: the snapshot is refreshed every idle_refresh_s
PENDING_MAX_S = 30.0  # kept at most this long (with no worker registered, no heartbeat makes it redundant)
AHEAD_WAIT_S = 0.05  # a reservation made ahead waits at most this long for its stage call to be written

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, slots=True)
class SloRouting:
    profile: LatencyProfile
    ttft_ms: float  # default targets for requests that bring none
    tbt_ms: float
    config: MultiplexConfig = MultiplexConfig()


class NoRoute(Exception):
    """No plan for this request, and why: `Reason.NO_ROOM` (workers exist but have no room now: retry later),
    `REFUSED` (admission control: no path meets its SLO), `TOO_LARGE` (no worker could ever hold it) or
    `NO_WORKER` (no live worker set covers it)."""

    def __init__(self, message: str, reason: Reason, full: str | None = None):
        super().__init__(message)
        self.message = message
        self.reason = reason
        self.full = full  # `route_ahead`'s reservation: the planned worker that had no KV room after all


@dataclasses.dataclass(slots=True)
class _Pending:
    routed_at: float  # unix seconds, the clock of the registry's heartbeat timestamps
    plan: RoutePlan
    summary: RouteSummary
    prefilled: bool = False  # its first token came: nothing of it is queued for encode or prefill any more
    sent: dict[str, float] = dataclasses.field(default_factory=dict)  # worker id → when its stage call went out


class Router:
    def __init__(
        self,
        registry: RedisRegistry,
        routing: RoutingConfig = RoutingConfig(),
        refresh_s: float = 0.05,
        tracing: Tracing | None = None,
        slo: SloRouting | None = None,
        reservations: Reservations | None = None,
        reports_delivery: bool = False,
        idle_refresh_s: float = 0.5,
    ):
        """`slo`: route by the SLO-aware multiplexing policy over this latency profile; None: least loaded.
        `reservations`: book each route's KV tokens in Redis so concurrent routers never overbook a worker.
        `reports_delivery`: the caller says (`sent`) when each chosen worker is handed the request, and until
        then the route loads that worker whatever its heartbeats say — a decoder on path ① gets a request
        only after its encode and prefill, most of a TTFT later. Else a worker is taken to have it at once."""
        self.registry = registry
        self.routing = routing
        self.refresh_s = refresh_s
        self.idle_refresh_s = max(idle_refresh_s, refresh_s)
        self._last_route = float("-inf")  # time.monotonic() of the last route asked for
        self._routing = asyncio.Event()  # set by a route: an idle refresher goes back to refresh_s at once
        self.tracing = tracing or Tracing()
        self.slo = slo
        self.reservations = reservations
        self.reports_delivery = reports_delivery
        self.decisions = {path: 0 for path in PrefillPath}
        self._snapshot: list[WorkerSnapshot] = []
        self._snapshot_at = float("-inf")
        self._lock = asyncio.Lock()
        self._pending: dict[str, _Pending] = {}  # by request id: routes made here, until forgotten
        self.affinity = PrefixAffinity()  # what it sent where, for prefix-cache-aware routing
        # by request id, oldest first: when, and the workers its KV is reserved on (until forgotten or expired)
        self._reserved: dict[str, tuple[float, tuple[str, ...]]] = {}
        self._releases: set[asyncio.Task] = set()

    @classmethod
    def over_redis(
        cls,
        client,
        prefix: str,
        routing: RoutingConfig = RoutingConfig(),
        tracing: Tracing | None = None,
        slo: SloRouting | None = None,
        ttl_s: float = 3.0,
        reports_delivery: bool = False,
    ) -> Router:
        """A router over the mesh's registry and reservations under `prefix` in this Redis."""
        return cls(
            RedisRegistry(client, prefix, ttl_s),
            routing,
            tracing=tracing,
            slo=slo,
            reservations=Reservations(client, prefix),
            reports_delivery=reports_delivery,
        )

    def invalidate(self) -> None:
        """The registry changed (a worker came or went): the next read goes to Redis."""
        self._snapshot_at = float("-inf")

    async def workers(self) -> list[WorkerSnapshot]:
        """The registry snapshot: kept fresh by `refresh_forever`; read inline only when it is older than that."""
        if time.monotonic() - self._snapshot_at >= 2 * self.refresh_s:
            await self.refresh()
        return self._snapshot

    async def refresh(self) -> None:
        async with self._lock:
            now = time.monotonic()
            try:
                self._snapshot = self._with_pending(await self.registry.snapshot())
                self.affinity.keep_only({w.info.registration for w in self._snapshot})
            except (redis.exceptions.RedisError, OSError) as e:
                log.warning("registry unreachable (%s); routing on the last snapshot", e)
                self._snapshot = [
                    dataclasses.replace(w, age_s=w.age_s + now - self._snapshot_at) for w in self._snapshot
                ]
            self._snapshot_at = now

    async def refresh_forever(self) -> None:
        """Keep the snapshot fresh off the request path, so a route never waits on Redis for it. With no route
        for `IDLE_AFTER_S`, refresh every `idle_refresh_s` only (an idle toggle or gateway then reads Redis
        2 times a second instead of 20); the first route after that reads the snapshot inline if it is older
        than 2 × `refresh_s` (one Redis round trip), and wakes this loop to `refresh_s` again."""
        while True:
            await self.refresh()
            if time.monotonic() - self._last_route < IDLE_AFTER_S:
                await asyncio.sleep(self.refresh_s)
                continue
            self._routing.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._routing.wait(), self.idle_refresh_s)

    async def route(self, summary: RouteSummary) -> RoutePlan:
        """The request's plan, its KV reserved on the chosen workers; raises NoRoute."""
        self._last_route = time.monotonic()
        self._routing.set()
        workers = await self.workers()
        if not summary.exclude:  # a request routed again waits for room or a worker (it is under way): no 400 then
            _check_fits(workers, summary, self._max_heartbeat_age_s)
        full_workers: set[str] = set()
        plan, full = None, None
        for _ in range(MAX_RESERVE_ATTEMPTS):
            plan = self._plan(workers, summary)
            if plan is None and not full_workers:  # maybe workers registered (elsewhere) since the last refresh
                await self.refresh()
                workers = self._snapshot
                plan = self._plan(workers, summary)
            if plan is None and full_workers:
                break
            if plan is None:
                raise NoRoute(_why_no_route(workers, summary, self._max_heartbeat_age_s), Reason.NO_WORKER)
            amounts = needs(plan, summary, self.routing.reserved_output_tokens)
            try:
                full = (
                    None if self.reservations is None else await self.reservations.reserve(summary.request_id, amounts)
                )
            except asyncio.CancelledError:  # its client left: the script may have run in Redis all the same
                self._reserve_noted(summary.request_id, tuple(amounts))
                self.forget(summary.request_id)
                raise
            if full is None:
                if self.reservations is not None:
                    self._reserve_noted(summary.request_id, tuple(amounts))
                break
            full_workers.add(full)
            summary = dataclasses.replace(summary, exclude=summary.exclude | {full})  # no room there: route around it
        if plan is None or full is not None:
            raise NoRoute("no worker has KV room for this request now (all reserved); retry later", Reason.NO_ROOM)
        self._chosen(plan, summary, workers)
        return plan

    def _chosen(self, plan: RoutePlan, summary: RouteSummary, workers: list[WorkerSnapshot]) -> None:
        """The plan is the request's: its work loads the workers, it is counted, and the route span says so."""
        self._bump(plan, summary)
        self.affinity.chosen(plan, summary)
        self.decisions[plan.path] += 1
        self.tracing.annotate(
            {
                "epdmesh.path": plan.path.value,
                "epdmesh.decoder": plan.decoder.worker_id,
                "epdmesh.prefill": plan.prefill.worker_id,
                "epdmesh.encoder": plan.encoder.worker_id if plan.encoder else None,
                "epdmesh.live_workers": len(workers),
            }
        )

    async def route_ahead(
        self, summary: RouteSummary, after: asyncio.Event | None = None
    ) -> tuple[RoutePlan, asyncio.Future]:
        """The plan at once and its KV reservation under way: the caller sends the first stage's call without
        waiting on Redis, and awaits `reserved` before anything that needs the reservation (the decoder's KV).
        `reserved` gives None, or raises NoRoute with `full` set when a planned worker had no room after all (the
        caller then cancels what it sent and routes again without that worker). Raises NoRoute as `route` does.
        `after`: the reservation's Redis call waits until it is set (the caller's stage call written: the client
        side of the script costs ~0.1 ms of this loop, which the call's message would otherwise wait behind), or
        AHEAD_WAIT_S at most; None: one loop turn."""
        workers = await self.workers()
        if not summary.exclude:
            _check_fits(workers, summary, self._max_heartbeat_age_s)
        plan = self._plan(workers, summary) if self.reservations is not None else None
        if plan is None:  # nothing to overlap, or no plan on this snapshot: route's own refresh and reasons
            reserved = asyncio.get_running_loop().create_future()
            reserved.set_result(None)
            return await self.route(summary), reserved
        self._last_route = time.monotonic()
        self._routing.set()
        amounts = needs(plan, summary, self.routing.reserved_output_tokens)
        self._chosen(plan, summary, workers)
        reserved = asyncio.ensure_future(self._reserve_ahead(summary.request_id, amounts, after))
        return plan, reserved

    async def _reserve_ahead(
        self, request_id: str, amounts: dict[str, tuple[int, int]], after: asyncio.Event | None
    ) -> None:
        try:
            if after is None:
                await asyncio.sleep(0)  # one loop turn: a stage call made next goes out first
            else:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(after.wait(), AHEAD_WAIT_S)
            full = await self.reservations.reserve(request_id, amounts)
        except BaseException:  # cancelled (its client left) or Redis failed: the script may have run all the same
            self._reserve_noted(request_id, tuple(amounts))
            self.forget(request_id)
            raise
        if full is not None:
            self.forget(request_id)  # all or nothing: none was made, and its work no longer loads the workers
            raise NoRoute(
                f"worker {full} has no KV room left for this request (reserved meanwhile)", Reason.NO_ROOM, full=full
            )
        self._reserve_noted(request_id, tuple(amounts))

    @property
    def _max_heartbeat_age_s(self) -> float:
        return self.routing.max_heartbeat_age_s if self.slo is None else self.slo.config.max_heartbeat_age_s

    def _plan(self, workers: list[WorkerSnapshot], summary: RouteSummary) -> RoutePlan | None:
        cache_aware = bool(summary.prefix_hashes) and self.routing.cache_aware
        if cache_aware:
            summary = self.affinity.predicted(workers, summary)
        plan = self._policy_plan(workers, summary)
        if cache_aware and plan is not None and self.affinity.needs_no_encode(plan, summary):
            plan = dataclasses.replace(plan, images_cached=True)
        return plan

    def _policy_plan(self, workers: list[WorkerSnapshot], summary: RouteSummary) -> RoutePlan | None:
        if self.slo is None:
            return route(workers, summary, self.routing)
        s = self.slo
        ttft, tbt = summary.ttft_slo_ms or s.ttft_ms, summary.tbt_slo_ms or s.tbt_ms
        decision = route_slo(workers, summary, ttft, tbt, summary.elapsed_ms, s.profile, s.config)
        self.tracing.annotate(
            {
                "epdmesh.slack_ms": decision.slack_ms,
                "epdmesh.predicted_ttft_ms": decision.predicted_ttft_ms,
                "epdmesh.route_reason": decision.reason,
                "epdmesh.meets_slo": decision.meets_slo,
            }
        )
        if decision.refused:  # else no live worker set serves it: route() says which roles are missing
            raise NoRoute(
                f"no worker can serve this request within its SLO (TTFT {ttft:.0f} ms, TBT {tbt:.0f} ms, "
                f"predicted TTFT {decision.predicted_ttft_ms:.0f} ms); retry later",
                Reason.REFUSED,
            )
        return decision.plan

    def prefilled(self, request_id: str) -> None:
        """The request's first token came: its encode and prefill no longer load the workers it was routed to."""
        if (entry := self._pending.get(request_id)) is not None:
            entry.prefilled = True
        self.affinity.prefill_done(request_id)

    def sent(self, request_id: str, worker_id: str) -> None:
        """The request's stage on worker_id is being called now: a heartbeat from it after this includes it."""
        if (entry := self._pending.get(request_id)) is not None:
            entry.sent.setdefault(worker_id, time.time())

    def _reserve_noted(self, request_id: str, workers: tuple[str, ...]) -> None:
        now = time.time()
        self._reserved[request_id] = (now, workers)
        while (oldest := next(iter(self._reserved.items()), None)) and oldest[1][0] < now - self.reservations.ttl_s:
            del self._reserved[oldest[0]]  # expired in Redis by now (the toggle's router never forgets a route)

    def forget(self, request_id: str) -> None:
        """The request ended (finished, failed or routed again under another id). Its KV reservations end now
        too: a worker ends one when it admits the request, but a request can end before its decoder ever
        sees it (done at its first token, its client gone, its prefill worker failed), and its reservation
        would hold KV room for nothing until it expires."""
        self._pending.pop(request_id, None)
        self.affinity.forget(request_id)
        _, workers = self._reserved.pop(request_id, (0.0, ()))
        if workers and self.reservations is not None:
            task = asyncio.ensure_future(self.reservations.release_request(request_id, workers))
            self._releases.add(task)
            task.add_done_callback(self._released)

    def _released(self, task: asyncio.Task) -> None:
        self._releases.discard(task)
        if not task.cancelled() and task.exception() is not None:  # it expires by itself: nothing is lost
            log.debug("releasing a reservation failed: %s", task.exception())

    async def settle(self) -> None:
        """Wait for the reservations being released (before closing the Redis client)."""
        if self._releases:
            await asyncio.gather(*self._releases, return_exceptions=True)

    def _bump(self, plan: RoutePlan, summary: RouteSummary) -> None:
        """Book the request's work on the chosen workers in the local snapshot, and remember it as pending."""
        entry = _Pending(time.time(), plan, summary)
        if not self.reports_delivery:
            entry.sent = dict.fromkeys(_workers_of(plan), entry.routed_at)
        self._pending[summary.request_id] = entry
        self._snapshot = [_plus(w, [entry]) for w in self._snapshot]

    def _with_pending(self, snapshot: list[WorkerSnapshot]) -> list[WorkerSnapshot]:
        """Each worker's reported load plus the pending routes its last heartbeat cannot include: those not
        handed to it yet, or handed to it after that heartbeat."""
        now = time.time()
        reported = {w.worker_id: now - w.age_s for w in snapshot}  # when each one's last heartbeat was made

        def unreported(e: _Pending, wid: str) -> bool:
            return (sent := e.sent.get(wid)) is None or sent > reported[wid]

        touching: dict[str, list[_Pending]] = {}  # worker id → the pending routes that load it
        for request_id, e in list(self._pending.items()):
            loaded = [wid for wid in _workers_of(e.plan) if wid in reported and unreported(e, wid)]
            if not loaded or e.routed_at <= now - PENDING_MAX_S:  # in every live worker's load already
                del self._pending[request_id]
                continue
            for wid in loaded:
                touching.setdefault(wid, []).append(e)
        return [_plus(w, touching.get(w.worker_id, [])) for w in snapshot]


def _workers_of(plan: RoutePlan) -> set[str]:
    """The workers the plan hands the request to (not its encoder when its images' KV is predicted cached)."""
    encodes = plan.encoder is not None and not plan.images_cached
    return {plan.decoder.worker_id, plan.prefill.worker_id} | ({plan.encoder.worker_id} if encodes else set())


def _plus(w: WorkerSnapshot, pending: list[_Pending]) -> WorkerSnapshot:
    """w with the work of these routes added to its load: queued encode and prefill until their first token,
    the decode tokens they will generate."""
    load, wid = w.load, w.worker_id
    decode_tokens = waiting = prefill_tokens = images = 0
    for e in pending:
        plan, summary = e.plan, e.summary
        if plan.decoder.worker_id == wid:
            decode_tokens += summary.max_tokens
        if e.prefilled:
            continue
        if plan.prefill.worker_id == wid:
            waiting, prefill_tokens = waiting + 1, prefill_tokens + summary.num_prompt_tokens
        if plan.encoder is not None and plan.encoder.worker_id == wid and not plan.images_cached:
            images += summary.num_images
            waiting += plan.prefill.worker_id != wid
    if not (decode_tokens or waiting or images):
        return w
    return dataclasses.replace(
        w,
        load=dataclasses.replace(
            load,
            unfinished_decode_tokens=load.unfinished_decode_tokens + decode_tokens,
            num_waiting=load.num_waiting + waiting,
            queued_prefill_tokens=load.queued_prefill_tokens + prefill_tokens,
            queued_images=load.queued_images + images,
        ),
    )


def largest_decoder_cache(workers: list[WorkerSnapshot], max_age_s: float) -> int:
    """KV tokens the largest live decoder's whole cache holds (0: none known)."""
    return max((w.load.kv_tokens_total for w in workers if w.has(Stage.DECODE) and w.age_s <= max_age_s), default=0)


def _check_fits(workers: list[WorkerSnapshot], summary: RouteSummary, max_age_s: float) -> None:
    """NoRoute(TOO_LARGE) when no live decoder's whole KV cache holds the request's prompt + max_tokens: it could
    wait for room forever (admission reserves the worst case). Workers whose size is unknown let it through."""
    need = summary.num_prompt_tokens + summary.max_tokens
    sizes = [
        w.load.kv_tokens_total
        for w in workers
        if w.has(Stage.DECODE) and w.age_s <= max_age_s and not w.excluded_by(summary.exclude)
    ]
    if sizes and all(0 < size < need for size in sizes):
        raise NoRoute(
            f"this request needs {need} tokens of KV (prompt {summary.num_prompt_tokens} + max_tokens "
            f"{summary.max_tokens}), more than any decoder's whole cache holds ({max(sizes)}); lower "
            "max_tokens",
            Reason.TOO_LARGE,
        )


def _why_no_route(workers: list[WorkerSnapshot], summary: RouteSummary, max_age_s: float) -> str:
    """Which roles are missing, naming only the workers the request could have used (a worker that failed it, or
    whose heartbeats stopped, is registered for a few seconds more: listing its roles as live read as a
    contradiction)."""
    if not workers:
        return "no live workers are registered"
    usable = [w for w in workers if w.age_s <= max_age_s and not w.excluded_by(summary.exclude)]
    need = "an encoder, a prefill and a decode role" if summary.num_images else "a prefill and a decode role"
    why = f"no live worker set covers {need}; "
    why += f"live workers have roles {sorted({w.info.role_label for w in usable})}" if usable else "no worker is live"
    left_out = sorted(w.worker_id for w in workers if w not in usable)
    return why + (f" (left out: {', '.join(left_out)}, silent or failed this request)" if left_out else "")
