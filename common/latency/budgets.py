"""Stage budgets (TriInfer): the largest batch whose predicted iteration time stays within the stage's
time limit — α·TTFT_max on instances without the decode role (a request needs at least two iterations,
encode then prefill, before its first token), TBT_max on instances with it. Iteration time grows with
batch size, so a binary search over the latency model finds it. An iteration may carry both kinds of work (a
request's last image and the first chunk of its prompt, say): `image_token_cost` is what one image's encode takes
from the token budget of the same iteration, so the two together still fit the limit.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable

from common.latency.model import (
    LatencyProfile,
    decode_ms,
    encode_ms,
    iteration_ms,
    mixed_cost,
    mixed_ms,
    prefill_chunk_ms,
)

ALPHA = 0.5
# what a decode-only iteration costs where decoders put a joining request's first decode in one (`join_first`):
# this many sequences of this many tokens each
JOIN_REFERENCE_BATCH, JOIN_REFERENCE_CONTEXT = 64, 1024


@dataclasses.dataclass(frozen=True, slots=True)
class Budgets:
    image_budget: int  # τ_e
    token_budget: int  # τ_t
    limit_ms: float  # the iteration-time limit they were derived for
    tokens_fit: bool  # False: even one prompt token's iteration exceeds the limit (τ_t is 1)
    images_fit: bool  # False: one image's encode alone exceeds it (τ_e is 1: an iteration that encodes runs past it)
    image_token_cost: int = 0  # tokens of τ_t one image's encode takes in the same iteration

    @property
    def fits(self) -> bool:
        return self.tokens_fit and self.images_fit


@dataclasses.dataclass(frozen=True, slots=True)
class IterationTime:
    """An iteration's time limit and the profile that predicts it. τ_t counts a decode as one token, but at long
    contexts a decode reads far more KV than a prompt token computes: `tokens_beside` is what the iteration's own
    decodes leave for a prompt chunk."""

    profile: LatencyProfile
    limit_ms: float

    def tokens_beside(
        self, decodes: int, context_tokens: int, upper: int, chunk_context: int = 0, overrun_ms: float = 0.0
    ) -> int:
        """Prompt tokens (a chunk after `chunk_context` tokens of its prompt) that fit beside `decodes` sequences
        holding `context_tokens` KV tokens, within the limit less what iterations here overrun the profile by
        (`Overrun`; never below a quarter of the limit)."""
        limit = max(self.limit_ms - overrun_ms, self.limit_ms / 4)
        return largest_within(
            lambda t: iteration_ms(
                self.profile, decodes=decodes, decode_context=context_tokens, chunks=((t, chunk_context),)
            ),
            limit,
            upper,
            _chunk_guess(self.profile, decodes, context_tokens, chunk_context, limit),
        )

    def predict_ms(self, images: int, decodes: int, context_tokens: int, chunks: list[tuple[int, int]]) -> float:
        return iteration_ms(self.profile, images=images, decodes=decodes, decode_context=context_tokens, chunks=chunks)


@dataclasses.dataclass(frozen=True, slots=True)
class GapSlack:
    """A P90 TBT target lets a tenth of a request's gaps run long: a decoder whose running requests can each spare
    one more slow gap may run an iteration to `long`'s limit (a prefill worker's, α·TTFT) and take a whole prompt
    where TBT-sized budgets would chunk it — as colocation with whole-prompt chunks does, but only while no
    request's P90 gap is put past the target. A request's slow gaps are counted as its iterations here run past
    `target_ms`; how many it may have is known once its answer's length is (`sure_gaps`): no more than what
    it already decoded, unless `ignore_eos` or `min_tokens` fix it."""

    target_ms: float  # the P90 TBT target: a gap past it is slow
    long: IterationTime  # the limit an iteration whose decodes can all spare a slow gap runs to
    token_budget: int  # τ_t of such an iteration
    reserve: int = 0  # slow gaps each request keeps for delays this worker does not see (delivery, the host)

    def __post_init__(self) -> None:
        if self.target_ms <= 0 or self.token_budget < 1 or self.reserve < 0:
            raise ValueError("GapSlack needs target_ms > 0, token_budget >= 1 and reserve >= 0")

    def spare(self, sure_gaps: int, slow_gaps: int) -> int:
        """Slow gaps a request with at least `sure_gaps` gaps, `slow_gaps` of them slow already, can still take."""
        return slow_gaps_allowed(sure_gaps) - slow_gaps - self.reserve


def slow_gaps_allowed(num_gaps: int) -> int:
    """Gaps past the target that `num_gaps` gaps may hold with their P90 (linearly interpolated, as `vllm bench
    serve` and `bench/goodput.py` take it) within the target: the gap at rank ⌈0.9·(n−1)⌉ must not be slow."""
    if num_gaps < 1:
        return 0
    return num_gaps - 1 - (9 * (num_gaps - 1) + 9) // 10


class Overrun:
    """By how much this host's iterations outlast what its profile predicts — the gateway, the page server and the
    load generator share its cores, which the profile measured without them. A high quantile of the recent
    differences actual − predicted, in milliseconds, so that most iterations sized by it land within their limit.
    A difference, not a ratio: an overhead per iteration that the profile misses would, as a ratio, grow as the
    iterations it shrinks get shorter, and shrink them further."""

    def __init__(self, window: int = 64, quantile: float = 0.9):
        if window < 1 or not 0 < quantile <= 1:
            raise ValueError("need window >= 1 and 0 < quantile <= 1")
        self._excess: collections.deque[float] = collections.deque(maxlen=window)
        self.quantile = quantile
        self.ms = 0.0  # nothing observed yet (or iterations ran within their prediction): the profile as it is

    def observe(self, predicted_ms: float, actual_ms: float) -> None:
        if predicted_ms <= 0:
            return
        self._excess.append(actual_ms - predicted_ms)
        ranked = sorted(self._excess)
        self.ms = max(ranked[min(len(ranked) - 1, int(self.quantile * len(ranked)))], 0.0)


def largest_within(time_of: Callable[[int], float], limit_ms: float, upper: int, guess: int | None = None) -> int:
    """Largest x in [1, upper] with time_of(x) <= limit_ms (time_of non-decreasing); 0 if none. `guess`: where the
    answer is likely to be (a closed form's): steps of 1, 2, 4, … from it bracket the answer, which a binary search
    then finds (two calls when the guess is it); without one, the binary search over [1, upper] decides."""
    lo, hi = 1, upper  # the answer, once time_of(1) fits, lies in [lo, hi]
    if guess is not None and 1 <= min(guess, upper):
        guess = min(guess, upper)
        step = 1
        if time_of(guess) <= limit_ms:
            lo = guess
            while lo + step <= upper and time_of(lo + step) <= limit_ms:
                lo, step = lo + step, 2 * step
            hi = min(lo + step - 1, upper)
        else:
            hi = guess - 1
            while hi - step >= 1 and time_of(hi - step + 1) > limit_ms:
                hi, step = hi - step, 2 * step
            lo = max(hi - step + 1, 1)
    if lo == 1 and time_of(1) > limit_ms:
        return 0
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if time_of(mid) <= limit_ms:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _chunk_guess(profile: LatencyProfile, decodes: int, context: int, chunk_context: int, limit_ms: float) -> int:
    """The chunk `IterationTime.tokens_beside` finds, solved from `iteration_ms`'s form: with d decodes, t prompt
    tokens after c of their prompt, the time is overhead + decode KV reads + c·t + t²/2 attention terms + the larger
    of the weights' floor and the compute of d + t rows — the larger of two quadratics in t, each ≤ the limit, with
    the rows' curve (`mixed_cost`, which depends on t) taken at t = 1, then refined by Newton's steps."""
    a, b = profile.prefill.quadratic_ms / 2, profile.prefill.quadratic_ms * chunk_context
    reads = profile.decode.quadratic_ms * context

    def over(t: float) -> float:  # the time of t tokens beside the decodes, less the limit (t may be fractional)
        if t < 1:
            return mixed_cost(profile, decodes, 1).base_ms(decodes + t) + reads + a * t * t + b * t - limit_ms
        return mixed_ms(profile, decodes, t) + reads + a * t * t + b * t - limit_ms

    curve = mixed_cost(profile, decodes, 1)
    fixed = curve.overhead_ms + reads
    best = min(
        _root(a, b, fixed + curve.floor_ms - limit_ms),
        _root(a, b + curve.per_unit_ms, fixed + curve.per_unit_ms * (decodes + curve.half_units) - limit_ms),
    )
    if decodes > 0 and 1 <= best < 1 << 31:  # the curve at t = 1 undercharges larger t: Newton's steps from there
        for _ in range(4):
            now = over(best)
            slope = over(best + 1) - now
            if abs(now) < 1e-9 or slope <= 0:
                break
            best -= now / slope
    return int(best) if 1 <= best < 1 << 31 else 1


def _root(a: float, b: float, c: float) -> float:
    """The largest t with a·t² + b·t + c ≤ 0 (a, b ≥ 0), inf where every t is."""
    if a > 0:
        disc = b * b - 4 * a * c
        return (-b + disc**0.5) / (2 * a) if disc >= 0 else -1.0
    return -c / b if b > 0 else (float("inf") if c <= 0 else -1.0)


def stage_limit_ms(has_decode: bool, ttft_ms: float, tbt_ms: float, alpha: float = ALPHA, joins: bool = False) -> float:
    """`joins`: requests are handed over to this decoder by prefill workers; one that joins waits for the
    iteration in flight, then runs its own, so two iterations must fit TBT (the limit is TBT/2)."""
    if ttft_ms <= 0 or tbt_ms <= 0 or not 0 < alpha <= 1:
        raise ValueError("SLO targets must be positive and 0 < alpha <= 1")
    if not has_decode:
        return alpha * ttft_ms
    return tbt_ms / 2 if joins else tbt_ms


def budgets_for(
    profile: LatencyProfile,
    has_decode: bool,
    ttft_ms: float,
    tbt_ms: float,
    max_images: int = 64,
    max_tokens: int = 1 << 15,
    alpha: float = ALPHA,
    headroom: float = 1.0,
    joins: bool = False,
    join_first: bool = False,
) -> Budgets:
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
    beside_image = largest_within(lambda t: prefill_chunk_ms(profile, t), limit - encode_ms(profile, 1), max_tokens)
    return Budgets(
        max(images, 1),
        max(tokens, 1),
        limit,
        tokens_fit=tokens > 0,
        images_fit=images > 0,
        image_token_cost=max(tokens - beside_image, 1),
    )
