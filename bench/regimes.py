"""The toggle against each kind of baseline, cell by cell, from saved goodput reports — and what issue 34's three
goals together ask of each cell against its goodput bound.

Each configuration of a report is sorted by its `--topology` and flags: one role set with every stage is
colocation — *tuned* with a latency profile (stage budgets), *vLLM-style* without; several role sets of which one
both prefills and decodes beside dedicated prefill workers (`EP2+EPD1`, `EPD1+P2`) is the *toggle*; any other split
is *static*. Per kind the best goodput (the interpolated 90% crossing) counts. The goals ask the toggle for
≥ 1.3× the best colocation, ≥ 1.3× the best static split and ≥ 2.4× the best vLLM-style configuration at once:
`need` is the largest of the three, shown as a share of the bound no scheduler exceeds on those instances.

    python -m bench.regimes bench/plots/sim-regimes-n*-seed*.json    # a markdown table on stdout
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
from pathlib import Path

from bench.goodput import crossing
from common.request import Stage
from common.topology import decoders_join, parse_topology

GOALS = {"colocated": 1.3, "static": 1.3, "vLLM-style": 2.4}


@dataclasses.dataclass(frozen=True, slots=True)
class Cell:
    instances: int
    ttft_ms: float
    tbt_ms: float
    workload: str
    source: str  # the report's file name
    best: dict[str, tuple[float, str]]  # kind → (goodput, configuration)
    bound: float
    unbounded: frozenset[str] = frozenset()  # kinds whose best met the goal up to the sweep's top rate (goodput ≥ it)

    def goodput(self, kind: str) -> str:
        return ("≥ " if kind in self.unbounded else "") + f"{self.best[kind][0]:.1f}" if kind in self.best else "—"

    @property
    def need(self) -> tuple[float, str]:
        """The toggle's goodput the three goals ask together (of the kinds the cell ran), and the kind that asks it."""
        return max(
            ((factor * self.best[kind][0], kind) for kind, factor in GOALS.items() if kind in self.best),
            default=(0.0, "none ran"),
        )

    def ratio(self, kind: str) -> str:
        if kind not in self.best:
            return "—"
        return f"{self.best['toggle'][0] / self.best[kind][0]:.2f}×" if self.best[kind][0] else "∞"


def kind_of(args: list[str]) -> str:
    """colocated / vLLM-style / toggle / static, from a configuration's serve arguments."""
    groups = parse_topology(_topology(args))
    if len(groups) == 1 and groups[0].roles == {Stage.ENCODE, Stage.PREFILL, Stage.DECODE}:
        return "colocated" if "--latency-profile" in args else "vLLM-style"
    return "toggle" if decoders_join(groups) else "static"  # decoders that prefill beside dedicated prefill workers


def _topology(args: list[str]) -> str:
    return args[args.index("--topology") + 1]


def cells(path: Path) -> list[Cell]:
    report = json.loads(path.read_text())
    out = []
    for workload in report["workloads"]:
        best: dict[str, tuple[float, str]] = {}
        unbounded: set[str] = set()
        instances, bound = 0, 0.0
        for name, runs in report["configs"].items():
            args = report["serve_args"][name]
            instances = sum(group.count for group in parse_topology(_topology(args)))
            run = runs[workload]
            bound = run["goodput_bound"]
            goodput = crossing(run["points"], report["attainment"])
            kind = kind_of(args)
            if goodput > best.get(kind, (-1.0, ""))[0]:
                best[kind] = (goodput, name)
                top = max(run["points"], key=lambda point: point["request_rate"])
                (unbounded.add if top["slo_attainment"] >= report["attainment"] else unbounded.discard)(kind)
        out.append(
            Cell(
                instances,
                report["slo_ttft_ms"],
                report["slo_tbt_ms"],
                workload,
                path.name,
                best,
                bound,
                frozenset(unbounded),
            )
        )
    return out


def table(all_cells: list[Cell]) -> str:
    head = (
        "| N | TTFT (ms) | TBT (ms) | workload | report | colocated | vLLM-style | static | toggle | bound "
        "| ÷ colocated | ÷ static | ÷ vLLM | the goals need | of the bound | the toggle reaches |"
    )
    lines = [head, "|---:|---:|---:|---|---|" + "---:|" * 11]
    for c in sorted(all_cells, key=lambda c: (-c.instances, c.ttft_ms, -c.tbt_ms, c.workload, c.source)):
        need, kind = c.need
        lines.append(
            f"| {c.instances} | {c.ttft_ms:g} | {c.tbt_ms:g} | {c.workload} | {_seed(c.source)} | "
            + " | ".join(c.goodput(k) for k in ("colocated", "vLLM-style", "static"))
            + f" | {c.goodput('toggle')} `{c.best['toggle'][1]}` | {c.bound:.1f} | "
            + " | ".join(c.ratio(k) for k in ("colocated", "static", "vLLM-style"))
            + f" | {need:.1f} ({kind}) | {need / c.bound:.0%} | {c.best['toggle'][0] / c.bound:.0%} |"
        )
    return "\n".join(lines)


def _seed(name: str) -> str:
    match = re.search(r"seed(\d+)", name) or re.search(r"-s(\d+)\.json$", name)
    return f"seed {match.group(1)}" if match else name


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("reports", nargs="+", type=Path, help="goodput reports (JSON) with a toggle and baselines each")
    args = p.parse_args(argv)
    found = [c for path in args.reports for c in cells(path)]
    missing = sorted({c.source for c in found if "toggle" not in c.best})
    if missing:  # (a sweep still under way writes its report after each configuration)
        print(f"left out, no toggle configuration in: {', '.join(missing)}", file=sys.stderr)
    found = [c for c in found if "toggle" in c.best]
    if not found:
        raise SystemExit("no report with a toggle configuration")
    print(table(found))
    return 0


if __name__ == "__main__":
    sys.exit(main())
