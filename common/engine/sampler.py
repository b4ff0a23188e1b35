"""Turn the last-position logits of a batch into next tokens.

Greedy rows take the argmax. Other rows apply temperature, top-k and top-p, then sample.
A seeded request draws its n-th token from a generator seeded by a hash of (seed, n), so its output
does not depend on batch composition or on which engine ran which step.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Collection

import torch

from common.engine.outputs import TokenLogprob
from common.request import Request

FLOAT32_MAX = torch.finfo(torch.float32).max
NUCLEUS_FIRST_K = 256  # top-p alone: look for the nucleus among this many most likely tokens first (×4 until found)


class Sampler:
    def __init__(self, seed: int = 0, eos_token_ids: Collection[int] = ()):
        self._generator = torch.Generator().manual_seed(seed)
        self.eos_token_ids = tuple(eos_token_ids)

    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> list[int]:
        logits = apply_penalties(logits, requests, self.eos_token_ids)
        tokens = logits.argmax(dim=-1).tolist()
        for row, request in enumerate(requests):
            if not request.sampling.greedy:
                tokens[row] = self._sample(logits[row], request)
        return tokens

    def _sample(self, logits: torch.Tensor, request: Request) -> int:
        """One draw among the candidates top-k and top-p leave, never sorting the whole vocabulary when it can be
        helped (a 32k-token sort took 2.2 ms on a CPU core; the draw itself is then among a few hundred)."""
        params = request.sampling
        probs, candidates = distribution(logits, params)
        if not float(probs.sum()) > 0:  # every token masked (stop ids and min_tokens, say): no draw to make
            return int(logits.argmax())
        if params.seed is None:
            generator = self._generator
        else:
            generator = torch.Generator().manual_seed(stream_seed(params.seed, len(request.generated_token_ids)))
        index = int(torch.multinomial(probs, 1, generator=generator))
        return index if candidates is None else int(candidates[index])


def stream_seed(seed: int, n: int) -> int:
    """The generator seed of a seeded request's n-th draw: a hash of both, because torch's CPU generator keeps
    only the low 32 bits of its seed (an arithmetic mix made seeds 2^32 apart draw the same tokens)."""
    digest = hashlib.blake2b(seed.to_bytes(8, "little", signed=True) + n.to_bytes(8, "little"), digest_size=4)
    return int.from_bytes(digest.digest(), "little")


def distribution(logits: torch.Tensor, params) -> tuple[torch.Tensor, torch.Tensor | None]:
    """What one row is drawn from: (unnormalized probabilities, the token id of each; None: ids are positions),
    after temperature, min-p (a token's probability at least min_p × the most likely one's: its logit at least
    the top logit + log min_p), top-k (renormalized over the k, as masking the rest would) and top-p (over the
    probabilities top-k left)."""
    # an extreme penalty (a repetition_penalty of 1e-224 divides by it) can push logits past float32: +inf would make
    # softmax NaN where the limit is all the mass on those tokens, so they become the largest finite value
    scaled = (logits.float().cpu() / params.temperature).nan_to_num(nan=float("-inf"), posinf=FLOAT32_MAX)
    if params.min_p > 0:  # vLLM's order: after temperature, before top-k and top-p
        scaled = scaled.masked_fill(scaled < scaled.max() + math.log(params.min_p), float("-inf"))
    if params.top_k and params.top_k < scaled.numel():
        values, candidates = torch.topk(scaled, params.top_k)  # most likely first
        probs = torch.softmax(values, dim=-1)
    elif params.top_p < 1.0:
        probs, candidates = _nucleus_candidates(scaled, params.top_p)  # full-distribution probabilities
    else:
        probs, candidates = torch.softmax(scaled, dim=-1), None
    if params.top_p < 1.0:
        outside = probs.cumsum(0) - probs > params.top_p
        probs = probs.masked_fill(outside, 0.0)
    return probs, candidates


def _nucleus_candidates(scaled: torch.Tensor, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The most likely tokens, sorted, and their probabilities under the whole distribution — enough of them
    to hold the top-p nucleus: once the first k hold more than top_p of the mass, no token after them is in it."""
    log_total = torch.logsumexp(scaled, dim=-1)
    k = min(NUCLEUS_FIRST_K, scaled.numel())
    while True:
        values, candidates = torch.topk(scaled, k)
        probs = torch.exp(values - log_total)
        if k == scaled.numel() or float(probs.sum()) > top_p:
            return probs, candidates
        k = min(4 * k, scaled.numel())


