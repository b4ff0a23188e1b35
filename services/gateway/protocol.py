"""OpenAI chat-completions requests in, validated `ChatRequest`s out; errors as OpenAI error JSON.

Everything a client can get wrong is caught here with a message that says what to fix:
malformed JSON, unknown model, bad message shapes, broken or oversized images, remote image
URLs (refused unless enabled), out-of-range sampling parameters.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from common.sampling import SEED_MIN, InvalidSamplingParams, SamplingParams
from services.gateway.errors import ApiError
from services.gateway.fields import refuse_unsupported
from services.gateway.images import image_part
from services.gateway.structured import parse_grammar
from services.gateway.tools import ToolChoice, parse_tools, tool_grammar

__all__ = ["ChatRequest", "check_length", "parse_chat_request", "parse_conversation", "parse_sampling"]
MAX_STOP_STRINGS = 4
MAX_CHOICES = 16  # n: each choice is a request of its own, with its own KV reservation
MAX_TOKEN_ID = 2**31 - 1  # what the mesh's wire carries; the model's vocabulary is checked where it runs
INLINE_TOKENIZE_CHARS = 4096  # text up to this many characters is tokenized on the event loop: a thread hop costs more


@dataclasses.dataclass(slots=True)
class ChatRequest:
    model: str
    conversation: list[dict]  # HF chat format; image parts carry PIL images (a remote one its URL until fetched)
    sampling: SamplingParams
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False  # usage in every streamed chunk, counted to that chunk (vLLM's extension)
    return_token_ids: bool = False
    slo_ttft_ms: float | None = None  # this request's own targets (body field "slo"); None: the server's defaults
    slo_tbt_ms: float | None = None
    n: int = 1  # choices: n requests of the same prompt
    max_tokens_given: bool = True  # False: `sampling.max_tokens` is a placeholder until the prompt's length is known
    prompt: str | list[int] | None = None  # a text completion's (`/v1/completions`): no chat template, no images
    tools: ToolChoice | None = None  # the tools sent, and whether the answer calls them (`tools.py`)
    template_kwargs: dict | None = None  # `chat_template_kwargs`: variables for the chat template
    echo: dict | None = None  # a /v1/responses request's own fields, which its response object repeats
    cache_salt: str = ""  # vLLM's: this request shares prefix-cache blocks only with requests of the same salt

    @property
    def tool_definitions(self) -> list[dict] | None:
        """The tools as the chat template takes them (None: none sent)."""
        return self.tools.definitions if self.tools is not None else None

    def sampling_for(self, num_prompt_tokens: int, context_tokens: int) -> SamplingParams:
        """The sampling parameters once the prompt's length is known: a left-out max_tokens is the rest of the
        context (`context_tokens`: the model's limit, or less where the decoders' caches hold less), as vLLM
        defaults it; never below min_tokens or 1 (a prompt that fills the context is refused by the length check)."""
        if self.max_tokens_given:
            return self.sampling
        rest = max(context_tokens - num_prompt_tokens, self.sampling.min_tokens, 1)
        return dataclasses.replace(self.sampling, max_tokens=rest)

    def choice(self, index: int) -> ChatRequest:
        """Choice `index` of n: seed s becomes s + index (wrapping within 64 bits), as vLLM seeds its n sequences."""
        seed = self.sampling.seed
        if seed is None:
            return dataclasses.replace(self, n=1)
        seed = (seed + index - SEED_MIN) % 2**64 + SEED_MIN
        return dataclasses.replace(self, n=1, sampling=dataclasses.replace(self.sampling, seed=seed))

    @property
    def is_text_completion(self) -> bool:
        return self.prompt is not None

    @property
    def num_text_chars(self) -> int:
        """The text the prompt is built from: the messages' text, earlier calls' arguments and the tools' definitions
        (as JSON), which the template may render."""
        if self.prompt is not None:
            return len(self.prompt) if isinstance(self.prompt, str) else 0
        n = sum(
            len(part["text"]) for message in self.conversation for part in message["content"] if part["type"] == "text"
        )
        n += sum(
            len(json.dumps(call["function"]["arguments"]))
            for message in self.conversation
            for call in message.get("tool_calls") or ()
        )
        return n + (self.tools.text_chars if self.tools is not None else 0)

    @property
    def num_images(self) -> int:
        return sum(part["type"] == "image" for message in self.conversation for part in message["content"])

    @property
    def short_text(self) -> bool:
        """Its text is short enough to tokenize on the event loop (`INLINE_TOKENIZE_CHARS`)."""
        return self.num_text_chars <= INLINE_TOKENIZE_CHARS


def check_length(num_tokens: int, max_tokens: int, max_model_len: int, max_tokens_given: bool = True) -> None:
    """A 400 when the prompt and what it may generate do not fit the model."""
    if not max_tokens_given and num_tokens >= max_model_len:
        raise ApiError(
            400,
            f"the prompt ({num_tokens} tokens) leaves no room to generate within the model's limit of "
            f"{max_model_len} tokens; shorten it",
            "messages",
        )
    total = num_tokens + max_tokens
    if total > max_model_len:
        raise ApiError(
            400,
            f"prompt ({num_tokens} tokens) plus max_tokens ({max_tokens}) is {total}, "
            f"over the model's limit of {max_model_len}; shorten the prompt or lower max_tokens",
        )


def parse_chat_request(raw: bytes, served_models: list[str], allow_remote_images: bool = False) -> ChatRequest:
    return parse_chat_body(json_body(raw, served_models), allow_remote_images)


def parse_chat_body(body: dict, allow_remote_images: bool = False) -> ChatRequest:
    """A chat-completions body (a JSON object naming a served model) as the request it asks for."""
    conversation = parse_conversation(body.get("messages"), allow_remote_images)
    tools = parse_tools(body)
    return ChatRequest(
        conversation=conversation,
        sampling=parse_sampling(body, tool_grammar(tools)),
        tools=tools,
        template_kwargs=parse_template_kwargs(body),
        **common_fields(body),
        max_tokens_given=body.get("max_completion_tokens") is not None or body.get("max_tokens") is not None,
    )


def parse_template_kwargs(body: dict) -> dict | None:
    """vLLM's `chat_template_kwargs`: an object of variables for the chat template (e.g. {"enable_thinking": false});
    one the template does not read changes nothing and is left out; one the server sets itself is a 400."""
    from common.model.processor import RESERVED_TEMPLATE_VARIABLES

    value = body.get("chat_template_kwargs")
    if value is None or value == {}:
        return None
    if not isinstance(value, dict):
        raise ApiError(
            400, "'chat_template_kwargs' must be an object of the chat template's variables", "chat_template_kwargs"
        )
    reserved = sorted(set(value) & RESERVED_TEMPLATE_VARIABLES)
    if reserved:
        raise ApiError(
            400,
            f"chat_template_kwargs may not set {', '.join(reserved)}: the server sets "
            f"{'them' if len(reserved) > 1 else 'it'} (send it as its own field where there is one)",
            "chat_template_kwargs",
        )
    return value


def parse_conversation(messages, allow_remote_images: bool = False) -> list[dict]:
    """A chat's `messages` in the HF chat format the processor takes (image parts decoded, checked)."""
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list of {role, content} objects", "messages")
    return [_parse_message(m, i, allow_remote_images) for i, m in enumerate(messages)]


