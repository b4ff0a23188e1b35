"""The goodput benchmark's pure parts: arrivals, request shapes, SLO attainment and the vllm-named metrics."""

import statistics

import pytest

from bench.goodput import Result, meets_slo, parse_args, prediction_report, summarize
from bench.goodput_launch import log_path
from bench.goodput_report import plot
from bench.workloads import SHAPES, arrivals, request_bodies, trace_times


def test_trace_arrivals_keep_the_traces_burstiness_at_any_rate():
    trace = trace_times()
    assert len(trace) == 12031 and trace == sorted(trace) and 3500 < trace[-1] < 3700  # one hour
    for rate in (0.5, 8.0):
        times = arrivals(400, rate, "mooncake", seed=1, trace=trace)
        gaps = [b - a for a, b in zip(times, times[1:])]
        assert times[0] == 0 and min(gaps) >= 0
        assert statistics.fmean(gaps) == pytest.approx(1 / rate)
    assert (
        arrivals(50, 4.0, seed=2, trace=trace)
        == arrivals(50, 4.0, seed=2, trace=trace)
        != arrivals(50, 4.0, seed=3, trace=trace)
    )
    poisson = arrivals(2000, 5.0, "poisson", seed=0)
    gaps = [b - a for a, b in zip(poisson, poisson[1:])]
    assert statistics.fmean(gaps) == pytest.approx(0.2, rel=0.1) and statistics.pstdev(gaps) == pytest.approx(
        0.2, rel=0.15
    )
    with pytest.raises(ValueError):
        arrivals(5, 1.0, "uniform")


def test_request_bodies_are_streaming_one_image_fixed_output():
    bodies = request_bodies(SHAPES["pope"], 5, "m", seed=1)
    assert len(bodies) == 5 and all(b["stream"] and b["ignore_eos"] and b["max_tokens"] == 4 for b in bodies)
    parts = bodies[0]["messages"][0]["content"]
    assert parts[0]["image_url"]["url"].startswith("data:image/jpeg;base64,") and "Answer yes or no" in parts[1]["text"]
    assert len({b["messages"][0]["content"][0]["image_url"]["url"] for b in bodies}) == 5


