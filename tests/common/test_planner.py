"""The planner's policy (`common/policy/planner.py`) on the analytic H20 profile: the pools follow the stage loads,
hysteresis and the switch budget hold it still, and shapes it does not plan are left alone."""

import dataclasses

import pytest

from common.latency.roofline import load_profile
from common.policy import placement
from common.policy.planner import (
    Decision,
    Forecast,
    Interval,
    Planner,
    PlannerConfig,
    PoolWorker,
    Window,
    decide,
    forecast,
    owned_stages,
)
from common.policy.planner import label as planner_label
from common.request import Stage

E, P, D = Stage.ENCODE, Stage.PREFILL, Stage.DECODE
H20 = load_profile("H20")
CAPTIONS = (600, 1, 12)  # an image, a short prompt, a short answer: prefill-bound
LONG_ANSWERS = (100, 0, 512)  # a short text prompt, a long answer: decode-bound


def _mesh(counts: dict[frozenset, int], kv_tokens: int = 100_000) -> list[PoolWorker]:
    workers = []
    for roles, n in counts.items():
        workers += [
            PoolWorker(f"{''.join(s.name[0] for s in sorted(roles))}{i}", roles, 0, kv_tokens) for i in range(n)
        ]
    return workers


def _at(rate: float, *requests) -> Forecast:
    return Forecast(rate, placement.StageLoad.of(list(requests)), 0.0, 0.0)


def test_the_pools_follow_the_stage_loads_one_switch_at_a_time():
    mesh = _mesh({frozenset({E, P}): 4, frozenset({D}): 4})
    captions = decide(mesh, _at(10, CAPTIONS), H20, 1000, 100)
    assert captions.action == "switch" and captions.target == {"EP": 7, "D": 1}
    assert [(s.before, s.after) for s in captions.switches] == [(frozenset({D}), frozenset({E, P}))]
    answers = decide(mesh, _at(10, LONG_ANSWERS), H20, 1000, 100)
    assert answers.action == "switch" and answers.target["D"] > 4 and answers.switches[0].after == frozenset({D})
    # more switches an interval when the budget allows: straight to the target
    config = PlannerConfig(max_switches=8)
    assert len(decide(mesh, _at(10, CAPTIONS), H20, 1000, 100, config).switches) == 3


def test_the_least_busy_worker_of_a_pool_is_switched_first():
    mesh = _mesh({frozenset({E, P}): 4})
    mesh += [PoolWorker("busy", frozenset({D}), 900, 100_000), PoolWorker("idle", frozenset({D}), 5, 100_000)]
    mesh += [PoolWorker("half", frozenset({D}), 50, 100_000)]
    decision = decide(mesh, _at(10, CAPTIONS), H20, 1000, 100, PlannerConfig(max_switches=2))
    assert [s.worker_id for s in decision.switches] == ["idle", "half"]


def test_it_holds_when_the_gain_is_under_the_margin_or_the_pools_match():
    mesh = _mesh({frozenset({E, P}): 4, frozenset({D}): 4})
    balanced = decide(mesh, _at(10, (600, 1, 300)), H20, 1000, 100)
    assert balanced.action == "hold" and balanced.target == balanced.current == {"D": 4, "EP": 4}
    near = _mesh({frozenset({E, P}): 5, frozenset({D}): 3})  # the target, EP6+D2, takes 9% off the bottleneck
    small_gain = decide(near, _at(10, (3000, 1, 200)), H20, 1000, 100)
    assert small_gain.action == "hold" and small_gain.target != small_gain.current and not small_gain.switches
    assert decide(near, _at(10, (3000, 1, 200)), H20, 1000, 100, PlannerConfig(margin=0.0)).action == "switch"


def test_measured_misses_shift_the_demand_to_the_stage_that_missed():
    mesh = _mesh({frozenset({E, P}): 4, frozenset({D}): 4})
    load = placement.StageLoad.of([(600, 1, 300)])
    calm = decide(mesh, Forecast(10, load, 0.0, 0.0), H20, 1000, 100)
    late_first = decide(mesh, Forecast(10, load, 0.8, 0.0), H20, 1000, 100)
    slow_tokens = decide(mesh, Forecast(10, load, 0.0, 0.8), H20, 1000, 100)
    assert late_first.demand["prefill"] > calm.demand["prefill"] and late_first.target["EP"] > 4
    assert slow_tokens.demand["decode"] > calm.demand["decode"] and slow_tokens.target["D"] > 4


