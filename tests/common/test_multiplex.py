"""The SLO-aware multiplexing toggle as a pure function: which path, which workers, when it refuses."""

import dataclasses

import pytest

from common.latency import LatencyProfile, StageCost
from common.policy.multiplex import MultiplexConfig, route_slo
from common.policy.routing import PrefillPath, RouteSummary
from common.request import Stage
from common.workers import WorkerInfo, WorkerLoad, WorkerSnapshot

E, P, D = Stage.ENCODE, Stage.PREFILL, Stage.DECODE
# encode 10 ms per image; prefill 0.1 ms per token; decode 5 ms + 1 ms per running sequence
PROFILE = LatencyProfile(
    "t",
    "analytic",
    "hw",
    "m",
    encode=StageCost(per_unit_ms=10.0),
    prefill=StageCost(per_unit_ms=0.1),
    decode=StageCost(overhead_ms=5.0, per_unit_ms=1.0),
    transfer_latency_ms=0.0,
    transfer_gbps=1.0,
    image_tokens=576,
)


def w(wid, roles, age=0.0, **load):
    return WorkerSnapshot(WorkerInfo(wid, "127.0.0.1:1", frozenset(roles)), WorkerLoad(**load), age)


def ask(tokens, images=0, exclude=()):
    return RouteSummary("r", tokens, images, 16, frozenset(exclude))


def registered(workers, decoder_token_budget=0, prefill_token_budget=0, join_first=False):
    """The workers as they register the stage budgets they run: decoders τ_t = `decoder_token_budget` (and
    `join_first`), workers without the decode role `prefill_token_budget` (0: none reported)."""

    def budgets(s):
        decodes = s.has(D)
        info = dataclasses.replace(
            s.info,
            token_budget=decoder_token_budget if decodes else prefill_token_budget,
            join_first=join_first and decodes,
        )
        return dataclasses.replace(s, info=info)

    return [budgets(s) for s in workers]


def decide(
    workers,
    tokens,
    images=0,
    ttft=500.0,
    tbt=50.0,
    elapsed=0.0,
    decoder_token_budget=0,
    prefill_token_budget=0,
    join_first=False,
    **config,
):
    workers = registered(workers, decoder_token_budget, prefill_token_budget, join_first)
    return route_slo(workers, ask(tokens, images), ttft, tbt, elapsed, PROFILE, MultiplexConfig(**config))


MESH = [w("e", {E}), w("p", {P}), w("pd", {P, D}, running_decode_batch=10)]


def test_both_paths_fit_short_prompts_go_to_the_decoder_long_ones_to_prefill_workers():
    short = decide(MESH, 100)
    assert (short.plan.path, short.plan.prefill.worker_id, short.plan.decoder.worker_id) == (
        PrefillPath.MULTIPLEXED,
        "pd",
        "pd",
    )
    # the decode iteration running now (15), then one iteration of its 10 decodes and these 100 tokens (11)
    assert short.meets_slo and short.predicted_ttft_ms == pytest.approx(15 + 11)
    # the plan carries the prediction from the request's arrival: time already spent plus what is to come
    assert short.plan.predicted_ttft_ms == pytest.approx(15 + 11)
    assert decide(MESH, 100, elapsed=40).plan.predicted_ttft_ms == pytest.approx(40 + 15 + 11)
    longer = decide(MESH, 600, short_prompt_tokens=512, tbt=200)
    assert (longer.plan.path, longer.plan.prefill.worker_id) == (PrefillPath.DEDICATED, "p")
    assert longer.reason.startswith("both paths fit")


def test_a_prefill_that_would_break_the_decoders_tbt_goes_to_a_prefill_worker():
    d = decide(MESH, 1000)  # an iteration of 10 decodes + 1000 prompt tokens: 101 ms > 50 ms TBT
    assert (d.plan.path, d.plan.prefill.worker_id, d.plan.decoder.worker_id) == (PrefillPath.DEDICATED, "p", "pd")
    assert d.meets_slo and d.reason == "the only path that fits the SLO" and d.predicted_ttft_ms == pytest.approx(100)


def test_a_busy_prefill_worker_sends_the_prefill_to_a_decoder_with_slack():
    busy = [w("e", {E}), w("p", {P}, queued_prefill_tokens=6000), w("pd", {P, D}, running_decode_batch=2)]
    d = decide(busy, 300, tbt=100)  # P: 600 + 30 ms > 500; PD: iterations of 30 ms, a joiner's two ≤ 100
    assert (d.plan.path, d.plan.prefill.worker_id) == (PrefillPath.MULTIPLEXED, "pd") and d.meets_slo


