"""The gateway's way through the mesh: route, then drive the stages by handles.

Life of a request here:
  1. the chat is turned into prompt tokens and pixels (the checkpoint's own processor), and
     checked against the model's length limit — nothing is routed for a request that cannot run;
  2. route → plan (encoder, prefill path + worker, decoder): in-process (`services.toggle.router`, one Redis
     round trip for the reservation) when this gateway was given the registry, else the toggle's `Route` rpc;
  3. (the stages, `stages.py`) images on a worker other than the prefill one: `Encode` there (awaited), and at once the next
     stage's call with the images pending on that encoder: that stage gets the image handle from the
     encoder (`AwaitEncode`), not through here;
  4. dedicated path: `Prefill` (pixels or pending images) → first token + KV handle, then
     `Decode(KV handle)`; colocated / multiplexed: `Decode` on the decoder, which prefills itself;
  5. the decode stream is the request's output. Pages never pass through here; a handle this
     gateway got but could not pass on (client gone) is released at its source.
  6. a worker that fails the request (down, draining, or its pages' source died) is routed around:
     the request starts again on another route — after some tokens went out, as a continuation that
     prefills prompt + those tokens (request migration), so the client sees no duplicates. A decoder
     that preempted the request and could not recompute it (its KV cache ran out; its images came as
     pages) hands it back: it goes on the same way, on any route with room (that decoder too), waiting
     for one while every decoder is full.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import contextvars
import logging
import time
from collections.abc import AsyncIterator

import grpc

from common.engine.outputs import RequestOutput
from common.model.processor import ChatProcessor, image_digests
from common.policy.affinity import summary_fields
from common.policy.routing import PrefillPath, RouteSummary
from common.request import Request
from common.transfer.channels import ChannelPool
from epdmesh.v1 import mesh_pb2 as pb
from epdmesh.v1 import mesh_pb2_grpc as pb_grpc
from services import wire
from common.telemetry.metrics import GatewayMetrics
from common.telemetry.tracing import Tracing, set_attributes
from services.gateway.migration import continuation, rebased
from services.gateway.status import HEALTHY_HEARTBEAT_AGE_S, MeshStatus
from services.gateway.stage_errors import StageFailed, api_error_from_rpc
from services.gateway.protocol import ApiError, ChatRequest, check_length
from services.gateway.responses import Prepended
from services.gateway.stages import HandedBack, Stages, consume
from services.stage_calls.client import StageCalls
from services.toggle.router import REFUSED_KEY, NoRoute, Router, largest_decoder_cache

log = logging.getLogger(__name__)


MAX_ATTEMPTS = 3  # routes tried per request when workers fail it
MAX_HAND_BACKS = 8  # hand-backs of a request in a row without a token in between (not failures: preemptions)
# a request whose worker died waits this long for one to take its place (`epdmesh serve` restarts a dead worker,
# which registers within seconds) before it fails; new requests are not held: they get a 503 at once
FAILOVER_WAIT_S = 30.0
# a stream under way (tokens sent) that no decoder has room for waits this long — as a queued request would; a
# decoder that handed it back made room for an older one that may run for minutes
ROOM_WAIT_S = 300.0
FAILOVER_POLL_S = 0.25
RECENT_PREDICTIONS = 1024  # routed requests whose predicted and actual TTFT /stats shows
CAPACITY_REFRESH_S = 5.0


class MeshBackend(MeshStatus):
    def __init__(self, processor: ChatProcessor, toggle_address: str, max_model_len: int,
                 metrics: GatewayMetrics | None = None, tracing: Tracing | None = None, router: Router | None = None,
                 stage_calls: str = "stream"):
        """`router`: route in this process over the registry in Redis; None: ask the toggle (a gRPC hop).
        `stage_calls`: Encode and Prefill on a stream kept open to each worker, or as unary rpcs (services/stage_calls)."""
        self.processor = processor
        self.router = router
        self._refresher: asyncio.Task | None = None
        self.metrics = metrics
        self.tracing = tracing or Tracing()
        self.channels = ChannelPool()  # channels are made on first use, inside the serving event loop
        self.calls = StageCalls(self.channels, stage_calls, self.tracing)
        self.stages = Stages(self.channels, self.calls, self.tracing, sent=self._sent, spawn=self._spawn)
        self.toggle_address = toggle_address
        self.max_model_len = max_model_len
        self.paths = {path: 0 for path in PrefillPath}
        self.retries = 0
        # (seq, path, predicted, actual TTFT ms from arrival, request id) of the last requests the SLO policy routed
        self.predictions: collections.deque[tuple[int, str, float, float, str]] = collections.deque(maxlen=RECENT_PREDICTIONS)
        self.num_predictions = 0
        self._background: set[asyncio.Task] = set()
        self._capacity, self._capacity_at = 0, float("-inf")  # toggle-routed: the largest decoder's cache, and when read

    @property
    def toggle(self) -> pb_grpc.ToggleStub:
        return pb_grpc.ToggleStub(self.channels.get(self.toggle_address))

    async def start(self, chat: ChatRequest, request_id: str, span=None) -> tuple[int, AsyncIterator[RequestOutput]]:
        """`span`: the request's root span; route and stage calls become its children.

        With images, the processor starts on a thread at once (milliseconds per image) and, meanwhile, the
        prompt's length is counted without the pixels and the route asked for on it: both off the critical
        path. A text prompt is tokenized first (that is as quick)."""
        arrival = time.monotonic()
        slo = (chat.slo_ttft_ms, chat.slo_tbt_ms)
        num_images = chat.num_images
        plan = None
        if num_images:
            applying = self._prepare_in_thread(self._apply, chat, span)
            try:
                # tokenizing a short text costs less than a thread hop
                early_ids = await self._prepare(self._prompt_ids, chat, span, inline=chat.short_text)
                num_tokens = len(early_ids)
                sampling = await self._sampling(chat, num_tokens)
                self._check_length(num_tokens, sampling.max_tokens, chat.max_tokens_given)
                prefix = self._prefix_of(early_ids, image_digests(chat.conversation), chat.cache_salt)
                def summary_of() -> RouteSummary:
                    return RouteSummary(request_id, num_tokens, num_images, sampling.max_tokens, frozenset(), *slo,
                                        elapsed_ms=(time.monotonic() - arrival) * 1e3, **prefix)
                plan = await self._reroute(summary_of, span, 1, wait_for_worker=False)  # waits while all are full
            except BaseException:
                applying.add_done_callback(consume)  # the thread runs to its end; nobody needs what it makes
                raise
            try:
                ids, images = await applying  # a prompt the processor refuses is a 400 here
                self._check_length(len(ids), sampling.max_tokens, chat.max_tokens_given)
            except BaseException:
                if self.router is not None:
                    self.router.forget(request_id)  # its reservations end now, not when they expire
                raise
        else:  # a short text prompt is tokenized on the loop: a thread hop would cost more than the tokenizing
            ids, images = await self._prepare(self._apply, chat, span, inline=chat.short_text)
            sampling = await self._sampling(chat, len(ids))
            self._check_length(len(ids), sampling.max_tokens, chat.max_tokens_given)
        request = Request(request_id, ids, sampling, images, arrival_time=arrival, cache_salt=chat.cache_salt)
        stream = self._with_failover(request, span, slo, plan)
        first = await anext(stream)  # errors before the first token surface here, as an HTTP status
        return len(ids), Prepended(first, stream)

    def _apply(self, chat: ChatRequest):
        """Prompt ids and images; the pixels leave the processor's last, cheap steps to the worker that encodes
        them where that is exact: a quarter of the bytes to send (`common.model.pixels`)."""
        if chat.is_text_completion:
            return self.processor.encode_prompt(chat.prompt)
        return self.processor.apply(chat.conversation, finish_pixels=False, tools=chat.tool_definitions,
                                    template_kwargs=chat.template_kwargs)

    def _prompt_ids(self, chat: ChatRequest) -> list[int]:
        return self.processor.prompt_ids(chat.conversation, chat.tool_definitions, chat.template_kwargs)

    def _prefix_of(self, token_ids: list[int], image_keys: list[str], salt: str) -> dict:
        return summary_fields(token_ids, image_keys, self.processor.config, salt)

    async def _prepare(self, fn, chat: ChatRequest, span=None, inline: bool = False):
        """`fn(chat)`, off the event loop unless `inline`; a conversation the processor refuses is a 400.
        Traced as a child of `span` named after `fn` (`apply`: chat template, tokenizer, image preprocessing)."""
        if not inline:
            return await self._prepare_in_thread(fn, chat, span)
        return self._traced(fn, chat, span)

    def _prepare_in_thread(self, fn, chat: ChatRequest, span=None) -> asyncio.Future:
        """`_prepare` on a thread that starts now, not at the caller's next await: the loop can do other work
        (count tokens, route) while it runs."""
        return asyncio.get_running_loop().run_in_executor(None, contextvars.copy_context().run, self._traced, fn, chat, span)

    def _traced(self, fn, chat: ChatRequest, span):
        with _refused_prompt(), self.tracing.activate(span), self.tracing.span(fn.__name__.lstrip("_")):
            return fn(chat)

    async def _sampling(self, chat: ChatRequest, num_prompt_tokens: int):
        if chat.max_tokens_given:
            return chat.sampling
        return chat.sampling_for(num_prompt_tokens, await self.context_tokens())

    async def context_tokens(self) -> int:
        """The most one request can hold: the model's limit, or what the largest live decoder's whole KV cache holds
        when that is less — from the registry this gateway routes over, or else the toggle's (read again at most
        every CAPACITY_REFRESH_S: caches do not change size)."""
        if self.router is not None:
            largest = largest_decoder_cache(await self.router.workers(), HEALTHY_HEARTBEAT_AGE_S)
        else:
            if time.monotonic() - self._capacity_at >= CAPACITY_REFRESH_S:
                self._capacity_at = time.monotonic()
                with contextlib.suppress(grpc.aio.AioRpcError):
                    reply = await self.toggle.ListWorkers(pb.ListWorkersRequest(), timeout=2)
                    self._capacity = largest_decoder_cache(
                        [wire.snapshot_from_pb(w) for w in reply.workers], HEALTHY_HEARTBEAT_AGE_S)
            largest = self._capacity
        return min(self.max_model_len, largest) if largest else self.max_model_len

    def _check_length(self, num_tokens: int, max_tokens: int, given: bool = True) -> None:
        check_length(num_tokens, max_tokens, self.max_model_len, given)

    async def _route(self, summary: RouteSummary, span, attempt: int, ahead: bool = False,
                     written: asyncio.Event | None = None):
        """The plan; `ahead`: (plan, its reservation under way or None), for a caller that sends its first stage
        call before the reservation is made (`Router.route_ahead`), and sets `written` once that call's message
        is written (or it sends none): the reservation's Redis call waits for it."""
        try:
            with self.tracing.activate(span), self.tracing.span("route", {"epdmesh.attempt": attempt}):
                if self.router is None:
                    plan = await self.toggle.Route(wire.summary_to_pb(summary), timeout=10)
                    return (plan, None) if ahead else plan
                if self._refresher is None:  # in the serving loop, where the Redis client's connections live
                    self._refresher = asyncio.ensure_future(self.router.refresh_forever())
                if not ahead:
                    return wire.plan_to_pb(await self.router.route(summary))
                plan, reserved = await self.router.route_ahead(summary, written)
                reserved.add_done_callback(consume)  # awaited by the stages, unless they failed first
                return wire.plan_to_pb(plan), reserved
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.UNAVAILABLE:
                raise NoLiveRoute(503, f"routing is unavailable: {e.details()}", headers={"Retry-After": "1"}) from None
            if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:  # the toggle's "busy": no room now, or refused
                refused = any(key == REFUSED_KEY for key, _ in (e.trailing_metadata() or ()))
                raise (ApiError if refused else NoRoomNow)(503, f"routing: {e.details()}",
                                                           headers={"Retry-After": "1"}) from None
            raise api_error_from_rpc(e, "routing") from None
        except NoRoute as e:
            if not e.fits:
                raise ApiError(400, e.message, "max_tokens") from None
            if e.busy:  # no room now (it waits for some), or admission control refused it (it is told at once)
                raise (ApiError if e.refused else NoRoomNow)(503, f"routing: {e.message}",
                                                             headers={"Retry-After": "1"}) from None
            raise NoLiveRoute(503, f"routing is unavailable: {e.message}", headers={"Retry-After": "1"}) from None

    async def _reroute(self, summary_of, span, attempt: int, wait_for_worker: bool = True) -> pb.RoutePlan:
        """The route of a request a worker failed or handed back, or of one no worker had room for: while every
        worker is full, wait up to ROOM_WAIT_S for room, as a queued request would (a refusal by admission control
        is not waited out); with `wait_for_worker` (a request that was under way), also wait up to FAILOVER_WAIT_S
        for a worker of a role none is left of (a restarted one) rather than fail it. A new request in that case
        gets its 503 + Retry-After at once."""
        start, said = time.monotonic(), False
        waits_for = (NoLiveRoute, NoRoomNow) if wait_for_worker else NoRoomNow
        waiting = self.metrics.waiting_for_room.labels(self.metrics.model) if self.metrics is not None else None
        counted = False
        try:
            while True:
                try:
                    return await self._route(summary_of(), span, attempt)
                except waits_for as e:
                    wait_s = ROOM_WAIT_S if isinstance(e, NoRoomNow) else FAILOVER_WAIT_S
                    if time.monotonic() >= start + wait_s:
                        raise
                    if not said:  # once per request, not once per poll
                        log.info("request %s waits up to %.0f s for %s (%s)", summary_of().request_id, wait_s,
                                 "room" if isinstance(e, NoRoomNow) else "a worker to take over", e.message)
                        said = True
                    if isinstance(e, NoRoomNow) and waiting is not None and not counted:
                        waiting.inc()
                        counted = True
                    await asyncio.sleep(FAILOVER_POLL_S)
        finally:
            if counted:
                waiting.dec()

    async def _with_failover(self, request: Request, span=None, slo: tuple[float | None, float | None] = (None, None),
                             plan: pb.RoutePlan | None = None) -> AsyncIterator[RequestOutput]:
        """The request's outputs; when a worker fails it, route again around that worker and continue.
        `plan`: the first attempt's route, when it was asked for already.

        Tokens already produced are never produced twice: a retry after some output prefills the prompt
        plus those tokens on the new route (migration) and asks only for the rest.
        """
        emitted: list[int] = []
        exclude: set[str] = set()
        attempt = failures = hand_backs = 0
        progress = 0  # tokens sent when the last hand-back came
        while True:
            attempt += 1
            current = request if not emitted else continuation(request, emitted, attempt)
            reserved = None
            written = asyncio.Event()  # the first stage call's message is out: a reservation ahead may go to Redis
            if plan is None or attempt > 1:
                prefix = self._prefix_of(current.prompt_token_ids, [image.content_hash for image in current.images],
                                         current.cache_salt)

                def summary_of(current=current, prefix=prefix) -> RouteSummary:
                    return RouteSummary(current.request_id, current.num_prompt_tokens, len(current.images),
                                        current.sampling.max_tokens, frozenset(exclude), *slo,
                                        elapsed_ms=(time.monotonic() - request.arrival_time) * 1e3, **prefix)
                if attempt > 1:
                    plan = await self._reroute(summary_of, span, attempt)
                else:
                    try:  # a text prompt: its first stage call goes out while Redis reserves
                        plan, reserved = await self._route(summary_of(), span, attempt, ahead=True, written=written)
                    except NoRoomNow:  # every worker is full: it waits for one with room, as a queued request
                        plan = await self._reroute(summary_of, span, attempt, wait_for_worker=False)
            path = wire.path_from_pb(plan.path)
            set_attributes(span, {"epdmesh.path": path.value, "epdmesh.decoder": plan.decoder.worker_id,
                                  "epdmesh.prefill": plan.prefill.worker_id, "epdmesh.attempts": attempt,
                                  "epdmesh.encoder": plan.encoder.worker_id if plan.HasField("encoder") else None})
            before = list(emitted)
            stream = self.stages.drive(current, plan, path, span, reserved, written)
            try:
                async for out in stream:
                    if out.new_token_ids or out.finished:
                        if len(emitted) == len(before) and self.router is not None:
                            self.router.prefilled(current.request_id)  # its prefill no longer loads the worker
                        if not emitted:
                            self._first_token(path, plan, request.arrival_time, request.request_id)
                        emitted.extend(out.new_token_ids)
                        yield rebased(out, request.request_id, before, self.detokenize, self.eos_token_ids)
                return
            except HandedBack as back:
                hand_backs = 1 if len(emitted) > progress else hand_backs + 1  # only those without progress count
                progress = len(emitted)
                if hand_backs > MAX_HAND_BACKS:
                    raise ApiError(503, f"the decoders preempted this request {hand_backs} times without a token in "
                                        "between: their KV caches are full; retry later",
                                   headers={"Retry-After": "1"}) from None
                log.info("request %s: decoder %s preempted it after %d tokens and handed it back; going on elsewhere",
                         request.request_id, back.worker_id, len(emitted))
                if self.metrics is not None:
                    self.metrics.hand_backs.labels(self.metrics.model).inc()
            except StageFailed as failed:
                if failed.busy:  # no room on the worker after all: not its failure; the next route waits for room
                    log.debug("request %s: %s; routing it again when there is room", request.request_id,
                              failed.error.message)
                    continue
                failures += 1
                if failed.blame is None or failures == MAX_ATTEMPTS:
                    raise failed.error from None
                exclude.add(failed.blame)
                self.retries += 1
                if self.metrics is not None:
                    self.metrics.retries.labels(self.metrics.model).inc()
                (log.debug if failed.busy else log.warning)("request %s: %s; routing around worker %s (attempt %d, %d tokens kept)",
                            request.request_id, failed.error.message, failed.blame, attempt + 1, len(emitted))
            finally:
                await stream.aclose()
                written.set()
                if reserved is not None:
                    reserved.cancel()  # a stream that never started never did; a no-op once it is done
                if self.router is not None:
                    self.router.forget(current.request_id)

    def detokenize(self, ids: list[int]) -> str:
        return self.processor.detokenize(ids)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return tuple(self.processor.config.eos_token_ids)

    def _first_token(self, path: PrefillPath, plan: pb.RoutePlan, arrival: float, request_id: str) -> None:
        """Count the path that made the request's first token, and how far the policy's prediction of it was off."""
        self.paths[path] += 1
        if self.metrics is not None:
            self.metrics.paths.labels(self.metrics.model, path.value).inc()
        if not plan.HasField("predicted_ttft_ms"):
            return
        actual = (time.monotonic() - arrival) * 1e3
        self.num_predictions += 1
        self.predictions.append((self.num_predictions, path.value, round(plan.predicted_ttft_ms, 3), round(actual, 3),
                                 request_id))
        if self.metrics is not None:
            self.metrics.prediction_error.labels(self.metrics.model, path.value).observe(
                (actual - plan.predicted_ttft_ms) / 1e3)

    async def stats(self) -> dict:
        return {"paths": {p.value: n for p, n in self.paths.items()}, "retries": self.retries,
                "ttft_predictions": {"fields": ["seq", "path", "predicted_ms", "actual_ms", "id"],
                                     "recent": list(self.predictions)},
                "workers": await self.worker_stats()}

    async def close(self) -> None:
        if self._refresher is not None:
            self._refresher.cancel()
        if self.router is not None:
            await self.router.settle()
            await self.router.registry.redis.aclose()
        await self.calls.close()
        await self.channels.close()

    def _sent(self, request: Request, worker_id: str) -> None:
        """Tell the router the request reaches this worker now: until then its route loads the worker."""
        if self.router is not None:
            self.router.sent(request.request_id, worker_id)

    def _spawn(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)


class NoLiveRoute(ApiError):
    """No live worker set covers the request (not: every one is busy)."""


class NoRoomNow(ApiError):
    """Live workers cover the request, but none has room for it now."""


@contextlib.contextmanager
def _refused_prompt():
    """A conversation the processor refuses is the client's error: a 400 that says why."""
    try:
        yield
    except (ValueError, TypeError, KeyError) as e:
        raise ApiError(400, f"could not build the prompt: {e}") from None
