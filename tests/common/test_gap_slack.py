"""P90 gap slack: how many slow gaps a request may have, the scheduler's long iterations while every decode can spare
one, what a decoder reports of it and how the SLO policy reads that."""

import dataclasses

import pytest

from bench.goodput import _pct
from common.kv_manager import ImageBlockManager, KVBlockManager
from common.latency import LatencyProfile, StageCost
from common.latency.budgets import GapSlack, IterationTime, slow_gaps_allowed
from common.policy.multiplex import route_slo
from common.policy.routing import PrefillPath, RoutePlan, RouteSummary
from common.request import ImageInput, Request, Stage
from common.sampling import SamplingParams
from common.scheduler import Scheduler, SchedulerConfig
from common.workers import WorkerInfo, WorkerLoad, WorkerSnapshot
from services.routing.book import Pending, _plus
from tests.common.test_scheduler import step

FLAT = StageCost(per_unit_ms=1.0)  # 1 ms per token or per decode
PROFILE = LatencyProfile("t", "measured", "cpu", "m", FLAT, FLAT, FLAT, 0.0, 1.0, 4)


@pytest.mark.parametrize("num_gaps", range(1, 80))
def test_slow_gaps_allowed_is_the_most_the_benchmarks_p90_lets_through_however_slow(num_gaps):
    """The count agrees with the benchmark's own P90 (linear interpolation): that many slow gaps, however slow, keep
    the P90 within the target; one more, slow enough, does not."""
    target, fast, slow = 100.0, 50.0, 1e4
    allowed = slow_gaps_allowed(num_gaps)
    assert allowed >= 0
    assert _pct([slow] * allowed + [fast] * (num_gaps - allowed), 90) <= target
    if allowed < num_gaps:
        assert _pct([slow] * (allowed + 1) + [fast] * (num_gaps - allowed - 1), 90) > target


def test_allowed_counts_at_answer_lengths_of_the_workloads():
    assert [slow_gaps_allowed(n) for n in (0, 1, 3, 10, 11, 20, 21, 31)] == [0, 0, 0, 0, 1, 1, 2, 3]


def request(rid="r", prompt=8, **sampling):
    return Request(rid, list(range(prompt)), SamplingParams(**sampling))


def test_sure_gaps_trusts_max_tokens_only_where_nothing_but_it_ends_the_answer():
    assert request(max_tokens=32, ignore_eos=True).sure_gaps == 31
    assert request(max_tokens=32).sure_gaps == 0  # EOS may come with the next token
    assert request(max_tokens=32, ignore_eos=True, stop=("x",)).sure_gaps == 0
    assert request(max_tokens=32, min_tokens=12).sure_gaps == 11
    grown = request(max_tokens=32)
    grown.output_token_ids.extend([5] * 20)
    assert grown.sure_gaps == 20  # the 20 it has and the next one's


def scheduler(reserve=0):
    """τ_t 10 within 10 ms (the TBT limit; 1 ms a token or decode); long iterations to 100 ms, 100 tokens."""
    slack = GapSlack(10.0, IterationTime(PROFILE, 100.0), 100, reserve=reserve)
    config = SchedulerConfig(token_budget=10, iteration_time=IterationTime(PROFILE, 10.0), gap_slack=slack)
    return Scheduler(config, KVBlockManager(256, 4), ImageBlockManager(16, 4))


def decoding(s, rid, **sampling):
    r = request(rid, prompt=4, **sampling)
    s.add(r)
    step(s)
    assert r.status.name == "DECODING"
    return r


def test_an_iteration_runs_long_while_every_decode_can_spare_a_slow_gap_and_counts_it():
    s = scheduler()
    long_answer = decoding(s, "a", max_tokens=32, ignore_eos=True)  # 31 gaps: 3 may be slow
    s.add(request("prompt", prompt=60))
    plan = s.schedule()
    assert plan.decodes == [long_answer] and [c.num_tokens for c in plan.prefills] == [60]  # whole, not 9
    s.observe(plan, 61.0)
    assert long_answer.num_slow_gaps == 1


