"""The gateway's backend over the mesh: a chat in, its outputs out.

1. the chat is turned into prompt tokens and pixels (`prompt`), and checked against the model's length limit —
   nothing is routed for a request that cannot run. With images, the processor runs on a thread while the prompt's
   length is counted without the pixels and its route asked for (`route_client`): both off the critical path;
2. the request's attempts (`failover`): each drives its route's stages (`stages`), and a worker that fails the
   request is routed around, the request migrating with the tokens already sent;
3. errors before the first token surface from `start` as the HTTP status; pages never pass through here.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from common.engine.outputs import RequestOutput
from common.model.processor import ChatProcessor, image_digests
from common.policy.routing import RouteSummary
from common.request import Request
from common.sampling import SamplingParams
from common.telemetry.metrics import GatewayMetrics
from common.telemetry.tracing import Tracing
from common.tls import MeshTls
from common.transfer.channels import ChannelPool
from services.gateway.mesh.failover import Failover
from services.gateway.mesh.outcome import StageError, consume
from services.gateway.mesh.prompt import Prompts
from services.gateway.mesh.route_client import Route, RouteClient
from services.gateway.mesh.route_stats import RouteStats
from services.gateway.mesh.stages import Stages
from services.gateway.mesh.status import MeshStatus
from services.gateway.protocol import ChatRequest, check_length
from services.gateway.responses import Prepended
from services.routing.router import Router
from services.stage_calls.client import StageCalls


class MeshBackend:
    def __init__(
        self,
        processor: ChatProcessor,
        toggle_address: str,
        max_model_len: int,
        metrics: GatewayMetrics | None = None,
        tracing: Tracing | None = None,
        router: Router | None = None,
        stage_calls: str = "stream",
        tls: MeshTls | None = None,
        hold_ttft_ms: float | None = None,
    ):
        """`router`: route in this process over the registry in Redis; None: ask the toggle (a gRPC hop).
        `stage_calls`: Encode and Prefill on a stream kept open to each worker, or as unary rpcs
        (services/stage_calls). `tls`: mutual TLS on every channel to the mesh (common/tls.py). `hold_ttft_ms`:
        hold handed-over first tokens (`--first-token-hold`; the default TTFT target), or None."""
        self.processor = processor
        self.max_model_len = max_model_len
        self.tracing = tracing or Tracing()
        self.channels = ChannelPool(tls)  # channels are made on first use, inside the serving event loop
        self.calls = StageCalls(self.channels, stage_calls, self.tracing)
        self.prompts = Prompts(processor, self.tracing)
        self.routes = RouteClient(self.channels, toggle_address, router, self.tracing, metrics)
        self.route_stats = RouteStats(metrics)
        self.status = MeshStatus(self.routes, self.channels)
        self._background: set[asyncio.Task] = set()
        self.stages = Stages(self.channels, self.calls, self.tracing, spawn=self._spawn)
        self.failover = Failover(self.routes, self.stages, self.route_stats, self.prompts, metrics, hold_ttft_ms)
        self.planner = None  # the planner's task (`services/gateway/planner.py`), when it runs here
        self.recorder = None  # the recorded trace (`services/gateway/trace_record.py`), with `--record-trace`

    async def start(self, chat: ChatRequest, request_id: str, span=None) -> tuple[int, AsyncIterator[RequestOutput]]:
        """The prompt's length and the request's outputs, its first one already come. `span`: the request's root
        span; route and stage calls become its children."""
        arrival = time.monotonic()
        route = None
        if chat.num_images:
            ids, images, sampling, route = await self._with_images(chat, request_id, arrival, span)
        else:  # a short text prompt is tokenized on the loop: a thread hop would cost more than the tokenizing
            ids, images = await self.prompts.run(self.prompts.apply, chat, span, inline=chat.short_text)
            sampling = await self._sampling(chat, len(ids))
            check_length(len(ids), sampling.max_tokens, self.max_model_len, chat.max_tokens_given)
        request = Request(request_id, ids, sampling, images, arrival_time=arrival, cache_salt=chat.cache_salt)
        stream = self.failover.outputs(request, span, (chat.slo_ttft_ms, chat.slo_tbt_ms), route)
        if self.planner is not None:
            stream = self.planner.observe(request, stream)
        if self.recorder is not None:
            stream = self.recorder.observe(request, stream)
        first = await anext(stream)  # errors before the first token surface here, as an HTTP status
        return len(ids), Prepended(first, stream)

    async def _with_images(
        self, chat: ChatRequest, request_id: str, arrival: float, span
    ) -> tuple[list[int], list, SamplingParams, Route]:
        """Prompt ids, images, sampling and route of a chat with images: the processor on a thread from now on, the
        length counted and the route asked for meanwhile."""
        applying = self.prompts.in_thread(self.prompts.apply, chat, span)
        try:
            # tokenizing a short text costs less than a thread hop
            early_ids = await self.prompts.run(self.prompts.prompt_ids, chat, span, inline=chat.short_text)
            sampling = await self._sampling(chat, len(early_ids))
            check_length(len(early_ids), sampling.max_tokens, self.max_model_len, chat.max_tokens_given)
            prefix = self.prompts.prefix_fields(early_ids, image_digests(chat.conversation), chat.cache_salt)

            def summary_of() -> RouteSummary:
                return RouteSummary(
                    request_id,
                    len(early_ids),
                    chat.num_images,
                    sampling.max_tokens,
                    frozenset(),
                    chat.slo_ttft_ms,
                    chat.slo_tbt_ms,
                    elapsed_ms=(time.monotonic() - arrival) * 1e3,
                    **prefix,
                )

            try:
                route = await self.routes.reroute(
                    summary_of, span, 1, wait_for_worker=False
                )  # waits while all are full
            except StageError as e:
                raise e.api_error() from None
        except BaseException:
            applying.add_done_callback(consume)  # the thread runs to its end; nobody needs what it makes
            raise
        try:
            ids, images = await applying  # a prompt the processor refuses is a 400 here
            check_length(len(ids), sampling.max_tokens, self.max_model_len, chat.max_tokens_given)
        except BaseException:
            route.end()  # its reservations end now, not when they expire
            raise
        return ids, images, sampling, route

    async def _sampling(self, chat: ChatRequest, num_prompt_tokens: int) -> SamplingParams:
        if chat.max_tokens_given:
            return chat.sampling
        return chat.sampling_for(num_prompt_tokens, await self.context_tokens())

    async def context_tokens(self) -> int:
        """The most one request can hold: the model's limit, or what the largest live decoder's whole KV cache holds
        when that is less."""
        largest = await self.routes.largest_cache()
        return min(self.max_model_len, largest) if largest else self.max_model_len

    def detokenize(self, ids: list[int]) -> str:
        return self.prompts.detokenize(ids)

    async def health(self) -> dict:
        return await self.status.health()

    async def stats(self) -> dict:
        planner = {"planner": self.planner.as_dict()} if self.planner is not None else {}
        return {**self.route_stats.as_dict(), **planner, "workers": await self.status.worker_stats()}

    async def start_background(self) -> None:
        if self.planner is not None:
            self.planner.start()

    async def close(self) -> None:
        if self.planner is not None:
            await self.planner.stop()
        if self.recorder is not None:
            await self.recorder.close()
        await self.routes.close()
        await self.calls.close()
        await self.channels.close()

    def _spawn(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