def test_attainment_needs_ttft_and_p90_tbt_and_metrics_use_vllms_names(tmp_path):
    fast = Result(True, 0.2, [0.01] * 20, 0.4, 600, 21)
    slow_start = Result(True, 2.0, [0.01] * 20, 2.2, 600, 21)
    stalls = Result(True, 0.2, [0.01] * 17 + [0.5] * 3, 1.9, 600, 21)  # 3 of 20 gaps slow: P90 over
    one_stall = Result(True, 0.2, [0.01] * 19 + [0.5], 0.9, 600, 21)  # 1 of 20: P90 fine
    failed = Result(False, error="HTTP 503")
    assert [meets_slo(r, 1000, 100) for r in (fast, slow_start, stalls, one_stall, failed)] == [
        True,
        False,
        False,
        True,
        False,
    ]
    m = summarize([fast, slow_start, stalls, one_stall, failed], 10.0, 0.5, 1000, 100)
    assert m["completed"] == 4 and m["failed"] == 1 and m["slo_attainment"] == 0.4
    assert m["request_goodput"] == pytest.approx(0.2) and m["request_throughput"] == pytest.approx(0.4)
    assert m["ttft_attainment"] == 0.6 and m["tbt_attainment"] == 0.6
    assert m["median_ttft_ms"] == pytest.approx(200) and m["p99_ttft_ms"] > 1900
    assert m["total_output_tokens"] == 84 and m["mean_tpot_ms"] > 10
    assert m["median_max_gap_ms"] == pytest.approx(255) and m["p90_max_gap_ms"] > 400  # one_stall's hidden 500 ms
    report = {
        "workloads": ["pope"],
        "attainment": 0.9,
        "backend": "test",
        "slo_ttft_ms": 1000,
        "slo_tbt_ms": 100,
        "arrival": "mooncake",
        "configs": {"A": {"pope": {"goodput": 0.5, "points": [m]}}},
    }
    plot(report, tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 5000


def test_multiimage_requests_carry_four_images_of_their_own_and_their_bound_counts_them():
    from bench.goodput_report import add_bound
    from common.latency import goodput_bound
    from common.latency.roofline import load_profile

    bodies = request_bodies(SHAPES["multiimage"], 3, "m", seed=1)
    urls = [[part["image_url"]["url"] for part in b["messages"][0]["content"][:-1]] for b in bodies]
    assert [len(u) for u in urls] == [4, 4, 4] and len({u for us in urls for u in us}) == 12
    assert bodies[0]["messages"][0]["content"][-1]["text"].startswith("Here are four pictures.")
    shared = request_bodies(SHAPES["multiimage"], 3, "m", seed=1, distinct_images=6)  # taken in turn
    first, second = ([p["image_url"]["url"] for p in b["messages"][0]["content"][:4]] for b in shared[:2])
    assert second[2:] == first[:2] and len(set(first + second)) == 6
    h20 = load_profile("H20")
    result = {"output_tokens": 32, "images_per_request": 4, "goodput": 5.0}
    result["points"] = [{"completed": 10, "total_input_tokens": 23600}]
    add_bound(result, h20, 4)
    assert result["goodput_bound"] == pytest.approx(goodput_bound(h20, 4, 2360, 4, 32))
    assert result["goodput_bound"] < goodput_bound(h20, 4, 2360, 1, 32)


def test_a_shifting_load_runs_its_shapes_in_equal_runs_each_with_images_of_its_own():
    import argparse

    from bench.bodies import workload_of
    from bench.workloads import phase_sizes, phased_bodies, phases_of, trace_scale_of

    assert phases_of("textcaps") is None and trace_scale_of("pope>detail", 16) is None
    assert [s.name for s in phases_of("pope>detail>pope")] == ["pope", "detail", "pope"]
    with pytest.raises(ValueError, match="'captions'"):
        phases_of("pope>captions")
    with pytest.raises(ValueError, match="A>B"):
        trace_scale_of("captions", 16)
    assert phase_sizes(7, 3) == [3, 2, 2] and phase_sizes(2, 3) == [1, 1, 0]
    bodies = phased_bodies(phases_of("pope>detail>pope"), 7, "m", seed=1)
    assert [b["max_tokens"] for b in bodies] == [4, 4, 4, 384, 384, 4, 4]
    urls = [b["messages"][0]["content"][0]["image_url"]["url"] for b in bodies]
    assert len(set(urls)) == 7  # the second pope run's pictures are not the first's: no cache hit between them
    args = argparse.Namespace(trace_scale=16, num_prompts=7, seed=1)
    bodies_of, meta = workload_of("pope>detail>pope", None, "m", args)
    assert bodies_of(0) == bodies and meta["phases"] == ["pope", "detail", "pope"]
    assert meta["output_tokens"] == pytest.approx((5 * 4 + 2 * 384) / 7) and meta[
        "images_per_request"
    ] == pytest.approx(1)


def test_a_shifting_load_takes_the_conversation_workload_as_a_phase_with_a_trace_window_of_its_own():
    import argparse

    from bench import conversation
    from bench.bodies import workload_of
    from bench.workloads import TracePhase, phase_runs, phased_bodies, phases_of

    vocab = conversation.Vocabulary(("a", "b", "c", "d", "e", "f", "g", "h"), chat_tokens=100, max_model_len=4096)
    phases = phases_of("conversation>detail>conversation/8", trace_scale=32)
    assert phases == [TracePhase(32), SHAPES["detail"], TracePhase(8)]
    assert [p.name for p in phases] == ["conversation/32", "detail", "conversation/8"]
    assert phase_runs(phases, 9, seed=2) == [(TracePhase(32), 3, 6), (SHAPES["detail"], 3, 7), (TracePhase(8), 3, 8)]
    with pytest.raises(ValueError, match="must divide 512"):
        phases_of("conversation/3>detail")
    with pytest.raises(ValueError, match="vocabulary"):
        phased_bodies(phases, 9, "m")
    args = argparse.Namespace(trace_scale=32, num_prompts=9, seed=2)
    bodies_of, meta = workload_of("conversation>detail>conversation/8", lambda: vocab, "m", args)
    bodies = bodies_of(1)
    first, third = bodies[:3], bodies[6:]
    assert bodies[3:6] == phased_bodies([SHAPES["detail"]] * 3, 9, "m", seed=2, variant=1)[3:6]  # the run's seed, 7
    # each conversation run is the trace window its own seed picks, at its own scale (÷32: 16-token blocks)
    for run, seed, scale in ((first, 6, 32), (third, 8, 8)):
        planned = conversation.plan(3, seed, vocab, scale)
        assert [b["max_tokens"] for b in run] == [p.output_tokens for p in planned]
        assert run == conversation.request_bodies(planned, vocab, "m", seed, 1)
    assert meta["phases"] == ["conversation/32", "detail", "conversation/8"]
    assert meta["output_tokens"] == pytest.approx(sum(b["max_tokens"] for b in bodies) / 9)
    assert meta["images_per_request"] == 1


def test_each_configuration_is_measured_against_the_bound_of_its_instances(tmp_path):
    from bench.goodput_report import add_bound, instances_of
    from common.latency import goodput_bound
    from common.latency.roofline import load_profile

    assert instances_of(["--topology", "E2+P2+D4", "--backend", "emulated"]) == 8
    assert instances_of(["--topology", "EP4+PD4"]) == 8 and instances_of(["--topology", "local"]) == 1
    assert instances_of(["--backend", "emulated"]) == 0
    h20 = load_profile("H20")
    point = {"completed": 10, "total_input_tokens": 6200}
    result = {"output_tokens": 32, "goodput": 40.0, "points": [{"completed": 0, "total_input_tokens": 0}, point]}
    add_bound(result, h20, 8)
    assert result["goodput_bound"] == pytest.approx(goodput_bound(h20, 8, 620, 1, 32))
    assert 60 < result["goodput_bound"] < 120 and result["fraction_of_bound"] == pytest.approx(
        40 / result["goodput_bound"]
    )
    real = {"output_tokens": 32, "goodput": 4.0, "points": [point]}
    add_bound(real, None, 1)  # the real backend has no profile: no bound claimed
    assert "goodput_bound" not in real
    report = {
        "workloads": ["textcaps"],
        "attainment": 0.9,
        "backend": "test",
        "slo_ttft_ms": 1000,
        "slo_tbt_ms": 100,
        "arrival": "mooncake",
        "configs": {"A": {"textcaps": {**result, "points": [{**point, "request_rate": 10.0, "slo_attainment": 1.0}]}}},
    }
    plot(report, tmp_path / "b.png")
    assert (tmp_path / "b.png").stat().st_size > 5000


def test_prediction_report_takes_the_requests_routed_between_two_reads_per_path_in_unscaled_ms():
    fields = ["seq", "path", "predicted_ms", "actual_ms"]
    before = {"ttft_predictions": {"fields": fields, "recent": [[1, "dedicated", 100.0, 900.0]]}}
    rows = [[1, "dedicated", 100.0, 900.0]] + [[1 + i, "dedicated", 100.0, 100.0 + 10 * i] for i in range(1, 11)]
    after = {"ttft_predictions": {"fields": fields, "recent": rows + [[12, "multiplexed", 300.0, 200.0]]}}
    report = prediction_report(before, after, scale=10)
    assert len(report["requests"]) == 11 and report["requests"][-1] == ["multiplexed", 30.0, 20.0]
    late = report["by_path"]["dedicated"]  # errors 1..10 ms once unscaled; the one before is left out
    assert late["count"] == 10 and late["median_error_ms"] == 6 and late["p90_error_ms"] == 10
    assert late["p10_error_ms"] == 2 and late["late_fraction"] == 1.0
    assert report["by_path"]["multiplexed"] == {
        "count": 1,
        "p10_error_ms": -10,
        "median_error_ms": -10,
        "p90_error_ms": -10,
        "late_fraction": 0.0,
    }


def test_a_goodput_above_the_bound_is_flagged_as_a_burst_not_a_sustained_rate(tmp_path, capsys):
    import types

    from bench.goodput_report import finish

    def run(goodput):
        return {
            "output_tokens": 32,
            "goodput": goodput,
            "goodput_bound": 85.9,
            "points": [{"request_rate": goodput, "slo_attainment": 0.95, "completed": 80}],
        }

    report = {
        "workloads": ["textcaps"],
        "attainment": 0.9,
        "backend": "test",
        "slo_ttft_ms": 1000,
        "slo_tbt_ms": 150,
        "arrival": "mooncake",
        "num_prompts": 80,
        "configs": {"A": {"textcaps": run(60.0)}},
    }
    finish(report, tmp_path / "r.json", types.SimpleNamespace(plot=None))
    assert "above the bound" not in capsys.readouterr().out
    report["configs"]["B"] = {"textcaps": run(100.0)}
    finish(report, tmp_path / "r.json", types.SimpleNamespace(plot=None))
    out = capsys.readouterr().out
    assert "B on textcaps came out above the bound" in out and "within ~0.8 s" in out and "--num-prompts" in out
    report["configs"]["C"] = {"textcaps": {**run(0.0), "points": [{"request_rate": 15.0, "slo_attainment": 0.5}]}}
    finish(report, tmp_path / "r.json", types.SimpleNamespace(plot=None))
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.strip().startswith("C "))
    assert row.split()[1:] == ["<", "15"]  # failed at its lowest rate: below it, not a measured 0
    assert "textcaps: vs A: B 1.67×, C < 0.25×" in out  # and its ratio is below that rate's, not 0


