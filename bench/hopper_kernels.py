"""The analytic H100 (H200) profile against measured Hopper kernels: what a prompt chunk and a decode step of
LLaVA-1.5-7B's language model cost on an H100 (H200) SXM, summed from NVIDIA aiconfigurator's published kernel tables
(bf16 GEMMs at every row count, flash-attention context and generation attention, measured under SGLang), and
which prefill saturation point of the H20 profile (`epdmesh profile --analytic H20 --prefill-saturation S`) makes
its H100 twin (the same calibration, scaled by SM count) cost what the kernels cost.

    git clone https://github.com/ai-dynamo/aiconfigurator          # its tables are parquet: pip install pyarrow
    python -m bench.hopper_kernels --tables aiconfigurator/aic-core/src/aiconfigurator_core/systems/data/h100_sxm \
        --out bench/results/hopper-kernels-h100.json                 # and a .png beside it

Per layer: the four GEMMs of a Llama-2-7B layer (QKV 4096→12288, output 4096→4096, gate/up 4096→22016, down
11008→4096; shapes off the tables' grid interpolated linearly in N and K) and causal attention over the chunk (32
heads of 128; context attention at batch 1), times 32 layers; a decode step: the GEMMs at one row per sequence and
generation attention over each sequence's context. Not in the sums: norms, rotary, activations, the logits and the
launches between kernels (the profile's 1.5 ms per iteration stands for those), so the measured costs are a floor.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path

from common.latency.model import decode_ms, prefill_chunk_ms
from common.latency.roofline import analytic_profile, load_profile

LAYERS = 32
HEADS, HEAD_DIM = 32, 128
GEMMS = ((12288, 4096), (4096, 4096), (22016, 4096), (4096, 11008))  # (N, K) of a Llama-2-7B layer, rows = tokens
CANDIDATES = (96, 128, 160, 192, 256, 320, 384, 512, 768, 1024)  # H20 prefill saturation points tried (tokens)
DECODE_POINTS = ((1, 512), (1, 1024), (8, 1024), (32, 1024), (64, 1024), (128, 1024), (256, 512))


@dataclasses.dataclass(frozen=True, slots=True)
class Tables:
    """Kernel latencies in ms: GEMMs by (rows, N, K); context attention by prompt length (batch 1, HEADS ×
    HEAD_DIM); generation attention by (sequences, context length)."""

    gemm: dict[tuple[int, int, int], float]
    context: dict[int, float]
    generation: dict[tuple[int, int], float]

    def gemm_ms(self, rows: int, n: int, k: int) -> float:
        """Bilinear in N and K between the table's grid points (a GEMM's time is near linear in each)."""
        ns = sorted({key[1] for key in self.gemm if key[0] == rows})
        ks = sorted({key[2] for key in self.gemm if key[0] == rows})
        (n0, n1, fn), (k0, k1, fk) = _bracket(n, ns), _bracket(k, ks)
        t = {(a, b): self.gemm[rows, a, b] for a in (n0, n1) for b in (k0, k1)}
        return (
            (1 - fn) * (1 - fk) * t[n0, k0]
            + fn * (1 - fk) * t[n1, k0]
            + (1 - fn) * fk * t[n0, k1]
            + fn * fk * t[n1, k1]
        )

    def context_ms(self, tokens: int) -> float:
        lo, hi, f = _bracket(tokens, sorted(self.context))
        return (1 - f) * self.context[lo] + f * self.context[hi]

    def prefill_ms(self, tokens: int) -> float:
        """One whole prompt of `tokens`, the language model's kernels only."""
        return LAYERS * (sum(self.gemm_ms(tokens, n, k) for n, k in GEMMS) + self.context_ms(tokens))

    def decode_ms(self, sequences: int, context: int) -> float:
        return LAYERS * (sum(self.gemm_ms(sequences, n, k) for n, k in GEMMS) + self.generation[sequences, context])

    def prefill_points(self, limit: int = 8192) -> list[int]:
        """Row counts measured for every GEMM shape's neighbours and within the attention table."""
        top = max(self.context)
        rows = sorted({key[0] for key in self.gemm})
        return [m for m in rows if m <= min(limit, top) and self._covers(m)]

    def _covers(self, rows: int) -> bool:
        try:
            for n, k in GEMMS:
                self.gemm_ms(rows, n, k)
        except (KeyError, StopIteration, ValueError):
            return False
        return True


