"""epdmesh against vLLM on this machine: one checkpoint, one load generator, one server at a time, one launch.

    python -m bench.peer [--vllm-venv ../peer-work/vllm-venv] [--topology local,EPD1] [--rates 3,4,5,6,7,8]
    make bench-peer ARGS="..."

1. Writes `make-tiny-model --preset small` (62M-class llava-1.5 shape, 576 image tokens) in the layout vLLM loads
   (llava-hf tensor names; `architectures` in config.json; a `PreTrainedTokenizerFast` tokenizer; a chat template
   taking `image_url` parts).
2. For each server in turn — vLLM's CPU build (`vllm serve`, bf16, as `../shared/peer/serve_vllm.sh` runs it) and
   `epdmesh serve --topology T` with serve's defaults (bf16 where the CPU computes it, compiled, its own latency
   profile) plus the SLOs and vLLM's context (`--max-model-len 2048`: a workload clipped to a server's context is
   the same on both) — starts it on a loopback port, then:
   - a low-load probe: --probe-requests single streamed chats, one after the other (TTFT and TPOT medians);
   - `epdmesh bench goodput --url …` on --workload (default the `textcaps` shape: one fresh JPEG a request, 32
     output tokens, EOS ignored; `conversation`: the Mooncake trace's lengths ÷ --trace-scale and its shared
     prefixes; `detail`: 384-token answers), Poisson arrivals, over --rates; goodput = the highest rate with ≥ 90%
     SLO attainment, and the rate where attainment crosses 90%, interpolated — or, where --rates did not bracket
     it, the bound the sweep gives (`< 1.50`: below the lowest rate; `≥ 6.00`: at or past the highest);
   and stops it.
3. Writes JSON (every point of both) and a PNG (attainment vs rate), and prints the ratios (a bound where a
   crossing is one).

vLLM is not a dependency of epdmesh: install it beside the repo with `../shared/peer/setup_vllm_cpu.sh`.
This is a benchmark, not a test; CI never runs it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

if not __package__:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx  # noqa: E402

from bench.launches import bounded_crossing, ratio, shown  # noqa: E402
from bench.workloads import SHAPES, request_bodies  # noqa: E402
from common.ports import free_port  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
MAX_MODEL_LEN = 2048  # both servers' context, as ../shared/peer/serve_vllm.sh serves vLLM


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vllm-venv", default=str(ROOT.parent / "peer-work" / "vllm-venv"))
    p.add_argument(
        "--topology",
        default="local",
        help="epdmesh's topology (a comma list runs each in turn; an entry may carry its own serve options, "
        "'local,local --no-gap-slack'); default: the one to run on a CPU host",
    )
    p.add_argument("--servers", default="vllm,epdmesh", help="which to run, in this order")
    p.add_argument("--rates", default="3,4,5,6,7,8")
    p.add_argument(
        "--workload",
        default="textcaps",
        help="what `epdmesh bench goodput` sends: a dataset shape (textcaps, detail, …), conversation[/N], or "
        "trace:PATH (a recorded trace, at its own arrivals: the others arrive as a Poisson process)",
    )
    p.add_argument("--trace-scale", type=int, default=16, help="conversation: the trace's lengths ÷ this")
    p.add_argument("--num-prompts", type=int, default=80, help="requests per rate")
    p.add_argument("--probe-requests", type=int, default=10)
    p.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    p.add_argument("--slo-tbt-ms", type=float, default=100.0)
    p.add_argument("--epdmesh-args", default="", help="more `epdmesh serve` options (none: serve's defaults)")
    p.add_argument(
        "--vllm-args",
        default="",
        help="more `vllm serve` options, e.g. --max-num-batched-tokens 640 (none: vLLM's defaults)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench/results/peer.json")
    return p.parse_args(argv)


def peer_checkpoint() -> Path:
    """The `small` preset written once, then adapted to what vLLM 0.32 loads (the tensors are already hub-named)."""
    from epdmesh.checkpoints import make_model

    home = Path(os.environ.get("EPDMESH_HOME", Path.home() / ".cache" / "epdmesh"))
    path = home / "bench-models" / "small-llava-hf"
    if (path / "model.safetensors").is_file():
        return path
    tmp = path.with_name(path.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    make_model(tmp, "small")
    config = json.loads((tmp / "tokenizer_config.json").read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"  # vLLM's transformers does not know TokenizersBackend
    (tmp / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    model_config = json.loads((tmp / "config.json").read_text())  # without it vLLM takes the model for a pooling one
    model_config["architectures"] = ["LlavaForConditionalGeneration"]
    (tmp / "config.json").write_text(json.dumps(model_config, indent=2) + "\n")
    template = tmp / "chat_template.jinja"  # vLLM hands OpenAI parts through: an image arrives as image_url
    template.write_text(
        template.read_text().replace("part['type'] == 'image'", "part['type'] in ['image', 'image_url']")
    )
    tmp.rename(path)
    return path


def wait_ready(url: str, proc: subprocess.Popen, timeout: float, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited ({proc.returncode}) before it was ready; see {log}")
        try:
            if httpx.get(f"{url}/v1/models", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError(f"the server was not ready in {timeout:.0f} s; see {log}")


def start_vllm(args, model: Path, port: int, work: Path) -> tuple[subprocess.Popen, Path]:
    venv = Path(args.vllm_venv)
    if not (venv / "bin" / "vllm").is_file():
        raise SystemExit(f"no vLLM at {venv}: run ../shared/peer/setup_vllm_cpu.sh in {venv.parent} (or --vllm-venv)")
    cache = work / "vllm-cache"
    env = dict(
        os.environ,
        VLLM_CACHE_ROOT=str(cache / "vllm"),
        TORCHINDUCTOR_CACHE_DIR=str(cache / "inductor"),
        VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "4"),
    )
    log = work / "vllm.log"
    argv = [
        str(venv / "bin" / "vllm"),
        "serve",
        str(model),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "bfloat16",
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--seed",
        str(args.seed),
        *args.vllm_args.split(),
    ]
    return subprocess.Popen(argv, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True), log


def start_epdmesh(args, entry: str, model: Path, port: int, work: Path) -> tuple[subprocess.Popen, Path]:
    """`entry`: a topology, then that run's own serve options (after --epdmesh-args)."""
    topology, *own = entry.split()
    log = work / f"epdmesh-{'_'.join(entry.split()).replace('/', '_')}.log"
    argv = [
        sys.executable,
        "-m",
        "epdmesh.cli",
        "serve",
        "--topology",
        topology,
        "--model",
        str(model),
        "--port",
        str(port),
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--slo-ttft-ms",
        str(args.slo_ttft_ms),
        "--slo-tbt-ms",
        str(args.slo_tbt_ms),
        *args.epdmesh_args.split(),
        *own,
    ]
    env = {k: v for k, v in os.environ.items() if k not in ("EPDMESH_ENFORCE_EAGER", "EPDMESH_AUTO_PROFILE")}
    return subprocess.Popen(argv, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True), log


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def probe(url: str, model_name: str, n: int, seed: int) -> dict:
    """n single streamed chats, one at a time: medians of TTFT and of the mean gap between tokens (TPOT)."""
    bodies = request_bodies(SHAPES["textcaps"], n + 1, model_name, seed=seed + 7919)
    ttfts, tpots = [], []
    with httpx.Client(timeout=60) as client:
        for i, body in enumerate(bodies):
            start = time.perf_counter()
            times = []
            with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
                if r.status_code != 200:
                    raise RuntimeError(f"{url}: {r.status_code} {r.read().decode()[:500]}")
                for line in r.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        chunk = json.loads(line[6:])
                        if chunk.get("choices") and (
                            chunk["choices"][0].get("token_ids") or chunk["choices"][0]["delta"].get("content")
                        ):
                            times.append(time.perf_counter())
            if i and len(times) >= 2:  # the first request warms the server
                ttfts.append((times[0] - start) * 1e3)
                tpots.append((times[-1] - times[0]) / (len(times) - 1) * 1e3)
    return dict(requests=len(ttfts), ttft_p50_ms=statistics.median(ttfts), tpot_p50_ms=statistics.median(tpots))


