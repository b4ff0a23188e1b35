"""The latency model as pure functions, the budgets found on it, and the analytic profiles."""

import dataclasses
import math
import subprocess
import sys

import pytest

from common.latency import LatencyProfile, StageCost, decode_ms, encode_ms, prefill_chunk_ms, prefill_ms, transfer_ms
from common.latency.budgets import IterationTime, Overrun, _chunk_guess, budgets_for, largest_within, stage_limit_ms
from common.latency.model import iteration_ms
from common.latency.roofline import LLAVA_15_7B, TRIINFER_H20, analytic_profile, load_profile, saturation_points


def profile(**overrides) -> LatencyProfile:
    base = dict(
        name="t",
        source="measured",
        hardware="cpu",
        model="m",
        encode=StageCost(overhead_ms=1.0, floor_ms=5.0, per_unit_ms=2.0, half_units=0.5),
        prefill=StageCost(overhead_ms=0.5, floor_ms=3.0, per_unit_ms=0.1, half_units=10.0, quadratic_ms=0.001),
        decode=StageCost(overhead_ms=0.5, floor_ms=4.0, per_unit_ms=0.2, half_units=5.0, quadratic_ms=0.01),
        transfer_latency_ms=0.1,
        transfer_gbps=2.0,
        image_tokens=256,
    )
    return LatencyProfile(**{**base, **overrides})


def test_stage_times_follow_the_formula():
    p = profile()
    assert encode_ms(p, 0) == 0
    assert encode_ms(p, 1) == 1.0 + 5.0  # floor: max(5, 2·1.5)
    assert encode_ms(p, 4) == 1.0 + 2.0 * 4.5
    assert prefill_chunk_ms(p, 100) == pytest.approx(0.5 + 0.1 * 110 + 0.001 * 100 * 50)
    assert prefill_chunk_ms(p, 50, context=100) == pytest.approx(0.5 + 0.1 * 60 + 0.001 * 50 * 125)
    assert prefill_ms(p, 100, chunk=50) == pytest.approx(prefill_chunk_ms(p, 50) + prefill_chunk_ms(p, 50, 50))
    assert prefill_ms(p, 120, chunk=50) == pytest.approx(
        prefill_chunk_ms(p, 50) + prefill_chunk_ms(p, 50, 50) + prefill_chunk_ms(p, 20, 100)
    )
    assert prefill_ms(p, 100) == prefill_ms(p, 100, chunk=500) == prefill_chunk_ms(p, 100)
    assert decode_ms(p, 8, 800) == pytest.approx(0.5 + 4.0 + 0.01 * 800)  # floor: max(4, 0.2·13)
    assert decode_ms(p, 40, 0) == pytest.approx(0.5 + 0.2 * 45)
    assert transfer_ms(p, 2_000_000) == pytest.approx(0.1 + 1.0)


def test_profiles_round_trip_and_reject_nonsense(tmp_path):
    p = profile()
    p.save(tmp_path / "p.json")
    assert LatencyProfile.load(tmp_path / "p.json") == p
    with pytest.raises(ValueError, match="per_unit_ms"):
        StageCost(per_unit_ms=-1)
    with pytest.raises(ValueError, match="source"):
        profile(source="guessed")
    with pytest.raises(ValueError, match="profile"):
        LatencyProfile.from_json('{"format": "other"}')


def test_binary_search_finds_the_last_batch_within_the_limit():
    assert largest_within(lambda x: x * x, 50, 1000) == 7
    assert largest_within(lambda x: 10 + x, 5, 1000) == 0
    assert largest_within(lambda x: 1, 5, 64) == 64
    calls = []
    largest_within(lambda x: calls.append(x) or x, 700, 1 << 20)
    assert len(calls) <= 22  # logarithmic


@pytest.mark.parametrize("has_decode", [False, True])
def test_budgets_are_the_largest_batches_under_the_stage_limit(has_decode):
    p = profile()
    b = budgets_for(p, has_decode, ttft_ms=200, tbt_ms=30)
    limit = 30 if has_decode else 100  # TBT on decode instances, α·TTFT (α = 0.5) elsewhere
    assert b.limit_ms == limit == stage_limit_ms(has_decode, 200, 30) and b.fits
    assert encode_ms(p, b.image_budget) <= limit < encode_ms(p, b.image_budget + 1)
    assert prefill_chunk_ms(p, b.token_budget) <= limit < prefill_chunk_ms(p, b.token_budget + 1)
    beside = b.token_budget - b.image_token_cost  # tokens that fit beside one image's encode
    assert 0 < b.image_token_cost < b.token_budget
    assert encode_ms(p, 1) + prefill_chunk_ms(p, beside) <= limit < encode_ms(p, 1) + prefill_chunk_ms(p, beside + 1)
    tight = budgets_for(p, has_decode, ttft_ms=2, tbt_ms=1)
    assert (tight.image_budget, tight.token_budget, tight.fits) == (1, 1, False)
    assert not tight.tokens_fit and not tight.images_fit