def test_where_prefill_workers_hand_requests_over_two_multiplexed_iterations_must_fit_tbt():
    """A request P hands to the decoder while a multiplexed prefill runs there waits for the iteration in
    flight and then its own; with only decoders (nothing joins from elsewhere) one iteration is the limit."""
    busy = [w("e", {E}), w("p", {P}, queued_prefill_tokens=5200), w("pd", {P, D}, running_decode_batch=2)]
    d = decide(busy, 300)  # PD: a 30 ms iteration suits its decodes, but a joiner's gap is 60 ms (20% over 50)
    assert d.plan.path == PrefillPath.DEDICATED and not d.meets_slo  # P: 550 ms, 10% over the 500 ms TTFT
    assert "least violating" in d.reason
    decoders_only = [
        w("e", {E}),
        w("pd1", {P, D}, running_decode_batch=2),
        w("pd2", {P, D}, running_decode_batch=2, queued_prefill_tokens=6000),
    ]
    d = decide(decoders_only, 300)
    assert (d.plan.path, d.plan.prefill.worker_id) == (PrefillPath.COLOCATED, "pd1") and d.meets_slo


def test_when_nothing_fits_the_least_violating_option_or_a_refusal():
    d = decide(MESH, 1000, ttft=50, tbt=20)
    assert d.plan is not None and not d.meets_slo and "least violating" in d.reason
    assert d.plan.prefill.worker_id == "p"  # 100 ms vs 50: 1.0 over; the decoder would be (101-20)/20 over
    refused = decide(MESH, 1000, ttft=50, tbt=20, admission_control=True)
    assert refused.plan is None and refused.refused and "admission control" in refused.reason
    nobody = decide([w("p", {P})], 100, admission_control=True)  # nothing to refuse: no worker set serves it
    assert nobody.plan is None and not nobody.refused and nobody.reason == "no live decoder"


def test_the_encoder_with_the_earliest_finish_and_its_time_comes_off_the_slack():
    mesh = [w("e1", {E}, queued_images=3), w("e2", {E}), w("p", {P}), w("d", {D})]
    d = decide(mesh, 200, images=1, elapsed=100)
    assert d.plan.encoder.worker_id == "e2" and d.slack_ms == pytest.approx(500 - 100 - 10)
    with_ep = [w("e", {E}, queued_images=1), w("ep", {E, P}), w("d", {D})]
    assert decide(with_ep, 200, images=1).plan.encoder.worker_id == "ep"  # encode where the prefill runs


def test_with_stage_budgets_a_long_prefill_is_chunked_onto_a_decoder_within_tbt():
    busy = [w("e", {E}), w("p", {P}, queued_prefill_tokens=6000), w("pd", {P, D}, running_decode_batch=10)]
    unchunked = decide(busy, 1000, tbt=100)  # P: 700 ms > 500; PD: one 101 ms iteration, a joiner's two > 100
    assert not unchunked.meets_slo
    # τ_t = 410 on the decoder: 400 prompt tokens per iteration beside its 10 decodes (41 ms; two ≤ 100),
    # 1000 tokens in 400 + 400 + 200: 41 + 41 + 21 ms after the running iteration (15)
    chunked = decide(busy, 1000, decoder_token_budget=410, tbt=100)
    assert (chunked.plan.path, chunked.plan.prefill.worker_id) == (PrefillPath.MULTIPLEXED, "pd") and chunked.meets_slo
    assert chunked.predicted_ttft_ms == pytest.approx(15 + 41 + 41 + 21)
    queued = [
        w("e", {E}),
        w("p", {P}, queued_prefill_tokens=6000),
        w("pd", {P, D}, running_decode_batch=10, queued_prefill_tokens=800),
    ]
    assert decide(queued, 1000, decoder_token_budget=410, tbt=100).predicted_ttft_ms == pytest.approx(
        15 + 2 * 41 + 41 + 41 + 21
    )
    tight = decide(busy, 1000, decoder_token_budget=410, tbt=30)  # the budget's iterations (41 ms) break a 30 ms TBT
    assert not tight.meets_slo


def test_an_encoder_that_prefills_too_encodes_beside_its_next_chunk():
    mesh = [w("ep1", {E, P}, queued_prefill_tokens=3000), w("ep2", {E, P}, queued_images=1), w("d", {D})]
    d = decide(mesh, 200, images=1, prefill_token_budget=1000)
    assert d.plan.encoder.worker_id == "ep2"  # 20 ms of encodes beats 10 ms + a 100 ms chunk beside it
    assert d.slack_ms == pytest.approx(500 - 20)


