"""vLLM's tokenizer endpoints, answered by the gateway's own processor (no worker is involved).

  POST /tokenize   {"prompt": "...", "add_special_tokens": true}        a text as /v1/completions tokenizes it
                   {"messages": [...], "add_generation_prompt": true}   a chat as /v1/chat/completions builds its
                                                                        prompt (each image as the tokens it expands to;
                                                                        "tools" and "chat_template_kwargs" as a chat
                                                                        takes them)
                   → {"count", "max_model_len", "tokens", "token_strs"} (the tokens' own strings with
                     "return_token_strs": true, else null)
  POST /detokenize {"tokens": [...]} → {"prompt": "..."}

"model" may be left out (the served model); a model this server does not serve is a 404, bad input a 400 that says
what to fix, as for the completions endpoints.
"""

from __future__ import annotations

import asyncio

from services.gateway.errors import ApiError
from services.gateway.protocol import (
    INLINE_TOKENIZE_CHARS,
    is_token_id,
    json_body,
    parse_conversation,
    parse_template_kwargs,
)
from services.gateway.tools import parse_tools


async def tokenize(
    raw: bytes, processor, model_name: str, max_model_len: int, max_text_chars: int, fetcher=None
) -> dict:
    """`max_text_chars`: more text than this cannot fit the model whatever its tokens: a 400 before tokenizing.
    `fetcher`: where the server fetches remote images (`images.ImageFetcher`), or None: they are refused."""
    body = json_body(raw, [model_name], default_model=model_name)
    token_strs = _flag(body, "return_token_strs", False)
    if ("prompt" in body) == ("messages" in body):
        raise ApiError(400, "send either 'prompt' (a text) or 'messages' (a chat) to tokenize", "prompt")
    if "prompt" in body:
        chars, images, work = _text_work(body, processor)
    else:
        chars, images, work = await _chat_work(body, processor, fetcher)
    if chars > max_text_chars:
        raise ApiError(
            400,
            f"{chars} characters of text are more than the model's limit of {max_model_len} tokens can hold; send less",
            "messages" if images or "messages" in body else "prompt",
        )
    try:
        ids = work() if chars <= INLINE_TOKENIZE_CHARS and not images else await asyncio.to_thread(work)
    except (ValueError, TypeError, KeyError) as e:
        raise ApiError(400, f"could not tokenize: {e}") from None
    return {
        "count": len(ids),
        "max_model_len": max_model_len,
        "tokens": ids,
        "token_strs": processor.tokenizer.convert_ids_to_tokens(ids) if token_strs else None,
    }


def _text_work(body: dict, processor):
    """(characters, images, the tokenization to run) of a `prompt`."""
    prompt = body["prompt"]
    if not isinstance(prompt, str):
        raise ApiError(400, "'prompt' must be a string", "prompt")
    special = _flag(body, "add_special_tokens", True)
    return len(prompt), 0, lambda: processor.tokenizer(prompt, add_special_tokens=special)["input_ids"]


async def _chat_work(body: dict, processor, fetcher):
    """(characters, images, the tokenization to run) of `messages`, their remote images fetched."""
    if "add_special_tokens" in body and _flag(body, "add_special_tokens", False):
        # the chat template places them; vLLM's default (false) is all we do
        raise ApiError(
            400,
            "a chat's special tokens come from its template; 'add_special_tokens': true is not supported with "
            "'messages'",
            "add_special_tokens",
        )
    conversation = parse_conversation(body["messages"], fetcher is not None)
    if fetcher is not None:
        await fetcher.fetch(conversation)
    tools = parse_tools({"tools": body.get("tools"), "tool_choice": "none"})
    template_kwargs = parse_template_kwargs(body)
    generation_prompt = _flag(body, "add_generation_prompt", True)
    chars = sum(len(p["text"]) for m in conversation for p in m["content"] if p["type"] == "text")
    images = sum(p["type"] == "image" for m in conversation for p in m["content"])

    def work():
        return processor.apply(
            conversation,
            finish_pixels=False,
            add_generation_prompt=generation_prompt,
            tools=tools.definitions if tools else None,
            template_kwargs=template_kwargs,
        )[0]

    return chars, images, work


def detokenize(raw: bytes, processor, model_name: str) -> dict:
    body = json_body(raw, [model_name], default_model=model_name)
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(is_token_id(t) for t in tokens):
        raise ApiError(400, "'tokens' must be a list of token ids (integers)", "tokens")
    vocab = len(processor.tokenizer)
    bad = next((t for t in tokens if t >= vocab), None)
    if bad is not None:
        raise ApiError(400, f"token id {bad} is not in the vocabulary (ids 0 to {vocab - 1})", "tokens")
    return {"prompt": processor.tokenizer.decode(tokens)}


def _flag(body: dict, key: str, default: bool) -> bool:
    value = body.get(key, default)
    if not isinstance(value, bool):
        raise ApiError(400, f"'{key}' must be true or false", key)
    return value
