"""Goodput over several launches of one `epdmesh bench goodput` sweep (or `epdmesh sim goodput`): per configuration
and workload, each launch's goodput as the interpolated 90% crossing, their mean and spread (min–max), and the ratio
of a configuration to the others, taken launch by launch (each launch is one seed, its configurations side by side).

    python -m bench.launches bench/results/emu-conversation-s1.json bench/results/emu-conversation-s2.json \\
        --versus 'EP7+EPD1 toggle'

A launch given as `A.json,B.json` is one launch swept in two runs (the same seed, more rates): each configuration's
points are pooled. Prints a Markdown table; `--out` writes the same as JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from bench.goodput import crossing


def crossings(report: dict) -> dict[tuple[str, str], tuple[float, str]]:
    """(configuration, workload) → its interpolated goodput in one report and what it is: `=` a crossing between two
    swept rates, `<` below the lowest rate swept (the value is that rate), `≥` at or above the highest (ditto)."""
    target = report.get("attainment", 0.9)
    return {
        (name, workload): bounded_crossing(run["points"], target)
        for name, workloads in report["configs"].items()
        for workload, run in workloads.items()
    }


def bounded_crossing(points: list[dict], target: float = 0.9) -> tuple[float, str]:
    """One sweep's goodput and what it is: `=` interpolated between two swept rates, `<` below the lowest rate swept
    (the value is that rate), `≥` at or above the highest (ditto)."""
    rates = sorted((p["request_rate"], p["slo_attainment"]) for p in points)
    if rates and rates[0][1] < target:
        return rates[0][0], "<"
    if rates and rates[-1][1] >= target:
        return rates[-1][0], "≥"
    return crossing(points, target), "="


def shown(value: float, kind: str, digits: int = 1) -> str:
    return f"{value:.{digits}f}" if kind == "=" else f"{kind} {value:.{digits}f}"


def combine(reports: list[dict], versus: str | None = None) -> list[dict]:
    """One row per (configuration, workload) run in every report: each launch's goodput (`kinds`: `=` crossed
    between two rates swept, `<` / `≥` a bound outside the grid), and where every launch crossed, the mean, min and
    max; with `versus`, the ratio `versus` ÷ this configuration in each launch (a bound where either is one)."""
    per_launch = [crossings(r) for r in reports]
    keys = [k for k in per_launch[0] if all(k in c for c in per_launch)]
    rows = []
    for name, workload in keys:
        values, kinds = zip(*(c[(name, workload)] for c in per_launch))
        row = {"config": name, "workload": workload, "goodput": list(values), "kinds": list(kinds)}
        if all(k == "=" for k in kinds):
            row |= {"mean": statistics.fmean(values), "min": min(values), "max": max(values)}
        if versus and name != versus and all((versus, workload) in c for c in per_launch):
            row["ratio"] = [ratio(c[(versus, workload)], (v, k)) for c, v, k in zip(per_launch, values, kinds)]
        rows.append(row)
    return rows


def ratio(num: tuple[float, str], den: tuple[float, str]) -> tuple[float, str]:
    """num ÷ den, and whether it is exact (`=`), a lower bound (`>`) or an upper one (`<`), or unknown (`?`)."""
    (a, ka), (b, kb) = num, den
    lower = ka in "=≥" and kb in "=<"  # num at least a, den at most b
    upper = ka in "=<" and kb in "=≥"
    kind = "=" if ka == kb == "=" else ">" if lower else "<" if upper else "?"
    return (a / b if b else float("inf"), kind)


def pooled(reports: list[dict]) -> dict:
    """Several runs of one launch (the same seed) as one report: each (configuration, workload)'s points together."""
    out = {**reports[0], "configs": {}}
    for report in reports:
        for name, workloads in report["configs"].items():
            for workload, run in workloads.items():
                mine = out["configs"].setdefault(name, {}).setdefault(workload, {**run, "points": []})
                mine["points"] = mine["points"] + run["points"]
    return out


def markdown(rows: list[dict], versus: str | None = None) -> str:
    head = "| workload | configuration | goodput per launch (req/s) | mean | spread |"
    rule = "|---|---|---|---:|---:|"
    if versus:
        head += f" `{versus}` ÷ it, per launch |"
        rule += "---|"
    lines = [head, rule]
    for r in rows:
        goodputs = " / ".join(shown(v, k) for v, k in zip(r["goodput"], r["kinds"]))
        line = f"| {r['workload']} | `{r['config']}` | {goodputs} | "
        line += f"{r['mean']:.1f} | {r['min']:.1f}–{r['max']:.1f} |" if "mean" in r else "— | — |"
        if versus:
            ratios = " / ".join(f"{'' if k == '=' else k + ' '}{x:.2f}×" for x, k in r.get("ratio", []))
            line += f" {ratios or '—'} |"
        lines.append(line)
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.launches", description=__doc__.split("\n\n")[0])
    p.add_argument("reports", nargs="+", help="goodput JSON files, one per launch (A.json,B.json: pooled)")
    p.add_argument("--versus", help="the configuration whose ratio to each of the others is shown")
    p.add_argument("--out", type=Path, help="also write the rows as JSON")
    args = p.parse_args(argv)
    reports = [pooled([json.loads(Path(f).read_text()) for f in str(arg).split(",")]) for arg in args.reports]
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
