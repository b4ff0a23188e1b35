"""A mesh on simulated time: the workers of a topology (`sim/worker.py`), the router's own decisions
(`services/routing/book.py`: the policy, cache-aware prediction, the routes not yet in a report) over the loads the
workers report every heartbeat, and each request driven through its stages as the gateway drives it
(`services/gateway/mesh/stages.py`): an awaited encode beside the next stage, a prefill worker that finds the
images' KV in its prefix cache starting without their pages, pages pulled into blocks reserved for them (waiting
for room as a worker does), a request a decoder hands back going on elsewhere as a continuation.

With a planner (`epdmesh serve --planner`), the gateway's planner runs too, and its role switches run as a worker
runs them (`sim/switch.py`); a decode a switching decoder hands back with its KV goes on elsewhere from those pages.

The gateway's KV reservations run too (`services/routing/reservations.py`'s `Ledger`, the Redis script's rule in
memory, through the router's own steps `RouteBook.steps`): a route books the KV tokens of the worker that runs the
prompt against what it last reported free (on path ① the decoder books its own room as the pages come, in its
engine), and the booking ends when the worker's next heartbeat reports the request admitted, when the request ends
or routes again, or at its expiry. A request no worker has room
for waits at the gateway for room, polling (`route_client.reroute`), and one whose pages found no room on their
worker within the worker's wait is routed again the same way (after some tokens, as a continuation that prefills
again); one routed again after a worker left waits for a worker too. A refusal (SLO admission, too large, no worker
for a new request) fails it, as the gateway's 4xx/503 would.

What it leaves out, and so does not predict: the host's own costs (HTTP, gRPC, tokenizing, image decoding — zero
here), the reservation made ahead of its Redis round trip for a text prompt (`Router.route_ahead`: routed as any
other here), and failed workers."""

from __future__ import annotations

import collections
import dataclasses
import uuid

from common.engine.errors import NoRoomForPages, RequestRejected
from common.engine.outputs import RequestOutput
from common.policy.affinity import request_fields
from common.policy.first_token import held, hold_until, released_at
from common.policy.routing import PrefillPath, RoutePlan, RouteSummary
from common.request import ImageInput, Request, SamplingParams, Stage
from common.workers import HEARTBEAT_INTERVAL_S, WorkerSnapshot
from services.gateway.mesh.failover import MAX_HAND_BACKS
from services.gateway.mesh.migration import continuation, resumed
from services.gateway.mesh.route_client import FAILOVER_POLL_S, wait_for
from services.routing.book import REFRESH, NoRoute, RouteBook
from services.routing.reservations import TTL_S, Ledger
from services.routing.router import REFRESH_S
from services.worker.runtime import IMPORT_POLL_S, IMPORT_WAIT_S
from sim.events import Loop
from sim.switch import Planning, RoleSwitches
from sim.worker import SimWorker


@dataclasses.dataclass(frozen=True, slots=True)
class Prompt:
    """A request as the gateway hands it to the router and the workers: token ids, its images (digests), its
    route summary's prefix fields."""

    token_ids: list[int]
    image_digests: list[str]
    max_tokens: int
    prefix: dict  # `common.policy.affinity.summary_fields`


@dataclasses.dataclass(slots=True)
class Timeline:
    """What a client would have seen of one request, in simulated seconds."""

    arrival: float
    token_times: list[float] = dataclasses.field(default_factory=list)
    num_prompt_tokens: int = 0
    cached_tokens: int = 0
    path: PrefillPath | None = None
    error: str = ""
    done: bool = False


@dataclasses.dataclass(eq=False, slots=True)
class _Import:
    """Handed-over pages waiting for room at `dest` (the source holds them under `source_id`)."""

    flight: _Flight
    source: SimWorker
    dest: SimWorker
    request: Request
    kind: str
    since: float
    source_id: str