def goodput(args, url: str, work: Path, name: str) -> dict:
    out = work / f"goodput-{name}.json"
    argv = [
        sys.executable,
        "-m",
        "bench.goodput",
        "--url",
        url,
        "--workload",
        args.workload,
        "--trace-scale",
        str(args.trace_scale),
        "--arrival",
        "mooncake" if args.workload.startswith("trace:") else "poisson",  # mooncake: a trace file's own arrivals
        "--rates",
        args.rates,
        "--num-prompts",
        str(args.num_prompts),
        "--slo-ttft-ms",
        str(args.slo_ttft_ms),
        "--slo-tbt-ms",
        str(args.slo_tbt_ms),
        "--seed",
        str(args.seed),
        "--out",
        str(out),
    ]
    subprocess.run(argv, check=True, cwd=ROOT)
    report = json.loads(out.read_text())
    (result,) = [w for c in report["configs"].values() for w in c.values()]
    value, kind = bounded_crossing(result["points"])
    # crossing: the 90% crossing, or the swept rate it lies beyond (`crossing_kind` `<`: below the lowest; `≥`: at
    # or above the highest)
    return dict(goodput=result["goodput"], crossing=value, crossing_kind=kind, points=result["points"])


def run_server(args, name: str, start, work: Path) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    began = time.monotonic()
    proc, log = start(port)
    try:
        wait_ready(url, proc, 900, log)
        ready_s = time.monotonic() - began
        model_name = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
        print(f"{name}: ready in {ready_s:.0f} s; low-load probe", file=sys.stderr)
        low = probe(url, model_name, args.probe_requests, args.seed)
        print(f"{name}: {low}; goodput sweep", file=sys.stderr)
        return dict(name=name, ready_s=ready_s, low_load=low, **goodput(args, url, work, name))
    finally:
        stop(proc)