def json_body(raw: bytes, served_models: list[str], default_model: str | None = None) -> dict:
    """The request body as a JSON object that names a model this server serves (or names none, when there is a
    `default_model` to take)."""
    try:
        text = raw.decode("utf-8-sig")  # a leading byte-order mark, which some clients send, is not an error
    except UnicodeDecodeError as e:
        raise ApiError(400, f"request body must be UTF-8 encoded JSON (byte {e.start} is not UTF-8)") from None
    try:
        body = json.loads(text)
    except json.JSONDecodeError as e:
        raise ApiError(400, f"request body is not valid JSON: {e}") from None
    except RecursionError:
        raise ApiError(400, "request body nests too deeply (over ~1,000 levels of arrays or objects)") from None
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object")
    if body.get("model") is None and default_model is not None:
        body["model"] = default_model
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise ApiError(
            400, f"'model' must be a string, got {type(model).__name__}; this server serves {served_models}", "model"
        )
    if not model:
        raise ApiError(400, f"'model' is required; this server serves {served_models}", "model")
    if model not in served_models:
        raise ApiError(404, f"the model '{model}' does not exist; this server serves {served_models}", "model")
    return body


def common_fields(body: dict) -> dict:
    """What chat and text completions read alike: the model, n, streaming and its options, our extensions."""
    n = _typed(body, "n", int, 1)
    if not 1 <= n <= MAX_CHOICES:
        raise ApiError(400, f"'n' must be between 1 and {MAX_CHOICES}, got {n}", "n")
    stream_options = body.get("stream_options") or {}
    if not isinstance(stream_options, dict):
        raise ApiError(400, "'stream_options' must be an object", "stream_options")
    if stream_options and not body.get("stream"):
        raise ApiError(400, "'stream_options' is only for streamed requests (\"stream\": true)", "stream_options")
    include_usage = _typed(stream_options, "include_usage", bool, False)
    continuous = _typed(stream_options, "continuous_usage_stats", bool, False)
    salt = body.get("cache_salt")
    if salt is not None and not (isinstance(salt, str) and salt):
        raise ApiError(
            400,
            "'cache_salt' must be a non-empty string (a secret of the tenant's, e.g. 43 characters of "
            "base64: 256 random bits)",
            "cache_salt",
        )
    return dict(
        model=body["model"],
        stream=_typed(body, "stream", bool, False),
        n=n,
        include_usage=include_usage,
        continuous_usage=include_usage and continuous,
        return_token_ids=_typed(body, "return_token_ids", bool, False),
        cache_salt=salt or "",
        **_parse_slo(body.get("slo")),
    )