def test_it_keeps_the_decoders_the_decodes_under_way_need():
    """Back from long answers to captions: the three decoders hold 300 decodes of ~800 tokens of KV, more than one
    decoder's cache holds; the target keeps enough of them until those finish."""
    full = [PoolWorker(f"d{i}", frozenset({D}), 40_000, 100_000, 100, 80_000) for i in range(3)]
    mesh = _mesh({frozenset({E, P}): 5}) + full
    busy = decide(mesh, _at(10, CAPTIONS), H20, 1000, 100)
    assert busy.target == {"D": 3, "EP": 5} and busy.action == "hold"  # 240k tokens of KV: 3 caches at γ = 0.9
    done = [dataclasses.replace(w, decoding=0, context_tokens=0) for w in full]
    assert decide(_mesh({frozenset({E, P}): 5}) + done, _at(10, CAPTIONS), H20, 1000, 100).target == {"D": 1, "EP": 7}


def test_shapes_it_does_not_plan_and_no_load_are_left_alone():
    one_pool = decide(_mesh({frozenset({E, P, D}): 8}), _at(10, CAPTIONS), H20, 1000, 100)
    overlap = decide(
        _mesh({frozenset({E, P}): 6, frozenset({E, P, D}): 1, frozenset({D}): 1}), _at(10, CAPTIONS), H20, 1000, 100
    )
    missing = decide(_mesh({frozenset({E, P}): 7, frozenset({P}): 1}), _at(10, CAPTIONS), H20, 1000, 100)
    assert (one_pool.action, overlap.action, missing.action) == ("fixed", "fixed", "fixed")
    idle = decide(_mesh({frozenset({E, P}): 4, frozenset({D}): 4}), None, H20, 1000, 100)
    assert idle == Decision("idle", "too few arrivals to plan from", current={"D": 4, "EP": 4})
    warm_up = forecast(None, Interval(10, (CAPTIONS, LONG_ANSWERS)), 0.5)  # two requests: not enough to switch on
    assert decide(_mesh({frozenset({E, P}): 4, frozenset({D}): 4}), warm_up, H20, 1000, 100).action == "idle"
    three = decide(_mesh({frozenset({E}): 2, frozenset({P}): 3, frozenset({D}): 3}), _at(10, CAPTIONS), H20, 1000, 100)
    assert three.action == "switch" and sum(three.target.values()) == 8 and min(three.target.values()) >= 1


def test_the_forecast_takes_the_shape_from_arrivals_corrected_by_what_finished():
    assert forecast(None, Interval(10), 0.5) is None  # nothing arrived: nothing to plan from
    first = forecast(None, Interval(10, (CAPTIONS,) * 100), 0.5)
    assert first.rate == 10 and (first.load.prompt_tokens, first.load.output_tokens) == (600, 12)
    # half the prompt tokens were prefix-cache hits, a quarter of max_tokens was used, one in four missed TTFT
    done = Interval(10, (LONG_ANSWERS,) * 300, ((800, 400, 128, 512),) * 4, ttft_missed=1, tbt_missed=2)
    second = forecast(first, done, 0.5)
    assert second.rate == 20 and second.cached == 0.25 and second.used == 0.625
    assert second.load.prompt_tokens == (600 + 50) / 2 and second.load.output_tokens == (12 + 128) / 2
    assert (second.ttft_miss, second.tbt_miss) == (0.125, 0.25)
    quiet = forecast(second, Interval(10), 0.5)  # nothing arrived: the shape stays, the rate falls
    assert quiet.rate == 10 and quiet.load == second.load and quiet.cached == second.cached
    assert (first.arrivals, second.arrivals, quiet.arrivals) == (100, 300, 0)


def test_a_bad_configuration_is_refused():
    with pytest.raises(ValueError, match="interval_s > 0"):
        PlannerConfig(interval_s=0)


