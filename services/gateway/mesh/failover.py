"""A request's attempts: route, drive the stages, and when a worker fails the request, go on elsewhere.

1. each attempt routes (the first may have been routed already, while the prompt was being built) and drives the
   route's stages (`stages.Stages`);
2. a worker that fails the request (down, draining, or its pages' source died) is routed around: the request
   starts again on another route — after some tokens went out, as a continuation that prefills prompt + those
   tokens (`migration`), so the client sees no duplicates;
3. a worker that had no room after all is not a failure: the request routes again, waiting for room;
4. a decoder that preempted the request and could not recompute it (its KV cache ran out; its images came as
   pages) hands it back: it goes on the same way, on any route with room (that decoder too);
5. a decoder that switches roles hands its running requests back with their KV pages: each goes on on another
   decoder from those pages, nothing prefilled again (`migration.resumed`);
6. with `--first-token-hold`, the first token of a request handed over from its prefill worker goes out with its
   second, at most until 90% of its TTFT target (`common.policy.first_token`); the route's bookkeeping (its
   prefill's end, the prediction's error) counts the token when it came.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable

from common.engine.outputs import RequestOutput
from common.policy.first_token import held, hold_until
from common.policy.routing import RouteSummary
from common.request import Request
from common.telemetry.metrics import GatewayMetrics
from common.telemetry.tracing import set_attributes
from services.gateway.errors import ApiError
from services.gateway.mesh.migration import continuation, rebased, resumed
from services.gateway.mesh.outcome import HandedBack, StageError
from services.gateway.mesh.prompt import Prompts
from services.gateway.mesh.route_client import Route, RouteClient
from services.gateway.mesh.route_stats import RouteStats
from services.gateway.mesh.stages import Stages

log = logging.getLogger(__name__)

MAX_ATTEMPTS = 3  # routes tried per request when workers fail it
MAX_AWAY = 16  # workers routed to that had left the mesh on purpose (draining, switching roles): each is excluded
MAX_HAND_BACKS = 8  # hand-backs of a request in a row without a token in between (not failures: preemptions)


class Attempts:
    """Counts how a request's attempts ended, and decides whether it goes on."""

    def __init__(self, request_id: str):
        self.request_id = request_id
        self.number = 0
        self.failures = 0
        self.hand_backs = 0  # in a row without progress
        self.away = 0  # routes to workers that had left the mesh (not failures)
        self.progress = 0  # tokens sent when the last hand-back came
        self.exclude: set[str] = set()  # registrations of the workers that failed it

    def handed_back(self, back: HandedBack, emitted: int) -> None:
        self.hand_backs = 1 if emitted > self.progress else self.hand_backs + 1  # only those without progress count
        self.progress = emitted
        if self.hand_backs > MAX_HAND_BACKS:
            raise ApiError(
                503,
                f"the decoders preempted this request {self.hand_backs} times without a token in "
                "between: their KV caches are full; retry later",
                headers={"Retry-After": "1"},
            )
        log.info(
            "request %s: decoder %s preempted it after %d tokens and handed it back; going on elsewhere",
            self.request_id,
            back.worker_id,
            emitted,
        )

    def failed(self, error: StageError, emitted: int) -> None:
        """Route around the worker to blame, or raise the client's error when there is none or no attempt is left."""
        if error.no_room:  # no room on the worker after all: not its failure; the next route waits for room
            log.debug("request %s: %s; routing it again when there is room", self.request_id, error.message)
            return
        if error.away and error.blame is not None and self.away < MAX_AWAY:  # not its failure: route around it
            self.away += 1
            self.exclude.add(error.blame)
            log.info("request %s: %s; routing around it (%d tokens kept)", self.request_id, error.message, emitted)
            return
        self.failures += 1
        if error.blame is None or self.failures == MAX_ATTEMPTS:
            raise error.api_error() from None
        self.exclude.add(error.blame)
        log.warning(
            "request %s: %s; routing around worker %s (attempt %d, %d tokens kept)",
            self.request_id,
            error.message,
            error.blame,
            self.number + 1,
            emitted,
        )


