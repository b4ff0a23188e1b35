"""`epdmesh plan`: the deployments it enumerates, TriInfer's heuristic, and a ranking simulated end to end."""

import itertools
import json
import logging
from pathlib import Path

import pytest

from common.latency.roofline import load_profile
from common.policy import placement
from common.request import Stage
from common.topology import ROLE_SETS, deployments, parse_topology
from epdmesh.cli import main as cli_main
from sim.plan import main as plan

H20 = str(Path(__file__).resolve().parents[2] / "profiles" / "llava-1.5-7b-h20.json")


def roles_of(topology: str) -> tuple[str, ...]:
    """Each worker's role letters, sorted: the deployment as a multiset."""
    return tuple(sorted(g.label for g in parse_topology(topology) for _ in range(g.count)))


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8])
def test_all_is_every_multiset_of_role_sets_that_holds_every_stage_once(n):
    every = {
        tuple(sorted(combo))
        for combo in itertools.combinations_with_replacement(ROLE_SETS, n)
        if set("".join(combo)) == set("EPD")
    }
    found = [roles_of(t) for t in deployments(n, "all")]
    assert len(found) == len(set(found)) and set(found) == every


def test_the_spaces_nest_and_count_as_documented():
    pools, pairs, every = (set(deployments(8, s)) for s in ("pools", "pairs", "all"))
    assert (len(pools), len(pairs), len(every)) == (43, 106, 2871)
    assert pools <= pairs <= every
    assert {"EPD8", "E2+P2+D4", "EP6+D2", "ED5+P3", "E1+PD7"} <= pools
    assert "EP4+EPD4" in pairs - pools and "E1+EP1+P1+D5" in every - pairs
    for topology in pools:  # each stage on exactly one pool
        groups = parse_topology(topology)
        assert all(sum(stage in g.roles for g in groups) == 1 for stage in Stage)


def test_the_partition_follows_the_stage_times_and_gives_every_stage_one():
    assert placement.partition(8, {"encode": 1, "prefill": 3, "decode": 4}) == (1, 3, 4)
    assert placement.partition(8, {"encode": 0, "prefill": 0.01, "decode": 9}) == (1, 1, 6)
    assert placement.partition(3, {"encode": 5, "prefill": 0, "decode": 0}) == (1, 1, 1)
    for times in ({"encode": 1, "prefill": 1, "decode": 1}, {"encode": 0.2, "prefill": 2.5, "decode": 7}):
        assert sum(placement.partition(11, times)) == 11
    assert placement.candidates(8, {"encode": 0.5, "prefill": 3, "decode": 4.5}) == ["E1+P3+D4", "EP4+D4", "ED5+P3"]


def test_stage_times_grow_with_the_work_of_their_stage():
    profile = load_profile(H20)
    base = placement.StageLoad(images=1, prompt_tokens=600, output_tokens=32, context_tokens=616)
    seconds = placement.stage_seconds(profile, base, 1000, 100, kv_tokens=200_000)
    longer = placement.stage_seconds(profile, placement.StageLoad(1, 600, 128, 664), 1000, 100, kv_tokens=200_000)
    assert longer["decode"] > seconds["decode"] and longer["prefill"] == seconds["prefill"]
    assert all(v > 0 for v in seconds.values())
    tight = placement.stage_seconds(profile, base, 1000, 100, kv_tokens=2_000)  # a small KV caps the batch
    assert tight["decode"] > seconds["decode"]


def test_plan_ranks_every_deployment_and_reports_the_heuristics_pick(emulated_dir, tmp_path):
    out = tmp_path / "plan.json"
    argv = ["--instances", "3", "--profile", H20, "--model", str(emulated_dir), "--workload", "textcaps"]
    argv += ["--duration", "0.5", "--steps", "3", "--jobs", "1", "--out", str(out)]
    assert plan(argv) == 0
    report = json.loads(out.read_text())
    entry = report["workloads"]["textcaps"]
    ranking = entry["ranking"]
    assert report["deployments"] == 8 and len(ranking) == 16  # 8 deployments × 2 routings
    assert {(r["topology"], r["routing"]) for r in ranking} == {
        (t, r) for t in deployments(3, "pools") for r in ("slo", "least-loaded")
    }
    goodputs = [r["goodput"] for r in ranking]
    assert goodputs == sorted(goodputs, reverse=True) and 0 < goodputs[0] <= entry["goodput_bound"]
    assert all(len(r["points"]) == 3 or r["goodput"] == entry["goodput_bound"] for r in ranking)
    assert ranking[0]["rank"] == 1 and all(r["rank"] == 1 + goodputs.index(r["goodput"]) for r in ranking)
    heuristic = entry["heuristic"]
    assert heuristic["candidates"] == ["E1+P1+D1", "EP2+D1", "ED2+P1"]
    pick = heuristic["pick"]
    assert pick["topology"] in heuristic["candidates"] and 1 <= pick["rank"] <= 16
    baselines = entry["baselines"]
    assert [b["baseline"] for b in baselines] == ["vLLM-style 2048", "vLLM-style 8192"]
    assert all(b["topology"] == "EPD3" and b["goodput"] <= entry["goodput_bound"] for b in baselines)
    assert out.with_suffix(".png").stat().st_size > 10_000