def test_colocated_when_no_dedicated_prefill_worker_exists():
    d = decide([w("epd", {E, P, D})], 100, images=1)
    assert (d.plan.path, d.plan.encoder.worker_id, d.plan.prefill.worker_id) == (PrefillPath.COLOCATED, "epd", "epd")


def test_stale_and_excluded_workers_are_never_chosen():
    mesh = [w("e", {E}), w("p-stale", {P}, age=9.0), w("p", {P}, queued_prefill_tokens=100), w("d", {D})]
    assert decide(mesh, 100).plan.prefill.worker_id == "p"
    d = route_slo(mesh, ask(100, exclude={"p"}), 500, 50, 0, PROFILE)
    assert d.plan is None and d.reason == "no live prefill worker"
    assert route_slo([w("d", {D}, age=9.0)], ask(10), 500, 50, 0, PROFILE).reason == "no live decoder"


def test_policy_imports_no_torch():
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", "import sys, common.policy.multiplex; print('torch' in sys.modules)"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert out.strip() == "False"


def test_a_handed_over_request_goes_to_the_decoder_whose_next_iterations_are_short():
    """A decoder busy with multiplexed prefill chunks runs long iterations; a request joining it waits for
    the one in flight and then its own, and on a 4-token answer that gap is its P90 TBT."""
    mesh = [
        w("p", {P}),
        w("pd1", {P, D}, running_decode_batch=4, unfinished_decode_tokens=40, queued_prefill_tokens=2000),
        w("pd2", {P, D}, running_decode_batch=10, unfinished_decode_tokens=400),
    ]
    d = decide(mesh, 1000, decoder_token_budget=410)  # prefill fits only on P (PD chunks: 3 × ~41 ms + queue)
    assert d.plan.path == PrefillPath.DEDICATED and d.plan.decoder.worker_id == "pd2"
    quiet = [
        w("p", {P}),
        w("pd1", {P, D}, running_decode_batch=4, unfinished_decode_tokens=40),
        w("pd2", {P, D}, running_decode_batch=10, unfinished_decode_tokens=400),
    ]
    assert decide(quiet, 1000, decoder_token_budget=410).plan.decoder.worker_id == "pd1"  # no chunks: the lighter one


def test_a_busy_prefill_worker_first_finishes_its_iteration_under_way():
    """A prefill worker's iteration can be α·TTFT long; a request sent there waits it out. Counting it sends a
    long prompt to the decoder when the dedicated worker is mid-iteration, and not when it is idle."""
    idle = [w("e", {E}), w("p", {P}), w("pd", {P, D}, running_decode_batch=2)]
    assert decide(idle, 600, tbt=200).plan.path == PrefillPath.DEDICATED  # 60 ms on P; long prompts prefer ①
    busy = [
        w("e", {E}),
        w("p", {P}, num_running=1, last_iteration_ms=480, iteration_elapsed_ms=30),
        w("pd", {P, D}, running_decode_batch=2),
    ]
    d = decide(busy, 600, tbt=200)  # P: 450 left + 60 > 500; PD: its decode step under way, then one with 600 tokens
    assert (d.plan.path, d.plan.prefill.worker_id) == (PrefillPath.MULTIPLEXED, "pd") and d.meets_slo
    from common.latency.model import decode_ms, iteration_ms

    assert d.predicted_ttft_ms == pytest.approx(
        decode_ms(PROFILE, 2, 0) + iteration_ms(PROFILE, decodes=2, decode_context=0, chunks=[(600, 0)])
    )
    ep = [
        w("ep1", {E, P}, num_running=1, last_iteration_ms=300, iteration_elapsed_ms=1e-3),
        w("ep2", {E, P}, queued_images=2),
        w("d", {D}),
    ]
    d = decide(ep, 200, images=1)  # ep1: 300 under way + 10 to encode; ep2: its 3 images, 30 ms: ep2 encodes
    assert (d.plan.encoder.worker_id, d.plan.prefill.worker_id) == ("ep2", "ep2")
    assert d.predicted_ttft_ms == pytest.approx(30 + 20) and d.slack_ms == pytest.approx(500 - 30)


def test_a_decoder_that_encodes_the_images_itself_delays_its_decodes_by_the_encode_too():
    """One iteration of 2 decodes and a 300-token prompt takes 30.2 ms; encoding its image (10 ms) first makes
    the decodes' gap 40.2 ms, which a 35 ms TBT does not allow."""
    epd = [w("epd", {E, P, D}, running_decode_batch=2)]
    assert decide(epd, 300, tbt=35).meets_slo  # text: no encode
    assert not decide(epd, 300, images=1, tbt=35).meets_slo
    assert decide(epd, 300, images=1, tbt=45).meets_slo


