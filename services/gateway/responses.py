"""A request's outputs as OpenAI's chat-completion objects: one `chat.completion`, or a stream of
`chat.completion.chunk`s (SSE) — with `n` choices, one output stream each, interleaved as their tokens come. A
text completion's (`/v1/completions`) are the same, shaped as `text_completion` objects: `text` instead of a
message or delta, no role chunk, and logprobs in the legacy form."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator

from common.detokenizer import IncrementalDetokenizer
from common.engine.outputs import RequestOutput
from services.gateway.completions import legacy_logprobs
from services.gateway.errors import ApiError
from services.gateway.protocol import ChatRequest
from services.gateway.tools import AnswerDeltas, finish_reason
from services.gateway.tools import message as tool_message

log = logging.getLogger(__name__)


class Prepended:
    """`first`, then the rest of `rest` (a backend's output stream once its first output came). Closing it closes
    `rest` at once, even before its first read — a generator wrapping `rest` would leave that to the garbage
    collector, and with it the end of the request's route and reservations."""

    def __init__(self, first: RequestOutput, rest: AsyncIterator[RequestOutput]):
        self._first: RequestOutput | None = first
        self._rest = rest

    def __aiter__(self):
        return self

    async def __anext__(self) -> RequestOutput:
        if self._first is not None:
            first, self._first = self._first, None
            return first
        return await anext(self._rest)

    async def aclose(self) -> None:
        self._first = None
        await self._rest.aclose()


def internal_error(e: Exception) -> ApiError:
    """A bug of ours, as the client sees it: an OpenAI-style 500 (the traceback goes to the log)."""
    return ApiError(500, f"internal error ({type(e).__name__}: {e}); the server logged it, please report it")


class Logprobs:
    """A request's logprobs in OpenAI's form: per token its text, logprob, UTF-8 bytes and top alternatives."""

    def __init__(self, token_text):
        self.token_text = token_text

    def _entry(self, token_id: int, logprob: float) -> dict:
        text, raw = self.token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(raw)}

    def entries(self, out: RequestOutput) -> list[dict]:
        return [
            {**self._entry(lp.token_id, lp.logprob), "top_logprobs": [self._entry(t, v) for t, v in lp.top]}
            for lp in out.logprobs or ()
        ]


