"""TriInfer's topology heuristic (Algorithm 2): a workload's stage loads → each stage's capacity per instance at its
SLO budget → N instances split across the stages by the time each needs → the E+P+D split and the EP+D and ED+P
deployments derived from it. The caller replays the workload on the candidates (`epdmesh plan` simulates them) and
keeps the best.
"""

from __future__ import annotations

import dataclasses
import statistics

from common.latency.budgets import ALPHA, largest_within
from common.latency.model import LatencyProfile, decode_ms, encode_ms, prefill_chunk_ms

KV_FRACTION = 0.9  # TriInfer's γ: of a decoder's KV capacity, the part a full batch may hold


@dataclasses.dataclass(frozen=True, slots=True)
class StageLoad:
    """A workload's mean work per request: images encoded, prompt tokens prefilled (image tokens included, a
    cached prefix not), output tokens decoded, and the KV a decoding request holds on average."""

    images: float
    prompt_tokens: float
    output_tokens: float
    context_tokens: float

    @classmethod
    def of(cls, requests: list[tuple[int, int, int]]) -> StageLoad:
        """From (prompt tokens, images, output tokens) per request."""
        prompts = [p for p, _, _ in requests]
        outputs = [o for _, _, o in requests]
        return cls(
            statistics.fmean(i for _, i, _ in requests),
            statistics.fmean(prompts),
            statistics.fmean(outputs),
            statistics.fmean(p + o / 2 for p, o in zip(prompts, outputs)),
        )


def stage_seconds(
    profile: LatencyProfile,
    load: StageLoad,
    ttft_ms: float,
    tbt_ms: float,
    kv_tokens: int,
    alpha: float = ALPHA,
) -> dict[str, float]:
    """Instance-seconds per request of each stage, at the throughput of its largest batch within its limit: encode
    and prefill within α·TTFT, decode within TBT and within γ of a decoder's KV (`kv_tokens`)."""
    limit = alpha * ttft_ms
    images = max(largest_within(lambda n: encode_ms(profile, n), limit, 256), 1)
    tokens = max(largest_within(lambda t: prefill_chunk_ms(profile, t), limit, 1 << 15), 1)
    context = max(load.context_tokens, 1.0)
    fits_kv = max(int(KV_FRACTION * kv_tokens / context), 1)
    batch = max(largest_within(lambda b: decode_ms(profile, b, round(b * context)), tbt_ms, fits_kv), 1)
    return {
        "encode": load.images * encode_ms(profile, images) / images / 1e3,
        "prefill": load.prompt_tokens * prefill_chunk_ms(profile, tokens) / tokens / 1e3,
        "decode": load.output_tokens * decode_ms(profile, batch, round(batch * context)) / batch / 1e3,
    }


def partition(n: int, seconds: dict[str, float]) -> tuple[int, int, int]:
    """(N_e, N_p, N_d): `n` ≥ 3 instances in proportion to each stage's time, each stage at least one."""
    if n < 3:
        raise ValueError("an E+P+D split needs at least 3 instances")
    e, p, d = apportion(n, [seconds[s] for s in ("encode", "prefill", "decode")])
    return e, p, d


def apportion(n: int, weights: list[float], minimums: list[int] | None = None) -> list[int]:
    """`n` ≥ len(weights) instances in proportion to the weights, each at least one (or its minimum, as far as `n`
    goes): the largest remainders get what rounding down leaves, the largest counts over their share give up what
    the minimums take."""
    k = len(weights)
    if n < k:
        raise ValueError(f"{n} instances cannot give each of {k} pools one")
    floor = [max(1, m) for m in (minimums or [1] * k)]
    times = [max(w, 0.0) for w in weights]
    total = sum(times) or 1.0
    shares = [n * t / total for t in times]
    counts = [max(f, int(s)) for f, s in zip(floor, shares)]
    while sum(counts) < n:
        counts[max(range(k), key=lambda i: shares[i] - counts[i])] += 1
    while sum(counts) > n:
        above = [i for i in range(k) if counts[i] > floor[i]] or [i for i in range(k) if counts[i] > 1]
        counts[max(above, key=lambda i: counts[i] - shares[i])] -= 1
    return counts


def candidates(n: int, seconds: dict[str, float]) -> list[str]:
    """TriInfer's three deployments of `n` instances: E+P+D from the partition, then EP+D and ED+P from it."""
    e, p, d = partition(n, seconds)
    return [f"E{e}+P{p}+D{d}", f"EP{e + p}+D{d}", f"ED{e + d}+P{p}"]
