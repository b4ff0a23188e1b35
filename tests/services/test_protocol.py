"""The parsed chat request: what decides whether the gateway tokenizes it on its event loop."""

import json

from services.gateway.protocol import INLINE_TOKENIZE_CHARS, parse_chat_request


def _chat(*texts: str):
    body = {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": t} for t in texts]}]}
    return parse_chat_request(json.dumps(body).encode(), ["m"])


def test_short_text_counts_every_text_part_against_the_inline_limit():
    half = "x" * (INLINE_TOKENIZE_CHARS // 2)
    assert _chat("hello").short_text and _chat(half, half).short_text
    assert not _chat(half, half, "y").short_text
    assert _chat(half, half, "y").num_text_chars == INLINE_TOKENIZE_CHARS + 1