def test_attainment_by_path_matches_the_clients_requests_to_the_gateways_routes_by_id():
    fields = ["seq", "path", "predicted_ms", "actual_ms", "id"]
    rows = [
        [1, "dedicated", 100.0, 200.0, "a"],
        [2, "dedicated", 100.0, 200.0, "b"],
        [3, "multiplexed", 50.0, 90.0, "c"],
    ]
    results = [
        Result(True, 0.1, [0.02, 0.02, 0.02], request_id="a"),  # meets both
        Result(True, 1.5, [0.02, 0.02, 0.02], request_id="b"),  # TTFT 1500 ms > 1000
        Result(True, 0.1, [0.02, 0.02, 0.30], request_id="c"),  # its P90 gap is 244 ms > 150
        Result(True, 0.1, [0.02], request_id="unrouted"),  # no route recorded: in no path
        Result(False, error="HTTP 503", request_id=""),
    ]
    report = prediction_report({}, {"ttft_predictions": {"fields": fields, "recent": rows}}, 1, results, 1000, 150)
    by_path = report["attainment_by_path"]
    assert by_path["dedicated"] == {
        "count": 2,
        "ttft_attainment": 0.5,
        "tbt_attainment": 1.0,
        "slo_attainment": 0.5,
        "p90_of_p90_gap_ms": pytest.approx(20.0),
    }
    assert by_path["multiplexed"]["count"] == 1 and by_path["multiplexed"]["tbt_attainment"] == 0.0
    assert by_path["multiplexed"]["p90_of_p90_gap_ms"] == pytest.approx(244.0)
    assert by_path["multiplexed"]["tbt_missed"] == {
        "count": 1,
        "first_gap_slow": 0,
        "median_slow_gaps": 1,
        "median_gaps": 3,
    }