def apply_penalties(logits: torch.Tensor, requests: list[Request], eos_token_ids: Collection[int] = ()) -> torch.Tensor:
    """The logits with each row's penalties applied (a copy; the same tensor when no row has any), before
    temperature and sampling, in the order vLLM and transformers apply them: the request's logit bias, then
    repetition (transformers' rule, over prompt and generated tokens), then frequency and presence (OpenAI's,
    over generated tokens).
    Batched over the rows that have them: one scatter for the tokens seen, one for the counts."""
    rows = [row for row, request in enumerate(requests) if request.sampling.adjusts_logits]
    if not rows:
        return logits
    logits = logits.clone()
    vocab, device = logits.shape[-1], logits.device

    def padded(lists: list[list[int]]) -> torch.Tensor:  # [rows, longest], padded with `vocab` (a spare column)
        width = max((len(ids) for ids in lists), default=0)
        return torch.tensor([ids + [vocab] * (width - len(ids)) for ids in lists], dtype=torch.long, device=device)

    def _present(ids: torch.Tensor) -> torch.Tensor:  # the padding replaced by each row's first id: a repeat,
        return torch.where(ids == vocab, ids[:, :1], ids)  # harmless where a value is read and written back

    biased = [(row, token, bias) for row in rows for token, bias in requests[row].sampling.logit_bias]
    if biased:
        at_rows, tokens, biases = zip(*biased)
        logits.index_put_(
            (torch.tensor(at_rows, device=device), torch.tensor(tokens, device=device)),
            torch.tensor(biases, dtype=logits.dtype, device=device),
            accumulate=True,
        )
    repeat = [row for row in rows if requests[row].sampling.repetition_penalty != 1]
    if repeat:  # only the tokens seen are read and written: never a whole [rows, vocab] temporary
        at = torch.tensor(repeat, device=device).unsqueeze(1)
        ids = _present(padded([requests[row].prompt_token_ids + requests[row].generated_token_ids for row in repeat]))
        factor = torch.tensor(
            [requests[row].sampling.repetition_penalty for row in repeat], dtype=logits.dtype, device=device
        ).unsqueeze(1)
        values = logits[at, ids]  # a token seen twice is read twice and written twice with the same value
        logits[at, ids] = torch.where(values > 0, values / factor, values * factor)
    counted = [
        row
        for row in rows
        if requests[row].generated_token_ids
        and (requests[row].sampling.frequency_penalty or requests[row].sampling.presence_penalty)
    ]
    if counted:
        at = torch.tensor(counted, device=device).unsqueeze(1)
        ids = padded([requests[row].generated_token_ids for row in counted])
        counts = torch.zeros(len(counted), vocab + 1, dtype=logits.dtype, device=device)
        counts = counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=logits.dtype))
        ids = _present(ids)
        times = counts.gather(1, ids)
        frequency, presence = (
            torch.tensor(
                [getattr(requests[row].sampling, name) for row in counted], dtype=logits.dtype, device=device
            ).unsqueeze(1)
            for name in ("frequency_penalty", "presence_penalty")
        )
        logits[at, ids] = logits[at, ids] - (frequency * times + presence * (times > 0).to(logits.dtype))
    early = [
        (row, token)
        for row in rows
        if len(requests[row].output_token_ids) < requests[row].sampling.min_tokens
        and requests[row].grammar_matcher is None  # a structured answer's grammar decides where it may end
        for token in _stop_ids(requests[row].sampling, eos_token_ids)
    ]
    if early:  # min_tokens (vLLM's, transformers' min_new_tokens): nothing that would end it can be drawn yet
        at_rows, tokens = zip(*early)
        logits[torch.tensor(at_rows, device=device), torch.tensor(tokens, device=device)] = float("-inf")
    return logits


def _stop_ids(params, eos_token_ids: Collection[int]) -> set[int]:
    return set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))


def logprobs_of(logits: torch.Tensor, requests: list[Request], tokens: list[int]) -> dict[str, TokenLogprob]:
    """For the rows whose request asked for logprobs: the sampled token's log-probability and the top ones,
    from the raw logits (float32 log-softmax), by request id."""
    rows = [row for row, request in enumerate(requests) if request.sampling.logprobs is not None]
    if not rows:
        return {}
    logprobs = torch.log_softmax(logits[rows].float(), dim=-1).cpu()
    k = max(requests[row].sampling.logprobs for row in rows)
    top_values, top_ids = logprobs.topk(k, dim=-1) if k else (None, None)
    out = {}
    for i, row in enumerate(rows):
        request, token = requests[row], tokens[row]
        n = request.sampling.logprobs
        top = tuple(zip(top_ids[i, :n].tolist(), top_values[i, :n].tolist())) if n else ()
        out[request.request_id] = TokenLogprob(token, float(logprobs[i, token]), top)
    return out