def test_given_deployments_without_budgets_are_ranked_as_given(emulated_dir, tmp_path):
    out = tmp_path / "plan.json"
    argv = ["--instances", "3", "--profile", H20, "--model", str(emulated_dir), "--topologies", "E1+P1+D1,EPD3"]
    argv += ["--no-budgets", "--routing", "least-loaded", "--no-baselines", "--duration", "0.5", "--steps", "2"]
    assert plan([*argv, "--jobs", "2", "--out", str(out)]) == 0  # two processes, spawned
    assert not [f for f in logging.getLogger("epdmesh").filters if type(f).__name__ == "_Once"]  # its own, removed
    report = json.loads(out.read_text())
    assert report["deployments"] == 2 and report["space"] == "given"
    ranking = report["workloads"]["textcaps"]["ranking"]
    assert sorted(r["topology"] for r in ranking) == ["E1+P1+D1", "EPD3"]
    assert "--latency-profile" not in report["serve_args"] and report["workloads"]["textcaps"]["baselines"] == []
    with pytest.raises(SystemExit):
        plan([*argv[:-6], "--routing", "slo", "--no-budgets"])
    with pytest.raises(SystemExit):  # through the CLI, as a user types it: 4 workers are not --instances 3
        cli_main(["plan", "--instances", "3", "--profile", H20, "--topologies", "E1+P1+D2"])


def test_a_point_of_a_shifting_load_sends_each_phase_its_share():
    from sim.plan import sent_at

    runs = [["a1", "a2", "a3"], ["b1", "b2", "b3"], ["c1", "c2", "c3"]]
    assert sent_at(runs, 5) == ["a1", "a2", "b1", "b2", "c1"]
    assert sent_at([["x1", "x2", "x3"]], 2) == ["x1", "x2"]


def test_plan_ranks_deployments_on_a_recorded_trace_and_reads_them_against_its_rates(emulated_dir, tmp_path, capsys):
    from common import trace

    rows = [  # 70 requests: one a second for a minute, then ten within the second minute's first second
        trace.TraceRow(float(i * 1000 if i < 60 else 60_000 + (i - 60) * 100), 300, 8, (i,)) for i in range(70)
    ]
    path, out = tmp_path / "traffic.jsonl", tmp_path / "plan.json"
    trace.write(rows, path)
    workload = f"trace:{path}"
    argv = ["--instances", "2", "--profile", H20, "--model", str(emulated_dir), "--workload", workload]
    argv += ["--topologies", "EPD2", "--routing", "slo", "--no-baselines", "--steps", "2", "--jobs", "1"]
    assert plan([*argv, "--out", str(out)]) == 0
    entry = json.loads(out.read_text())["workloads"][workload]
    assert entry["recorded"]["requests"] == 70 and entry["recorded"]["mean_rate"] == pytest.approx(69 / 60.9)
    assert entry["recorded"]["busiest_minute_rate"] == pytest.approx(1.0)  # minutes from the first arrival: 60, 10
    assert entry["ranking"][0]["goodput"] > 0
    assert "the trace arrived at 1.13 req/s, its busiest minute 1.00: the best holds" in capsys.readouterr().out


def test_a_warning_every_deployment_would_repeat_is_logged_once_per_process(caplog):
    from sim import plan as plan_module

    log = logging.getLogger("epdmesh")
    before = list(log.filters)
    try:
        assert plan_module._quiet() is not None and plan_module._quiet() is None  # idempotent: one filter
        assert sum(isinstance(f, plan_module._Once) for f in log.filters) == 1
        with caplog.at_level("WARNING", logger="epdmesh"):
            for _ in range(3):
                log.warning("one image's encode (%d ms) exceeds the %d ms limit", 253, 100)
            log.warning("one image's encode (%d ms) exceeds the %d ms limit", 253, 50)
        assert [r.getMessage() for r in caplog.records] == [
            "one image's encode (253 ms) exceeds the 100 ms limit",
            "one image's encode (253 ms) exceeds the 50 ms limit",
        ]
    finally:
        log.filters[:] = before
