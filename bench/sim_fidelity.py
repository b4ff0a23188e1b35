"""How closely the simulator predicts the emulated mesh: the same goodput sweep (configurations, workloads, rates,
requests, seeds) run by `epdmesh bench goodput --backend emulated` on real processes and by `epdmesh sim goodput` on
simulated time, compared point by point.

    python -m bench.sim_fidelity --time-scale 10 --workload textcaps,conversation --rates 5,10,15,20 \\
        --config 'EPD4=--topology EPD4 --latency-profile {profile} --routing slo --budget-headroom 0.8' \\
        --config 'E1+P1+D2=--topology E1+P1+D2' --out bench/results/fidelity.json

Every argument is the goodput benchmark's (the simulator ignores --time-scale: its time is the hardware's). Writes
both reports beside `--out` (`-emulated.json`, `-simulated.json`) and the comparison: per configuration and
workload, the goodput of each (the 90% crossing, interpolated between the swept rates) and their ratio, and per rate
the attainment of each and the difference in points; then a table, with the largest gaps first.

`--emulated-report PATH` compares with an emulated report written before (the `-emulated.json` of an earlier run of
the same command) and runs the simulator alone: seconds, where the mesh's sweeps take half an hour.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

if not __package__:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import goodput  # noqa: E402


def compare(emulated: dict, simulated: dict) -> list[dict]:
    rows = []
    target = emulated["attainment"]
    for name, by_workload in emulated["configs"].items():
        for workload, real in by_workload.items():
            sim = simulated["configs"][name][workload]
            sim_at = {p["request_rate"]: p for p in sim["points"]}
            per_rate = [
                {
                    "rate": p["request_rate"],
                    "emulated": p["slo_attainment"],
                    "simulated": sim_at[p["request_rate"]]["slo_attainment"],
                    "points": 100 * (sim_at[p["request_rate"]]["slo_attainment"] - p["slo_attainment"]),
                }
                for p in real["points"]
                if p["request_rate"] in sim_at
            ]
            real_x, sim_x = goodput.crossing(real["points"], target), goodput.crossing(sim["points"], target)
            rows.append(
                {
                    "config": name,
                    "workload": workload,
                    "emulated_goodput": real_x,
                    "simulated_goodput": sim_x,
                    "ratio": sim_x / real_x if real_x else None,
                    "max_points": max((abs(r["points"]) for r in per_rate), default=0.0),
                    "per_rate": per_rate,
                }
            )
    return rows


def main(argv=None) -> int:
    from sim import goodput as sim_goodput

    argv = list(sys.argv[1:] if argv is None else argv)
    own = argparse.ArgumentParser(add_help=False)
    own.add_argument("--emulated-report", type=Path)
    known, argv = own.parse_known_args(argv)
    args = goodput.parse_args(
        argv + ["--backend", "emulated"], prog="python -m bench.sim_fidelity", description=__doc__
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    paths = {kind: out.with_name(f"{out.stem}-{kind}.json") for kind in ("emulated", "simulated")}
    if known.emulated_report is not None:
        if not known.emulated_report.is_file():
            print(f"python -m bench.sim_fidelity: no report at {known.emulated_report}", file=sys.stderr)
            return 2
        paths["emulated"] = known.emulated_report
    status = sim_goodput.main(argv + ["--out", str(paths["simulated"])])
    if known.emulated_report is None:
        status = status or goodput.main(argv + ["--backend", "emulated", "--out", str(paths["emulated"])])
    if status:
        return status
    emulated, simulated = (json.loads(paths[k].read_text()) for k in ("emulated", "simulated"))
    rows = compare(emulated, simulated)
    out.write_text(
        json.dumps({"emulated": str(paths["emulated"]), "simulated": str(paths["simulated"]), "rows": rows}, indent=2)
        + "\n"
    )
    print(f"\n{'config':>14} {'workload':>14} {'emulated':>9} {'simulated':>9} {'ratio':>6} {'max gap (points)':>17}")
    for r in sorted(rows, key=lambda r: -r["max_points"]):
        ratio = f"{r['ratio']:.2f}" if r["ratio"] is not None else "-"
        print(
            f"{r['config']:>14} {r['workload']:>14} {r['emulated_goodput']:>9.1f} {r['simulated_goodput']:>9.1f} "
            f"{ratio:>6} {r['max_points']:>17.1f}"
        )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