@dataclasses.dataclass(slots=True)
class _Flight:
    """One request under way: the engine request of its current route, where its stages run, what it emitted."""

    original: Request
    timeline: Timeline
    prompt: Prompt
    plan: RoutePlan | None = None
    current: Request | None = None  # the original, or a continuation after a hand-back
    emitted: list[int] = dataclasses.field(default_factory=list)
    waiting_images: tuple[SimWorker, Request] | None = None  # a stage sent with its images pending on the encoder
    hand_backs: int = 0  # in a row without a token in between
    progress: int = 0  # tokens sent when the last hand-back came
    attempts: int = 0  # routes after the first: each continuation's id carries the number
    resume: tuple[SimWorker, str] | None = None  # (worker, request id) holding its KV, handed back by a switch
    reserved: tuple[str, ...] = ()  # the workers its current route's KV is reserved on
    cached: int = 0  # prompt tokens its current route's prefill found in the prefix cache
    prefix: dict = dataclasses.field(default_factory=dict)  # the current request's route summary prefix fields
    exclude: frozenset[str] = frozenset()  # registrations of the workers that left the mesh under it
    held: tuple[float, int] | None = None  # its first output held (`--first-token-hold`): until when, its tokens


class SimMesh:
    def __init__(
        self,
        loop: Loop,
        workers: list[SimWorker],
        book: RouteBook,
        model,
        control_scale: float = 1.0,
        planning: Planning | None = None,
        planner_phase: float = 0.0,
        hold_ttft_s: float | None = None,
    ):
        """`control_scale` K: heartbeats, the router's snapshot refresh and the planner's interval, grace and settle
        time K× shorter in the hardware's time than a deployment's, as on an emulated mesh run at time ×K (whose
        host keeps its own pace while the model's time slows K-fold); 1: a deployment's. `planner_phase` φ in [0, 1):
        the planner's first step comes φ of an interval early (a gateway's planner steps on its own clock, started
        before the load: where its steps fall against the load's shifts is chance). `hold_ttft_s`: the TTFT target
        when handed-over first tokens are held as the gateway holds them (`--first-token-hold`), or None."""
        self.loop, self.book, self.model = loop, book, model  # the checkpoint's config (`LlavaConfig`)
        self.hold_ttft_s = hold_ttft_s
        self.heartbeat_s, self.refresh_s = HEARTBEAT_INTERVAL_S / control_scale, REFRESH_S / control_scale
        # the gateway's and the workers' waits, on the host's clock: K× shorter in the hardware's time too
        self.poll_s, self.import_wait_s = FAILOVER_POLL_S / control_scale, IMPORT_WAIT_S / control_scale
        self.import_poll_s = IMPORT_POLL_S / control_scale
        # by worker id: handed-over pages waiting for room there, first come first served (`runtime.ImportQueue`)
        self.imports: dict[str, collections.deque[_Import]] = {w.worker_id: collections.deque() for w in workers}
        self._import_timers: set[str] = set()
        self.control_scale = control_scale
        self.reservations = Ledger(TTL_S / control_scale)
        self.admitted: dict[str, set[str]] = {w.worker_id: set() for w in workers}  # since its last heartbeat
        self.waited = 0  # polls of requests waiting at the gateway for room or a worker
        self.rerouted = 0  # routes again after a worker had no room for the pages after all
        self.resumed = 0  # requests a switching decoder handed back with their KV that went on from those pages
        self.workers = {w.worker_id: w for w in workers}
        for w in workers:
            w.deliver = self.delivered
        self.reports: dict[str, tuple[object, float]] = {}
        self._snapshot_at = float("-inf")
        self.flights: dict[str, _Flight] = {}  # by the engine request id of the current route
        self.timelines: list[Timeline] = []
        self.unfinished = 0
        for i, w in enumerate(workers):  # heartbeats spread over the interval, as independent processes' are
            self.reports[w.worker_id] = (w.load(), 0.0)
            loop.at(self.heartbeat_s * (i + 1) / len(workers), self._beat, w)
        self.planner = None if planning is None else RoleSwitches(self, planning, planner_phase)

    # ----- the registry -----

    def _beat(self, w: SimWorker) -> None:
        self.reports[w.worker_id] = (w.load(), self.loop.now)
        admitted, self.admitted[w.worker_id] = self.admitted[w.worker_id], set()
        self.reservations.release(w.worker_id, admitted)  # (the toggle's Heartbeat)
        self.loop.after(self.heartbeat_s, self._beat, w)

    def registry(self) -> list[WorkerSnapshot]:
        now = self.loop.now
        return [
            WorkerSnapshot(w.info, load, now - at)
            for w in self.workers.values()
            if not w.away
            for load, at in [self.reports[w.worker_id]]
        ]

    # ----- requests -----

    def submit(self, at: float, prompt: Prompt) -> Timeline:
        timeline = Timeline(at, num_prompt_tokens=len(prompt.token_ids))
        self.timelines.append(timeline)
        self.unfinished += 1
        self.loop.at(at, self._arrive, timeline, prompt)
        return timeline

    def _arrive(self, timeline: Timeline, prompt: Prompt) -> None:
        if self.planner is not None:
            self.planner.window.arrived(len(prompt.token_ids), len(prompt.image_digests), prompt.max_tokens)
        images = [ImageInput(None, self.model.image_tokens_per_image, digest) for digest in prompt.image_digests]
        sampling = SamplingParams(max_tokens=prompt.max_tokens, temperature=0.0, ignore_eos=True)
        request = Request(
            f"chatcmpl-{uuid.uuid4().hex[:16]}", prompt.token_ids, sampling, images, arrival_time=self.loop.now
        )
        self._route(_Flight(request, timeline, prompt, current=request, prefix=prompt.prefix), frozenset())

    def _route(self, flight: _Flight, exclude: frozenset[str], again: bool = False, since: float | None = None):
        """`again`: an attempt after the first (a worker had no room, left, or handed the request back), which also
        waits for a worker of a role none is left of. `since`: when its waiting began."""
        now, request = self.loop.now, flight.current
        since = now if since is None else since
        if now - self._snapshot_at >= self.refresh_s:
            self._refresh()
        summary = RouteSummary(
            request.request_id,
            request.num_prompt_tokens,
            len(request.images),
            request.sampling.max_tokens,
            exclude,
            elapsed_ms=(now - flight.timeline.arrival) * 1e3,
            **flight.prefix,
        )
        steps = self.book.steps(summary, self.book.routing.reserved_output_tokens)
        reply = None
        try:
            while True:
                ask = steps.send(reply)
                if ask == REFRESH:
                    self._refresh()
                    reply = None
                else:
                    reply = self.reservations.reserve(request.request_id, ask, now)
        except StopIteration as done:
            plan, summary, amounts = done.value
        except NoRoute as e:  # waited out as `route_client.reroute` does, else the client's error
            wait_s = wait_for(e.reason, again)
            if wait_s is not None and now < since + wait_s / self.control_scale:
                self.waited += 1
                self.loop.after(self.poll_s, self._route, flight, exclude, again, since)
                return
            self._end(flight, e.message)
            return
        self.book.chosen(plan, summary, now)
        flight.plan, flight.waiting_images, flight.reserved, flight.cached = plan, None, tuple(amounts), 0
        flight.timeline.path = flight.timeline.path or plan.path
        self.flights[request.request_id] = flight
        self._drive(flight)

    def _refresh(self) -> None:
        self.book.refreshed(self.registry(), self.loop.now)
        self._snapshot_at = self.loop.now

    def _sent(self, request: Request, worker: SimWorker) -> None:
        """The stage call reaches the worker: the router's record, and the admission its next heartbeat reports."""
        self.book.sent(request.request_id, worker.worker_id, self.loop.now)
        self.admitted[worker.worker_id].add(request.request_id)

    def _forget(self, flight: _Flight) -> None:
        """The current route is over (the request ended, or routes again): the router forgets it, its reservations
        end."""
        request_id = flight.current.request_id
        self.flights.pop(request_id, None)
        self.book.forget(request_id)
        self.reservations.release_request(request_id, flight.reserved)
        flight.reserved = ()

    def _drive(self, flight: _Flight) -> None:
        """The stages of `flight.plan`: the encode (elsewhere: awaited beside the next stage), then the prefill on
        its worker (dedicated: a prefill worker, handing the KV over; else the decoder, which decodes on)."""
        plan, request = flight.plan, flight.current
        if flight.resume is not None:  # on from the KV pages a switching decoder handed back
            (source, source_id), flight.resume = flight.resume, None
            self.resumed += 1
            decoder = self.workers[plan.decoder.worker_id]
            staged = _staged(request, Stage.DECODE, Stage.DECODE, self.loop.now, flight.emitted[-1:])
            self._sent(request, decoder)
            self._pull(flight, source, decoder, staged, "kv", self.loop.now, source_id)
            return
        dedicated = plan.path == PrefillPath.DEDICATED
        target = self.workers[(plan.prefill if dedicated else plan.decoder).worker_id]
        last = Stage.PREFILL if dedicated else Stage.DECODE
        separate = bool(request.images) and plan.encoder.worker_id != target.worker_id
        first = Stage.ENCODE if request.images and not separate else Stage.PREFILL  # it encodes them itself
        staged = _staged(request, first, last, self.loop.now)
        self._sent(request, target)
        if not separate:
            self._add(flight, target, staged)
            return
        if target.engine.config.enable_prefix_caching and self._pinned(flight, target, staged):
            return
        flight.waiting_images = (target, staged)
        self._encode(flight)

    def _pinned(self, flight: _Flight, target: SimWorker, staged: Request) -> bool:
        """The worker's prefix cache holds the images' KV: it starts at once, without their pages."""
        if _refuses(target, staged):
            return False  # (the encode goes on; the stage is refused when its pages come)
        try:
            if not target.engine.pages.pin_cached(staged):
                return False
        except RequestRejected as e:
            self._end(flight, str(e))
            return True
        target.add(staged, preloaded=True)
        return True

    def _encode(self, flight: _Flight) -> None:
        encoder = self.workers[flight.plan.encoder.worker_id]
        request = _staged(flight.current, Stage.ENCODE, Stage.ENCODE, self.loop.now)
        self._sent(flight.current, encoder)
        self._add(flight, encoder, request)

    def _add(self, flight: _Flight, worker: SimWorker, request: Request) -> None:
        if _refuses(worker, request):
            self._refused(flight, worker)
            return
        try:
            worker.add(request)
        except RequestRejected as e:
            self._end(flight, str(e))

    # ----- what the workers give -----

    def delivered(self, worker: SimWorker, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            flight = self.flights.get(_route_id(out.request_id))
            if flight is None:  # it ended meanwhile: its pages go back
                worker.engine.pages.release(out.request_id)
                continue
            if out.handed_back:
                self._handed_back(flight, worker, out)
            elif out.handed_off and out.pages[0] == "image":
                self._encoded(flight, worker)
            else:
                self._tokens(flight, worker, out)
        self._poke_imports(worker)  # (a request that ended here freed its blocks)

    def _encoded(self, flight: _Flight, encoder: SimWorker) -> None:
        if flight.waiting_images is None:  # the stage started without them (its cache held their KV)
            encoder.engine.pages.release(_stage_id(flight.current.request_id, Stage.ENCODE))
            encoder.kick()
            return
        target, staged = flight.waiting_images
        flight.waiting_images = None
        source_id = _stage_id(flight.current.request_id, Stage.ENCODE)
        self._pull(flight, encoder, target, staged, "image", self.loop.now, source_id)

    def _tokens(self, flight: _Flight, worker: SimWorker, out: RequestOutput) -> None:
        now, timeline = self.loop.now, flight.timeline
        if flight.held is not None:
            self._release(flight, now)
        elif not flight.emitted and self.hold_ttft_s is not None and held(flight.plan.path, out.finished):
            flight.held = (hold_until(timeline.arrival, self.hold_ttft_s), len(out.new_token_ids))  # as `failover`
        timeline.token_times += [now] * len(out.new_token_ids)
        flight.emitted += out.new_token_ids
        # the usage's cached tokens: the last route's, of the prompt (`stages.py`, `migration.rebased`)
        flight.cached = max(flight.cached, out.num_cached_tokens)
        timeline.cached_tokens = min(flight.cached, flight.original.num_prompt_tokens)
        self.book.prefilled(flight.current.request_id)  # its first token came: nothing of it is queued to prefill
        if out.finished:
            self._end(flight)
            if self.planner is not None:
                self.planner.finished(flight.original, timeline)
        elif out.handed_off:  # the prefill worker's first token: the KV goes to the decoder
            decoder = self.workers[flight.plan.decoder.worker_id]
            request = _staged(flight.current, Stage.DECODE, Stage.DECODE, now, out.output_token_ids)
            self._sent(request, decoder)
            self._pull(flight, worker, decoder, request, "kv", now, out.request_id)

    def _pull(self, flight, source: SimWorker, dest: SimWorker, request: Request, kind: str, since: float, source_id):
        """Blocks reserved at `dest` for the pages — at once when none wait before them there and there is room, else
        in turn, as a worker's `ImportQueue` gives them — then the transfer's time, then the request goes on there;
        the source frees its copy (held under its engine id there, `source_id`)."""
        waiting = _Import(flight, source, dest, request, kind, since, source_id)
        queue = self.imports[dest.worker_id]
        if not queue and self._import(waiting):
            return
        queue.append(waiting)
        self.loop.after(since + self.import_wait_s - self.loop.now, self._import_expired, waiting)
        self._arm_imports(dest)

    def _import(self, w: _Import) -> bool:
        """Try `w`'s blocks; False while there is no room (it waits)."""
        if _refuses(w.dest, w.request):  # it left the mesh, or came back with other roles: the pages are let go of
            w.source.engine.pages.release(w.source_id)
            w.source.kick()
            self._refused(w.flight, w.dest)
            return True
        try:
            _, blocks, tokens = w.dest.engine.pages.reserve_import(w.request)
        except NoRoomForPages:
            return False
        except RequestRejected as e:
            w.source.engine.pages.release(w.source_id)
            self._end(w.flight, str(e))
            return True
        self.loop.after(
            w.dest.engine.transfer_delay_s(w.kind, tokens),
            self._pulled,
            w.source,
            w.dest,
            w.request,
            blocks,
            w.source_id,
        )
        return True

    def _poke_imports(self, dest: SimWorker) -> None:
        """Blocks may have been freed at `dest`: the first in line tries, and each after it while they fit."""
        queue = self.imports[dest.worker_id]
        while queue and self._import(queue[0]):
            queue.popleft()

    def _arm_imports(self, dest: SimWorker) -> None:
        if dest.worker_id not in self._import_timers:
            self._import_timers.add(dest.worker_id)
            self.loop.after(self.import_poll_s, self._import_tick, dest)

    def _import_tick(self, dest: SimWorker) -> None:
        self._import_timers.discard(dest.worker_id)
        self._poke_imports(dest)
        if self.imports[dest.worker_id]:
            self._arm_imports(dest)

    def _import_expired(self, w: _Import) -> None:
        """Its wait is over without room (NoRoomForPages): the gateway routes it again."""
        queue = self.imports[w.dest.worker_id]
        if w in queue:
            queue.remove(w)
            w.source.engine.pages.release(w.source_id)
            w.source.kick()
            self._no_room(w.flight)

    def _pulled(self, source: SimWorker, dest: SimWorker, request: Request, blocks: list[int], source_id: str) -> None:
        pages = source.engine.pages
        kind, held, tokens = pages.handoff_pages(source_id)
        dest.engine.pages.cache(kind).write_blocks(blocks, pages.cache(kind).read_blocks(held, tokens))
        pages.release(source_id)
        source.kick()
        self._poke_imports(source)
        dest.add(request, preloaded=True)

    def _refused(self, flight: _Flight, worker: SimWorker) -> None:
        """A stage sent to a worker that left the mesh (a switch): routed around it, the tokens sent kept, not
        counted against the request (`failover.Attempts`: away)."""
        flight.exclude |= {worker.info.registration}
        self._again(flight)

    def _no_room(self, flight: _Flight) -> None:
        """The pages found no room on their worker within its wait (NoRoomForPages): not the worker's failure; the
        request routes again, waiting for room (`failover.Attempts.failed`)."""
        self.rerouted += 1
        self._again(flight)

    def _again(self, flight: _Flight) -> None:
        """The next attempt: the request again, or after some tokens its continuation, prefilled on a new route."""
        self._forget(flight)
        if flight.emitted:
            flight.attempts += 1
            self._go_on_as(flight, continuation(flight.original, flight.emitted, flight.attempts))
        self._route(flight, flight.exclude, again=True)

    def _go_on_as(self, flight: _Flight, request: Request) -> None:
        """The request goes on as `request` (a continuation), routed with its own prefix fields, made once for all its
        attempts as the gateway makes them (`Prompts.prefix_of`): back where the cache holds its prompt."""
        flight.current, flight.prefix = request, request_fields(request, self.model)

    def _handed_back(self, flight: _Flight, decoder: SimWorker, out: RequestOutput) -> None:
        """Preempted where it cannot be recomputed, or its decoder switches roles: it goes on (the gateway's
        migration) from the KV pages handed back with it when there are some (`migration.resumed`), else as a
        continuation that prefills again. Not the decoder's failure: routed anywhere with room, that decoder too (a
        switching one is out of the registry meanwhile); only hand-backs without a token in between count
        (`failover.Attempts.handed_back`)."""
        self._forget(flight)
        flight.hand_backs = 1 if len(flight.emitted) > flight.progress else flight.hand_backs + 1
        flight.progress = len(flight.emitted)
        if flight.hand_backs > MAX_HAND_BACKS:
            if out.pages is not None:
                decoder.engine.pages.release(out.request_id)
            self._end(flight, "handed back too often")
            return
        flight.attempts += 1
        if out.pages is not None and flight.emitted:
            flight.resume = (decoder, out.request_id)
            self._go_on_as(flight, resumed(flight.original, flight.emitted, flight.attempts))
        else:
            self._go_on_as(flight, continuation(flight.original, flight.emitted, flight.attempts))
        self._route(flight, flight.exclude, again=True)

    def _release(self, flight: _Flight, now: float) -> None:
        """The held first output goes out: with the output that came `now`, or at the hold's end."""
        (until, n), times = flight.held, flight.timeline.token_times
        flight.held = None
        times[:n] = [released_at(times[0], now, until)] * n

    def _end(self, flight: _Flight, error: str = "") -> None:
        if flight.held is not None:
            self._release(flight, self.loop.now)
        if flight.timeline.done:
            return
        flight.timeline.done, flight.timeline.error = True, error
        if flight.current is not None:
            self._forget(flight)
        self.unfinished -= 1


def _refuses(worker: SimWorker, request: Request) -> bool:
    """The worker refuses the stage as AWAY: it is switching roles, or no longer holds one the stage needs (a route
    chosen before its switch)."""
    needs = {stage for stage in Stage if request.first_stage <= stage <= request.last_stage}
    return worker.away or not needs <= worker.info.roles


def _stage_id(request_id: str, last: Stage) -> str:
    """The engine request id of a stage on its worker, as the stage's servicer names it (`X@encode`, `X@prefill`,
    `X@decode`): two stages of one request on one worker (its encode beside its decode) stay apart."""
    return f"{request_id}@{last.name.lower()}"


def _route_id(engine_request_id: str) -> str:
    return engine_request_id.split("@", 1)[0]


def _staged(request: Request, first: Stage, last: Stage, now: float, output: list[int] = ()) -> Request:
    """The engine request one stage of `request` runs as on its worker (a fresh one per worker, as a stage call's
    spec makes it there: nothing of another worker's blocks), arriving there `now` (simulated time)."""
    return Request(
        _stage_id(request.request_id, last),
        request.prompt_token_ids,
        request.sampling,
        request.images,
        first_stage=first,
        last_stage=last,
        num_continued_tokens=request.num_continued_tokens,
        cache_salt=request.cache_salt,
        output_token_ids=list(output),
        arrival_time=now,
    )
