"""bench/regimes.py: each configuration's kind from its topology and flags, and what the three goals ask."""

import json

import pytest

from bench import regimes


def _run(rates_and_attainments, bound=10.0):
    return {
        "points": [{"request_rate": r, "slo_attainment": a} for r, a in rates_and_attainments],
        "goodput_bound": bound,
    }


def _report(tmp_path, configs):
    report = {
        "attainment": 0.9,
        "slo_ttft_ms": 1000.0,
        "slo_tbt_ms": 50.0,
        "workloads": ["conversation"],
        "serve_args": {name: args for name, (args, _) in configs.items()},
        "configs": {name: {"conversation": run} for name, (_, run) in configs.items()},
    }
    path = tmp_path / "sim-x-n2-seed7.json"
    path.write_text(json.dumps(report))
    return path


@pytest.mark.parametrize(
    "topology, flags, kind",
    [
        ("EPD2", ["--latency-profile", "p.json"], "colocated"),
        ("EPD2", ["--token-budget", "8192"], "vLLM-style"),
        ("EP1+D1", ["--latency-profile", "p.json"], "static"),
        ("ED1+P1", [], "static"),
        ("E1+P1+D1", [], "static"),
        ("EP1+EPD1", ["--gap-slack"], "toggle"),
        ("EPD1+P1", [], "toggle"),
        ("E1+PD1", [], "static"),  # no dedicated prefill worker beside the one that decodes
    ],
)
def test_kinds(topology, flags, kind):
    assert regimes.kind_of(["--topology", topology, *flags]) == kind


def test_the_goals_need_the_largest_of_the_three_and_the_table_says_it(tmp_path, capsys):
    path = _report(
        tmp_path,
        {
            "colocated": (["--topology", "EPD2", "--latency-profile", "p"], _run([(1, 1.0), (2, 1.0), (3, 0.8)])),
            "vllm": (["--topology", "EPD2", "--token-budget", "2048"], _run([(1, 0.95), (2, 0.85)])),
            "static a": (["--topology", "EP1+D1", "--latency-profile", "p"], _run([(1, 1.0), (2, 0.5)])),
            "static b": (["--topology", "ED1+P1", "--latency-profile", "p"], _run([(1, 1.0), (2, 0.94), (3, 0.5)])),
            "toggle": (["--topology", "EP1+EPD1", "--gap-slack"], _run([(1, 1.0), (4, 1.0), (5, 0.5)])),
        },
    )
    (cell,) = regimes.cells(path)
    assert cell.instances == 2 and cell.bound == 10.0
    assert cell.best["colocated"] == (pytest.approx(2.5), "colocated")
    assert cell.best["vLLM-style"] == (pytest.approx(1.5), "vllm")
    assert cell.best["static"] == (pytest.approx(2.0 + 0.04 / 0.44), "static b")
    assert cell.best["toggle"] == (pytest.approx(4.2), "toggle")
    assert cell.unbounded == frozenset() and cell.goodput("toggle") == "4.2"
    assert cell.need == (pytest.approx(3.6), "vLLM-style")  # 2.4 × 1.5 > 1.3 × 2.5 > 1.3 × 2.09
    assert cell.ratio("colocated") == "1.68×"
    assert regimes.main([str(path)]) == 0
    row = capsys.readouterr().out.splitlines()[-1]
    assert row.startswith("| 2 | 1000 | 50 | conversation | seed 7 | 2.5 | 1.5 | 2.1 | 4.2 `toggle` | 10.0 | 1.68× | ")
    assert row.endswith("| 3.6 (vLLM-style) | 36% | 42% |")


@pytest.mark.parametrize(
    "name, label",
    [("sim-sens-s512-n8-tbt100-conversation-seed1.json", "seed 1"), ("sim-h20-n8-gapslack-textcaps-s2.json", "seed 2")],
)
def test_the_seed_is_read_off_the_file_name(name, label):
    assert regimes._seed(name) == label


def test_a_report_without_a_toggle_is_left_out_and_none_left_is_refused(tmp_path, capsys):
    lone = _report(tmp_path, {"colocated": (["--topology", "EPD2", "--latency-profile", "p"], _run([(1, 1.0)]))})
    with pytest.raises(SystemExit, match="no report with a toggle configuration"):
        regimes.main([str(lone)])
    other = tmp_path / "sim-y-n2-seed8.json"
    report = json.loads(lone.read_text())
    report["serve_args"]["toggle"] = ["--topology", "EPD1+P1"]
    report["configs"]["toggle"] = {"conversation": _run([(1, 1.0), (2, 0.95)])}  # met up to the top rate
    other.write_text(json.dumps(report))
    assert regimes.main([str(lone), str(other)]) == 0
    out = capsys.readouterr()
    assert "left out, no toggle configuration in: sim-x-n2-seed7.json" in out.err
    (row,) = out.out.splitlines()[2:]
    assert row.split(" | ")[4:6] == ["seed 8", "≥ 1.0"] and row.split(" | ")[8] == "≥ 2.0 `toggle`"
