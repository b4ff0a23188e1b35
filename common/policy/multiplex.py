"""The SLO-aware multiplexing toggle (Tropical), a pure function over a registry snapshot and a latency profile.

For one request (prompt tokens T, images, its TTFT/TBT targets, time already spent):
  0. a busy worker first finishes the iteration under way (predicted as long as its last one, less what it
     had run when reported): new work there waits it out — a prefill worker's iteration may be α·TTFT long;
  1. encoder — the one with the least predicted finish time (its queued images plus these, beside the
     next prefill chunk when it prefills too); a prefill worker that can encode encodes the request
     itself (no image pages move), else the encode and the image-page pull come off the TTFT slack;
  2. path ① dedicated prefill worker p: allowed when the encode, p's predicted queue (its queued prompt
     tokens) + this prefill + the KV pull fit the remaining slack;
  3. path ② prefill on a decoder d that can prefill: allowed when d's current iteration (its running
     batch and their context) + this prefill fit the TBT target — the decodes it delays still meet
     their SLO — and the prefill itself fits the slack. Where prefill workers hand requests over to the
     decoders, a request joining d waits for the prefill's iteration in flight and then its own, so two
     such iterations must fit TBT (on a short answer that first gap is its P90) — or, where decoders give a
     joiner's first decode a decode-only iteration (`join_first`), one such iteration plus that one. When d runs
     with a stage budget (the τ_t it registered, TBT-derived as in TriInfer), the prefill is chunked to
     what the budget leaves beside the decodes, one chunk per iteration, and ② needs that each chunk's
     iteration fits (twice, where requests are handed over) and that the chunks (after d's queued
     prompts) finish within the slack — with join-first decoders, each chunk iteration before the prompt's
     last counted as followed by a decode-only one, for a request handed over meanwhile;
  4. both allowed: short prefills (≤ `short_prompt_tokens` left to compute) take ②, long ones ①; one allowed: that one;
     none: the least-violating option, or no plan (HTTP 503) when admission control is on;
  5. the decoder of path ① is the one where the handed-over request's first decode comes soonest (the
     iteration in flight plus the next, with the chunks of prefills multiplexed onto it — on a short
     answer that one gap is most of its P90 TBT), then the fewest unfinished tokens.
With prefix-cache affinity (the router's predictions in `RouteSummary.cached_tokens`), a prefill on a worker
predicted to hold part of the prompt costs only the rest (at its context), and one predicted to hold the images'
KV waits for no encode: so the policy weighs a cache hit against the worker's queue in predicted time.
Workers with stale statistics (a missed heartbeat) or that the request excludes are never chosen.
"""

from __future__ import annotations

import dataclasses

from common.latency.model import (
    LatencyProfile,
    chunked_iterations_ms,
    decode_ms,
    encode_ms,
    iteration_ms,
    prefill_chunk_ms,
    prefill_ms,
    transfer_ms,
)
from common.policy.routing import PrefillPath, RoutePlan, RouteSummary
from common.request import Stage
from common.workers import WorkerSnapshot


@dataclasses.dataclass(frozen=True, slots=True)
class MultiplexConfig:
    short_prompt_tokens: int = 512  # both paths allowed: prompts up to this prefill on the decoder
    admission_control: bool = False  # no path meets the SLO: refuse (503) instead of the least-violating one
    max_heartbeat_age_s: float = 3.0
    image_bytes: int = 0  # bytes of one image's pages (transfer time); 0: ignore
    kv_bytes_per_token: int = 0  # bytes of one token's KV pages; 0: ignore


@dataclasses.dataclass(frozen=True, slots=True)
class Decision:
    plan: RoutePlan | None  # None: refused (admission control) or nothing can serve it
    predicted_ttft_ms: float
    slack_ms: float  # the TTFT budget left for the prefill after the (chosen) encode and image pull
    reason: str
    meets_slo: bool
    refused: bool = False  # a plan existed, and admission control turned it down: no path meets the SLO


@dataclasses.dataclass(frozen=True, slots=True)
class _Option:
    path: PrefillPath
    worker: WorkerSnapshot
    ttft_ms: float  # predicted time to the first token from now: encode wait, queue, the prefill, the KV pull
    violation: float  # 0 when the option meets every target; else how far off, relative to the target


