"""A smoke run of bench/kv_admission.py: on-demand KV (with preemptions) and worst-case admission give the same
tokens (the bench fails otherwise), and only on-demand preempts."""

import json

from bench.kv_admission import main


def test_both_admissions_give_the_same_tokens_and_only_on_demand_preempts(tmp_path, tiny_dir):
    out = tmp_path / "kv.json"
    assert (
        main(
            [
                "--model",
                str(tiny_dir),
                "--requests",
                "8",
                "--prompt-lens",
                "16,64",
                "--max-tokens",
                "96",
                "--kv-blocks",
                "24",
                "--repeats",
                "1",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    rows = {row["admission"]: row for row in json.loads(out.read_text())["summary"]}
    assert rows["on-demand"]["preemptions"] > 0 and rows["worst-case"]["preemptions"] == 0
    assert rows["worst-case"]["max_decoding"] < rows["on-demand"]["max_decoding"]  # worst cases of 7-10 blocks
