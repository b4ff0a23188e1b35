"""bench/launches.py: goodput over several launches, and ratios taken launch by launch."""

import json

import pytest

from bench import launches


def _report(points_of: dict[str, list[tuple[float, float]]]) -> dict:
    return {
        "attainment": 0.9,
        "configs": {
            name: {"textcaps": {"points": [{"request_rate": r, "slo_attainment": a} for r, a in pts]}}
            for name, pts in points_of.items()
        },
    }


def test_launches_interpolate_each_crossing_and_take_ratios_per_launch(tmp_path, capsys):
    one = _report({"toggle": [(10, 1.0), (20, 0.8)], "colocated": [(10, 0.95), (20, 0.55)]})
    two = _report({"toggle": [(10, 0.9), (20, 0.7)], "colocated": [(10, 1.0), (20, 0.8)]})
    rows = {r["config"]: r for r in launches.combine([one, two], versus="toggle")}
    assert rows["toggle"]["goodput"] == pytest.approx([15.0, 10.0]) and "ratio" not in rows["toggle"]
    assert rows["colocated"]["goodput"] == pytest.approx([11.25, 15.0])
    assert (rows["colocated"]["min"], rows["colocated"]["max"]) == pytest.approx((11.25, 15.0))
    # per launch: 15 / 11.25 and 10 / 15, not the ratio of the means
    assert [x for x, _ in rows["colocated"]["ratio"]] == pytest.approx([15 / 11.25, 10 / 15])
    paths = []
    for i, r in enumerate((one, two)):
        paths.append(tmp_path / f"s{i}.json")
        paths[-1].write_text(json.dumps(r))
    out = tmp_path / "rows.json"
    assert launches.main([*map(str, paths), "--versus", "toggle", "--out", str(out)]) == 0
    table = capsys.readouterr().out
    assert "| textcaps | `colocated` | 11.2 / 15.0 | 13.1 | 11.2–15.0 | 1.33× / 0.67× |" in table
    assert len(json.loads(out.read_text())["rows"]) == 2
    # a launch swept in two runs: pooled points; a goodput off the grid is a bound, and so is its ratio
    low = _report({"toggle": [(5, 0.95), (8, 0.92)]})
    paths.append(tmp_path / "low.json")
    paths[-1].write_text(json.dumps(low))
    rows = {r["config"]: r for r in launches.combine([launches.pooled([two, low])], versus="colocated")}
    assert rows["toggle"]["goodput"] == pytest.approx([10.0]) and rows["toggle"]["kinds"] == ["="]
    assert len(launches.pooled([two, low])["configs"]["toggle"]["textcaps"]["points"]) == 4
    assert launches.crossings(
        one | {"configs": {"x": {"w": {"points": [{"request_rate": 4, "slo_attainment": 0.5}]}}}}
    )[("x", "w")] == (4, "<")
    assert launches.main([f"{paths[1]},{paths[2]}", str(paths[0]), "--versus", "colocated"]) == 0
    table = capsys.readouterr().out
    assert "| textcaps | `toggle` | 10.0 / 15.0 | 12.5 |" in table
    edge = launches.combine([_report({"a": [(10, 0.95)], "b": [(10, 0.95), (20, 0.5)]})], versus="a")
    assert edge[1]["ratio"][0][1] == ">"  # a holds 90% at the top of its grid: a ÷ b is at least that
    with pytest.raises(SystemExit):
        launches.main([str(paths[0]), "--versus", "nobody"])