def workload_label(args) -> str:
    if args.workload == "textcaps":
        return "textcaps (1 image, 32 output tokens, EOS ignored)"
    if args.workload == "conversation":
        return f"conversation (the trace's lengths ÷ {args.trace_scale}, shared prefixes, 1 image)"
    return args.workload


def plot(results: list[dict], path: Path, args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4))
    for r in results:
        pts = sorted(r["points"], key=lambda p: p["request_rate"])
        ax.plot(
            [p["request_rate"] for p in pts],
            [100 * p["slo_attainment"] for p in pts],
            marker="o",
            label=f"{r['name']} (90% at {shown(r['crossing'], r.get('crossing_kind', '='), 2)} req/s)",
        )
    ax.axhline(90, color="grey", linestyle="--", linewidth=1)
    ax.set_xlabel("request rate (req/s, Poisson)")
    ax.set_ylabel("SLO attainment (%)")
    slos = f"TTFT ≤ {args.slo_ttft_ms:g} ms, P90 TBT ≤ {args.slo_tbt_ms:g} ms"
    ax.set_title(f"{textwrap.fill(workload_label(args), 80)}\nbf16 CPU, {slos}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def summary(results: list[dict]) -> str:
    """The table printed at the end: each server's low-load latencies and its 90% crossing — a bound where the sweep
    did not bracket it (`< 1.50`: below the lowest rate swept) — and each epdmesh server's ratios to vLLM's, the
    goodput's a bound (`≥`, `≤`) or unknown (`?`) where either crossing is."""
    width = max([len("server"), *(len(r["name"]) for r in results)])
    lines = [f"{'server':<{width}} {'TTFT p50':>9} {'TPOT p50':>9} {'goodput':>8} {'90% at':>8}"]
    for r in results:
        low = r["low_load"]
        at = shown(r["crossing"], r.get("crossing_kind", "="), 2)
        met = f"{r['goodput']:g}" if r["goodput"] else "none"  # the highest rate swept that met 90%
        lines.append(f"{r['name']:<{width}} {low['ttft_p50_ms']:>7.0f}ms {low['tpot_p50_ms']:>7.1f}ms {met:>8} {at:>8}")
    base = next((r for r in results if r["name"] == "vLLM"), None)
    for r in results:
        if base is None or r is base:
            continue
        x, kind = ratio(
            (r["crossing"], r.get("crossing_kind", "=")), (base["crossing"], base.get("crossing_kind", "="))
        )
        goodput = {"=": f"{x:.2f}x", ">": f"≥ {x:.2f}x", "<": f"≤ {x:.2f}x"}.get(kind, "? (neither crossing bracketed)")
        lines.append(
            f"{r['name']} / vLLM: goodput {goodput} (interpolated), "
            f"TTFT {r['low_load']['ttft_p50_ms'] / base['low_load']['ttft_p50_ms']:.2f}x, "
            f"TPOT {r['low_load']['tpot_p50_ms'] / base['low_load']['tpot_p50_ms']:.2f}x"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("UCX_NET_DEVICES", "lo")  # the launcher's own default; set here for the child processes
    model = peer_checkpoint()
    work = Path(tempfile.mkdtemp(prefix="epdmesh-peer-"))
    results = []
    for server in args.servers.split(","):
        if server == "vllm":
            results.append(run_server(args, "vLLM", lambda port: start_vllm(args, model, port, work), work))
        elif server == "epdmesh":
            for topology in (t.strip() for t in args.topology.split(",")):
                results.append(
                    run_server(
                        args,
                        f"epdmesh {topology}",
                        lambda port, t=topology: start_epdmesh(args, t, model, port, work),
                        work,
                    )
                )
        else:
            raise SystemExit(f"unknown server {server!r}: vllm or epdmesh")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = dict(
        checkpoint=str(model),
        workload=f"{workload_label(args)}, Poisson",
        slo_ttft_ms=args.slo_ttft_ms,
        slo_tbt_ms=args.slo_tbt_ms,
        num_prompts=args.num_prompts,
        backend="real engines (torch CPU, bf16)",
        logs=str(work),
    )
    out.write_text(json.dumps(dict(meta, results=results), indent=2) + "\n")
    plot(results, out.with_suffix(".png"), args)
    print(summary(results))
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