def route_slo(
    workers: list[WorkerSnapshot],
    request: RouteSummary,
    ttft_ms: float,
    tbt_ms: float,
    elapsed_ms: float,
    profile: LatencyProfile,
    config: MultiplexConfig = MultiplexConfig(),
) -> Decision:
    live = [w for w in workers if w.age_s <= config.max_heartbeat_age_s and not w.excluded_by(request.exclude)]
    decoders = [w for w in live if w.has(Stage.DECODE)]
    if not decoders:
        return Decision(None, 0.0, 0.0, "no live decoder", False)
    # each encoder's predicted finish, once: it picks the encoder and prices a prefill on a worker that encodes
    finishes = {w.worker_id: _encode_finish(w, request, profile, config) for w in live if _encodes_here(w, request)}
    encoder, encode_pred = _encoder(live, finishes, request, profile, config)
    if request.num_images and encoder is None:
        return Decision(None, 0.0, 0.0, "no live encoder", False)

    def encode_wait(w: WorkerSnapshot) -> float:
        """When the request's image pages are ready for a prefill on w: w encodes it itself when it can
        (no image pages move; its own queue and the iteration under way count), else the chosen encoder — or
        at once where w is predicted to hold the images' KV in its prefix cache (it needs no image pages)."""
        if request.images_cached_on(w):
            return 0.0
        return finishes[w.worker_id] if _encodes_here(w, request) else encode_pred

    left = ttft_ms - elapsed_ms  # the TTFT still to spend: encode, prefill queue, the prefill, the KV pull
    options = [
        _dedicated(p, request, encode_wait(p), left, ttft_ms, profile, config)
        for p in live
        if p.has(Stage.PREFILL) and not p.has(Stage.DECODE)
    ]
    handoffs = bool(options)  # dedicated prefill workers exist: they hand requests over to the decoders
    options += [
        _multiplexed(d, request, encode_wait(d), left, ttft_ms, tbt_ms, profile, handoffs)
        for d in decoders
        if d.has(Stage.PREFILL)
    ]
    if not options:
        return Decision(None, 0.0, left - encode_pred, "no live prefill worker", False)
    chosen, reason = _choose(options, request, config)
    if chosen is None:
        return Decision(None, min(o.ttft_ms for o in options), left - encode_pred, reason, False, refused=True)
    if chosen.path == PrefillPath.DEDICATED:
        decoder = min(
            decoders,
            key=lambda w: (_join_gap_ms(w, profile), w.load.unfinished_decode_tokens, w.load.queue_length, w.worker_id),
        )
    else:
        decoder = chosen.worker
    path = PrefillPath.COLOCATED if chosen.path == PrefillPath.MULTIPLEXED and not handoffs else chosen.path
    if encoder is not None and chosen.worker.has(Stage.ENCODE):
        encoder = chosen.worker  # encode where the prefill runs: no image pages move
    plan = RoutePlan(encoder if request.num_images else None, chosen.worker, decoder, path, elapsed_ms + chosen.ttft_ms)
    return Decision(plan, chosen.ttft_ms, left - encode_wait(chosen.worker), reason, chosen.violation == 0)


def _in_flight_ms(w: WorkerSnapshot) -> float:
    """What is left of the iteration under way on w, which new work there waits out (a prefill worker's can be
    α·TTFT long: ignoring it made busy workers look free). Its length is taken as its last one's, less what it
    had run when w reported and since (the report's age). Past that length another has begun at a point we
    cannot know: half of one. No iteration under way when w reported: the work since starts the next one."""
    load = w.load
    if not load.iteration_elapsed_ms:
        return 0.0
    left = load.last_iteration_ms - load.iteration_elapsed_ms - w.age_s * 1e3
    return left if left > 0 else load.last_iteration_ms / 2


