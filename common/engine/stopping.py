"""When a request stops, and the text it ends with: EOS, a stop token, a stop string, or its length."""

from __future__ import annotations

from collections.abc import Callable, Collection

from common.detokenizer import IncrementalDetokenizer
from common.request import Request, RequestStatus


def check_stop(
    request: Request,
    token: int,
    eos_token_ids: Collection[int],
    max_model_len: int,
    detokenize: Callable[[list[int]], str],
) -> RequestStatus | None:
    """The status `request` finishes with now that `token` (the last of its output) was sampled, else None.

    With stop strings, `request.output_text` follows the output (a few tokens decoded per step, not the whole
    output again: common/detokenizer.py; a continuation's from the output before it) and ends as the text the
    client gets: cut before the stop string,
    without the text of an EOS or stop token, an incomplete last character as U+FFFD."""
    params = request.sampling
    # no stop yet (EOS and stop ids are masked too) — but a structured answer's grammar decides where it may end
    early = len(request.output_token_ids) < params.min_tokens and request.grammar_matcher is None
    eos = not params.ignore_eos and token in eos_token_ids
    if not early and (eos or token in params.stop_token_ids):
        if not eos:
            request.stop_reason = token
        if params.stop:
            request.output_text = _finished_text(request, detokenize, request.generated_token_ids[:-1])
        return RequestStatus.FINISHED_STOPPED
    if params.stop:
        detok = _detokenizer(request, detokenize)
        before = len(detok.text)
        detok.push(request.generated_token_ids[len(detok.token_ids) :])
        # as vLLM: a stop string counts where it ends in the text just added (one whole in the text of the min_tokens
        # before, when nothing was checked, does not)
        hits = (
            []
            if early
            else [(at, s) for s in params.stop if (at := detok.text.find(s, max(before - len(s) + 1, 0))) >= 0]
        )
        if hits:
            cut, stop = min(hits)
            request.output_text, request.stop_reason = detok.text[:cut], stop
            return RequestStatus.FINISHED_STOPPED
        request.output_text = detok.text
    matcher = request.grammar_matcher
    if matcher is not None and matcher.is_error():  # it gave up (a lexer limit): the output does not hold to it
        return RequestStatus.FINISHED_ABORTED
    if matcher is not None and matcher.is_stopped():  # nothing more fits it
        if params.stop:
            request.output_text = _finished_text(request, detokenize, request.generated_token_ids)
        return RequestStatus.FINISHED_STOPPED
    return _length(request, detokenize, max_model_len)


def _length(request: Request, detokenize, max_model_len: int) -> RequestStatus | None:
    if len(request.output_token_ids) >= request.sampling.max_tokens or request.num_tokens >= max_model_len:
        if request.sampling.stop:
            request.output_text = _finished_text(request, detokenize, request.generated_token_ids)
        return RequestStatus.FINISHED_LENGTH
    return None


def _detokenizer(request: Request, detokenize) -> IncrementalDetokenizer:
    """The request's own; a request that came from another worker starts one here (over its earlier tokens too). A
    continuation's (a migrated request's) starts over the output before it, so a stop string that began there is
    found where it ends; its text then holds that earlier output too (the gateway joins the two by their tokens)."""
    if request.detokenizer is None:
        request.detokenizer = IncrementalDetokenizer(detokenize)
        if request.num_continued_tokens:
            request.detokenizer.push(request.prompt_token_ids[-request.num_continued_tokens :])
    return request.detokenizer


def _finished_text(request: Request, detokenize, ids: list[int]) -> str:
    detok = _detokenizer(request, detokenize)
    detok.push(ids[len(detok.token_ids) :])
    detok.finish()
    return detok.text
