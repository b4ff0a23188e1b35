"""Reading a request of OpenAI's Responses API (`POST /v1/responses`) as the chat it is; `openai_responses.py`
answers it.

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
"""

from __future__ import annotations

import json
import logging
import re

from services.gateway.errors import ApiError
from services.gateway.fields import warn_unknown
from services.gateway.protocol import ChatRequest, json_body, parse_chat_body

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
# fields a response echoes back as they were sent
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
