"""The gateway's backend when everything runs in this process: one colocated engine (all roles), no mesh."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from common.engine.async_engine import AsyncEngine
from common.engine.engine import RequestRejected
from common.engine.outputs import RequestOutput
from common.model.processor import ChatProcessor
from common.request import Request
from services.gateway.errors import ApiError
from services.gateway.protocol import ChatRequest, check_length
from services.gateway.responses import Prepended


class LocalBackend:
    """One colocated worker (all roles) in this process."""

    def __init__(self, processor: ChatProcessor, engine: AsyncEngine, recorder=None):
        """`recorder`: the recorded trace (`services/gateway/trace_record.py`), with `--record-trace`."""
        self.processor = processor
        self.engine = engine
        self.recorder = recorder

    @property
    def max_model_len(self) -> int:
        return self.engine.engine.max_model_len

    @property
    def context_tokens(self) -> int:
        """The most one request can hold: the model's limit, or the whole KV cache when that holds less."""
        kv = self.engine.engine.scheduler.kv
        return min(self.max_model_len, kv.pool.num_blocks * kv.block_size)

    async def start(self, chat: ChatRequest, request_id: str, span=None) -> tuple[int, AsyncIterator[RequestOutput]]:
        arrival = time.monotonic()
        try:
            if not chat.num_images and chat.short_text:  # on the loop: a thread hop costs more than tokenizing
                ids, images = self._inputs(chat)
            else:
                ids, images = await asyncio.to_thread(self._inputs, chat)
        except (ValueError, TypeError, KeyError) as e:
            raise ApiError(400, f"could not build the prompt: {e}") from None
        sampling = chat.sampling_for(len(ids), self.context_tokens)
        check_length(len(ids), sampling.max_tokens, self.max_model_len, chat.max_tokens_given)
        request = Request(request_id, ids, sampling, images, cache_salt=chat.cache_salt)
        stream = self.engine.generate(request)
        if self.recorder is not None:
            stream = self.recorder.observe(request, stream, arrival)
        try:
            first = await anext(stream)
        except RequestRejected as e:
            raise ApiError(400, str(e)) from None

        return len(ids), Prepended(first, stream)

    def _inputs(self, chat: ChatRequest):
        if chat.is_text_completion:
            return self.processor.encode_prompt(chat.prompt)
        return self.processor.apply(
            chat.conversation, tools=chat.tool_definitions, template_kwargs=chat.template_kwargs
        )

    def detokenize(self, ids: list[int]) -> str:
        return self.processor.detokenize(ids)

    async def close(self) -> None:
        if self.recorder is not None:
            await self.recorder.close()

    async def stats(self) -> dict:
        return _asdict(self.engine.stats())

    async def health(self) -> dict:
        return {"status": "ok"} if self.engine.alive else {"status": "error", "reason": "the engine thread has stopped"}


def _asdict(obj) -> dict:
    return {name: getattr(obj, name) for name in obj.__slots__}
