"""OpenAI's text completions (`POST /v1/completions`), as vLLM serves them for a multimodal model: a text prompt, or
its token ids, continued as it is — no chat template, no images — through the same stages as a chat.

The request is a `ChatRequest` with a `prompt` and no conversation; what differs from a chat is read here: the
prompt, `max_tokens` (16 when left out, OpenAI's and vLLM's default for completions), and `logprobs` (an integer:
how many alternatives per token, in the legacy form `tokens` / `token_logprobs` / `top_logprobs` / `text_offset`).
"""

from __future__ import annotations

from services.gateway.errors import ApiError
from services.gateway.protocol import ChatRequest, common_fields, is_token_id, json_body, parse_sampling

DEFAULT_MAX_TOKENS = 16
MAX_LEGACY_LOGPROBS = 20


def parse_completion_request(raw: bytes, served_models: list[str]) -> ChatRequest:
    body = json_body(raw, served_models)
    prompt = _prompt(body.get("prompt"))
    if body.get("tools"):
        raise ApiError(
            400, "'tools' are for /v1/chat/completions; a text completion continues its prompt as it is", "tools"
        )
    if body.get("suffix"):
        raise ApiError(400, "'suffix' (insertion) is not supported by this server; leave it out", "suffix")
    sampling_body = {k: v for k, v in body.items() if k not in ("prompt", "suffix")}  # the rest is a chat's
    if body.get("max_tokens") is None:  # 16, or min_tokens when that asks for more
        min_tokens = body.get("min_tokens")
        sampling_body["max_tokens"] = max(DEFAULT_MAX_TOKENS, min_tokens if isinstance(min_tokens, int) else 0)
    logprobs = body.get("logprobs")
    if logprobs is not None:
        if isinstance(logprobs, bool) or not isinstance(logprobs, int) or not 0 <= logprobs <= MAX_LEGACY_LOGPROBS:
            raise ApiError(
                400,
                f"'logprobs' must be an integer from 0 to {MAX_LEGACY_LOGPROBS} (alternatives per "
                "token) for completions",
                "logprobs",
            )
        sampling_body.update(logprobs=True, top_logprobs=logprobs)
    if body.get("top_logprobs") is not None:
        raise ApiError(400, "completions take 'logprobs': <number of alternatives>, not 'top_logprobs'", "top_logprobs")
    return ChatRequest(conversation=[], sampling=parse_sampling(sampling_body), prompt=prompt, **common_fields(body))


def _prompt(value) -> str | list[int]:
    """One prompt: a string, or a list of token ids; a list holding exactly one of them is that one."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]
    if isinstance(value, str) and value:
        return value
    if isinstance(value, list) and value and all(is_token_id(t) for t in value):
        return list(value)
    if isinstance(value, list) and len(value) > 1 and all(isinstance(p, (str, list)) for p in value):
        raise ApiError(
            400,
            f"'prompt' holds {len(value)} prompts; this server takes one per request (send them as "
            "separate requests, which it batches)",
            "prompt",
        )
    raise ApiError(400, "'prompt' must be a non-empty string or a non-empty list of token ids", "prompt")


def legacy_logprobs(entries: list[dict], offset: int = 0) -> tuple[dict, int]:
    """OpenAI-form entries (`responses.Logprobs`) in the completions API's legacy form; `offset`: where in the
    completion's text the first entry's token starts. Also returns where the next one would."""
    tokens, values, tops, offsets = [], [], [], []
    for entry in entries:  # each position's alternatives and the sampled token, as vLLM gives up to logprobs + 1
        tokens.append(entry["token"])
        values.append(entry["logprob"])
        tops.append(
            {**{alt["token"]: alt["logprob"] for alt in entry["top_logprobs"]}, entry["token"]: entry["logprob"]}
        )
        offsets.append(offset)
        offset += len(entry["token"])
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}, offset