def _encode_finish(w: WorkerSnapshot, request: RouteSummary, profile: LatencyProfile, config: MultiplexConfig) -> float:
    """When w would have this request's images encoded: after its iteration under way, in the next one, beside
    its next prefill chunk when it prefills too.

    A prefill there then waits for w's whole queue, that chunk included: it is counted twice, which stands in for
    the iteration carrying the prompt's last tokens being filled to τ_t by arrivals. Counting it once measured worse
    (bench/README.md, "Path ① predictions and the double-counted chunk")."""
    beside = (
        prefill_chunk_ms(profile, min(w.load.queued_prefill_tokens, w.info.token_budget))
        if w.has(Stage.PREFILL)
        else 0.0
    )
    return _in_flight_ms(w) + encode_ms(profile, w.load.queued_images + request.num_images) + beside


def _encodes_here(w: WorkerSnapshot, request: RouteSummary) -> bool:
    """A prefill on w encodes the request's images there too: its iteration under way is in the encode wait."""
    return bool(request.num_images) and w.has(Stage.ENCODE)


def _encoder(live, finishes: dict[str, float], request, profile, config) -> tuple[WorkerSnapshot | None, float]:
    """The encoder with the least predicted finish (`finishes`: by worker id) and when its pages are pulled."""
    encoders = [w for w in live if w.worker_id in finishes]
    if not encoders:
        return None, 0.0
    best = min(encoders, key=lambda w: (finishes[w.worker_id], w.worker_id))
    pull = transfer_ms(profile, config.image_bytes * request.num_images) if config.image_bytes else 0.0
    return best, finishes[best.worker_id] + pull


def _dedicated(p, request, encode_wait, left, ttft_ms, profile, config) -> _Option:
    """`encode_wait`: when the image pages are ready; `left`: the TTFT still to spend."""
    queue = (0.0 if _encodes_here(p, request) else _in_flight_ms(p)) + prefill_ms(profile, p.load.queued_prefill_tokens)
    pull = (
        transfer_ms(profile, config.kv_bytes_per_token * request.num_prompt_tokens)
        if config.kv_bytes_per_token
        else 0.0
    )
    cached = min(request.cached_on(p), request.num_prompt_tokens - 1)  # the prefix p is predicted to hold
    predicted = encode_wait + queue + prefill_chunk_ms(profile, request.num_prompt_tokens - cached, cached) + pull
    return _Option(PrefillPath.DEDICATED, p, predicted, max(0.0, (predicted - left) / ttft_ms))