def _typed(body: dict, key: str, kind, default):
    value = body.get(key, default)
    if value is None:
        return default
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
        raise ApiError(400, f"'{key}' must be {kind.__name__}, got {type(value).__name__}", key)
    return value


def _parse_slo(slo: Any) -> dict:
    """`"slo": {"ttft_ms": 500, "tbt_ms": 50}` — an extension: this request's latency targets."""
    if slo is None:
        return {}
    if not isinstance(slo, dict) or not set(slo) <= {"ttft_ms", "tbt_ms"}:
        raise ApiError(400, "'slo' must be an object with 'ttft_ms' and/or 'tbt_ms' (milliseconds)", "slo")
    out = {}
    for key in ("ttft_ms", "tbt_ms"):
        if key in slo:
            value = slo[key]
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 3_600_000:
                raise ApiError(400, f"'slo.{key}' must be a positive number of milliseconds", "slo")
            out[f"slo_{key}"] = float(value)
    return out


def parse_sampling(body: dict, tools_grammar: str | None = None) -> SamplingParams:
    """`tools_grammar`: the grammar of the tool calls the answer must be (`tools.tool_grammar`), if any."""
    max_tokens = _typed(body, "max_completion_tokens", int, None)
    if max_tokens is None:  # left out: the rest of the context once the prompt is counted (`ChatRequest.sampling_for`)
        max_tokens = _typed(body, "max_tokens", int, max(1, _typed(body, "min_tokens", int, 0)))
    stop = body.get("stop")
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > MAX_STOP_STRINGS:
        raise ApiError(400, f"'stop' must be a non-empty string or a list of up to {MAX_STOP_STRINGS} of them", "stop")
    stop_ids = body.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or not all(is_token_id(t) for t in stop_ids):
        raise ApiError(
            400, f"'stop_token_ids' must be a list of token ids (integers 0 to {MAX_TOKEN_ID})", "stop_token_ids"
        )
    refuse_unsupported(body)
    grammar = parse_grammar(body, tools_grammar)
    logprobs = _typed(body, "logprobs", bool, False)
    top_logprobs = _typed(body, "top_logprobs", int, None)
    if top_logprobs is not None and not logprobs:
        raise ApiError(400, "'top_logprobs' needs 'logprobs': true", "top_logprobs")
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=_typed(body, "temperature", float, 1.0),
            top_p=_typed(body, "top_p", float, 1.0),
            top_k=_parse_top_k(body),
            seed=_typed(body, "seed", int, None),
            stop=tuple(stop),
            stop_token_ids=tuple(stop_ids),
            ignore_eos=_typed(body, "ignore_eos", bool, False),
            logprobs=(top_logprobs or 0) if logprobs else None,
            presence_penalty=_typed(body, "presence_penalty", float, 0.0),
            frequency_penalty=_typed(body, "frequency_penalty", float, 0.0),
            repetition_penalty=_typed(body, "repetition_penalty", float, 1.0),
            logit_bias=_parse_logit_bias(body.get("logit_bias")),
            grammar=grammar,
            min_tokens=_typed(body, "min_tokens", int, 0),
            min_p=_typed(body, "min_p", float, 0.0),
        )
    except InvalidSamplingParams as e:
        raise ApiError(400, str(e), e.param) from None