def test_what_is_left_of_the_iteration_under_way_counts_from_the_report_and_its_age():
    """P reported 100 ms into an iteration as long as its last (400 ms), 0.1 s ago: 200 ms are left. A report
    older than the iteration says another began at an unknown point: half of one. None under way: nothing."""

    def ttft(age, elapsed):
        p = w("p", {P}, age=age, num_running=1, last_iteration_ms=400, iteration_elapsed_ms=elapsed)
        return decide([p, w("d", {D})], 100, ttft=2000).predicted_ttft_ms - 10  # less the prefill's own 10 ms

    assert ttft(0.1, 100) == pytest.approx(200)
    assert ttft(0.0, 399) == pytest.approx(1)
    assert ttft(0.5, 100) == pytest.approx(200)  # 400 - 100 - 500 < 0: a later iteration, halfway on average
    assert ttft(0.1, 0) == pytest.approx(0)  # between iterations when reported: the next one starts with this


def test_with_join_first_a_joiners_gap_is_one_multiplexed_iteration_plus_a_decode_only_one():
    """Decoders that give a handed-over request's first decode a decode-only iteration (`join_first`): path ②
    needs one chunk iteration plus that one within TBT, and path ①'s decoder is picked by that gap."""
    busy = [w("e", {E}), w("p", {P}, queued_prefill_tokens=5200), w("pd", {P, D}, running_decode_batch=2)]
    assert decide(busy, 300).plan.path == PrefillPath.DEDICATED  # two 30.2 ms iterations > 50
    d = decide(busy, 300, join_first=True)  # 30.2 + a decode-only iteration of 3 (8 ms) ≤ 50
    assert (d.plan.path, d.plan.prefill.worker_id) == (PrefillPath.MULTIPLEXED, "pd") and d.meets_slo
    # path ①: pd1 is busy with a multiplexed prefill (200 queued tokens), pd2 decodes 10 sequences
    mesh = [
        w("e", {E}),
        w("p", {P}),
        w("pd1", {P, D}, running_decode_batch=2, queued_prefill_tokens=200),
        w("pd2", {P, D}, running_decode_batch=10),
    ]
    # pd1: 20.2 + 20.3 ms (two chunk iterations) against pd2's 15 + 16: pd2
    assert decide(mesh, 1000).plan.decoder.worker_id == "pd2"
    # join_first: pd1's second is decode-only, 20.2 + 8 ms: pd1
    assert decide(mesh, 1000, join_first=True).plan.decoder.worker_id == "pd1"


def test_join_first_decoders_may_run_a_decode_only_iteration_after_each_chunk_before_the_prompts_last():
    """Requests handed over meanwhile each get a decode-only iteration after the chunk iteration in which they
    arrived (at most one between two chunk iterations), so a multiplexed prefill of n chunks behind q queued
    chunks may wait n + q − 1 of them before its first token."""
    mesh = [
        w("e", {E}),
        w("p", {P}, queued_prefill_tokens=100_000),
        w("pd", {P, D}, running_decode_batch=2, queued_prefill_tokens=250),
    ]
    # chunks of 100 beside the 2 decodes: queued 100 + 100 + 50 (25.6 ms), this prompt 3 × 100 (30.6 ms), after
    # the decode iteration in flight (7 ms); five decode-only iterations of 3 sequences (8 ms each) between them
    d = decide(mesh, 300, decoder_token_budget=102, join_first=True)
    assert d.plan.path == PrefillPath.MULTIPLEXED and d.predicted_ttft_ms == pytest.approx(7 + 25.6 + 30.6 + 5 * 8)
    without = decide(mesh, 300, decoder_token_budget=102, join_first=False, tbt=100)  # joiners wait a chunk instead
    assert without.plan.path == PrefillPath.MULTIPLEXED and without.predicted_ttft_ms == pytest.approx(7 + 25.6 + 30.6)


def test_a_decoder_whose_decodes_fill_its_budget_is_predicted_to_prefill_only_once_they_drain():
    """The scheduler gives a prefill no tokens while the running decodes take the whole budget."""
    full = [w("pd", {P, D}, running_decode_batch=20, unfinished_decode_tokens=200)]
    d = decide(full, 50, ttft=1000, decoder_token_budget=10)
    # its decode step (25 ms), ten more to drain 200 tokens from 20 sequences, then 50 tokens in chunks of 10
    assert d.predicted_ttft_ms == pytest.approx(25 + 10 * 25 + 5 * 1)
