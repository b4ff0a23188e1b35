"""A chat as the prompt the mesh runs: token ids and images from the checkpoint's own processor, and the fields of
its route summary that prefix-cache-aware routing reads. A conversation the processor refuses is a 400."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars

from common.model.processor import ChatProcessor
from common.policy.affinity import request_fields, summary_fields
from common.request import Request
from common.telemetry.tracing import Tracing
from services.gateway.errors import ApiError
from services.gateway.protocol import ChatRequest


class Prompts:
    def __init__(self, processor: ChatProcessor, tracing: Tracing):
        self.processor = processor
        self.tracing = tracing

    def apply(self, chat: ChatRequest):
        """Prompt ids and images; the pixels leave the processor's last, cheap steps to the worker that encodes
        them where that is exact: a quarter of the bytes to send (`common.model.pixels`)."""
        if chat.is_text_completion:
            return self.processor.encode_prompt(chat.prompt)
        return self.processor.apply(
            chat.conversation, finish_pixels=False, tools=chat.tool_definitions, template_kwargs=chat.template_kwargs
        )

    def prompt_ids(self, chat: ChatRequest) -> list[int]:
        """The prompt's ids without the pixels: its length, and its prefix, while the images are still processed."""
        return self.processor.prompt_ids(chat.conversation, chat.tool_definitions, chat.template_kwargs)

    def prefix_fields(self, token_ids: list[int], image_keys: list[str], salt: str) -> dict:
        return summary_fields(token_ids, image_keys, self.processor.config, salt)

    def prefix_of(self, request: Request) -> dict:
        return request_fields(request, self.processor.config)

    def detokenize(self, ids: list[int]) -> str:
        return self.processor.detokenize(ids)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return tuple(self.processor.config.eos_token_ids)

    async def run(self, fn, chat: ChatRequest, span=None, inline: bool = False):
        """`fn(chat)`, off the event loop unless `inline`. Traced as a child of `span` named after `fn` (`apply`:
        chat template, tokenizer, image preprocessing)."""
        if not inline:
            return await self.in_thread(fn, chat, span)
        return self._traced(fn, chat, span)

    def in_thread(self, fn, chat: ChatRequest, span=None) -> asyncio.Future:
        """`run` on a thread that starts now, not at the caller's next await: the loop can do other work (count
        tokens, route) while it runs."""
        return asyncio.get_running_loop().run_in_executor(
            None, contextvars.copy_context().run, self._traced, fn, chat, span
        )

    def _traced(self, fn, chat: ChatRequest, span):
        with _refused_prompt(), self.tracing.activate(span), self.tracing.span(fn.__name__.lstrip("_")):
            return fn(chat)


@contextlib.contextmanager
def _refused_prompt():
    """A conversation the processor refuses is the client's error: a 400 that says why."""
    try:
        yield
    except (ValueError, TypeError, KeyError) as e:
        raise ApiError(400, f"could not build the prompt: {e}") from None