def test_a_configuration_label_with_any_characters_names_a_log_file_beside_the_json(tmp_path):
    path = log_path(tmp_path / "run.json", "toggle, joins TBT/2+EP4")
    assert path.parent == tmp_path and path.name == "run-toggle_joins_TBT_2_EP4.log"


def test_a_configuration_may_sweep_its_own_rates_and_a_misnamed_one_is_refused(capsys):
    args = parse_args(
        ["--config", "a=--topology EPD1", "--config", "b=--topology EPD2", "--rates", "40,45", "--rates-of", "b=15,20"]
    )
    assert args.rate_list == [40.0, 45.0] and args.rates_of == {"b": [15.0, 20.0]}
    for bad in (["--rates-of", "c=15"], ["--rates-of", "b=15,x"], ["--rates-of", "b=0"]):
        with pytest.raises(SystemExit):
            parse_args(["--config", "a=--topology EPD1", "--config", "b=--topology EPD2", *bad])
    assert "--rates-of names no --config: c" in capsys.readouterr().err


def test_each_rate_points_images_are_files_of_their_own_with_the_same_prompts():
    base, other = (
        request_bodies(SHAPES["pope"], 6, "m", seed=2),
        request_bodies(SHAPES["pope"], 6, "m", seed=2, variant=3),
    )
    url = lambda b: b["messages"][0]["content"][0]["image_url"]["url"]  # noqa: E731
    assert not {url(b) for b in base} & {url(b) for b in other}
    assert [b["messages"][0]["content"][1] for b in base] == [b["messages"][0]["content"][1] for b in other]
    assert [url(b) for b in other] == [url(b) for b in request_bodies(SHAPES["pope"], 6, "m", seed=2, variant=3)]


def test_the_report_names_the_device_its_real_engine_ran_on():
    from bench.goodput import real_device

    assert real_device(["local=--topology local --device cuda --dtype bfloat16"]) == "CUDA"
    assert real_device(["a=--topology EPD1", "b=--device=cuda:1"]) == "CUDA"
    assert real_device(["local=--topology local"]) == "CPU" and real_device([]) == "CPU"
