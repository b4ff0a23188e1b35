"""Turn the last-position logits of a batch into next tokens.

Greedy rows take the argmax. Other rows apply temperature, top-k and top-p, then sample.
A seeded request draws its n-th token from a generator seeded by (seed, n), so its output
does not depend on batch composition or on which engine ran which step.
"""

from __future__ import annotations

import torch

from common.engine.outputs import TokenLogprob
from common.request import Request


class Sampler:
    def __init__(self, seed: int = 0):
        self._generator = torch.Generator().manual_seed(seed)

    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> list[int]:
        logits = apply_penalties(logits, requests)
        tokens = logits.argmax(dim=-1).tolist()
        for row, request in enumerate(requests):
            if not request.sampling.greedy:
                tokens[row] = self._sample(logits[row], request)
        return tokens

    def _sample(self, logits: torch.Tensor, request: Request) -> int:
        params = request.sampling
        scaled = logits.float().cpu() / params.temperature
        if params.top_k:
            kth = torch.topk(scaled, min(params.top_k, scaled.numel())).values[-1]
            scaled = scaled.masked_fill(scaled < kth, float("-inf"))
        probs = torch.softmax(scaled, dim=-1)
        if params.top_p < 1.0:
            sorted_probs, order = probs.sort(descending=True)
            outside = sorted_probs.cumsum(0) - sorted_probs > params.top_p
            probs = probs.scatter(0, order, sorted_probs.masked_fill(outside, 0.0))
        if params.seed is None:
            generator = self._generator
        else:
            generator = torch.Generator().manual_seed(params.seed * 1_000_003 + len(request.generated_token_ids))
        return int(torch.multinomial(probs, 1, generator=generator))


def apply_penalties(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """The logits with each row's penalties applied (a copy; the same tensor when no row has any), before
    temperature and sampling, as vLLM orders them: repetition (transformers' rule, over prompt and generated
    tokens), then frequency and presence (OpenAI's, over generated tokens), then the request's logit bias."""
    rows = [row for row, request in enumerate(requests) if request.sampling.adjusts_logits]
    if not rows:
        return logits
    logits = logits.clone()
    for row in rows:
        request, params, values = requests[row], requests[row].sampling, logits[row]
        generated = request.generated_token_ids
        if params.repetition_penalty != 1:
            seen = torch.tensor(sorted(set(request.prompt_token_ids).union(generated)), device=values.device)
            picked = values[seen]
            values[seen] = torch.where(picked > 0, picked / params.repetition_penalty, picked * params.repetition_penalty)
        if generated and (params.frequency_penalty or params.presence_penalty):
            counts = torch.bincount(torch.tensor(generated, device=values.device), minlength=values.numel())
            counts = counts[:values.numel()].to(values.dtype)
            values -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(values.dtype)
        for token, bias in params.logit_bias:
            values[token] += bias
    return logits


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