def test_an_iterations_decodes_leave_fewer_prompt_tokens_the_longer_their_context():
    p, limit = profile(), 100.0
    time = IterationTime(p, limit)
    alone = time.tokens_beside(0, 0, 1 << 15)
    assert alone == budgets_for(p, True, 1000, limit).token_budget
    short, long = time.tokens_beside(8, 8 * 100, 1 << 15), time.tokens_beside(8, 8 * 1000, 1 << 15)
    assert 0 < long < short < alone
    for decodes, context, tokens in ((8, 800, short), (8, 8000, long)):
        assert iteration_ms(p, decodes=decodes, decode_context=context, chunks=[(tokens, 0)]) <= limit
        assert iteration_ms(p, decodes=decodes, decode_context=context, chunks=[(tokens + 1, 0)]) > limit
    assert time.tokens_beside(8, 8000, upper=10) == 10 and time.tokens_beside(8, 10**6, 1 << 15) == 0


def test_the_chunk_beside_decodes_is_found_from_its_closed_form_as_the_search_finds_it():
    """`tokens_beside` starts from the closed form's guess: the same answer as the plain binary search, for profiles
    with and without a floor or attention term; the guess is the answer but at a float's edge."""
    import random

    rng = random.Random(7)
    profiles = [profile(), analytic_profile("H20"), profile(prefill=StageCost(overhead_ms=1.0, per_unit_ms=0.05))]
    hits = tried = 0
    for p in profiles:
        for _ in range(300):
            limit = rng.uniform(1, 400)
            decodes, context, chunk_context = rng.randint(0, 256), rng.randint(0, 300_000), rng.randint(0, 4000)
            upper, overrun = rng.choice([1 << 15, rng.randint(1, 3000)]), rng.choice([0.0, rng.uniform(0, 50)])
            time = IterationTime(p, limit)

            def time_of(t, d=decodes, c=context, cc=chunk_context, p=p):
                return iteration_ms(p, decodes=d, decode_context=c, chunks=((t, cc),))

            within = max(limit - overrun, limit / 4)
            plain = largest_within(time_of, within, upper)
            assert time.tokens_beside(decodes, context, upper, chunk_context, overrun) == plain
            if 1 < plain < upper:
                tried += 1
                hits += _chunk_guess(p, decodes, context, chunk_context, within) == plain
    assert tried > 200 and hits >= 0.99 * tried
    # a wrong guess costs calls, never the answer
    assert largest_within(lambda x: x * x, 50, 1000, guess=3) == largest_within(lambda x: x * x, 50, 1000, 900) == 7
    assert largest_within(lambda x: 10 + x, 5, 1000, guess=1) == 0


def test_h20_roofline_saturates_where_triinfer_measured():
    points = saturation_points(analytic_profile("H20"))
    for key, measured in (
        ("encode_images", TRIINFER_H20["encode_images"]),
        ("prefill_tokens", TRIINFER_H20["prefill_tokens"]),
        ("decode_sequences", TRIINFER_H20["decode_sequences"]),
    ):
        assert abs(points[key] - measured) <= 0.2 * measured, (key, points[key], measured)


def test_h20_batch_one_decode_is_near_its_weights_read():
    """A single sequence's decode step reads the weights once: memory-bound, within 2× of that floor (plus the
    iteration's overhead), not the compute curve of a half-filled GPU."""
    p = analytic_profile("H20")
    floor = p.decode.overhead_ms + LLAVA_15_7B.text_params * 2 / (4.8e12 * 0.8 / 1e3)
    assert floor <= decode_ms(p, 1, 0) <= 2 * floor, (decode_ms(p, 1, 0), floor)


def test_roofline_agrees_with_what_was_not_calibrated():
    h20, h100, h200 = (analytic_profile(hw) for hw in ("H20", "H100", "H200"))
    # TriInfer Fig. 11 (H20, NVLink): 95% of image pulls < 2 ms, of KV pulls < 8 ms
    image_bytes = LLAVA_15_7B.image_tokens * 4096 * 2
    kv_bytes = (1024 + LLAVA_15_7B.image_tokens) * LLAVA_15_7B.kv_bytes_per_token
    assert transfer_ms(h20, image_bytes) < 2 and transfer_ms(h20, kv_bytes) < 8
    # compute-bound prefill follows peak FLOP/s; memory-bound decode follows HBM bandwidth
    assert prefill_ms(h100, 4096) < prefill_ms(h20, 4096) / 4
    assert decode_ms(h200, 8, 8 * 1024) < decode_ms(h100, 8, 8 * 1024) < decode_ms(h20, 8, 8 * 1024) * 1.5
    for p in (h20, h100, h200):
        times = [prefill_chunk_ms(p, t) for t in range(1, 4096, 64)]
        assert times == sorted(times) and all(math.isfinite(t) for t in times)


