"""bench/decode_kernels.py: the alternation its ratios rest on, and each mode on a small case."""

import pytest

from bench import decode_kernels as dk
from kernels import cpu_amx, cpu_paged


def test_each_round_flips_the_order_and_every_run_counts():
    order = []
    medians = dk.alternate({"a": lambda: order.append("a"), "b": lambda: order.append("b")}, rounds=4)
    assert order == ["a", "b", "b", "a", "a", "b", "b", "a"]
    assert set(medians) == {"a", "b"} and all(m >= 0 for m in medians.values())


@pytest.mark.skipif(not cpu_paged.available(), reason="no C compiler on this host")
def test_attention_against_a_commit_builds_its_kernel_and_compares_outputs(capsys):
    dk.main(["attention", "--seqs", "2", "--context", "20", "--rounds", "2", "--against", "HEAD"])
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if "seqs" in x and "tokens" in x)
    assert "ours" in line and "HEAD" in line and "outputs equal: 1.000" in line  # HEAD: ours as committed
    assert cpu_paged._library is cpu_paged._ours  # routed back


@pytest.mark.skipif(not cpu_amx.available(), reason="no AMX on this host")
def test_products_report_bit_identity_per_row_count(capsys):
    dk.main(["products", "--rows", "3,40", "--rounds", "2"])
    lines = [x for x in capsys.readouterr().out.splitlines() if "rows" in x and "oneDNN" in x]
    assert len(lines) == 2 and "not bit-identical" not in lines[0]
