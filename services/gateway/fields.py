"""Which request fields the gateway knows: OpenAI's and vLLM's parameters it serves only with their neutral values
(refused otherwise: an answer must not silently ignore what was asked), and the rest it reads; a field neither knows
is served and named once in the log, as vLLM does."""

from __future__ import annotations

import logging

from services.gateway.errors import ApiError

log = logging.getLogger(__name__)


def refuse_unsupported(body: dict) -> None:
    """OpenAI parameters this server does not implement: a clear 400 rather than an answer that silently
    ignored what was asked (a client sending them with their neutral values is served)."""
    for key, neutral in NEUTRAL_ONLY.items():
        if key in body and body[key] not in neutral:
            raise ApiError(
                400, f"'{key}' is not supported by this server (it would change the answer); leave it out", key
            )
    warn_unknown(body, KNOWN_FIELDS | NEUTRAL_ONLY.keys())


def warn_unknown(body: dict, known) -> None:
    """As vLLM does: fields neither OpenAI nor this server knows are served, and named once in the log (a typo of a
    known field shows up here)."""
    if len(_warned) < MAX_WARNED_FIELDS and (unknown := sorted(set(body) - set(known) - _warned)):
        unknown = unknown[: MAX_WARNED_FIELDS - len(_warned)]
        _warned.update(unknown)
        log.warning(
            "request fields ignored (not OpenAI's or this server's): %s",
            ", ".join(unknown[:10]) + (f" and {len(unknown) - 10} more" if len(unknown) > 10 else ""),
        )


# OpenAI's and vLLM's parameters whose effect this server does not implement: served with their neutral values
# (which many clients send by default), refused with a 400 otherwise, rather than silently ignored
NEUTRAL_ONLY: dict[str, tuple] = {
    "best_of": (None, 1),
    "use_beam_search": (None, False),
    "length_penalty": (None, 1, 1.0),
    "prompt_logprobs": (None,),
    "include_stop_str_in_output": (None, False),
    "skip_special_tokens": (None, True),
    "spaces_between_special_tokens": (None, True),
    "truncate_prompt_tokens": (None,),
    "echo": (None, False),
    "add_generation_prompt": (None, True),
    "continue_final_message": (None, False),
    "chat_template": (None,),
    "guided_grammar": (None,),
    "allowed_token_ids": (None,),
    "bad_words": (None, []),
    "logits_processors": (None,),
    "functions": (None, []),
    "function_call": (None, "none"),
    "audio": (None,),
    "prediction": (None,),
    "web_search_options": (None,),
    "modalities": (None, ["text"]),
}
# what the gateway reads, and OpenAI's bookkeeping fields that do not change an answer
KNOWN_FIELDS = {
    "model",
    "messages",
    "n",
    "stream",
    "stream_options",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "logprobs",
    "top_logprobs",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "min_tokens",
    "min_p",
    "return_token_ids",
    "slo",
    "tools",
    "tool_choice",
    "response_format",
    "user",
    "metadata",
    "store",
    "service_tier",
    "parallel_tool_calls",
    "reasoning_effort",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "structured_outputs",
    "chat_template_kwargs",
    "cache_salt",
}
_warned: set[str] = set()
MAX_WARNED_FIELDS = 1000  # names remembered (a body with a million random keys must not grow this without end)