def test_an_encode_heavy_shape_encodes_an_image_in_most_of_its_prefill():
    """`H20:qwen2-vl-7b-1344`: an image's encode takes 0.5-1x its 2,304 tokens' prefill (LLaVA-1.5-7B's: < 0.1x),
    and one image fills the GPU, as many vision tokens as LLaVA's six; `H20` is LLaVA's profile as before."""
    qwen, llava = load_profile("H20:qwen2-vl-7b-1344"), load_profile("H20")
    assert (qwen.model, qwen.image_tokens, llava) == ("qwen2-vl-7b-1344", 2304, analytic_profile("H20"))

    def share(p):
        return encode_ms(p, 1) / prefill_chunk_ms(p, p.image_tokens)

    assert share(llava) < 0.1 and 0.5 < share(qwen) < 1
    assert saturation_points(qwen)["encode_images"] == 1
    assert encode_ms(qwen, 2) > 1.9 * encode_ms(qwen, 1)
    with pytest.raises(ValueError, match="unknown model shape"):
        load_profile("H20:llava-2")


def test_latency_code_imports_no_torch():
    code = "import sys, common.latency, common.latency.budgets, common.latency.roofline; print('torch' in sys.modules)"
    assert (
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
        == "False"
    )


def test_shipped_profiles_are_what_the_roofline_gives():
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "profiles"
    for spec, name in [(hw, f"llava-1.5-7b-{hw.lower()}") for hw in ("H20", "H100", "H200")] + [
        ("H20:qwen2-vl-7b-1344", "qwen2-vl-7b-1344-h20")
    ]:
        shipped = LatencyProfile.load(root / f"{name}.json")
        assert shipped == load_profile(spec), f"profiles/{name}.json is stale: epdmesh profile --analytic {spec}"


def test_iteration_time_composes_the_stages_and_scaling_dilates_every_time():
    from common.latency import iteration_ms, scaled
    from common.latency.model import mixed_cost

    p = analytic_profile("H20")
    assert iteration_ms(p) == 0.0
    assert iteration_ms(p, images=3) == encode_ms(p, 3)
    assert iteration_ms(p, decodes=8, decode_context=4000) == decode_ms(p, 8, 4000)
    assert iteration_ms(p, chunks=[(512, 0)]) == pytest.approx(prefill_chunk_ms(p, 512))
    assert iteration_ms(p, chunks=[(256, 256)]) == pytest.approx(prefill_chunk_ms(p, 256, 256))
    mixed = iteration_ms(p, images=1, decodes=4, decode_context=2000, chunks=[(300, 0), (200, 100)])
    assert mixed == pytest.approx(
        encode_ms(p, 1)
        + mixed_cost(p, 4, 500).base_ms(504)
        + p.decode.quadratic_ms * 2000
        + p.prefill.quadratic_ms * (300 * 150 + 200 * 200)
    )
    slow = scaled(p, 10)
    for args in ((3, 0, 0, ()), (0, 8, 4000, ()), (1, 4, 2000, ((300, 0), (200, 100)))):
        assert iteration_ms(slow, *args) == pytest.approx(10 * iteration_ms(p, *args))
    assert transfer_ms(slow, 1 << 30) == pytest.approx(10 * transfer_ms(p, 1 << 30))
    assert scaled(p, 1) is p
    with pytest.raises(ValueError):
        scaled(p, 0)


def test_budget_headroom_sizes_iterations_to_a_fraction_of_the_limit():
    p = analytic_profile("H20")
    assert budgets_for(p, True, 1000, 50, headroom=0.8) == dataclasses.replace(
        budgets_for(p, True, 1000, 40), limit_ms=40
    )
    assert budgets_for(p, True, 1000, 50, headroom=0.8).token_budget < budgets_for(p, True, 1000, 50).token_budget
    with pytest.raises(ValueError):
        budgets_for(p, True, 1000, 50, headroom=0)


