"""Goodput over several launches of one `epdmesh bench goodput` sweep (or `epdmesh sim goodput`): per configuration
and workload, each launch's goodput as the interpolated 90% crossing, their mean and spread (min–max), and the ratio
of a configuration to the others, taken launch by launch (each launch is one seed, its configurations side by side).

    python -m bench.launches bench/results/emu-conversation-s1.json bench/results/emu-conversation-s2.json \\
        --versus 'EP7+EPD1 toggle'

Prints a Markdown table; `--out` writes the same as JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from bench.goodput import crossing


def crossings(report: dict) -> dict[tuple[str, str], float]:
    """(configuration, workload) → its interpolated goodput in one report."""
    target = report.get("attainment", 0.9)
    return {
        (name, workload): crossing(run["points"], target)
        for name, workloads in report["configs"].items()
        for workload, run in workloads.items()
    }


def combine(reports: list[dict], versus: str | None = None) -> list[dict]:
    """One row per (configuration, workload) run in every report: each launch's goodput, mean, min, max, and with
    `versus` the ratio `versus` ÷ this configuration in each launch (its mean and spread)."""
    per_launch = [crossings(r) for r in reports]
    keys = [k for k in per_launch[0] if all(k in c for c in per_launch)]
    rows = []
    for name, workload in keys:
        values = [c[(name, workload)] for c in per_launch]
        row = {"config": name, "workload": workload, "goodput": values, "mean": statistics.fmean(values)}
        row |= {"min": min(values), "max": max(values)}
        if versus and name != versus and all((versus, workload) in c for c in per_launch):
            ratios = [c[(versus, workload)] / v if v else float("inf") for c, v in zip(per_launch, values)]
            row |= {"ratio": ratios, "ratio_mean": statistics.fmean(ratios)}
        rows.append(row)
    return rows


def markdown(rows: list[dict], versus: str | None = None) -> str:
    head = "| workload | configuration | goodput per launch (req/s) | mean | spread |"
    rule = "|---|---|---|---:|---:|"
    if versus:
        head += f" `{versus}` ÷ it, per launch |"
        rule += "---|"
    lines = [head, rule]
    for r in rows:
        line = (
            f"| {r['workload']} | `{r['config']}` | {' / '.join(f'{v:.1f}' for v in r['goodput'])} | "
            f"{r['mean']:.1f} | {r['min']:.1f}–{r['max']:.1f} |"
        )
        if versus:
            line += " " + (" / ".join(f"{x:.2f}×" for x in r["ratio"]) if "ratio" in r else "—") + " |"
        lines.append(line)
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.launches", description=__doc__.split("\n\n")[0])
    p.add_argument("reports", nargs="+", type=Path, help="goodput JSON files, one per launch")
    p.add_argument("--versus", help="the configuration whose ratio to each of the others is shown")
    p.add_argument("--out", type=Path, help="also write the rows as JSON")
    args = p.parse_args(argv)
    reports = [json.loads(path.read_text()) for path in args.reports]
    if args.versus and not any(args.versus == name for r in reports for name in r["configs"]):
        p.error(f"--versus {args.versus!r}: no such configuration in the reports")
    rows = combine(reports, args.versus)
    if not rows:
        p.error("no configuration and workload is in every report")
    print(markdown(rows, args.versus))
    if args.out:
        args.out.write_text(json.dumps({"launches": [str(p) for p in args.reports], "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
