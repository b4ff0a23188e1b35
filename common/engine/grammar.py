"""Structured output: a request whose sampling carries a grammar only ever samples tokens the grammar allows.

Life of a structured request in an engine:
  1. `attach` at admission: a matcher over the grammar (llguidance, as vLLM's `guidance` backend), fed every
     token the request sampled before it came here (a prefill's first token, a migrated request's earlier output),
     so it goes on where it was on whatever worker runs its next step; a grammar it cannot follow is refused;
  2. each step, `masked` sets the logits of every token the grammar does not allow next to -inf (the raw logits
     stay what logprobs report, as vLLM reports them), and `advance` feeds it the sampled token;
  3. when nothing can follow (a JSON object closed), the request stops there, finish reason "stop"
     (`common/engine/stopping.py`).

The matcher lives on the request; a request that leaves the engine takes it along and is dropped with it.
"""

from __future__ import annotations

import json
import logging
import warnings

import torch

from common.request import Request

log = logging.getLogger(__name__)

# compact JSON, as a client expects it: the grammar's flexible whitespace let a model pad between every token
JSON_OPTIONS = {"whitespace_flexible": False}


class GrammarRejected(ValueError):
    pass


def json_schema_grammar(schema: dict) -> str:
    """The grammar (llguidance's JSON form) of output that is a JSON value matching `schema`; raises
    GrammarRejected, saying why, for a schema it cannot follow."""
    import llguidance

    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=JSON_OPTIONS)
    except (ValueError, TypeError, RuntimeError) as e:  # e.g. NaN or Infinity, which JSON bodies may carry
        raise GrammarRejected(str(e)) from None
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise GrammarRejected(error)
    return grammar


def regex_grammar(pattern: str) -> str:
    """The grammar of output matching the regular expression `pattern` (the whole output); raises GrammarRejected."""
    import llguidance

    try:
        grammar = llguidance.LLMatcher.grammar_from_regex(pattern)
    except Exception as e:  # llguidance's own error for a pattern it cannot parse
        raise GrammarRejected(str(e)) from None
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise GrammarRejected(error)
    return grammar


class GrammarMasks:
    """The masks of one engine's structured requests, over its tokenizer (loaded at the first such request)."""

    def __init__(self, model_dir: str):
        self.model_dir = model_dir
        self._tokenizer = None

    def load(self) -> None:
        """Load the tokenizer now (a worker, before it serves), not under the engine's lock at the first structured
        request (~0.1-1 s)."""
        self.tokenizer  # noqa: B018

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            import llguidance.hf
            from transformers import AutoTokenizer

            self._tokenizer = llguidance.hf.from_tokenizer(AutoTokenizer.from_pretrained(self.model_dir))
        return self._tokenizer

    def attach(self, request: Request) -> None:
        """Give a structured request its matcher, at the point its tokens so far have brought the grammar to."""
        grammar = request.sampling.grammar
        if grammar is None or request.grammar_matcher is not None:
            return
        import llguidance

        matcher = llguidance.LLMatcher(self.tokenizer, grammar)
        earlier = request.generated_token_ids
        if matcher.is_error() or (earlier and not matcher.consume_tokens(earlier)):
            raise GrammarRejected(
                f"request {request.request_id}: {matcher.get_error() or 'its tokens break its grammar'}"
            )
        if not matcher.is_stopped() and not self._allows_any(matcher):  # e.g. [^\s\S], or a schema of only cycles
            raise GrammarRejected("no output satisfies it")
        request.grammar_matcher = matcher

    def _allows_any(self, matcher) -> bool:
        lt = _bitmask_ops()
        bitmask = lt.allocate_token_bitmask(1, self.tokenizer.vocab_size)
        lt.fill_next_token_bitmask(matcher, bitmask, 0)
        return not matcher.is_error() and bool(bitmask.any())

    def masked(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """`logits` (a copy) with what each structured row's grammar forbids next at -inf; the same tensor when no
        row has a grammar."""
        rows = [row for row, request in enumerate(requests) if request.grammar_matcher is not None]
        if not rows:
            return logits
        lt = _bitmask_ops()

        logits = logits.clone()
        vocab = self.tokenizer.vocab_size
        bitmask = lt.allocate_token_bitmask(len(rows), vocab)
        for i, row in enumerate(rows):
            lt.fill_next_token_bitmask(requests[row].grammar_matcher, bitmask, i)
        allowed = _unpack(bitmask, vocab).to(logits.device)
        at = torch.tensor(rows, device=logits.device)
        width = min(vocab, logits.shape[-1])
        part = logits[at, :width]
        logits[at, :width] = part.masked_fill(~allowed[:, :width], float("-inf"))
        if logits.shape[-1] > vocab:  # the model's padded rows beyond the tokenizer: never grammatical
            logits[at, vocab:] = float("-inf")
        return logits

    def advance(self, requests: list[Request], tokens: list[int]) -> None:
        for request, token in zip(requests, tokens):
            matcher = request.grammar_matcher
            if matcher is not None and not matcher.consume_token(token):
                log.error(
                    "request %s: its grammar refused the token %d it allowed: %s",
                    request.request_id,
                    token,
                    matcher.get_error(),
                )


def _bitmask_ops():
    with warnings.catch_warnings():  # its kernels use torch.jit.script, which torch now calls deprecated
        warnings.simplefilter("ignore", DeprecationWarning)
        import llguidance.torch

    return llguidance.torch


def _unpack(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """[rows, words] int32 bitmasks (bit i of word w: token 32w + i allowed) → [rows, vocab] bool."""
    bits = torch.arange(32, dtype=torch.int32)
    return ((bitmask.unsqueeze(-1) >> bits) & 1).bool().flatten(1)[:, :vocab]
