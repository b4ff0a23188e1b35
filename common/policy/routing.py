"""Routing: which encoder, which prefill path and worker, which decoder — a pure function.

The least-loaded policy of the mesh (the SLO-aware multiplexing toggle builds on this shape):
  1. decoder: among live workers with the decode role, fewest unfinished decode tokens, then
     shortest queue, then worker id (a total order, so ties are deterministic);
  2. prefill path: if the decoder also prefills and the cluster has no dedicated prefill worker,
     COLOCATED; else MULTIPLEXED for prompts up to `multiplex_max_tokens` (or when the mode says
     so), DEDICATED on the least-queued prefill-only worker otherwise;
  3. encoder (requests with images): the prefill worker itself when it encodes (no image pages
     move), else the least-queued encoder.
With prefix-cache affinity (the router's predictions in `RouteSummary.cached_tokens`), the prefill worker of
each path — dedicated, or the decoder that prefills — is the one predicted to hold the most of the prompt, as long
as its queue stays within `affinity_max_imbalance` requests of the least loaded one's.
Workers whose statistics are older than `max_heartbeat_age_s`, and those the request excludes
(they just failed it), are not considered. `None` means no live worker set can serve the request.
"""

from __future__ import annotations

import dataclasses
import enum

from common.request import Stage
from common.workers import WorkerSnapshot


class PrefillPath(enum.Enum):
    COLOCATED = "colocated"
    DEDICATED = "dedicated"
    MULTIPLEXED = "multiplexed"


@dataclasses.dataclass(frozen=True, slots=True)
class RouteSummary:
    request_id: str
    num_prompt_tokens: int
    num_images: int
    max_tokens: int
    exclude: frozenset[str] = frozenset()  # worker ids that just failed this request
    ttft_slo_ms: float | None = None  # the request's own targets (None: the router's defaults)
    tbt_slo_ms: float | None = None
    elapsed_ms: float = 0.0  # time already spent before routing
    # prefix-cache affinity (`common.policy.affinity`): the prompt's block hashes, where its images end, and what
    # the router predicts each worker holds of it (by registration; filled in by the router)
    prefix_hashes: tuple[int, ...] = ()
    image_end: int = 0
    cached_tokens: tuple[tuple[str, int], ...] = ()

    def cached_on(self, w: WorkerSnapshot) -> int:
        """Leading prompt tokens w is predicted to hold in its prefix cache."""
        return next((n for reg, n in self.cached_tokens if reg == w.info.registration), 0)

    def images_cached_on(self, w: WorkerSnapshot) -> bool:
        """w is predicted to hold its images' KV: a prefill there needs no image pages (nor waits for the encode)."""
        return bool(self.num_images) and self.cached_on(w) >= self.image_end > 0


@dataclasses.dataclass(frozen=True, slots=True)
class RoutePlan:
    encoder: WorkerSnapshot | None
    prefill: WorkerSnapshot
    decoder: WorkerSnapshot
    path: PrefillPath
    predicted_ttft_ms: float | None = None  # from the request's arrival to its first token (SLO-aware policy only)
    images_cached: bool = False  # the prefill worker is predicted to hold its images' KV: no Encode (router's)


@dataclasses.dataclass(frozen=True, slots=True)
class RoutingConfig:
    prefill_mode: str = "auto"  # auto | dedicated | multiplexed
    multiplex_max_tokens: int = 256  # auto: prompts up to this many tokens prefill on the decoder
    max_heartbeat_age_s: float = 3.0  # older statistics mean the worker may be dead: skip it
    # of a request's output, the KV tokens a route books on its decoder with the prompt (beyond them, decoders grow
    # their caches on demand and preempt when they run out)
    reserved_output_tokens: int = 256
    # prefix-cache affinity: a worker predicted to hold more of the prompt is chosen over the least loaded one while
    # its queue is at most this many requests longer (SGLang's cache-aware router balances the same way)
    affinity_max_imbalance: int = 4
    cache_aware: bool = True  # the router predicts each worker's prefix-cache hits (False: it tells the policy none)

    def __post_init__(self) -> None:
        if self.prefill_mode not in ("auto", "dedicated", "multiplexed"):
            raise ValueError(f"prefill_mode must be auto, dedicated or multiplexed, not {self.prefill_mode!r}")
        if self.reserved_output_tokens < 0:
            raise ValueError(f"reserved_output_tokens must be at least 0, got {self.reserved_output_tokens}")


def _least_queued(workers: list[WorkerSnapshot]) -> WorkerSnapshot:
    return min(workers, key=lambda w: (w.load.queue_length, w.load.num_leases, w.worker_id))


def route(workers: list[WorkerSnapshot], request: RouteSummary, config: RoutingConfig) -> RoutePlan | None:
    live = [w for w in workers if w.age_s <= config.max_heartbeat_age_s and not w.excluded_by(request.exclude)]
    decoders = [w for w in live if w.has(Stage.DECODE)]
    if not decoders:
        return None
    decoder = min(decoders, key=lambda w: (w.load.unfinished_decode_tokens, w.load.queue_length, w.worker_id))
    dedicated = [w for w in live if w.has(Stage.PREFILL) and not w.has(Stage.DECODE)]
    prefill, path = _choose_prefill(decoder, decoders, dedicated, request, config)
    if prefill is None:
        return None
    if path != PrefillPath.DEDICATED:
        decoder = prefill
    encoder = None
    if request.num_images:
        encoders = [w for w in live if w.has(Stage.ENCODE)]
        if not encoders:
            return None
        encoder = prefill if prefill.has(Stage.ENCODE) else _least_queued(encoders)
    return RoutePlan(encoder, prefill, decoder, path)


def _choose_prefill(decoder, decoders, dedicated, request, config) -> tuple[WorkerSnapshot | None, PrefillPath]:
    mixed = [w for w in decoders if w.has(Stage.PREFILL)]
    if not dedicated:
        if not mixed:
            return None, PrefillPath.DEDICATED
        best = decoder if decoder.has(Stage.PREFILL) else _least_decoding(mixed)
        return _with_affinity(mixed, best, request, config), PrefillPath.COLOCATED
    multiplex = bool(mixed) and (
        config.prefill_mode == "multiplexed"
        or (config.prefill_mode == "auto" and request.num_prompt_tokens <= config.multiplex_max_tokens)
    )
    if multiplex:
        best = decoder if decoder.has(Stage.PREFILL) else _least_decoding(mixed)
        return _with_affinity(mixed, best, request, config), PrefillPath.MULTIPLEXED
    return _with_affinity(dedicated, _least_queued(dedicated), request, config), PrefillPath.DEDICATED


def _with_affinity(
    workers: list[WorkerSnapshot], least_loaded: WorkerSnapshot, request: RouteSummary, config: RoutingConfig
) -> WorkerSnapshot:
    """The worker predicted to hold the most of the prompt (the less loaded of equals), unless its queue is more
    than `affinity_max_imbalance` requests longer than the least loaded one's; with no predicted hit, that one."""
    if not request.cached_tokens:
        return least_loaded
    best = max(workers, key=lambda w: (request.cached_on(w), -w.load.queue_length, -w.load.unfinished_decode_tokens))
    if request.cached_on(best) <= request.cached_on(least_loaded):
        return least_loaded
    if best.load.queue_length > least_loaded.load.queue_length + config.affinity_max_imbalance:
        return least_loaded
    return best


def _least_decoding(workers: list[WorkerSnapshot]) -> WorkerSnapshot:
    return min(workers, key=lambda w: (w.load.unfinished_decode_tokens, w.load.queue_length, w.worker_id))