def test_decoders_that_requests_join_get_half_the_tbt():
    p = analytic_profile("H20")
    joined = budgets_for(p, True, 1000, 150, headroom=0.8, joins=True)
    assert joined == dataclasses.replace(budgets_for(p, True, 1000, 60), limit_ms=60)  # 150 / 2 · 0.8
    assert joined.token_budget < budgets_for(p, True, 1000, 150, headroom=0.8).token_budget
    assert prefill_chunk_ms(p, joined.token_budget) * 2 <= 150  # two iterations fit one TBT
    assert budgets_for(p, False, 1000, 150, joins=True) == budgets_for(p, False, 1000, 150)  # only decoders


def test_decoders_that_give_joiners_a_decode_only_iteration_get_tbt_less_one():
    """`join_first`: a joiner waits for the iteration in flight, then decodes in a decode-only one, so the
    others may take what TBT leaves beside one (64 sequences of 1k tokens), but never less than TBT/2."""
    p = analytic_profile("H20")
    first = budgets_for(p, True, 1000, 150, headroom=0.8, joins=True, join_first=True)
    join = decode_ms(p, 64, 64 * 1024)
    assert 20 < join < 60 and first.limit_ms == pytest.approx(150 * 0.8 - join)
    assert (
        first.token_budget > 1.9 * budgets_for(p, True, 1000, 150, headroom=0.8, joins=True).token_budget
    )  # 478 vs 211
    assert prefill_chunk_ms(p, first.token_budget) + join <= 150 * 0.8
    tight = budgets_for(p, True, 1000, 40, joins=True, join_first=True)  # one decode-only iteration > TBT/2
    assert tight == budgets_for(p, True, 1000, 40, joins=True)
    assert budgets_for(p, True, 1000, 150, join_first=True) == budgets_for(p, True, 1000, 150)  # nobody joins


@pytest.mark.parametrize("hardware", ["H20", "H100"])
def test_request_cost_is_a_lower_bound_of_every_schedule_and_a_tight_one(hardware):
    """No batching of the iteration model serves N requests in less than N × request_cost_ms; one huge
    mixed batch comes close, so the goodput bound is what the hardware allows, not a loose guess."""
    import random

    from common.latency import goodput_bound, iteration_ms, request_cost_ms
    from common.latency.roofline import load_profile

    p = load_profile(hardware)
    prompt, out, n = 620, 16, 64
    per_request = request_cost_ms(p, prompt, 1, out)
    rng = random.Random(0)
    for _ in range(20):  # random schedules: encode batch, prefill chunk, requests per mixed iteration
        batch, chunk, group = rng.choice([1, 3, 8, 64]), rng.choice([64, 256, 620, 2048]), rng.choice([1, 4, 16, 64])
        total = sum(encode_ms(p, min(batch, n - i)) for i in range(0, n, batch))
        for first in range(0, n, group):
            members = min(group, n - first)
            done = 0
            while done < prompt:  # the group's prompts in chunks, side by side
                step = min(chunk, prompt - done)
                total += iteration_ms(p, chunks=[(step, done)] * members)
                done += step
            for t in range(out):  # then their decodes, one token each per iteration
                total += iteration_ms(p, decodes=members, decode_context=members * (prompt + t))
        assert total >= n * per_request * (1 - 1e-9)
    packed = (
        encode_ms(p, 64)
        + iteration_ms(p, chunks=[(prompt, 0)] * 64)
        + sum(iteration_ms(p, decodes=4096, decode_context=4096 * (prompt + t)) / 64 for t in range(out))
    )
    assert packed <= n * per_request * 1.1
    assert goodput_bound(p, 8, prompt, 1, out) == pytest.approx(2 * goodput_bound(p, 4, prompt, 1, out))


def test_the_overrun_is_a_high_quantile_of_recent_differences_and_never_negative():
    over = Overrun(window=10, quantile=0.8)
    assert over.ms == 0.0
    for excess in (-2, 0, 1, 2, 3, 4, 5, 6, 7, 30):
        over.observe(50.0, 50.0 + excess)
    assert over.ms == 7  # the 9th of 10: one outlier does not size every iteration
    over.observe(0.0, 5.0)  # nothing predicted: nothing learnt
    assert over.ms == 7
    for _ in range(10):
        over.observe(50.0, 40.0)
    assert over.ms == 0.0  # the window forgot the rest; faster than predicted leaves the limit as it is
    with pytest.raises(ValueError):
        Overrun(quantile=0)
    time = IterationTime(profile(), 100.0)
    assert time.tokens_beside(0, 0, 1 << 15, overrun_ms=20) == IterationTime(profile(), 80.0).tokens_beside(
        0, 0, 1 << 15
    )
    assert time.tokens_beside(0, 0, 1 << 15, overrun_ms=500) == IterationTime(profile(), 25.0).tokens_beside(
        0, 0, 1 << 15
    )


