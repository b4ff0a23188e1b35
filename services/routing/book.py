"""What a router decides and remembers, without I/O: the plan for a request over a registry snapshot, and the routes
it made that the workers' last reports cannot include yet. `Router` runs it over Redis (the registry, the KV
reservations) on the wall clock; the simulator (`sim/`) runs the very same object on simulated time.

Every method that needs the time takes it (`now`: seconds on the clock of the registry's heartbeat timestamps).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Generator

from common.latency import LatencyProfile
from common.policy.affinity import PrefixAffinity
from common.policy.multiplex import MultiplexConfig, route_slo
from common.policy.routing import PrefillPath, RoutePlan, RouteSummary, RoutingConfig, route
from common.request import Stage
from common.telemetry.tracing import Tracing
from common.workers import WorkerSnapshot
from services.failure import Reason
from services.routing.reservations import needs

PENDING_MAX_S = 30.0  # kept at most this long (with no worker registered, no heartbeat makes it redundant)
MAX_RESERVE_ATTEMPTS = 4  # plans tried when workers have no KV room left
REFRESH = "refresh"  # what `RouteBook.steps` asks for when no plan covers the request: a fresh registry read


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
class Pending:
    routed_at: float
    plan: RoutePlan
    summary: RouteSummary
    prefilled: bool = False  # its first token came: nothing of it is queued for encode or prefill any more
    sent: dict[str, float] = dataclasses.field(default_factory=dict)  # worker id → when its stage call went out


class RouteBook:
    def __init__(
        self,
        routing: RoutingConfig = RoutingConfig(),
        slo: SloRouting | None = None,
        tracing: Tracing | None = None,
        reports_delivery: bool = False,
    ):
        """`slo`: route by the SLO-aware multiplexing policy over this latency profile; None: least loaded.
        `reports_delivery`: the caller says (`sent`) when each chosen worker is handed the request, and until
        then the route loads that worker whatever its heartbeats say — a decoder on path ① gets a request
        only after its encode and prefill, most of a TTFT later. Else a worker is taken to have it at once."""
        self.routing = routing
        self.slo = slo
        self.tracing = tracing or Tracing()
        self.reports_delivery = reports_delivery
        self.decisions = {path: 0 for path in PrefillPath}
        self.snapshot: list[WorkerSnapshot] = []  # the registry's, plus the routes made since (`refreshed`)
        self.pending: dict[str, Pending] = {}  # by request id: routes made here, until forgotten
        self.affinity = PrefixAffinity()  # what it sent where, for prefix-cache-aware routing

    def refreshed(self, registry: list[WorkerSnapshot], now: float) -> None:
        """A new registry snapshot: each worker's reported load plus the routes made here that its last report
        cannot include (see `_with_pending`)."""
        self.snapshot = self._with_pending(registry, now)
        self.affinity.keep_only({w.info.registration for w in self.snapshot})

    @property
    def max_heartbeat_age_s(self) -> float:
        return self.routing.max_heartbeat_age_s if self.slo is None else self.slo.config.max_heartbeat_age_s

    def check_fits(self, summary: RouteSummary) -> None:
        """NoRoute(TOO_LARGE) for a request no live decoder could ever hold (see `check_fits`)."""
        if not summary.exclude:  # a request routed again waits for room or a worker (it is under way): no 400 then
            check_fits(self.snapshot, summary, self.max_heartbeat_age_s)

    def plan(self, summary: RouteSummary) -> RoutePlan | None:
        """The policy's plan over the snapshot (None: no live worker set covers it); NoRoute(REFUSED) when
        admission control turns it down."""
        workers = self.snapshot
        cache_aware = bool(summary.prefix_hashes) and self.routing.cache_aware
        if cache_aware:
            summary = self.affinity.predicted(workers, summary)
        plan = self.policy_plan(workers, summary)
        if cache_aware and plan is not None and self.affinity.needs_no_encode(plan, summary):
            plan = dataclasses.replace(plan, images_cached=True)
        return plan

    def steps(
        self, summary: RouteSummary, output_tokens: int, reserving: bool = True
    ) -> Generator[str | dict[str, tuple[int, int]], str | None, tuple[RoutePlan, RouteSummary, dict | None]]:
        """A route's decisions without its I/O (`Router.route` runs them over Redis; the simulator over its own
        reservations). Yields `REFRESH` when no plan covers the request on this snapshot and none was refused for
        room yet (workers may have registered since: the caller refreshes the book, sends None), and with
        `reserving` each plan's KV amounts (`reservations.needs`: worker id → (tokens, reported free)); the caller
        reserves them on every worker or none and sends back the worker that had no room (None: reserved), which
        the next plan routes around, `MAX_RESERVE_ATTEMPTS` plans at most. Returns the plan, the summary it was
        made for and the amounts reserved (None without `reserving`) — the caller then records it (`chosen`) — or
        raises NoRoute: TOO_LARGE, REFUSED, NO_WORKER, or NO_ROOM when no plan found room."""
        self.check_fits(summary)
        full_workers: set[str] = set()
        plan, full, amounts = None, None, None
        for _ in range(MAX_RESERVE_ATTEMPTS):
            plan = self.plan(summary)
            if plan is None and not full_workers:
                yield REFRESH
                plan = self.plan(summary)
            if plan is None and full_workers:
                break
            if plan is None:
                raise NoRoute(self.why_no_route(summary), Reason.NO_WORKER)
            amounts = needs(plan, summary, output_tokens) if reserving else None
            full = None if amounts is None else (yield amounts)
            if full is None:
                break
            full_workers.add(full)
            summary = dataclasses.replace(summary, exclude=summary.exclude | {full})  # no room there: route around it
        if plan is None or full is not None:
            raise NoRoute("no worker has KV room for this request now (all reserved); retry later", Reason.NO_ROOM)
        return plan, summary, amounts

    def policy_plan(self, workers: list[WorkerSnapshot], summary: RouteSummary) -> RoutePlan | None:
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
        if decision.refused:  # else no live worker set serves it: `why_no_route` says which roles are missing
            raise NoRoute(
                f"no worker can serve this request within its SLO (TTFT {ttft:.0f} ms, TBT {tbt:.0f} ms, "
                f"predicted TTFT {decision.predicted_ttft_ms:.0f} ms); retry later",
                Reason.REFUSED,
            )
        return decision.plan

    def why_no_route(self, summary: RouteSummary) -> str:
        return why_no_route(self.snapshot, summary, self.max_heartbeat_age_s)

    def chosen(self, plan: RoutePlan, summary: RouteSummary, now: float) -> None:
        """The plan is the request's: its work loads the workers in the snapshot (and stays pending until their
        reports include it), it is counted, and the route span says so."""
        entry = Pending(now, plan, summary)
        if not self.reports_delivery:
            entry.sent = dict.fromkeys(workers_of(plan), now)
        self.pending[summary.request_id] = entry
        self.snapshot = [_plus(w, [entry]) for w in self.snapshot]
        self.affinity.chosen(plan, summary)
        self.decisions[plan.path] += 1
        self.tracing.annotate(
            {
                "epdmesh.path": plan.path.value,
                "epdmesh.decoder": plan.decoder.worker_id,
                "epdmesh.prefill": plan.prefill.worker_id,
                "epdmesh.encoder": plan.encoder.worker_id if plan.encoder else None,
                "epdmesh.live_workers": len(self.snapshot),
            }
        )

    def prefilled(self, request_id: str) -> None:
        """The request's first token came: its encode and prefill no longer load the workers it was routed to."""
        if (entry := self.pending.get(request_id)) is not None:
            entry.prefilled = True
        self.affinity.prefill_done(request_id)

    def sent(self, request_id: str, worker_id: str, now: float) -> None:
        """The request's stage on worker_id is being called now: a report from it after this includes it."""
        if (entry := self.pending.get(request_id)) is not None:
            entry.sent.setdefault(worker_id, now)

    def forget(self, request_id: str) -> None:
        """The request ended (finished, failed or routed again under another id)."""
        self.pending.pop(request_id, None)
        self.affinity.forget(request_id)

    def _with_pending(self, snapshot: list[WorkerSnapshot], now: float) -> list[WorkerSnapshot]:
        """Each worker's reported load plus the pending routes its last report cannot include: those not
        handed to it yet, or handed to it after that report."""
        reported = {w.worker_id: now - w.age_s for w in snapshot}  # when each one's last report was made

        def unreported(e: Pending, wid: str) -> bool:
            return (sent := e.sent.get(wid)) is None or sent > reported[wid]

        touching: dict[str, list[Pending]] = {}  # worker id → the pending routes that load it
        for request_id, e in list(self.pending.items()):
            loaded = [wid for wid in workers_of(e.plan) if wid in reported and unreported(e, wid)]
            if not loaded or e.routed_at <= now - PENDING_MAX_S:  # in every live worker's load already
                del self.pending[request_id]
                continue
            for wid in loaded:
                touching.setdefault(wid, []).append(e)
        return [_plus(w, touching.get(w.worker_id, [])) for w in snapshot]


