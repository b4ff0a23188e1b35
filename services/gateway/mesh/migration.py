"""Request migration: a request that a failed worker left part-way goes on elsewhere as a continuation.

The continuation prefills the prompt plus the tokens already sent and asks only for the rest, so the client
sees no duplicates; its outputs are rebased into the original request's (earlier tokens and text in front).
"""

from __future__ import annotations

import dataclasses

from common.engine.outputs import RequestOutput
from common.request import Request


def continuation(request: Request, emitted: list[int], attempt: int) -> Request:
    """The rest of `request` after `emitted` tokens: their KV is rebuilt by prefilling them with the prompt."""
    sampling = dataclasses.replace(
        request.sampling,
        max_tokens=request.sampling.max_tokens - len(emitted),
        min_tokens=max(0, request.sampling.min_tokens - len(emitted)),
    )
    return Request(
        f"{request.request_id}-m{attempt}",
        request.prompt_token_ids + emitted,
        sampling,
        request.images,
        num_continued_tokens=len(emitted),
        cache_salt=request.cache_salt,
    )  # its penalties and seeded random stream go on from there


def resumed(request: Request, emitted: list[int], attempt: int) -> Request:
    """The rest of `request` on a decoder given the KV of its prompt and of all but the last of the `emitted`
    tokens (a decoder that switched roles handed those pages back): it decodes on from the last token."""
    return continuation(request, emitted[:-1], attempt)


def rebased(
    out: RequestOutput, request_id: str, before: list[int], detokenize, eos_token_ids: tuple[int, ...] = ()
) -> RequestOutput:
    """An output of a continuation as the original request's: earlier tokens (and their text) in front."""
    if not before:
        return out
    text = joined_text(before, out, detokenize, eos_token_ids) if out.text is not None else None
    return dataclasses.replace(
        out,
        request_id=request_id,
        output_token_ids=before + out.output_token_ids,
        text=text,
        num_prompt_tokens=out.num_prompt_tokens - len(before),
        num_cached_tokens=min(out.num_cached_tokens, out.num_prompt_tokens - len(before)),
    )


def joined_text(before: list[int], out: RequestOutput, detokenize, eos_token_ids: tuple[int, ...] = ()) -> str:
    """A continuation's final text as the whole request's: earlier and new tokens decoded together (two decodes
    joined are not one: a SentencePiece decode drops its first token's leading space), cut where the engine
    cut the continuation's: before the stop string (which may also begin in the earlier text), or before the
    stop or EOS token (a structured answer that stopped where its grammar ended keeps its last token)."""
    ids = before + out.output_token_ids
    if isinstance(out.stop_reason, str):
        full, head = detokenize(ids), len(detokenize(before))
        at = full.find(out.stop_reason, max(head - len(out.stop_reason) + 1, 0))
        return full[:at] if at >= 0 else full
    ended_by_token = isinstance(out.stop_reason, int) or (
        out.stop_reason is None and ids[-1:] and ids[-1] in eos_token_ids
    )
    return detokenize(ids[:-1] if out.finish_reason == "stop" and ended_by_token else ids)
