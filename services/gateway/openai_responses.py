"""OpenAI's Responses API (`POST /v1/responses`), as vLLM serves it: the request is read as the chat it is and goes
through the same stages; the answer comes back as a `response` object, or streamed as its typed events.

What a request is read as (everything else a chat takes, the same way):
  input            a string (one user message), or items: messages (`input_text`, `input_image` with a data URI or,
                   where allowed, an http(s) URL; an assistant's `output_text`), `function_call` (a call made
                   earlier) and `function_call_output` (its result)
  instructions     a system message before them
  max_output_tokens, temperature, top_p   as max_tokens, temperature, top_p
  text.format      {"type": "text" | "json_object" | "json_schema", name, schema, strict}  as response_format
  tools, tool_choice, parallel_tool_calls  function tools (flat: {type, name, description, parameters, strict}) and
                   "auto" (the default) / "none" / "required" / {"type": "function", "name"}; as a chat's (`tools.py`)
Not kept: nothing is stored (`store` changes nothing here), so `previous_response_id` and `conversation` are refused:
send the conversation so far in `input`. `background`, `include`, `top_logprobs`, `prompt`, `max_tool_calls` and
`truncation: "auto"` are refused; `reasoning`, `metadata`, `user` and the like are taken as they change no answer.

Streamed: response.created, response.in_progress, then per output item its `output_item.added`, its deltas
(`output_text.delta` or `function_call_arguments.delta`) and its `done` events, and last `response.completed` (or
`response.incomplete` when max_output_tokens cut it) with the whole response; each event numbered by
`sequence_number`, as `event: <type>` + `data: <json>` frames.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import time
from collections.abc import AsyncIterator

from common.engine.outputs import RequestOutput
from services.gateway.errors import ApiError
from services.gateway.fields import warn_unknown
from services.gateway.protocol import ChatRequest, json_body, parse_chat_body
from services.gateway.responses import choice_deltas, internal_error
from services.gateway.tools import calls_in

log = logging.getLogger(__name__)

# taken from the request and passed on as a chat's fields of the same meaning
PASSED = (
    "stream",
    "temperature",
    "top_p",
    "parallel_tool_calls",
    "seed",
    "top_k",
    "min_p",
    "repetition_penalty",
    "stop",
    "min_tokens",
    "ignore_eos",
    "slo",
    "chat_template_kwargs",
    "logit_bias",
    "cache_salt",
)
REFUSED = ("previous_response_id", "conversation", "background", "prompt", "max_tool_calls")
ECHOED = (
    "instructions",
    "metadata",
    "user",
    "temperature",
    "top_p",
    "max_output_tokens",
    "parallel_tool_calls",
    "tool_choice",
    "tools",
    "text",
    "reasoning",
    "service_tier",
    "truncation",
)
KNOWN = {
    "model",
    "input",
    "instructions",
    "max_output_tokens",
    "text",
    "tools",
    "tool_choice",
    "include",
    "top_logprobs",
    "truncation",
    "store",
    "metadata",
    "user",
    "reasoning",
    "service_tier",
    "safety_identifier",
    "prompt_cache_key",
    "stream_options",
    *PASSED,
    *REFUSED,
}


def parse_responses_request(raw: bytes, served_models: list[str], allow_remote_images: bool = False) -> ChatRequest:
    body = json_body(raw, served_models)
    for key in REFUSED:
        if body.get(key) is not None:
            raise ApiError(
                400,
                f"'{key}' is not supported: this server keeps no responses; send the whole conversation in 'input'"
                if key in ("previous_response_id", "conversation")
                else f"'{key}' is not supported by this server; leave it out",
                key,
            )
    if body.get("include") or body.get("top_logprobs"):
        key = "include" if body.get("include") else "top_logprobs"
        raise ApiError(400, f"'{key}' is not supported by this server (logprobs come with /v1/chat/completions)", key)
    if body.get("truncation") not in (None, "disabled"):
        raise ApiError(
            400,
            "'truncation' must be \"disabled\": a conversation that does not fit is a 400, not cut "
            '("auto" is not supported)',
            "truncation",
        )
    if body.get("metadata") is not None and not isinstance(body["metadata"], dict):
        raise ApiError(400, "'metadata' must be an object of strings", "metadata")
    warn_unknown(body, KNOWN)
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise ApiError(400, "'instructions' must be a string", "instructions")
    messages, origins = _messages(body.get("input"))
    if instructions:
        messages, origins = [{"role": "system", "content": instructions}, *messages], [("instructions", []), *origins]
    try:
        request = parse_chat_body(_chat_body(body, messages), allow_remote_images)
    except ApiError as e:
        raise in_responses_terms(e, origins) from None
    request.echo = {k: body.get(k) for k in ECHOED}
    return request


def _chat_body(body: dict, messages: list[dict]) -> dict:
    chat = {"model": body["model"], "messages": messages, **{k: body[k] for k in PASSED if k in body}}
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    response_format = _response_format(body.get("text"))
    if response_format is not None:
        chat["response_format"] = response_format
    if body.get("tools"):
        chat["tools"] = [_tool(t, i) for i, t in enumerate(_listed(body["tools"], "tools"))]
    if body.get("tool_choice") is not None:
        choice = body["tool_choice"]
        chat["tool_choice"] = (
            {"type": "function", "function": {"name": choice.get("name")}}
            if isinstance(choice, dict) and choice.get("type") == "function"
            else choice
        )
    return chat


# a chat's words for what the Responses API calls otherwise: errors say what the client sent
TERMS = [
    ('{"type": "function", "function": {"name": ...}}', '{"type": "function", "name": ...}'),
    ("max_tokens", "max_output_tokens"),
    ("response_format", "text.format"),
    (".function.", "."),
]
PARAMS = {"max_tokens": "max_output_tokens", "messages": "input", "response_format": "text"}


def in_responses_terms(error: ApiError, origins: list | None = None) -> ApiError:
    """`error`, raised by the chat path a Responses request runs on, in the Responses API's terms: its fields' names,
    and `messages[i]` as the input item (or the instructions) message i came from."""
    message = error.message
    for chat, ours in TERMS:
        message = message.replace(chat, ours)
    if origins is not None:

        def where(match: re.Match) -> str:
            index = int(match.group(1))
            if index >= len(origins):
                return match.group(0)
            origin, calls = origins[index]
            if match.group(2) is not None and int(match.group(2)) < len(calls):
                return calls[int(match.group(2))]
            return origin

        message = re.sub(r"messages\[(\d+)\](?:\.tool_calls\[(\d+)\])?", where, message)
    return ApiError(error.status, message, PARAMS.get(error.param, error.param), error.kind, error.headers)


def _listed(value, name: str) -> list:
    if not isinstance(value, list):
        raise ApiError(400, f"'{name}' must be a list", name)
    return value


def _messages(items) -> tuple[list[dict], list[tuple[str, list[str]]]]:
    """`input` as a chat's messages: consecutive function calls become one assistant message with tool_calls. Also
    where each message came from (its input item, and its calls' items), for errors."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}], [("input", [])]
    if not isinstance(items, list) or not items:
        raise ApiError(400, "'input' must be a string or a non-empty list of input items", "input")
    out: list[dict] = []
    origins: list[tuple[str, list[str]]] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message":
            if item.get("role") not in ("user", "assistant", "system", "developer"):
                raise ApiError(
                    400,
                    f"{where}.role must be user, assistant, system or developer, got "
                    f"{item.get('role')!r} (a tool's result is a function_call_output item)",
                    "input",
                )
            out.append({"role": item["role"], "content": _content(item.get("content"), where)})
            origins.append((where, []))
        elif kind == "function_call":
            if not isinstance(item.get("call_id"), str) or not isinstance(item.get("name"), str):
                raise ApiError(400, f"{where}: a function_call needs its call_id and name (strings)", "input")
            call = {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": item.get("arguments", "{}")},
            }
            if (
                out
                and out[-1]["role"] == "assistant"
                and out[-1].get("tool_calls") is not None
                and not out[-1]["content"]
            ):
                out[-1]["tool_calls"].append(call)
                origins[-1][1].append(where)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
                origins.append((where, [where]))
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str) or "output" not in item:
                raise ApiError(
                    400, f"{where}: a function_call_output needs the call_id it answers and its output", "input"
                )
            output = item["output"]
            if not isinstance(output, str):
                output = json.dumps(output) if output is not None else ""
            out.append({"role": "tool", "tool_call_id": item["call_id"], "content": output})
            origins.append((where, []))
        else:
            raise ApiError(
                400, f"{where} must be a message, a function_call or a function_call_output item, got {kind!r}", "input"
            )
    return out, origins