def test_reshape_moves_between_triinfers_shapes_without_leaving_a_stage_uncovered():
    """Captions on E1+P3+D4: its own shape's best is E1+P6+D1; with `reshape` ED1+P7 (the encoder on the decoder)
    loads its busiest pool less. Switches under way at once never take every holder of a stage out of the registry,
    so it gets there in two intervals: a decoder becomes ED first, the last decoder and the encoder move after."""
    mesh = _mesh({frozenset({E}): 1, frozenset({P}): 3, frozenset({D}): 4})
    assert set(decide(mesh, _at(20, CAPTIONS), H20, 1000, 100).target) == {"E", "P", "D"}  # its own shape
    config = PlannerConfig(reshape=True, max_switches=8)
    for interval in range(2):
        decision = decide(mesh, _at(20, CAPTIONS), H20, 1000, 100, config)
        assert decision.action == "switch" and decision.target == {"ED": 1, "P": 7}
        moving = {s.worker_id: s.after for s in decision.switches}
        staying = [w for w in mesh if w.worker_id not in moving]
        assert frozenset().union(*(w.roles for w in staying)) == frozenset(Stage), interval  # every stage held
        mesh = [dataclasses.replace(w, roles=moving.get(w.worker_id, w.roles)) for w in mesh]
    assert sorted(planner_label(w.roles) for w in mesh) == ["ED"] + ["P"] * 7
    assert decide(mesh, _at(20, CAPTIONS), H20, 1000, 100, config).action == "hold"


def test_a_toggles_mesh_is_planned_as_its_split_its_decoders_sized_to_the_decodes():
    """EP+EPD: the decoding pool is sized as EP+D's decoders are (its spare time prefills, as the toggle routes);
    the switches move workers between EP and EPD, never out of the mesh's two role sets."""
    EP, EPD = frozenset({E, P}), frozenset({E, P, D})
    split = _mesh({EP: 4, frozenset({D}): 4})
    mesh = _mesh({EP: 4, EPD: 4})
    for load, pools in ((CAPTIONS, {"EP": 7, "EPD": 1}), (LONG_ANSWERS, None)):
        as_split, decision = decide(split, _at(10, load), H20, 1000, 100), decide(mesh, _at(10, load), H20, 1000, 100)
        assert decision.action == "switch" and decision.demand == as_split.demand
        assert decision.target == {("EPD" if k == "D" else k): n for k, n in as_split.target.items()}
        assert pools is None or decision.target == pools
        assert {(s.before, s.after) for s in decision.switches} <= {(EP, EPD), (EPD, EP)}
    assert decide(mesh, _at(10, LONG_ANSWERS), H20, 1000, 100).switches[0].after == EPD
    # with the decodes under way it keeps the decoders they need, as a split does
    full = [PoolWorker(f"epd{i}", EPD, 40_000, 100_000, 100, 80_000) for i in range(3)]
    assert decide(_mesh({EP: 5}) + full, _at(10, CAPTIONS), H20, 1000, 100).target == {"EP": 5, "EPD": 3}


def test_which_stages_each_pool_is_planned_for():
    EP, EPD, PD, ED = frozenset({E, P}), frozenset({E, P, D}), frozenset({P, D}), frozenset({E, D})
    assert owned_stages([EP, EPD]) == [EP, frozenset({D})]
    assert owned_stages([EPD, frozenset({P})]) == [ED, frozenset({P})]
    assert owned_stages([frozenset({E}), frozenset({P}), PD]) == [frozenset({E}), frozenset({P}), frozenset({D})]
    assert owned_stages([ED, frozenset({P})]) == [ED, frozenset({P})]  # a split: its own
    assert owned_stages([EP, frozenset({P}), EPD]) is None  # two pools without decode overlap
    assert owned_stages([EP, EPD, frozenset({D})]) is None  # two pools decode
    assert owned_stages([frozenset({P}), frozenset({D})]) is None  # no pool encodes


def test_the_window_counts_what_arrived_and_finished_and_starts_again():
    now = [100.0]
    window = Window(lambda: now[0])
    window.arrived(*CAPTIONS)
    for outcome in ("attained", "ttft_violated", "tbt_violated", "tbt_violated"):
        window.done(600, 0, 12, 12, outcome)
    now[0] = 110.0
    assert window.take() == Interval(10.0, (CAPTIONS,), ((600, 0, 12, 12),) * 4, ttft_missed=1, tbt_missed=2)
    now[0] = 112.5
    assert window.take() == Interval(2.5)


def test_the_planner_forecasts_every_interval_and_holds_while_a_switch_is_under_way():
    planner = Planner(H20, 1000, 100)
    mesh = _mesh({frozenset({E, P}): 4, frozenset({D}): 4})
    held = planner.step(Interval(10, (CAPTIONS,) * 100), None)
    assert held.action == "hold" and planner.forecast.rate == 10
    moved = planner.step(Interval(10, (CAPTIONS,) * 300), mesh)  # the forecast mixes both intervals: 20 req/s
    assert planner.forecast.rate == 20 and moved == decide(mesh, planner.forecast, H20, 1000, 100)
    assert moved.action == "switch"
