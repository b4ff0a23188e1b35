"""bench/hopper_kernels.py: the kernel tables' arithmetic and the fit of the prefill saturation point, on
synthetic tables (the real ones are aiconfigurator's parquet files, read only by the benchmark)."""

import builtins
import math

import pytest

from bench import hopper_kernels as hk
from common.latency.model import decode_ms
from common.latency.roofline import analytic_profile, load_profile

ROWS = (1, 16, 64, 128, 256, 512, 1024, 2048, 4096)


def tables_costing(profile) -> hk.Tables:
    """Kernel tables whose 7B prefill costs exactly what `profile` predicts less its overhead: the QKV GEMM carries
    a layer's whole time, every other kernel none."""
    gemm = {}
    for m in ROWS:
        for n in (4096, 12288, 22016):
            for k in (4096, 11008):
                gemm[m, n, k] = hk.analytic_ms(profile, m) / hk.LAYERS if (n, k) == (12288, 4096) else 0.0
    return hk.Tables(gemm, {1: 0.0, 8192: 0.0}, {(1, 512): 0.5})


def test_gemm_times_off_the_grid_are_bilinear_in_n_and_k():
    f = lambda n, k: 0.25 + 1e-4 * n + 2e-4 * k + 3e-8 * n * k  # noqa: E731 (bilinear: interpolated exactly)
    tables = hk.Tables({(8, n, k): f(n, k) for n in (4096, 16384, 51200) for k in (4096, 10240, 12288)}, {}, {})
    assert tables.gemm_ms(8, 22016, 11008) == pytest.approx(f(22016, 11008), rel=1e-12)
    assert tables.gemm_ms(8, 16384, 4096) == f(16384, 4096)
    with pytest.raises(ValueError, match="outside the table's grid"):
        tables.gemm_ms(8, 65536, 4096)


def test_a_prompt_and_a_decode_step_sum_the_four_gemms_and_attention_over_32_layers():
    gemm = {(m, n, k): m * 1e-3 + n * 1e-6 for m in (4, 100) for n in (4096, 12288, 22016) for k in (4096, 11008)}
    tables = hk.Tables(gemm, {1: 0.1, 200: 2.1}, {(4, 1024): 0.3})
    layer = sum(100e-3 + n * 1e-6 for n, _ in hk.GEMMS)
    assert tables.prefill_ms(100) == pytest.approx(32 * (layer + 0.1 + 99 / 199 * 2.0))
    assert tables.decode_ms(4, 1024) == pytest.approx(32 * (sum(4e-3 + n * 1e-6 for n, _ in hk.GEMMS) + 0.3))
    assert tables.prefill_points() == [4, 100]


def test_the_fit_finds_the_saturation_point_the_kernels_were_made_from():
    tables = tables_costing(analytic_profile("H100", prefill_saturation=256))
    result = hk.report(tables, "synthetic")
    assert result["best"]["h20_prefill_saturation"] == 256
    assert result["best"]["rms_log_error"] == pytest.approx(0.0, abs=1e-9)
    assert result["shipped"]["mean_log_error"] > 0.2  # the shipped profile prices these chunks dearer
    assert [row["tokens"] for row in result["prefill"]] == list(ROWS)
    assert all(math.isclose(r["fitted_ms"], r["measured_ms"]) for r in result["prefill"])
    shipped = load_profile("H100")
    assert result["decode"] == [
        dict(
            sequences=1,
            context=512,
            measured_ms=pytest.approx(32 * (sum(tables.gemm_ms(1, n, k) for n, k in hk.GEMMS) + 0.5)),
            shipped_ms=pytest.approx(decode_ms(shipped, 1, 512) - 1.5),
        )
    ]
    text = hk.render(result)
    assert "best fit: --prefill-saturation 256" in text and "| 256 | 0.000 |" in text


def test_the_measured_saturation_is_bracketed_by_the_tables_rows():
    tables = tables_costing(analytic_profile("H100", prefill_saturation=256))
    lo, hi = hk._saturation(tables, list(ROWS))
    best = max(m / tables.prefill_ms(m) for m in ROWS)
    assert lo / tables.prefill_ms(lo) < 0.9 * best <= hi / tables.prefill_ms(hi)
    assert ROWS.index(hi) == ROWS.index(lo) + 1


def test_reading_the_tables_without_pandas_says_what_to_install(monkeypatch, tmp_path):
    real = builtins.__import__

    def no_pandas(name, *args, **kwargs):
        if name == "pandas":
            raise ImportError(name)
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_pandas)
    with pytest.raises(SystemExit, match="pip install pandas pyarrow"):
        hk.load_tables(tmp_path)
    with pytest.raises(SystemExit):
        hk.main(["--tables", str(tmp_path / "missing")])