def test_a_few_prompt_tokens_beside_decodes_cost_about_their_rows_and_a_batch_of_one_kind_its_curve():
    """The mixed batch's curve blends the two stages' by their shares of the rows: beside 50 decodes one prompt token
    adds well under a millisecond (the prefill curve alone would charge a whole prompt's roll-off, ~25 ms more on
    H20); with no decodes, or no prompt tokens, each stage's curve is what it was; more tokens never cost less."""
    from common.latency import iteration_ms
    from common.latency.model import mixed_cost

    p = analytic_profile("H20")
    decodes = iteration_ms(p, decodes=50, decode_context=50_000)
    one = iteration_ms(p, decodes=50, decode_context=50_000, chunks=[(1, 0)])
    assert 0 < one - decodes < 1.0 < p.prefill.base_ms(51) - p.decode.base_ms(50) - 20
    assert mixed_cost(p, 0, 300) == p.prefill and mixed_cost(p, 8, 0) == p.decode
    times = [iteration_ms(p, decodes=50, decode_context=50_000, chunks=[(t, 0)]) for t in range(0, 3000, 7)]
    assert times == sorted(times)
    whole = iteration_ms(p, chunks=[(2048, 0)])  # a whole prompt: beside it 50 decodes cost about their rows
    assert whole < iteration_ms(p, decodes=50, chunks=[(2048, 0)]) < whole + 50 * p.prefill.per_unit_ms + 1


def test_a_mixed_iterations_time_without_its_curve_is_the_curves_to_the_bit():
    """`mixed_ms` (the per-iteration path) is `mixed_cost(...).base_ms(...)` without building the curve."""
    import random

    from common.latency.model import mixed_cost, mixed_ms
    from common.latency.roofline import load_profile

    rng = random.Random(0)
    for name in ("H20", "H100"):
        p = load_profile(name)
        for _ in range(500):
            decodes, tokens = rng.choice([0, 1, rng.randrange(1, 300)]), rng.choice([0, 1, rng.uniform(0.5, 9000)])
            assert mixed_ms(p, decodes, tokens) == mixed_cost(p, decodes, tokens).base_ms(decodes + tokens)


@pytest.mark.parametrize("hardware", ["H20", "H100"])
def test_chunked_iterations_in_closed_form_are_the_sum_of_each_iteration(hardware):
    """What a prefill queue costs beside decodes (the SLO router prices it per decoder per route): the closed form
    against the iterations one by one, full chunks and a rest, with and without decodes beside them."""
    from common.latency.model import chunked_iterations_ms

    p = analytic_profile(hardware)
    cases = [(1, 175, 0, 0), (175, 175, 12, 9000), (20_000, 175, 40, 41_000), (5_003, 512, 3, 800), (999, 2048, 0, 0)]
    for tokens, chunk, decodes, context in [*cases, (30_001, 64, 200, 150_000)]:
        one_by_one = sum(
            iteration_ms(p, decodes=decodes, decode_context=context, chunks=[(min(chunk, tokens - s), s)])
            for s in range(0, tokens, chunk)
        )
        assert chunked_iterations_ms(p, tokens, chunk, decodes, context) == pytest.approx(one_by_one, rel=1e-12)
    assert chunked_iterations_ms(p, 0, 175) == 0.0
    with pytest.raises(ValueError, match="chunk"):
        chunked_iterations_ms(p, 10, 0)


def test_an_earlier_prefill_saturation_makes_small_chunks_cheaper_and_leaves_the_rest():
    shipped, earlier = load_profile("H20"), load_profile("H20", prefill_saturation=256)
    assert saturation_points(shipped)["prefill_tokens"] == 1075
    assert saturation_points(earlier)["prefill_tokens"] == 244  # the grid's point nearest below 256
    assert earlier.encode == shipped.encode and earlier.decode == shipped.decode
    assert dataclasses.replace(earlier.prefill, half_units=0) == dataclasses.replace(shipped.prefill, half_units=0)
    assert "prefill saturating at 256 tokens" in earlier.name
    beside_two = dict(decodes=2, decode_context=3000, chunks=[(16, 0)])
    assert round(iteration_ms(shipped, **beside_two), 1) == 32.4
    assert round(iteration_ms(earlier, **beside_two), 1) == 8.4
    with pytest.raises(ValueError, match="cannot saturate at 20 tokens"):
        load_profile("H20", prefill_saturation=20)
    with pytest.raises(ValueError, match="analytic profile"):
        load_profile("profiles/llava-1.5-7b-h20.json", prefill_saturation=256)