def _bracket(value: float, grid: list[int]) -> tuple[int, int, float]:
    """The grid points around `value` and its fraction of the way between them (exact points: both the same)."""
    if not grid or not grid[0] <= value <= grid[-1]:
        raise ValueError(f"{value} is outside the table's grid {grid[:1]}…{grid[-1:]}")
    hi = next(x for x in grid if x >= value)
    lo = max(x for x in grid if x <= value)
    return lo, hi, 0.0 if hi == lo else (value - lo) / (hi - lo)


def load_tables(directory: Path, framework: str = "sglang", version: str = "0.5.10") -> Tables:
    """aiconfigurator's per-GPU data directory (`…/systems/data/h100_sxm`): its bf16 GEMMs and flash attention."""
    try:
        import pandas as pd
    except ImportError:
        raise SystemExit("reading aiconfigurator's parquet tables needs pandas and pyarrow: pip install pandas pyarrow")
    gemm = pd.read_parquet(directory / "gemm" / framework / version / "gemm_perf.parquet")
    gemm = gemm[gemm.gemm_dtype == "bfloat16"]
    attention = {}
    for kind in ("context", "generation"):
        table = pd.read_parquet(directory / "attention" / framework / version / f"{kind}_attention_perf.parquet")
        keep = (table.attn_dtype == "bfloat16") & (table.kv_cache_dtype == "bfloat16")
        keep &= (table.num_heads == HEADS) & (table.num_key_value_heads == HEADS) & (table.head_dim == HEAD_DIM)
        attention[kind] = table[keep]
    context = attention["context"]
    context = context[context.batch_size == 1]
    return Tables(
        gemm={(int(r.m), int(r.n), int(r.k)): float(r.latency) for r in gemm.itertuples()},
        context={int(r.isl): float(r.latency) for r in context.itertuples()},
        # `step` s: the s-th generated token after a 1-token prompt, so the context holds s + 1 tokens
        generation={
            (int(r.batch_size), int(r.step) + 1): float(r.latency) for r in attention["generation"].itertuples()
        },
    )


def analytic_ms(profile, tokens: int) -> float:
    """A whole prompt's iteration on the profile, less its per-iteration overhead (the tables have no launches)."""
    return prefill_chunk_ms(profile, tokens) - profile.prefill.overhead_ms


def log_errors(tables: Tables, profile, points: list[int]) -> list[float]:
    return [math.log(analytic_ms(profile, m) / tables.prefill_ms(m)) for m in points]


def fit(tables: Tables, points: list[int], gpu: str = "H100") -> list[dict]:
    """Per candidate H20 saturation point, how its twin on `gpu` departs from the kernels' prefill costs."""
    rows = []
    for saturation in CANDIDATES:
        errors = log_errors(tables, analytic_profile(gpu, prefill_saturation=saturation), points)
        rows.append(
            dict(
                h20_prefill_saturation=saturation,
                rms_log_error=math.sqrt(sum(e * e for e in errors) / len(errors)),
                mean_log_error=sum(errors) / len(errors),
                max_log_error=max(errors, key=abs),
            )
        )
    return rows


def report(tables: Tables, source: str, gpu: str = "H100") -> dict:
    points = tables.prefill_points()
    shipped, fits = load_profile(gpu), fit(tables, points, gpu)
    best = min(fits, key=lambda r: r["rms_log_error"])
    twin = analytic_profile(gpu, prefill_saturation=best["h20_prefill_saturation"])
    shown = [m for m in points if m in (1, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192)]
    return dict(
        source=source,
        gpu=gpu,
        prefill=[
            dict(
                tokens=m,
                measured_ms=tables.prefill_ms(m),
                shipped_ms=analytic_ms(shipped, m),
                fitted_ms=analytic_ms(twin, m),
            )
            for m in shown
        ],
        decode=[
            dict(
                sequences=b,
                context=c,
                measured_ms=tables.decode_ms(b, c),
                shipped_ms=decode_ms(shipped, b, b * c) - shipped.decode.overhead_ms,
            )
            for b, c in DECODE_POINTS
            if (b, c) in tables.generation
        ],
        shipped=dict(
            zip(("rms_log_error", "mean_log_error", "max_log_error"), _summary(log_errors(tables, shipped, points)))
        ),
        fits=fits,
        best=best,
        measured_saturation=_saturation(tables, points),
        points=points,
    )