def test_a_decode_without_slack_to_spare_keeps_iterations_within_tbt():
    s = scheduler()
    decoding(s, "a", max_tokens=32, ignore_eos=True)
    open_ended = decoding(s, "b", max_tokens=32)  # may end at its next token: no slow gap to spare
    s.add(request("prompt", prompt=60))
    plan = s.schedule()
    assert len(plan.decodes) == 2 and [c.num_tokens for c in plan.prefills] == [8]  # 10 ms less the 2 decodes
    s.observe(plan, 10.0)  # within the target: not slow
    assert open_ended.num_slow_gaps == 0 and s.long_token_budget == 0


def test_slow_gaps_spent_end_the_slack_and_the_reserve_keeps_some():
    s = scheduler(reserve=1)
    r = decoding(s, "a", max_tokens=32, ignore_eos=True)  # 3 allowed, 1 kept: 2 to spend
    assert s.long_token_budget == 100
    for spent in (1, 2):  # prompts whose answers have slack of their own: only `r`'s runs out
        s.add(request(f"p{spent}", prompt=60, max_tokens=32, ignore_eos=True))
        plan = step(s)
        assert [c.num_tokens for c in plan.prefills] == [60]
        s.observe(plan, plan.predicted_ms)
        assert r.num_slow_gaps == spent
    assert s.long_token_budget == 0
    s.add(request("p3", prompt=60))
    assert sum(c.num_tokens for c in s.schedule().prefills) < 10


def test_a_request_handed_over_during_a_long_iteration_counts_its_first_gap_slow():
    s = scheduler()
    s.add(request("prompt", prompt=60))
    plan = s.schedule()  # no decodes: a long iteration
    joiner = Request("j", list(range(8)), SamplingParams(max_tokens=32, ignore_eos=True), first_stage=Stage.DECODE)
    joiner.num_computed_tokens, joiner.output_token_ids = 8, [7]
    s.add(joiner)  # its KV pulled in while that iteration runs
    s.observe(plan, 61.0)
    assert joiner.num_slow_gaps == 1
    s.observe(s.schedule(), 5.0)  # its first decode here, within the target
    assert joiner.num_slow_gaps == 1


@pytest.mark.parametrize("max_tokens, long", [(8, False), (32, True)], ids=["short-answer", "long-answer"])
def test_a_request_whose_kv_is_on_its_way_here_must_spare_a_slow_gap_too(max_tokens, long):
    """Its first gap here is the iteration its KV arrives during: with 7 gaps it may have no slow one (its P90 would
    be that gap), so no long iteration starts while it is importing; with 31 it may, and one does."""
    s = scheduler()
    joiner = Request(
        "j", list(range(8)), SamplingParams(max_tokens=max_tokens, ignore_eos=True), first_stage=Stage.DECODE
    )
    s.incoming[joiner.request_id] = joiner  # blocks reserved, pages being pulled (`PageHandover.importing`)
    assert s.long_token_budget == (100 if long else 0)
    s.add(request("prompt", prompt=60))
    assert [c.num_tokens for c in s.schedule().prefills] == ([60] if long else [10])
    del s.incoming[joiner.request_id]  # pulled in (or cancelled): nothing waits for it any more
    assert s.long_token_budget == 100


def test_the_engines_imports_are_what_its_scheduler_sees_joining(tiny_dir):
    from common.engine.config import EngineConfig
    from common.engine.engine import Engine

    engine = Engine(EngineConfig(model=str(tiny_dir), kv_cache_gib=0.01, image_cache_gib=0.01))
    assert engine.scheduler.incoming is engine.pages.importing


def test_without_decodes_an_iteration_runs_long():
    s = scheduler()
    assert s.long_token_budget == 100  # nothing to delay
    s.add(request("prompt", prompt=60))
    assert [c.num_tokens for c in s.schedule().prefills] == [60]


