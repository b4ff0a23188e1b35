"""A smoke run of bench/structured.py: every grammar kind runs and is compared with the unconstrained run."""

import json

from bench.structured import main


def test_each_grammar_is_timed_against_the_unconstrained_run(tmp_path, tiny_dir, capsys):
    out = tmp_path / "structured.json"
    assert (
        main(
            [
                "--model",
                str(tiny_dir),
                "--batches",
                "2",
                "--tokens",
                "6",
                "--repeats",
                "1",
                "--tools",
                "1,3",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    report = json.loads(out.read_text())
    assert set(report["results"]["2"]) == {"none", "json_schema", "regex", "tools"}
    assert set(report["tool_admission"]) == {"1", "3"} and all(
        c["grammar_build_ms"] > 0 and c["matcher_ms"] > 0 for c in report["tool_admission"].values()
    )
    assert report["results"]["2"]["none"]["ratio_to_none"] == 1.0
    assert all(r["decode_step_ms"] > 0 for r in report["results"]["2"].values())
    assert "× none" in capsys.readouterr().out