def _summary(errors: list[float]) -> tuple[float, float, float]:
    return math.sqrt(sum(e * e for e in errors) / len(errors)), sum(errors) / len(errors), max(errors, key=abs)


def _saturation(tables: Tables, points: list[int], fraction: float = 0.9) -> tuple[int, int]:
    """The measured row counts between which prefill throughput first reaches `fraction` of its best."""
    best = max(m / tables.prefill_ms(m) for m in points)
    reached = next(i for i, m in enumerate(points) if m / tables.prefill_ms(m) >= fraction * best)
    return points[max(reached - 1, 0)], points[reached]


def render(result: dict) -> str:
    lines = [
        f"LLaVA-1.5-7B's language model on an {result['gpu']} SXM: measured kernels ({result['source']}) against the "
        f"analytic {result['gpu']} profile as shipped and with the best-fitting prefill saturation",
        "",
        "| prompt tokens | measured kernels (ms) | shipped profile | ratio | fitted | ratio |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for row in result["prefill"]:
        m, s, f = row["measured_ms"], row["shipped_ms"], row["fitted_ms"]
        lines.append(f"| {row['tokens']} | {m:.2f} | {s:.2f} | {s / m:.2f}× | {f:.2f} | {f / m:.2f}× |")
    lo, hi = result["measured_saturation"]
    lines += [
        "",
        f"measured prefill reaches 90% of its best throughput between {lo} and {hi} tokens",
        "",
        "| decode: sequences × context | measured kernels (ms) | shipped profile | ratio |",
        "|---|---:|---:|---:|",
    ]
    for row in result["decode"]:
        m, s = row["measured_ms"], row["shipped_ms"]
        lines.append(f"| {row['sequences']} × {row['context']} | {m:.2f} | {s:.2f} | {s / m:.2f}× |")
    lines += ["", "| H20 prefill saturation (tokens) | rms log error | mean | largest |", "|---:|---:|---:|---:|"]
    ship = result["shipped"]
    lines.append(
        f"| shipped (1024, TriInfer) | {ship['rms_log_error']:.3f} | {ship['mean_log_error']:+.3f} | "
        f"{ship['max_log_error']:+.3f} |"
    )
    for row in result["fits"]:
        lines.append(
            f"| {row['h20_prefill_saturation']} | {row['rms_log_error']:.3f} | {row['mean_log_error']:+.3f} | "
            f"{row['max_log_error']:+.3f} |"
        )
    near = [
        r["h20_prefill_saturation"]
        for r in result["fits"]
        if r["rms_log_error"] <= result["best"]["rms_log_error"] + 0.01
    ]
    lines.append(
        f"best fit: --prefill-saturation {result['best']['h20_prefill_saturation']}; within 0.01 of its error: "
        f"{min(near)}–{max(near)}"
    )
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["prefill"]
    tokens = [r["tokens"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for key, label in (
        ("measured_ms", "measured kernels (aiconfigurator, SGLang)"),
        ("shipped_ms", "analytic profile as shipped"),
        ("fitted_ms", f"analytic, H20 saturation {result['best']['h20_prefill_saturation']}"),
    ):
        ax.plot(tokens, [r[key] / r["tokens"] * 1e3 for r in rows], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("prompt tokens in the iteration")
    ax.set_ylabel(f"µs per prompt token (LLaVA-1.5-7B LM, {result['gpu']})")
    ax.set_title("What a prompt chunk costs: measured Hopper kernels vs the profile")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.hopper_kernels", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--tables", type=Path, required=True, help="aiconfigurator's systems/data/h100_sxm (h200_sxm) directory"
    )
    p.add_argument(
        "--gpu", choices=("H100", "H200"), default="H100", help="the analytic profile the tables are set beside"
    )
    p.add_argument("--framework", default="sglang")
    p.add_argument("--version", default="0.5.10")
    p.add_argument("--out", type=Path, help="JSON of the comparison (a PNG of the prefill costs beside it)")
    args = p.parse_args(argv)
    if not args.tables.is_dir():
        p.error(f"{args.tables} is not a directory")
    tables = load_tables(args.tables, args.framework, args.version)
    result = report(tables, f"aiconfigurator {args.tables.name} {args.framework} {args.version}", args.gpu)
    print(render(result))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
        plot(result, args.out.with_suffix(".png"))
        print(f"wrote {args.out} and {args.out.with_suffix('.png')}", file=sys.stderr)


if __name__ == "__main__":
    main()
