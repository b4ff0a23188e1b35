"""Stage budgets (TriInfer): the largest batch whose predicted iteration time stays within the stage's
time limit — α·TTFT_max on instances without the decode role (a request needs at least two iterations,
encode then prefill, before its first token), TBT_max on instances with it. Iteration time grows with
batch size, so a binary search over the latency model finds it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from common.latency.model import LatencyProfile, decode_ms, encode_ms, prefill_chunk_ms

ALPHA = 0.5
# what a decode-only iteration costs where decoders put a joining request's first decode in one (`join_first`):
# this many sequences of this many tokens each
JOIN_REFERENCE_BATCH, JOIN_REFERENCE_CONTEXT = 64, 1024


@dataclasses.dataclass(frozen=True, slots=True)
class Budgets:
    image_budget: int  # τ_e
    token_budget: int  # τ_t
    limit_ms: float  # the iteration-time limit they were derived for
    fits: bool  # False: even a batch of one exceeds the limit (budgets are 1)


def largest_within(time_of: Callable[[int], float], limit_ms: float, upper: int) -> int:
    """Largest x in [1, upper] with time_of(x) <= limit_ms (time_of non-decreasing); 0 if none."""
    if time_of(1) > limit_ms:
        return 0
    lo, hi = 1, upper
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if time_of(mid) <= limit_ms:
            lo = mid
        else:
            hi = mid - 1
    return lo


def stage_limit_ms(has_decode: bool, ttft_ms: float, tbt_ms: float, alpha: float = ALPHA, joins: bool = False) -> float:
    """`joins`: requests are handed over to this decoder by prefill workers; one that joins waits for the
    iteration in flight, then runs its own, so two iterations must fit TBT (the limit is TBT/2)."""
    if ttft_ms <= 0 or tbt_ms <= 0 or not 0 < alpha <= 1:
        raise ValueError("SLO targets must be positive and 0 < alpha <= 1")
    if not has_decode:
        return alpha * ttft_ms
    return tbt_ms / 2 if joins else tbt_ms


def budgets_for(profile: LatencyProfile, has_decode: bool, ttft_ms: float, tbt_ms: float,
                max_images: int = 64, max_tokens: int = 1 << 15, alpha: float = ALPHA, headroom: float = 1.0,
                joins: bool = False, join_first: bool = False) -> Budgets:
    """`headroom` < 1 sizes iterations to that fraction of the limit, leaving room for what the profile does not
    predict (host overhead, delivery), so an iteration at the budget still lands within the SLO.
    `joins`: a decoder that prefills while prefill workers hand requests over to it (see `stage_limit_ms`);
    `join_first`: it gives a joining request's first decode a decode-only iteration, so the iteration in flight
    may take what TBT leaves beside that one (never less than TBT/2)."""
    if not 0 < headroom <= 1:
        raise ValueError("headroom must be in (0, 1]")
    limit = stage_limit_ms(has_decode, ttft_ms, tbt_ms, alpha, joins) * headroom
    if has_decode and joins and join_first:
        join = decode_ms(profile, JOIN_REFERENCE_BATCH, JOIN_REFERENCE_BATCH * JOIN_REFERENCE_CONTEXT)
        limit = max(limit, tbt_ms * headroom - join)
    images = largest_within(lambda n: encode_ms(profile, n), limit, max_images)
    tokens = largest_within(lambda t: prefill_chunk_ms(profile, t), limit, max_tokens)
    return Budgets(max(images, 1), max(tokens, 1), limit, fits=images > 0 and tokens > 0)