def test_gap_slack_needs_budgets_from_a_profile():
    slack = GapSlack(10.0, IterationTime(PROFILE, 100.0), 100)
    with pytest.raises(ValueError, match="iteration_time"):
        SchedulerConfig(gap_slack=slack)
    with pytest.raises(ValueError):
        GapSlack(0.0, IterationTime(PROFILE, 100.0), 100)


# ----- the SLO policy: a decoder that reports long_token_budget -----

E, P, D = Stage.ENCODE, Stage.PREFILL, Stage.DECODE


def snapshot(wid, roles, token_budget=0, **load):
    return WorkerSnapshot(
        WorkerInfo(wid, "127.0.0.1:1", frozenset(roles), token_budget=token_budget), WorkerLoad(**load)
    )


def mesh(long_token_budget):
    return [
        snapshot("p", {P}, queued_prefill_tokens=900),  # 900 ms of queue: a 300-token prompt there misses 1 s
        snapshot("pd", {P, D}, token_budget=20, running_decode_batch=4, long_token_budget=long_token_budget),
    ]


def test_a_decoder_whose_decodes_can_spare_a_gap_takes_the_prompt_in_one_long_iteration():
    summary = RouteSummary("r", 300, 0, 16, frozenset())
    chunked = route_slo(mesh(0), summary, 1000.0, 30.0, 0.0, PROFILE)
    assert chunked.plan.path == PrefillPath.DEDICATED and not chunked.meets_slo  # 16-token chunks: 19 iterations
    long = route_slo(mesh(400), summary, 1000.0, 30.0, 0.0, PROFILE)
    assert (long.plan.path, long.plan.prefill.worker_id) == (PrefillPath.MULTIPLEXED, "pd") and long.meets_slo
    # the decode iteration running now (4 ms), then one of the 4 decodes and the whole prompt (304 ms)
    assert long.predicted_ttft_ms == pytest.approx(4 + 304)
    too_long = route_slo(mesh(200), summary, 1000.0, 30.0, 0.0, PROFILE)  # 300 tokens beside 4 decodes > 200
    assert too_long.plan.path == PrefillPath.DEDICATED


def test_a_route_onto_a_decoders_long_iteration_spends_the_slack_its_report_showed():
    d = mesh(400)[1]
    plan = RoutePlan(None, d, d, PrefillPath.MULTIPLEXED, 300.0)
    pending = Pending(0.0, plan, RouteSummary("r", 300, 0, 16, frozenset()))
    after = _plus(d, [pending])
    assert after.load.long_token_budget == 0 and after.load.queued_prefill_tokens == 300
    elsewhere = dataclasses.replace(plan, prefill=mesh(0)[0])
    assert _plus(d, [dataclasses.replace(pending, plan=elsewhere)]).load.long_token_budget == 400


def image_scheduler(gap_slack: bool):
    """An image's encode takes all of τ_t (10 tokens in the 10 ms TBT limit): it never fits beside a decode."""
    slack = GapSlack(10.0, IterationTime(PROFILE, 100.0), 100) if gap_slack else None
    config = SchedulerConfig(
        token_budget=10,
        image_budget=1,
        image_token_cost=10,
        iteration_time=IterationTime(PROFILE, 10.0),
        gap_slack=slack,
    )
    return Scheduler(config, KVBlockManager(256, 4), ImageBlockManager(16, 4))


def with_image(rid="img"):
    return Request(rid, list(range(8)), SamplingParams(max_tokens=4), [ImageInput(None, 4, f"{rid}-0")])