def _multiplexed(d, request, encode_wait, left, ttft_ms, tbt_ms, profile, handoffs: bool = False) -> _Option:
    """`handoffs`: prefill workers hand requests over to the decoders, so one may join d while this prefill
    runs there, and its first gap is the chunk iteration in flight plus its own: two of them must fit TBT, or
    where d gives a joiner's first decode a decode-only iteration (`join_first`), one of them plus that one."""
    budget, join_first = _budget(d), d.info.join_first
    batch, context = d.load.running_decode_batch, d.load.decode_context_tokens
    iteration = decode_ms(profile, batch, context)
    in_flight = 0.0 if _encodes_here(d, request) else max(iteration, _in_flight_ms(d))
    queued = d.load.queued_prefill_tokens
    total = request.num_prompt_tokens
    cached = min(request.cached_on(d), total - 1)  # the prefix d is predicted to hold: computed from there
    if queued + total - cached <= d.load.long_token_budget - batch:
        return _long_step(d, request, encode_wait, in_flight, cached, left, ttft_ms, profile)
    if budget is None:  # the whole prompt in one iteration beside the running decodes
        queue = prefill_ms(profile, queued)
        steps = [iteration_ms(profile, decodes=batch, decode_context=context, chunks=[(total - cached, cached)])]
    else:  # chunks of what the budget leaves beside the decodes, one per iteration, queued prompts first
        chunk = budget - batch
        if chunk <= 0:  # no room beside the decodes: no prefill runs here until (as if) the batch has drained
            in_flight += iteration * -(-d.load.unfinished_decode_tokens // max(batch, 1))
            batch, context, chunk = 0, 0, max(budget, 1)
        queue = chunked_iterations_ms(profile, queued, chunk, batch, context)
        steps = [
            iteration_ms(profile, decodes=batch, decode_context=context, chunks=[(min(chunk, total - start), start)])
            for start in range(cached, total, chunk)
        ]
    joiner_only = decode_ms(profile, batch + 1, context) if handoffs and join_first else 0.0
    if joiner_only and budget is not None:  # requests handed over meanwhile: each chunk iteration before the
        # prompt's last may be followed by a decode-only one for a joiner's first decode (at most one between two)
        chunks_before = -(-d.load.queued_prefill_tokens // chunk) + len(steps) - 1
        queue += chunks_before * joiner_only
    predicted = encode_wait + in_flight + queue + sum(steps)
    joiner = (joiner_only if join_first else max(steps)) if handoffs else 0.0
    # where d encodes the images too, one of these iterations runs the vision tower first: the decodes wait for it
    longest = max(steps) + (
        encode_ms(profile, d.load.queued_images + request.num_images) if _encodes_here(d, request) else 0.0
    )
    tbt_over = (longest + joiner - tbt_ms) / tbt_ms if batch or handoffs else 0.0
    return _Option(PrefillPath.MULTIPLEXED, d, predicted, max(0.0, tbt_over, (predicted - left) / ttft_ms))


def _long_step(d, request, encode_wait, in_flight, cached, left, ttft_ms, profile) -> _Option:
    """d's decodes can each spare a gap past TBT (`long_token_budget`): its queued prompts and this one run in one
    long iteration, which the P90 TBT of the decodes it delays allows (a request handed over meanwhile counts its
    first gap slow there). Only its TTFT is checked."""
    chunks = [(d.load.queued_prefill_tokens, 0)] if d.load.queued_prefill_tokens else []
    chunks.append((request.num_prompt_tokens - cached, cached))
    step = iteration_ms(
        profile, decodes=d.load.running_decode_batch, decode_context=d.load.decode_context_tokens, chunks=chunks
    )
    predicted = encode_wait + in_flight + step
    return _Option(PrefillPath.MULTIPLEXED, d, predicted, max(0.0, (predicted - left) / ttft_ms))


def _join_gap_ms(d: WorkerSnapshot, profile: LatencyProfile) -> float:
    """The gap a request handed to decoder d waits for its first decode: the iteration in flight, then the
    next, which carries it — each with the chunk of d's queued prefills that fits beside the decodes; where d
    runs `join_first` the next is decode-only."""
    batch, context, queued = d.load.running_decode_batch, d.load.decode_context_tokens, d.load.queued_prefill_tokens
    budget = _budget(d)
    chunk = queued if budget is None else min(queued, max(0, budget - batch - 1))
    chunks = [(chunk, 0)] if chunk else []
    return iteration_ms(profile, decodes=batch, decode_context=context, chunks=chunks) + iteration_ms(
        profile, decodes=batch + 1, decode_context=context, chunks=[] if d.info.join_first else chunks
    )


def _budget(w: WorkerSnapshot) -> int | None:
    """τ_t as w registered it; None where it reported none (a whole prompt is then predicted in one iteration)."""
    return w.info.token_budget or None


def _choose(options: list[_Option], request: RouteSummary, config: MultiplexConfig) -> tuple[_Option | None, str]:
    ok = [o for o in options if o.violation == 0]
    by_path = {
        path: min((o for o in ok if o.path == path), key=lambda o: (o.ttft_ms, o.worker.worker_id), default=None)
        for path in (PrefillPath.DEDICATED, PrefillPath.MULTIPLEXED)
    }
    dedicated, multiplexed = by_path[PrefillPath.DEDICATED], by_path[PrefillPath.MULTIPLEXED]
    if dedicated and multiplexed:  # short: what the decoder would compute of it (less what it is predicted to hold)
        short = request.num_prompt_tokens - request.cached_on(multiplexed.worker) <= config.short_prompt_tokens
        return (
            (multiplexed, "both paths fit; short prompt on the decoder")
            if short
            else (dedicated, "both paths fit; long prompt on a prefill worker")
        )
    if dedicated or multiplexed:
        return dedicated or multiplexed, "the only path that fits the SLO"
    if config.admission_control:
        return None, "no path meets the SLO (admission control)"
    return min(
        options, key=lambda o: (o.violation, o.ttft_ms, o.worker.worker_id)
    ), "no path meets the SLO; least violating"
