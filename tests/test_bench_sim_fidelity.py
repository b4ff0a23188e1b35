"""`bench/sim_fidelity.py`: the simulator's sweep against the emulated mesh's, point by point; with
`--emulated-report`, against one written before, without launching a mesh."""

import json

import pytest

from bench import goodput, sim_fidelity
from sim import goodput as sim_goodput


def report(points: dict[float, float]) -> dict:
    """A goodput report of one configuration and workload: attainment by rate."""
    return {
        "attainment": 0.9,
        "configs": {
            "EPD4": {
                "textcaps": {"points": [{"request_rate": r, "slo_attainment": a} for r, a in sorted(points.items())]}
            }
        },
    }


ARGV = ["--workload", "textcaps", "--rates", "10,20,30", "--config", "EPD4=--topology EPD4"]


def test_an_earlier_emulated_report_is_compared_with_a_fresh_simulation_and_no_mesh_is_launched(tmp_path, monkeypatch):
    emulated = tmp_path / "before-emulated.json"
    emulated.write_text(json.dumps(report({10: 1.0, 20: 0.95, 30: 0.5})))
    simulated = report({10: 1.0, 20: 0.85, 30: 0.45})

    def simulate(argv):
        assert argv[: len(ARGV)] == ARGV and argv[-2] == "--out" and "--emulated-report" not in argv
        (tmp_path / argv[-1]).write_text(json.dumps(simulated))
        return 0

    def launch(argv):
        raise AssertionError("no emulated sweep with --emulated-report")

    monkeypatch.setattr(sim_goodput, "main", simulate)
    monkeypatch.setattr(goodput, "main", launch)
    out = tmp_path / "fidelity.json"
    assert sim_fidelity.main([*ARGV, "--out", str(out), "--emulated-report", str(emulated)]) == 0
    written = json.loads(out.read_text())
    assert written["emulated"] == str(emulated) and written["simulated"] == str(tmp_path / "fidelity-simulated.json")
    [row] = written["rows"]
    assert [round(r["points"], 6) for r in row["per_rate"]] == [0.0, -10.0, -5.0]
    assert row["emulated_goodput"] == pytest.approx(20 + 10 * 0.05 / 0.45)  # the 90% crossings, interpolated
    assert row["simulated_goodput"] == pytest.approx(10 + 10 * 0.1 / 0.15)
    assert row["max_points"] == pytest.approx(10.0)


def test_a_missing_emulated_report_is_a_clear_error(tmp_path, capsys):
    argv = [*ARGV, "--out", str(tmp_path / "f.json"), "--emulated-report", str(tmp_path / "none.json")]
    assert sim_fidelity.main(argv) == 2
    assert "no report at" in capsys.readouterr().err
