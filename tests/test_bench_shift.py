"""`epdmesh bench shift`'s parts that need no mesh: the phases, the arrivals, the per-phase and per-window
attainment, and the plot."""

import collections

import pytest

from bench.goodput import Result
from bench.shift import bodies_for, parse_phases, parse_rate, plot, schedule, summarize


def test_phases_are_parsed_and_bad_ones_named():
    assert parse_phases("document@20, detail@7.5") == [("document", 20.0), ("detail", 7.5)]
    for bad, says in [
        ("essay@10", "unknown shape 'essay'"),
        ("textcaps", "NAME@SECONDS"),
        ("textcaps@0", "NAME@SECONDS"),
        ("textcaps@x", "NAME@SECONDS"),
        (",", "at least one phase"),
    ]:
        with pytest.raises(ValueError, match=says):
            parse_phases(bad)


def test_arrivals_are_poisson_over_the_phases_each_taking_its_phases_shape():
    phases = [("document", 20.0), ("detail", 10.0), ("textcaps", 30.0)]
    sends = schedule(phases, (50.0, 50.0), seed=1)
    assert sends == schedule(phases, (50.0, 50.0), seed=1) and sends != schedule(phases, (50.0, 50.0), seed=2)
    times = [t for t, _ in sends]
    assert times == sorted(times) and 0 < times[0] and times[-1] < 60
    counts = collections.Counter(i for _, i in sends)
    assert abs(counts[0] - 1000) < 150 and abs(counts[1] - 500) < 110 and abs(counts[2] - 1500) < 180
    assert all((i == 0) == (t < 20) and (i == 2) == (t >= 30) for t, i in sends)
    bodies = bodies_for(phases, sends[:40] + sends[-3:], "m", seed=0)
    assert [b["max_tokens"] for b in bodies] == [16] * 40 + [32] * 3  # document's answers, then textcaps'


def test_a_ramping_rate_sends_more_towards_its_end():
    assert parse_rate("30") == (30.0, 30.0) and parse_rate("10..30") == (10.0, 30.0)
    for bad in ("0", "10..", "a..b", "-5..5"):
        with pytest.raises(ValueError, match="positive rate"):
            parse_rate(bad)
    sends = schedule([("textcaps", 30.0), ("detail", 30.0)], (10.0, 50.0), seed=3)
    first, second = (sum(i == k for _, i in sends) for k in (0, 1))
    assert abs(first - 600) < 100 and abs(second - 1200) < 140  # ∫ 10 → 30 and ∫ 30 → 50 over 30 s each


def test_attainment_is_counted_per_phase_and_window(tmp_path):
    phases = [("document", 4.0), ("detail", 4.0)]
    sends = [(0.5, 0), (1.5, 0), (3.0, 0), (4.5, 1), (7.9, 1)]
    met, late, slow = Result(True, 0.2, [0.01] * 9), Result(True, 2.0, [0.01]), Result(True, 0.1, [0.5] * 3)
    results = [met, late, met, slow, Result(False, error="HTTP 503: busy")]
    out = summarize(phases, sends, results, window=3.0, ttft_ms=1000, tbt_ms=100)
    assert out["attainment"] == 2 / 5 and out["failed"] == 1 and out["errors"] == ["HTTP 503: busy"]
    assert [p["attainment"] for p in out["by_phase"]] == [2 / 3, 0.0]
    assert [(w["t"], w["arrivals"], w["attainment"]) for w in out["windows"]] == [
        (0.0, 2, 0.5),
        (3.0, 2, 0.5),
        (6.0, 1, 0.0),
    ]
    report = {
        "backend": "emulated: H20",
        "phases": [{"shape": n, "seconds": s} for n, s in phases],
        "rate": 1.25,
        "window_s": 3.0,
        "slo_ttft_ms": 1000,
        "slo_tbt_ms": 100,
        "configs": {
            "static": {**out, "roles": [{"t": 0, "roles": {"EP": 1, "D": 1}}]},
            "planner": {**out, "roles": [{"t": 0, "roles": {"EP": 1, "D": 1}}, {"t": 5, "roles": {"D": 2}}]},
        },
    }
    plot(report, tmp_path / "shift.png")
    assert (tmp_path / "shift.png").stat().st_size > 10_000


def test_the_shift_screen_prices_a_planner_only_where_the_phases_need_opposite_splits():
    from bench.shift_screen import capacity, screen, splits

    assert len(splits(4)) == 2 * 3 + 3  # EP·+D· and ED·+P· three ways each, E·+P·+D· three ways
    prefill_heavy = {"encode": 0.01, "prefill": 0.2, "decode": 0.01}  # instance-seconds per request
    decode_heavy = {"encode": 0.01, "prefill": 0.05, "decode": 0.3}
    assert capacity(("EP+D", (3, 1)), prefill_heavy) == pytest.approx(min(3 / 0.21, 1 / 0.01))
    assert capacity(("E+P+D", (1, 2, 1)), decode_heavy) == pytest.approx(min(1 / 0.01, 2 / 0.05, 1 / 0.3))
    rows = {r["shift"]: r for r in screen({"a": prefill_heavy, "b": decode_heavy, "a2": dict(prefill_heavy)}, 4)}
    opposite, alike = rows["a>b>a"], rows["a>a2>a"]
    assert opposite["ratio"] > 1.2 and alike["ratio"] == pytest.approx(1.0)
    assert opposite["best_split"] == {"a": "ED1+P3", "b": "EP1+D3"}  # 15 and 10 req/s
    # the planner is held by the weaker phase at its best split; the static split by one split for both
    assert opposite["planner"] == pytest.approx(10.0)
    assert opposite["static"] == pytest.approx(
        max(min(capacity(s, prefill_heavy), capacity(s, decode_heavy)) for s in splits(4))
    )
    assert opposite["static"] < opposite["planner"]


def test_a_planners_runs_spread_over_its_phases_and_the_median_run_is_reported(monkeypatch):
    import types

    from bench import shift
    from bench.shift import planner_phases, simulate_phases

    assert planner_phases(0.0, 5, planned=True) == [0.0, 0.2, 0.4, 0.6, 0.8]
    assert planner_phases(0.5, 4, planned=True) == [0.5, 0.75, 0.0, 0.25]
    assert planner_phases(0.3, 5, planned=False) == [0.3]  # no planner: nothing to place, one run
    by_phase = {0.0: 0.9, 0.25: 0.5, 0.5: 0.7, 0.75: 0.95}
    seen = []

    def fake(serve_args, phases, args, phase):
        seen.append(phase)
        return {"attainment": by_phase[phase], "by_phase": [{"attainment": by_phase[phase]}]}

    monkeypatch.setattr(shift, "simulate_config", fake)
    args = types.SimpleNamespace(planner_phase=0.0, planner_phases=4)
    median = simulate_phases(["--topology", "EP7+D1", "--planner"], [], args)
    assert seen == [0.0, 0.25, 0.5, 0.75]
    assert median["attainment"] == 0.7 and median["planner_phase"] == 0.5  # the lower middle of four
    assert [r["attainment"] for r in median["planner_phases"]] == [0.9, 0.5, 0.7, 0.95]
    seen.clear()
    alone = simulate_phases(["--topology", "EP7+D1"], [], args)
    assert seen == [0.0] and "planner_phases" not in alone
