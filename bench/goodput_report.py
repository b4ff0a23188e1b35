"""The goodput report: bounds from the latency model, the plot, the printed table, re-plotting a saved run.

`bench/goodput.py` measures; this turns its JSON into what a reader looks at.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

from bench.workloads import SHAPES


def add_bound(result: dict, profile, instances: int) -> None:
    """The shape's goodput bound on `instances` accelerators of `profile` (`common.latency.goodput_bound`:
    what no scheduler can exceed) and the fraction of it this configuration reached. Every dataset shape has one
    image (`multiimage`: four); the prompt length is the mean the server reported. A conversation's bound is over
    its own requests, each costing only what an earlier request of the window does not share with it (its image
    neither, then)."""
    from common.latency import goodput_bound, request_cost_ms

    done = next((p for p in result["points"] if p["completed"]), None)
    if profile is None or not instances or done is None:
        return
    if "requests" in result:  # a conversation: each request's own lengths, its prefix held by an earlier one free
        costs = [
            request_cost_ms(profile, prompt, images, output, cached_tokens=shared)
            for prompt, shared, output, images in result["requests"]
        ]
        result["goodput_bound"] = instances * 1e3 * len(costs) / sum(costs)
    else:
        prompt = round(done["total_input_tokens"] / done["completed"])
        images = result.get("images_per_request", 1)
        result["goodput_bound"] = goodput_bound(profile, instances, prompt, images, result["output_tokens"])
    result["fraction_of_bound"] = result["goodput"] / result["goodput_bound"]


def instances_of(serve_args: list[str]) -> int:
    """Worker instances of a launched configuration (0 when its topology is not given)."""
    from common.topology import parse_topology

    if "--topology" not in serve_args:
        return 0
    topology = serve_args[serve_args.index("--topology") + 1]
    return 1 if topology == "local" else sum(g.count for g in parse_topology(topology))


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = report["workloads"]
    fig, axes = plt.subplots(1, len(workloads), figsize=(5.5 * len(workloads), 4.2), squeeze=False)
    for ax, workload in zip(axes[0], workloads):
        for name, runs in report["configs"].items():
            run = runs.get(workload)
            if not run:
                continue
            rates = [p["request_rate"] for p in run["points"]]
            ax.plot(
                rates,
                [100 * p["slo_attainment"] for p in run["points"]],
                marker="o",
                label=f"{name} (goodput {_goodput_text(run)})",
            )
        ax.axhline(100 * report["attainment"], color="grey", linestyle="--", linewidth=1)
        bounds = {
            run[workload]["goodput_bound"]
            for run in report["configs"].values()
            if run.get(workload, {}).get("goodput_bound")
        }
        for bound in sorted(bounds):
            ax.axvline(bound, color="black", linestyle=":", linewidth=1)
            ax.annotate(f"bound {bound:.0f}", (bound, 4), rotation=90, fontsize=7, ha="right")
        ax.set_title(textwrap.fill(f"{workload}: {_shape_text(report, workload)}", 52), fontsize=9)
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel("SLO attainment (%)")
        ax.set_ylim(0, 102)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(
        textwrap.fill(
            f"{report['backend']} — SLO TTFT {report['slo_ttft_ms']:g} ms, P90 TBT "
            f"{report['slo_tbt_ms']:g} ms, {report['arrival']} arrivals",
            60 * len(workloads),
        ),
        fontsize=10,
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _shape_text(report: dict, workload: str) -> str:
    run = next((runs[workload] for runs in report["configs"].values() if workload in runs), {})
    if "trace_scale" in run:
        return (
            f"trace lengths ÷{run['trace_scale']}, {run['mean_prompt_tokens']:.0f} prompt / "
            f"{run['output_tokens']:.0f} output tokens (means), {run['ideal_shared_fraction']:.0%} shared"
        )
    if "phases" in run:
        return f"phases {' > '.join(run['phases'])}, {run['output_tokens']:.0f} output tokens (mean)"
    return f"{run.get('output_tokens', SHAPES[workload].output_tokens if workload in SHAPES else '?')} output tokens"


def replot(args) -> int:
    from common.latency.roofline import load_profile

    out = Path(args.replot)
    report = json.loads(out.read_text())
    hardware = load_profile(report.get("profile", args.profile)) if report["backend"].startswith("emulated") else None
    for name, per in report["configs"].items():
        for result in per.values():
            add_bound(result, hardware, instances_of(report["serve_args"].get(name, [])))
    out.write_text(json.dumps(report, indent=2) + "\n")
    finish(report, out, args)
    return 0


def finish(report: dict, out: Path, args) -> None:
    """Plot the report and print its goodput table, the bounds and the ratios to the first configuration."""
    png = Path(args.plot) if args.plot else out.with_suffix(".png")
    plot(report, png)
    workloads = report["workloads"]
    print(
        f"\ngoodput (highest rate with ≥ {report['attainment']:.0%} of requests within "
        f"TTFT {report['slo_ttft_ms']:g} ms and P90 TBT {report['slo_tbt_ms']:g} ms), backend {report['backend']}:"
    )
    names = list(report["configs"])
    width = max(14, *(len(n) for n in names))

    def cell(result: dict) -> str:
        bound, text = result.get("goodput_bound"), _goodput_text(result)
        return text if text.startswith("<") or not bound else f"{text} ({result['goodput'] / bound:.0%})"

    print(f"{'config':>{width}} " + " ".join(f"{w:>14}" for w in workloads))
    for name in names:
        print(f"{name:>{width}} " + " ".join(f"{cell(report['configs'][name][w]):>14}" for w in workloads))
    bounds = {tuple(report["configs"][n][w].get("goodput_bound") for w in workloads) for n in names}
    for row in sorted(bounds, key=str):
        if any(row):
            who = (
                ""
                if len(bounds) == 1
                else " ("
                + ", ".join(
                    n for n in names if tuple(report["configs"][n][w].get("goodput_bound") for w in workloads) == row
                )
                + ")"
            )
            print(
                f"{'bound':>{width}} "
                + " ".join(f"{b:>14.1f}" if b else f"{'-':>14}" for b in row)
                + f"  req/s no scheduler exceeds on these instances{who}; (%) = share of it reached"
            )
    over = [
        (n, w, r["goodput"])
        for n in names
        for w in workloads
        if (r := report["configs"][n][w]).get("goodput_bound") and r["goodput"] > r["goodput_bound"]
    ]
    if over:
        window = report["num_prompts"] / max(rate for _, _, rate in over)
        print(
            f"note: {', '.join(f'{n} on {w}' for n, w, _ in over)} came out above the bound: at that rate the "
            f"{report['num_prompts']} requests of a point arrive within ~{window:.1f} s, a burst the queues absorb "
            "within the TTFT target; raise --num-prompts to measure a rate the mesh sustains"
        )
    if len(names) > 1:
        base = names[0]
        for w in workloads:
            ref = report["configs"][base][w]["goodput"]
            ratios = ", ".join(f"{n} {_ratio(report['configs'][n][w], ref)}" for n in names[1:])
            print(f"{w}: vs {base}: {ratios}")
    print(f"wrote {out} and {png}")


def _goodput_text(result: dict) -> str:
    """A goodput, or `< R` where the sweep failed at its lowest rate R (not a measured 0)."""
    rates = [p["request_rate"] for p in result["points"]]
    return f"< {min(rates):g}" if not result["goodput"] and rates else f"{result['goodput']:g}"


def _ratio(result: dict, ref: float) -> str:
    """result's goodput over ref; one that failed at its lowest rate is below that rate's ratio."""
    rates = [p["request_rate"] for p in result["points"]]
    if not ref:
        return "-"
    if not result["goodput"] and rates:
        return f"< {min(rates) / ref:.2f}×"
    return f"{result['goodput'] / ref:.2f}×"
