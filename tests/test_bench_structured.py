"""A smoke run of bench/structured.py: every grammar kind runs and is compared with the unconstrained run."""

import json

from bench.structured import main


def test_each_grammar_is_timed_against_the_unconstrained_run(tmp_path, tiny_dir, capsys):
    out = tmp_path / "structured.json"
    assert main(["--model", str(tiny_dir), "--batches", "2", "--tokens", "6", "--repeats", "1", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert set(report["results"]["2"]) == {"none", "json_schema", "regex"}
    assert report["results"]["2"]["none"]["ratio_to_none"] == 1.0
    assert all(r["decode_step_ms"] > 0 for r in report["results"]["2"].values())
    assert "× none" in capsys.readouterr().out