def _parse_top_k(body: dict) -> int:
    """vLLM's extension: 0 or -1 means no top-k cut."""
    top_k = _typed(body, "top_k", int, 0)
    if top_k < -1:
        raise ApiError(400, f"top_k must be -1 or 0 (no cut) or at least 1, got {top_k}", "top_k")
    return max(0, top_k)


def _parse_logit_bias(value: Any) -> tuple[tuple[int, float], ...]:
    """OpenAI's `{"<token id>": bias}` → ((token id, bias), …), ids in ascending order."""
    if value is None:
        return ()
    try:
        if not isinstance(value, dict) or any(
            isinstance(b, bool) or not isinstance(b, (int, float)) for b in value.values()
        ):
            raise ValueError
        bias = tuple(sorted((int(token), float(bias)) for token, bias in value.items()))
        if not all(is_token_id(token) for token, _ in bias):
            raise ValueError
        return bias
    except ValueError:
        raise ApiError(
            400,
            f"'logit_bias' must map token ids (as strings, 0 to {MAX_TOKEN_ID}) to numbers between -100 and 100",
            "logit_bias",
        ) from None


def is_token_id(value: Any) -> bool:
    """An integer a token id can be (the model checks it against its vocabulary)."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_TOKEN_ID


def _parse_message(message: Any, index: int, allow_remote: bool) -> dict:
    where = f"messages[{index}]"
    if not isinstance(message, dict):
        raise ApiError(400, f"{where} must be an object with 'role' and 'content'", "messages")
    role = message.get("role")
    if role == "developer":  # OpenAI's newer name for the system role; chat templates know "system"
        role = "system"
    if role not in ("system", "user", "assistant", "tool"):
        raise ApiError(
            400, f"{where}.role must be 'system', 'developer', 'user', 'assistant' or 'tool', got {role!r}", "messages"
        )
    content = message.get("content")
    extra = {}
    if role == "assistant" and message.get("tool_calls") is not None:  # a call it made earlier in the chat
        extra["tool_calls"] = _earlier_calls(message["tool_calls"], where)
        content = [] if content is None else content
    if role == "tool" and message.get("tool_call_id") is not None:
        if not isinstance(message["tool_call_id"], str):
            raise ApiError(400, f"{where}.tool_call_id must be a string", "messages")
        extra["tool_call_id"] = message["tool_call_id"]
    if isinstance(content, str):
        return {"role": role, "content": [{"type": "text", "text": _unicode(content, f"{where}.content")}], **extra}
    if not isinstance(content, list):
        raise ApiError(400, f"{where}.content must be a string or a list of content parts", "messages")
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": _unicode(part["text"], f"{where}.content[{j}]")})
        elif kind == "image_url":
            url = part.get("image_url", {})
            url = url.get("url") if isinstance(url, dict) else url
            if role != "user":
                raise ApiError(400, f"{where}: images are accepted in user messages only", "messages")
            parts.append(image_part(url, f"{where}.content[{j}]", allow_remote))
        else:
            raise ApiError(
                400,
                f"{where}.content[{j}] must be {{type: text, text}} or {{type: image_url, image_url: {{url}}}}",
                "messages",
            )
    return {"role": role, "content": parts, **extra}


def _unicode(text: str, where: str) -> str:
    """`text`, if it is Unicode a tokenizer can take (JSON's \\ud800-style escapes can make lone surrogates)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ApiError(
            400,
            f"{where} holds a lone UTF-16 surrogate ({text[e.start]!r} at {e.start}), which is not "
            "text; send valid Unicode",
            "messages",
        ) from None
    return text


def _earlier_calls(calls: Any, where: str) -> list[dict]:
    """An assistant message's `tool_calls` in the form chat templates take (arguments as an object, as vLLM hands
    them to Hugging Face templates)."""
    if not isinstance(calls, list):
        raise ApiError(
            400,
            f"{where}.tool_calls must be a list of {{id, type: function, function: {{name, arguments}}}}}}}}",
            "messages",
        )
    out = []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ApiError(
                400,
                f"{where}.tool_calls[{j}] must be {{id, type: function, function: {{name, arguments}}}}",
                "messages",
            )
        arguments = function.get("arguments", "{}")
        try:
            arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
        except json.JSONDecodeError:
            arguments = None
        if not isinstance(arguments, dict):
            raise ApiError(
                400,
                f"{where}.tool_calls[{j}].function.arguments must be the arguments as a JSON object (its text)",
                "messages",
            )
        out.append(
            {"id": call.get("id"), "type": "function", "function": {"name": function["name"], "arguments": arguments}}
        )
    return out