def workers_of(plan: RoutePlan) -> set[str]:
    """The workers the plan hands the request to (not its encoder when its images' KV is predicted cached)."""
    encodes = plan.encoder is not None and not plan.images_cached
    return {plan.decoder.worker_id, plan.prefill.worker_id} | ({plan.encoder.worker_id} if encodes else set())


def _plus(w: WorkerSnapshot, pending: list[Pending]) -> WorkerSnapshot:
    """w with the work of these routes added to its load: queued encode and prefill until their first token,
    the decode tokens they will generate."""
    load, wid = w.load, w.worker_id
    decode_tokens = waiting = prefill_tokens = images = 0
    long_token_budget = load.long_token_budget
    for e in pending:
        plan, summary = e.plan, e.summary
        if plan.decoder.worker_id == wid:
            decode_tokens += summary.max_tokens
            if plan.prefill.worker_id == wid:  # a prompt sent to run beside its decodes: one long step per report
                long_token_budget = 0
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
            long_token_budget=long_token_budget,
        ),
    )


def largest_decoder_cache(workers: list[WorkerSnapshot], max_age_s: float) -> int:
    """KV tokens the largest live decoder's whole cache holds (0: none known)."""
    return max((w.load.kv_tokens_total for w in workers if w.has(Stage.DECODE) and w.age_s <= max_age_s), default=0)


def check_fits(workers: list[WorkerSnapshot], summary: RouteSummary, max_age_s: float) -> None:
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


def why_no_route(workers: list[WorkerSnapshot], summary: RouteSummary, max_age_s: float) -> str:
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