def _content(content, where: str):
    """A message's content in the chat form: input_text / output_text → text parts, input_image → image_url parts."""
    if isinstance(content, str) or content is None:
        return content
    if not isinstance(content, list):
        raise ApiError(400, f"{where}.content must be a string or a list of content parts", "input")
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text"):
            parts.append({"type": "text", "text": part.get("text")})
        elif kind == "input_image":
            url = part.get("image_url")
            if not isinstance(url, str):
                raise ApiError(
                    400,
                    f"{where}.content[{j}]: an input_image needs an image_url (a data URI; file ids are not supported)",
                    "input",
                )
            parts.append({"type": "image_url", "image_url": {"url": url}})
        else:
            raise ApiError(
                400, f"{where}.content[{j}] must be input_text, input_image or output_text, got {kind!r}", "input"
            )
    return parts


def _response_format(text) -> dict | None:
    if text is None:
        return None
    form = text.get("format") if isinstance(text, dict) else None
    if not isinstance(text, dict) or (form is not None and not isinstance(form, dict)):
        raise ApiError(
            400, '\'text\' must be {"format": {"type": "text" | "json_object" | "json_schema", ...}}', "text"
        )
    if form is None or form.get("type") == "text":
        return None
    if form.get("strict") is not None and not isinstance(form["strict"], bool):
        raise ApiError(400, "text.format.strict must be true or false", "text")
    if form.get("type") == "json_schema":
        if not isinstance(form.get("schema"), dict):
            raise ApiError(400, "text.format of type json_schema needs its 'schema' (an object)", "text")
        return {"type": "json_schema", "json_schema": {k: form[k] for k in ("name", "schema", "strict") if k in form}}
    return form


def _tool(tool, i: int) -> dict:
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise ApiError(
            400, f'tools[{i}]: only function tools are supported (type "function", name, parameters)', "tools"
        )
    return {
        "type": "function",
        "function": {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool},
    }


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
