"""bench/prompt_attention.py: the kernel mode's table (the image mode compiles the `small` preset: not in CI)."""

import pytest
import torch

from bench import prompt_attention as pa
from kernels import cpu_prompt


@pytest.mark.skipif(not cpu_prompt.supports(torch.empty(1, 64)), reason="no AVX-512 on this host")
def test_kernel_mode_times_every_shape_against_sdpa(capsys, monkeypatch):
    monkeypatch.setattr(pa, "SHAPES", [("a", 40, 2, 32, True, 2), ("b", 33, 4, 16, False, 1)])
    assert pa.main(["kernel", "--dtype", "float32", "--rounds", "2"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[2:]]
    assert [r[:3] for r in rows] == [["a", "40", "2×32"], ["b", "33", "4×16"]]
    assert all(float(r[3]) > 0 and float(r[4]) > 0 and r[6].endswith("×") for r in rows)


@pytest.mark.skipif(not cpu_prompt.supports(torch.empty(1, 64)), reason="no AVX-512 on this host")
def test_kernel_mode_against_a_commit_builds_its_kernel_beside_ours(capsys, monkeypatch):
    monkeypatch.setattr(pa, "SHAPES", [("a", 40, 2, 32, True, 2)])
    ours = cpu_prompt._library
    assert pa.main(["kernel", "--dtype", "float32", "--rounds", "2", "--against", "HEAD"]) == 0
    out, err = capsys.readouterr()
    header, row = out.splitlines()[1], out.splitlines()[2].split()
    assert "HEAD µs" in header and len(row) == 9 and float(row[7]) > 0 and row[8].endswith("×")
    assert "differ" not in err  # the same source: bit-identical outputs
    assert cpu_prompt._library is ours  # the module's own loader again after the bench
