"""OpenAI's Responses API (`POST /v1/responses`), as vLLM serves it: the request is read as the chat it is and goes
through the same stages; the answer comes back as a `response` object, or streamed as its typed events.

How a request is read: `responses_request.py`.

Streamed: response.created, response.in_progress, then per output item its `output_item.added`, its deltas
(`output_text.delta` or `function_call_arguments.delta`) and its `done` events, and last `response.completed` (or
`response.incomplete` when max_output_tokens cut it) with the whole response; each event numbered by
`sequence_number`, as `event: <type>` + `data: <json>` frames.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator

from common.engine.outputs import RequestOutput
from services.gateway.errors import ApiError
from services.gateway.protocol import ChatRequest
from services.gateway.responses import choice_deltas, internal_error
from services.gateway.tools import calls_in

log = logging.getLogger(__name__)


class _Ids:
    """The response's id and its items' ids, from the request's."""

    def __init__(self, request_id: str):
        self.hex = request_id.split("-", 1)[-1]
        self.response = f"resp_{self.hex}"
        self.message = f"msg_{self.hex}"

    def call(self, index: int) -> str:
        return f"fc_{self.hex}_{index}"


def _cut_last(items: list[dict], status: str) -> list[dict]:
    """A response cut short (max_output_tokens) leaves its last function call unfinished: that item says so."""
    if status == "incomplete" and items and items[-1]["type"] == "function_call":
        items[-1] = {**items[-1], "status": "incomplete"}
    return items


def _status(out: RequestOutput | None) -> tuple[str, dict | None]:
    reason = out.finish_reason if out is not None else None
    if reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    if reason == "abort":
        return "incomplete", {"reason": "aborted"}
    return "completed", None


def _response(
    chat: ChatRequest,
    ids: _Ids,
    model: str,
    created: float,
    status: str,
    output: list[dict],
    usage: dict | None,
    incomplete: dict | None = None,
) -> dict:
    echo = chat.echo or {}
    return {
        "id": ids.response,
        "object": "response",
        "created_at": int(created),
        "status": status,
        "model": model,
        "output": output,
        "error": None,
        "incomplete_details": incomplete,
        "instructions": echo.get("instructions"),
        "metadata": echo.get("metadata") or {},
        "max_output_tokens": echo.get("max_output_tokens"),
        "temperature": 1.0 if echo.get("temperature") is None else echo["temperature"],
        "top_p": 1.0 if echo.get("top_p") is None else echo["top_p"],
        "parallel_tool_calls": echo.get("parallel_tool_calls") is not False,
        "tool_choice": echo.get("tool_choice") or ("auto" if echo.get("tools") else "none"),
        "tools": echo.get("tools") or [],
        "text": echo.get("text") or {"format": {"type": "text"}},
        "reasoning": echo.get("reasoning"),
        "truncation": echo.get("truncation") or "disabled",
        "user": echo.get("user"),
        "previous_response_id": None,
        "store": False,
        "usage": usage,
    }


def _usage(num_prompt: int, out: RequestOutput | None) -> dict:
    n = len(out.output_token_ids) if out is not None else 0
    cached = out.num_cached_tokens if out is not None else 0
    return {
        "input_tokens": num_prompt,
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
        "output_tokens": n,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": num_prompt + n,
    }


def _items(chat: ChatRequest, ids: _Ids, text: str, calls: list[dict], status: str) -> list[dict]:
    """The answer's output items: its function calls, or its text as one message."""
    if calls:
        return [
            {
                "type": "function_call",
                "id": ids.call(i),
                "call_id": c["id"],
                "name": c["function"]["name"],
                "arguments": c["function"]["arguments"],
                "status": "completed",
            }
            for i, c in enumerate(calls)
        ]
    return [
        {
            "type": "message",
            "id": ids.message,
            "status": status,
            "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}],
        }
    ]


def whole(
    chat: ChatRequest,
    request_id: str,
    model: str,
    num_prompt: int,
    results: list[tuple[RequestOutput, list[dict]]],
    detokenize,
    with_logprobs: bool,
) -> dict:
    """The answer as one `response` object."""
    ((out, _),) = results
    text = out.text if out.text is not None else detokenize(out.output_token_ids)
    calls = calls_in(chat.tools, text)
    status, incomplete = _status(out)
    ids = _Ids(request_id)
    return _response(
        chat,
        ids,
        model,
        time.time(),
        status,
        _cut_last(_items(chat, ids, text, calls, status), status),
        _usage(num_prompt, out),
        incomplete,
    )