class Failover:
    def __init__(
        self,
        routes: RouteClient,
        stages: Stages,
        stats: RouteStats,
        prompts: Prompts,
        metrics: GatewayMetrics | None = None,
        hold_ttft_ms: float | None = None,
    ):
        """`hold_ttft_ms`: the default TTFT target when handed-over first tokens are held (`--first-token-hold`);
        None: never held."""
        self.hold_ttft_ms = hold_ttft_ms
        self.routes = routes
        self.stages = stages
        self.stats = stats
        self.prompts = prompts  # a continuation's prefix for routing, and its text joined to what went out before
        self.metrics = metrics

    def outputs(
        self,
        request: Request,
        span=None,
        slo: tuple[float | None, float | None] = (None, None),
        route: Route | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """The request's outputs, going on elsewhere when a worker fails it. `route`: the first attempt's, when it
        was asked for already. Tokens already produced are never produced twice."""
        hold = _Hold()
        stream = self._attempts(request, span, slo, route, hold)
        return stream if self.hold_ttft_ms is None else held_first(stream, hold, self._held)

    async def _attempts(
        self, request: Request, span, slo: tuple[float | None, float | None], route: Route | None, hold: _Hold
    ) -> AsyncIterator[RequestOutput]:
        emitted: list[int] = []
        attempts = Attempts(request.request_id)
        back: HandedBack | None = None  # how the last attempt's decoder handed the request back
        while True:
            attempts.number += 1
            current, before, resume = self._next(request, emitted, back, attempts.number)
            if route is None or attempts.number > 1:
                route = await self._route(current, request.arrival_time, slo, attempts, span)
            plan = route.plan
            set_attributes(
                span,
                {
                    "epdmesh.path": plan.path.value,
                    "epdmesh.decoder": plan.decoder.worker_id,
                    "epdmesh.prefill": plan.prefill.worker_id,
                    "epdmesh.attempts": attempts.number,
                    "epdmesh.encoder": plan.encoder.worker_id if plan.encoder is not None else None,
                },
            )
            if resume is not None:
                stream = self.stages.resume(current, route, emitted[-1], resume.kv, resume.source, span)
            else:
                stream = self.stages.drive(current, route, span)
            back, first = None, True
            try:
                async for out in stream:
                    if out.new_token_ids or out.finished:
                        if first:
                            route.prefilled()  # its prefill no longer loads the worker
                            first = False
                        if not emitted:
                            self.stats.first_token(route.plan, request.arrival_time, request.request_id)
                            if self._holds(plan, out):
                                hold.until = hold_until(request.arrival_time, (slo[0] or self.hold_ttft_ms) / 1e3)
                        emitted.extend(out.new_token_ids)
                        yield rebased(
                            out, request.request_id, before, self.prompts.detokenize, self.prompts.eos_token_ids
                        )
                return
            except HandedBack as handed:
                back = handed
                attempts.handed_back(handed, len(emitted))
                self._count("hand_backs")
            except StageError as error:
                attempts.failed(error, len(emitted))
                if not error.no_room and not error.away:
                    self.stats.retries += 1
                    self._count("retries")
            finally:
                await stream.aclose()
                route.end()

    def _next(
        self, request: Request, emitted: list[int], back: HandedBack | None, attempt: int
    ) -> tuple[Request, list[int], HandedBack | None]:
        """The attempt's request, the tokens sent before its own, and the hand-back it resumes from (if any): on
        from the KV pages a decoder handed back, only the last token decoded again; else the request, or after some
        tokens its continuation, prefilled."""
        resume = self._resumable(back, request, emitted)
        if resume is not None:
            return resumed(request, emitted, attempt), emitted[:-1], resume
        return (continuation(request, emitted, attempt) if emitted else request), list(emitted), None

    def _resumable(self, back: HandedBack | None, request: Request, emitted: list[int]) -> HandedBack | None:
        """`back`, when its KV pages can carry the request on: they hold its prompt and every token sent but the
        last. Pages that do not are let go of at once."""
        if back is None or back.kv is None:
            return None
        if emitted and back.kv.num_tokens == request.num_prompt_tokens + len(emitted) - 1:
            return back
        log.warning(
            "request %s: the %d tokens of KV handed back by %s do not match the %d sent; prefilling again",
            request.request_id,
            back.kv.num_tokens,
            back.worker_id,
            len(emitted),
        )
        self.stages.release(back.kv)
        return None

    async def _route(
        self, current: Request, arrival: float, slo: tuple[float | None, float | None], attempts: Attempts, span
    ) -> Route:
        prefix = self.prompts.prefix_of(current)

        def summary_of() -> RouteSummary:
            return RouteSummary(
                current.request_id,
                current.num_prompt_tokens,
                len(current.images),
                current.sampling.max_tokens,
                frozenset(attempts.exclude),
                *slo,
                elapsed_ms=(time.monotonic() - arrival) * 1e3,
                **prefix,
            )

        try:
            if attempts.number > 1:
                route = await self.routes.reroute(summary_of, span, attempts.number)
            else:
                try:  # a text prompt: its first stage call goes out while Redis reserves
                    route = await self.routes.route(summary_of(), span, attempts.number, ahead=True)
                except StageError as e:
                    if not e.no_room:
                        raise
                    # every worker is full: it waits for one with room, as a queued request
                    route = await self.routes.reroute(summary_of, span, attempts.number, wait_for_worker=False)
        except StageError as e:
            raise e.api_error() from None
        return route

    def _holds(self, plan, first: RequestOutput) -> bool:
        """Whether the request's first output is held: handed over from its prefill worker, and not its last."""
        return self.hold_ttft_ms is not None and held(plan.path, first.finished)

    def _held(self, seconds: float) -> None:
        if self.metrics is not None:
            self.metrics.first_token_hold.labels(self.metrics.model).observe(seconds)

    def _count(self, counter: str) -> None:
        if self.metrics is not None:
            getattr(self.metrics, counter).labels(self.metrics.model).inc()


class _Hold:
    """Until when the stream's first output is held (`time.monotonic()`); None: sent at once. Set by the time
    that output comes."""

    __slots__ = ("until",)

    def __init__(self):
        self.until: float | None = None


async def held_first(
    stream: AsyncIterator[RequestOutput], hold: _Hold, held: Callable[[float], None] = lambda seconds: None
) -> AsyncIterator[RequestOutput]:
    """`stream`, its first output sent with the second or at `hold.until`, whichever comes first (`held(seconds)`:
    how long it was held). What the stream raises meanwhile comes after the first output, as it would have without
    the hold."""
    second = None
    try:
        first = await anext(stream, None)
        if first is None:
            return
        came = time.monotonic()
        wait = hold.until - came if hold.until is not None else 0.0
        if wait > 0:
            second = asyncio.ensure_future(anext(stream, None))
            await asyncio.wait((second,), timeout=wait)
            held(time.monotonic() - came)
        yield first
        if second is not None:
            out, second = await second, None
            if out is None:
                return
            yield out
        async for out in stream:
            yield out
    finally:
        if second is not None:  # the client left while it was held: the rest of the request ends now
            second.cancel()
            await asyncio.gather(second, return_exceptions=True)
        await stream.aclose()