@pytest.mark.parametrize("gap_slack", [False, True], ids=["budgets", "gap-slack"])
def test_an_image_over_the_limit_waits_for_decodes_that_can_spare_the_slow_gap_it_makes(gap_slack):
    """Without gap slack an image too big for the limit is encoded alone in a step anyway (nothing waits forever);
    with it, not while a decode beside it cannot spare that slow gap — it goes in a long iteration, or once no
    decode is left to stall."""
    s = image_scheduler(gap_slack)
    open_ended = decoding(s, "a", max_tokens=32)  # may end at its next token: no slow gap to spare
    s.add(with_image())
    plan = s.schedule()
    assert plan.decodes == [open_ended] and [e.num_images for e in plan.encodes] == ([] if gap_slack else [1])

    s = image_scheduler(gap_slack)
    decoding(s, "b", max_tokens=32, ignore_eos=True)  # 3 slow gaps to spare: a long iteration encodes it
    s.add(with_image())
    assert [e.num_images for e in s.schedule().encodes] == [1]

    s = image_scheduler(gap_slack)
    s.add(with_image())
    assert [e.num_images for e in s.schedule().encodes] == [1]  # nothing decodes


def test_a_request_whose_kv_arrives_during_a_long_iteration_counts_its_first_gap_slow_once():
    """Its pull overlaps the iteration (it is added once the KV is in, after the iteration): its first gap here waits
    the iteration out all the same, and counts once however many slow iterations it spans."""
    s = scheduler()
    s.add(request("prompt", prompt=60))
    plan = s.schedule()  # no decodes: a long iteration
    joiner = Request("j", list(range(8)), SamplingParams(max_tokens=32, ignore_eos=True), first_stage=Stage.DECODE)
    s.incoming[joiner.request_id] = joiner  # its pull began while the iteration runs
    s.observe(plan, 61.0)
    assert joiner.num_slow_gaps == 1
    s.observe(plan, 61.0)  # a second slow iteration before it joins: still one first gap
    del s.incoming[joiner.request_id]
    joiner.num_computed_tokens, joiner.output_token_ids = 8, [7]
    s.add(joiner)
    s.observe(s.schedule(), 61.0)  # a third, before it decodes here: the same gap
    assert joiner.num_slow_gaps == 1


def test_a_handed_over_request_whose_first_gap_here_outlasts_the_target_counts_it_slow_though_no_iteration_did():
    """Its first gap began on the prefill worker: the pull, the rest of the iteration it arrived during and its own
    first decode here — each iteration within the target, their sum past it. Timed from its arrival here, once."""
    s = scheduler()
    sampling = SamplingParams(max_tokens=32, ignore_eos=True)
    late = Request("late", list(range(8)), sampling, first_stage=Stage.DECODE, arrival_time=100.0)
    prompt = Request("soon", list(range(8)), sampling, first_stage=Stage.DECODE, arrival_time=100.006)
    for joiner in (late, prompt):
        joiner.num_computed_tokens, joiner.output_token_ids = 8, [7]
        s.add(joiner)
    plan = s.schedule()
    assert plan.joiners == [late, prompt]
    s.observe(plan, 5.0, now=100.012)  # 12 ms after `late` came (target 10), 6 ms after `prompt`
    assert late.num_slow_gaps == 1 and prompt.num_slow_gaps == 0
    plan = s.schedule()
    assert plan.joiners == []
    s.observe(plan, 5.0, now=100.030)  # their second gaps: this iteration's own 5 ms
    assert late.num_slow_gaps == 1 and prompt.num_slow_gaps == 0


def test_a_first_gap_counted_slow_during_the_pull_is_not_counted_again_when_it_decodes():
    s = scheduler()
    s.add(request("prompt", prompt=60))
    plan = s.schedule()  # no decodes: a long iteration
    joiner = Request("j", list(range(8)), SamplingParams(max_tokens=32, ignore_eos=True), first_stage=Stage.DECODE)
    joiner.arrival_time = 0.0
    s.incoming[joiner.request_id] = joiner
    s.observe(plan, 61.0, now=0.061)
    del s.incoming[joiner.request_id]
    joiner.num_computed_tokens, joiner.output_token_ids = 8, [7]
    s.add(joiner)
    s.observe(s.schedule(), 5.0, now=0.066)  # 66 ms since it came: the same first gap, counted already
    assert joiner.num_slow_gaps == 1