class _Events:
    """One streamed answer's events, numbered; what is open (the message, each call's item) and what it holds."""

    def __init__(self, ids: _Ids):
        self.ids = ids
        self.seq = 0
        self.text = ""  # the message's text so far
        self.message_open = False
        self.calls: dict[int, dict] = {}  # per call index, its output item

    def event(self, kind: str, **fields) -> str:
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': self.seq - 1, **fields})}\n\n"

    def delta(self, delta: dict) -> list[str]:
        """The events of one chat delta: text into the message (opened at its first), or call pieces."""
        frames = self.text_delta(delta["content"]) if delta.get("content") else []
        for entry in delta.get("tool_calls") or ():
            frames += self.call_delta(entry)
        return frames

    def text_delta(self, text: str) -> list[str]:
        ids, frames = self.ids, []
        if not self.message_open:
            self.message_open = True
            item = {"type": "message", "id": ids.message, "status": "in_progress", "role": "assistant", "content": []}
            frames += [
                self.event("response.output_item.added", output_index=0, item=item),
                self.event(
                    "response.content_part.added",
                    item_id=ids.message,
                    output_index=0,
                    content_index=0,
                    part={"type": "output_text", "text": "", "annotations": []},
                ),
            ]
        self.text += text
        frames.append(
            self.event(
                "response.output_text.delta",
                item_id=ids.message,
                output_index=0,
                content_index=0,
                delta=text,
                logprobs=[],
            )
        )
        return frames

    def call_delta(self, entry: dict) -> list[str]:
        ids, frames, index = self.ids, [], entry["index"]
        if index not in self.calls:
            if self.calls:  # the one before is whole: it closes before this one opens, as OpenAI's do
                frames += self.call_done(max(self.calls))
            self.calls[index] = {
                "type": "function_call",
                "id": ids.call(index),
                "call_id": entry["id"],
                "name": entry["function"]["name"],
                "arguments": "",
                "status": "in_progress",
            }
            frames.append(self.event("response.output_item.added", output_index=index, item=dict(self.calls[index])))
        piece = entry["function"].get("arguments") or ""
        if piece:
            self.calls[index]["arguments"] += piece
            frames.append(
                self.event(
                    "response.function_call_arguments.delta", item_id=ids.call(index), output_index=index, delta=piece
                )
            )
        return frames

    def call_done(self, index: int, status: str = "completed") -> list[str]:
        item = self.calls[index] = {**self.calls[index], "status": status}
        return [
            self.event(
                "response.function_call_arguments.done",
                item_id=item["id"],
                output_index=index,
                arguments=item["arguments"],
            ),
            self.event("response.output_item.done", output_index=index, item=item),
        ]

    def closing(self, chat: ChatRequest, status: str) -> tuple[list[str], list[dict]]:
        """The events that close what is open, and the output items they leave."""
        if self.calls:
            frames = self.call_done(max(self.calls), "incomplete" if status == "incomplete" else "completed")
            return frames, [self.calls[index] for index in sorted(self.calls)]
        ids, frames = self.ids, []
        output = _items(chat, ids, self.text, [], status)
        part = output[0]["content"][0]
        if not self.message_open:  # nothing came: the item still opens and closes, as OpenAI's stream does
            frames += [
                self.event("response.output_item.added", output_index=0, item={**output[0], "content": []}),
                self.event(
                    "response.content_part.added",
                    item_id=ids.message,
                    output_index=0,
                    content_index=0,
                    part={**part, "text": ""},
                ),
            ]
        frames += [
            self.event(
                "response.output_text.done",
                item_id=ids.message,
                output_index=0,
                content_index=0,
                text=self.text,
                logprobs=[],
            ),
            self.event("response.content_part.done", item_id=ids.message, output_index=0, content_index=0, part=part),
            self.event("response.output_item.done", output_index=0, item=output[0]),
        ]
        return frames, output


async def stream(
    chat: ChatRequest,
    request_id: str,
    model: str,
    num_prompt: int,
    streams: list[AsyncIterator[RequestOutput]],
    detokenize,
    logprobs=None,
) -> AsyncIterator[str]:
    """The answer as the Responses API's typed events (each chat delta's, sent as it comes; the first write carries
    response.created and response.in_progress with it)."""
    ids, created, finals = _Ids(request_id), time.time(), [None]
    events = _Events(ids)
    skeleton = _response(chat, ids, model, created, "in_progress", [], None)
    pending = events.event("response.created", response=skeleton) + events.event(
        "response.in_progress", response=skeleton
    )
    try:
        async with contextlib.aclosing(choice_deltas(0, chat, streams[0], detokenize, None, finals)) as deltas:
            async for choice in deltas:
                frames = events.delta(choice.get("delta", {}))
                if frames:
                    yield pending + "".join(frames)
                    pending = ""
    except Exception as e:  # a stage failed mid-stream (or a bug of ours): say so, as OpenAI's stream does
        if not isinstance(e, ApiError):
            log.exception("response %s failed mid-stream", ids.response)
            e = internal_error(e)
        yield pending + events.event("error", code=str(e.status), message=e.message, param=e.param)
        return
    status, incomplete = _status(finals[0])
    frames, output = events.closing(chat, status)
    final = _response(chat, ids, model, created, status, output, _usage(num_prompt, finals[0]), incomplete)
    kind = "response.completed" if status == "completed" else "response.incomplete"
    yield pending + "".join(frames) + events.event(kind, response=final)