def usage(num_prompt: int, finals: list[RequestOutput | None]) -> dict:
    """The prompt once, the completions of every choice (as OpenAI and vLLM count n > 1); the prompt tokens the
    prefix cache held, as OpenAI's `prompt_tokens_details.cached_tokens` (each choice is prefilled on its own: the
    most any of them found)."""
    n = sum(len(out.output_token_ids) for out in finals if out is not None)
    cached = max((out.num_cached_tokens for out in finals if out is not None), default=0)
    return {
        "prompt_tokens": num_prompt,
        "completion_tokens": n,
        "total_tokens": num_prompt + n,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


async def collect(
    streams: list[AsyncIterator[RequestOutput]], logprobs: Logprobs | None
) -> list[tuple[RequestOutput, list[dict]]]:
    """Each stream's last output and logprobs entries, the streams read concurrently; the first failure cancels
    the rest (their requests end) and is raised."""

    async def one(stream):
        final, entries = None, []
        async with contextlib.aclosing(stream):  # cancelled (a failed choice, the client gone): its request ends now
            async for out in stream:
                final = out
                if logprobs is not None:
                    entries += logprobs.entries(out)
        return final, entries

    if len(streams) == 1:
        return [await one(streams[0])]
    tasks = [asyncio.ensure_future(one(stream)) for stream in streams]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()


def completion(
    chat: ChatRequest,
    request_id: str,
    model: str,
    num_prompt: int,
    results: list[tuple[RequestOutput, list[dict]]],
    detokenize,
    with_logprobs: bool,
) -> dict:
    choices = []
    for index, (out, entries) in enumerate(results):
        text = _final_text(out, detokenize)
        if chat.is_text_completion:
            choice = {"index": index, "text": text, "logprobs": legacy_logprobs(entries)[0] if with_logprobs else None}
        else:
            message = tool_message(chat.tools, text) if _calls_tools(chat) else {"role": "assistant", "content": text}
            choice = {"index": index, "message": message, "logprobs": {"content": entries} if with_logprobs else None}
        choice.update(
            finish_reason=finish_reason(chat.tools, out.finish_reason, out.stop_reason, text),
            stop_reason=out.stop_reason,
        )
        if chat.return_token_ids:
            choice["token_ids"] = out.output_token_ids
        choices.append(choice)
    return {
        "id": request_id,
        "object": "text_completion" if chat.is_text_completion else "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage(num_prompt, [out for out, _ in results]),
    }


def _calls_tools(chat: ChatRequest) -> bool:
    return chat.tools is not None and chat.tools.calls


def _final_text(out: RequestOutput, detokenize) -> str:
    return out.text if out.text is not None else detokenize(out.output_token_ids)


GENERATED = "_generated"  # a choice's tokens so far, riding with it from its generator to its frame


async def sse(
    chat: ChatRequest,
    request_id: str,
    model: str,
    num_prompt: int,
    streams: list[AsyncIterator[RequestOutput]],
    detokenize,
    logprobs: Logprobs | None = None,
) -> AsyncIterator[str]:
    created = int(time.time())

    kind = "text_completion" if chat.is_text_completion else "chat.completion.chunk"

    counted = [0] * len(streams)  # tokens of each choice in the chunks made so far

    def frame(choices: list[dict], **extra) -> str:
        for choice in choices:
            counted[choice["index"]] = choice.pop(GENERATED, counted[choice["index"]])
        body = {"id": request_id, "object": kind, "created": created, "model": model, "choices": choices, **extra}
        if chat.continuous_usage and "usage" not in body:  # vLLM's stream_options.continuous_usage_stats
            n = sum(counted)
            body["usage"] = {"prompt_tokens": num_prompt, "completion_tokens": n, "total_tokens": num_prompt + n}
        return f"data: {json.dumps(body)}\n\n"

    finals: list[RequestOutput | None] = [None] * len(streams)
    deltas = [choice_deltas(i, chat, stream, detokenize, logprobs, finals) for i, stream in enumerate(streams)]
    held = ""  # the role chunks, sent with the first token's: it is already here, and one write is one wake-up less
    try:
        async with contextlib.aclosing(deltas[0] if len(deltas) == 1 else _merged(deltas)) as choices:
            async for choice in choices:
                if "role" in choice.get("delta", ()):
                    held += frame([choice])
                    continue
                yield held + frame([choice])
                held = ""
    except Exception as e:  # a stage failed mid-stream (or a bug of ours): say so in the stream, as OpenAI does
        if not isinstance(e, ApiError):
            log.exception("request %s failed mid-stream", request_id)
            e = internal_error(e)
        yield held + f"data: {json.dumps(e.body())}\n\n"
        yield "data: [DONE]\n\n"
        return
    if held:  # no chunk came after them (not expected: a choice ends with its finish reason)
        yield held
    if chat.include_usage:
        yield frame([], usage=usage(num_prompt, finals))
    yield "data: [DONE]\n\n"


class _ChoiceEntry:
    """Builds one choice's streamed entries (a chat's delta, or a text completion's text with legacy logprobs)."""

    def __init__(self, index: int, chat: ChatRequest, logprobs: Logprobs | None):
        self.index, self.chat, self.logprobs = index, chat, logprobs
        self.offset = 0  # text completions: where the next logprobs entry's token starts in the text

    def __call__(
        self,
        delta: dict,
        finish: str | None = None,
        token_ids: list[int] | None = None,
        out: RequestOutput | None = None,
    ) -> dict:
        chat, index = self.chat, self.index
        entries = self.logprobs.entries(out) if self.logprobs is not None and out is not None else None
        if chat.is_text_completion:
            legacy = None
            if entries:
                legacy, self.offset = legacy_logprobs(entries, self.offset)
            entry = {"index": index, "text": delta.get("content", ""), "logprobs": legacy, "finish_reason": finish}
        else:
            entry = {
                "index": index,
                "delta": delta,
                "logprobs": {"content": entries} if entries else None,
                "finish_reason": finish,
            }
        if finish is not None:  # as in the whole answer (and vLLM's stream): the stop string or token that ended it
            entry["stop_reason"] = out.stop_reason
        if chat.return_token_ids and token_ids is not None:
            entry["token_ids"] = token_ids
        if out is not None:
            entry[GENERATED] = len(out.output_token_ids)  # for a running usage; taken out before it is sent
        return entry


async def choice_deltas(
    index: int,
    chat: ChatRequest,
    outputs: AsyncIterator[RequestOutput],
    detokenize,
    logprobs: Logprobs | None,
    finals: list,
) -> AsyncIterator[dict]:
    """One choice's `choices` entries: its role (a chat's), then text deltas as tokens come (held back by the longest
    stop string's length but one, so a stop string is never half sent), then the rest with its finish reason. An
    answer that calls tools sends `tool_calls` deltas instead of text (a token that adds nothing to them, such as
    the JSON around a call's name, sends no chunk unless it carries logprobs or token ids)."""
    calls = AnswerDeltas(chat.tools) if _calls_tools(chat) else None

    def content(piece: str) -> dict:
        return {"content": piece} if calls is None else calls.feed(piece)

    every_token = calls is None or logprobs is not None or chat.return_token_ids
    holdback = max((len(s) for s in chat.sampling.stop), default=1) - 1
    choice = _ChoiceEntry(index, chat, logprobs)

    sent, last = "", None
    text = IncrementalDetokenizer(detokenize)  # a few tokens decoded per output, not the whole output again
    async with contextlib.aclosing(outputs):  # the client gone: its request ends now, not when collected
        first = await anext(outputs, None)  # already here (the backend waited for it): the stream, and its
        if not chat.is_text_completion:  # observer, start before anything is sent
            yield choice({"role": "assistant", "content": ""})
        async for out in _chain(first, outputs):
            last = out
            if out.finished:
                break
            text.push(out.output_token_ids[len(text.token_ids) :])
            safe = text.text[: len(text.text) - holdback] if holdback else text.text
            if len(safe) > len(sent) or out.new_token_ids:
                delta = content(safe[len(sent) :])
                if delta or every_token:
                    yield choice(delta, token_ids=out.new_token_ids, out=out)
                sent = safe
    finals[index] = last
    if last.text is not None:  # the engine's own text: cut at a stop string
        final = last.text
    else:
        text.push(last.output_token_ids[len(text.token_ids) :])
        text.finish()
        final = text.text
    delta = content(final[len(sent) :]) if calls is None else calls.last(final[len(sent) :], final)
    yield choice(
        delta,
        finish=finish_reason(chat.tools, last.finish_reason, last.stop_reason, final),
        token_ids=last.new_token_ids,
        out=last,
    )


async def _chain(first: RequestOutput | None, rest: AsyncIterator[RequestOutput]) -> AsyncIterator[RequestOutput]:
    if first is None:
        return
    yield first
    async for out in rest:
        yield out


async def _merged(generators: list[AsyncIterator[dict]]) -> AsyncIterator[dict]:
    """The generators' items as they come; the first failure is raised. When the consumer stops (the client went
    away) or one fails, every generator is closed, which ends its request."""
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(generator):
        try:
            async for item in generator:
                await queue.put(item)
            await queue.put(done)
        except BaseException as e:  # noqa: BLE001 — handed to the consumer, which raises it
            await queue.put(e)
            raise
        finally:
            await generator.aclose()

    tasks = [asyncio.ensure_future(pump(g)) for g in generators]
    try:
        running = len(tasks)
        while running:
            item = await queue.get()
            if item is done:
                running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
