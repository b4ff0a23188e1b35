"""KV blocks on demand (and preemption) vs booking every request's worst case, on the same engine and workload.

    python -m bench.kv_admission [--preset tiny] [--requests 64] [--kv-blocks 600,300,160] [--repeats 3]

Backend: real engine (torch, this machine's CPU unless --device), one process, no HTTP. The workload is what a
server sees when clients leave `max_tokens` high (or out: it is then the rest of the context): --requests text
prompts of --prompt-lens tokens (random ids, seeded), each allowed --max-tokens, sampled (temperature 1, seeded per
request) with a logit bias of --eos-bias on EOS, so answers end at EOS after a long-tailed number of tokens (mean
~160 with the defaults on the tiny checkpoint; the report gives the lengths seen). All are submitted at once to an
engine whose KV cache holds --kv-blocks blocks of 16 tokens (one row per size; the defaults hold 7, 3 and 2
requests' worst case — prompt + max_tokens — and 30, 15 and 8 of what they use on average).

  worst-case  admission books prompt + max_tokens (TGI's way, and ours before on-demand): nothing is preempted
  on-demand   admission takes the prompt's blocks and a request grows as it decodes; when the cache runs out the
              newest running request is preempted and later recomputes its prompt + output (vLLM's way)

Both runs produce the same tokens (seeded sampling does not depend on the batch; the bench fails otherwise), so the
difference is scheduling alone: output tok/s, requests/s, the mean number of requests decoding per iteration, and
preemptions. Medians of --repeats runs, the two modes interleaved, ratios on-demand / worst-case.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

if not __package__:  # run as `python bench/kv_admission.py`: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

from bench.engine import resolve_model  # noqa: E402
from common.engine.config import EngineConfig  # noqa: E402
from common.engine.engine import Engine  # noqa: E402
from common.model.loader import load_model  # noqa: E402
from common.paged_cache import PagedKVCache  # noqa: E402
from common.request import Request  # noqa: E402
from common.sampling import SamplingParams  # noqa: E402
from common.scheduler import KV_ADMISSION, SchedulerConfig  # noqa: E402

BLOCK = 16


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="llava-1.5 checkpoint dir (default: generate --preset's checkpoint, cached)")
    p.add_argument("--preset", default="tiny")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--prompt-lens", default="16,256", help="MIN,MAX prompt tokens (uniform draw)")
    p.add_argument("--max-tokens", type=int, default=1024, help="what every request allows")
    p.add_argument("--eos-bias", type=float, default=11.0, help="logit bias on EOS: how soon answers end")
    p.add_argument("--kv-blocks", default="600,300,160", help="KV cache sizes in blocks of 16 tokens, comma-separated")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--token-budget", type=int, default=SchedulerConfig().token_budget)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench/results/kv_admission.json")
    args = p.parse_args(argv)
    args.prompt_lens = tuple(int(x) for x in args.prompt_lens.split(","))
    args.kv_blocks = [int(x) for x in args.kv_blocks.split(",") if x.strip()]
    if len(args.prompt_lens) != 2 or not 2 <= args.prompt_lens[0] <= args.prompt_lens[1]:
        p.error("--prompt-lens is MIN,MAX with 2 <= MIN <= MAX")
    worst = args.prompt_lens[1] + args.max_tokens
    if min(args.kv_blocks, default=0) * BLOCK < worst or args.requests < 1 or args.repeats < 1:
        p.error(
            f"need --kv-blocks of at least {-(-worst // BLOCK)} (one request's worst case), --requests and "
            "--repeats >= 1"
        )
    return args


def workload(args: argparse.Namespace, eos: int) -> list[Request]:
    rng = random.Random(args.seed)
    requests = []
    for i in range(args.requests):
        prompt = [1] + [rng.randrange(5, 2000) for _ in range(rng.randint(*args.prompt_lens) - 1)]
        sampling = SamplingParams(
            max_tokens=args.max_tokens, temperature=1.0, seed=args.seed * 10_000 + i, logit_bias=((eos, args.eos_bias),)
        )
        requests.append(Request(f"r{i}", prompt, sampling))
    return requests


def make_engine(model_dir: Path, model, args: argparse.Namespace, kv_blocks: int, admission: str) -> Engine:
    text = model.cfg.text
    per_block = PagedKVCache.bytes_per_block(
        BLOCK, text.num_layers, text.num_kv_heads, text.head_dim, getattr(torch, args.dtype)
    )
    config = EngineConfig(
        model=str(model_dir),
        dtype=args.dtype,
        device=args.device,
        block_size=BLOCK,
        kv_cache_gib=kv_blocks * per_block / 2**30,
        image_cache_gib=1 / 1024,
        scheduler=SchedulerConfig(
            token_budget=args.token_budget, max_num_seqs=args.max_num_seqs, kv_admission=admission
        ),
    )
    return Engine(config, model=model)


def run(engine: Engine, requests: list[Request]) -> dict:
    """Every request to its end; what it took."""
    for request in requests:
        engine.add_request(request)
    outputs, batches = {}, []
    start = time.perf_counter()
    while engine.has_unfinished:
        batches.append(len(engine.scheduler.running))
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.output_token_ids
    elapsed = time.perf_counter() - start
    stats = engine.stats()
    assert len(outputs) == len(requests) and stats.kv_blocks_free == stats.kv_blocks_total, "blocks leaked"
    generated = sum(len(o) for o in outputs.values())
    return {
        "seconds": elapsed,
        "output_tokens": generated,
        "output_tok_s": generated / elapsed,
        "requests_s": len(requests) / elapsed,
        "mean_decoding": statistics.mean(batches),
        "max_decoding": max(batches),
        "iterations": len(batches),
        "preemptions": stats.num_preemptions,
        "outputs": outputs,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = resolve_model(args)
    model = load_model(model_dir, getattr(torch, args.dtype), torch.device(args.device))
    eos = model.cfg.eos_token_ids[0]
    cells = [(blocks, mode) for blocks in args.kv_blocks for mode in KV_ADMISSION]
    runs: dict[tuple[int, str], list[dict]] = {cell: [] for cell in cells}
    with tqdm(total=args.repeats * len(cells), desc="kv admission", unit="run", file=sys.stderr) as bar:
        for _ in range(args.repeats):
            for blocks, mode in cells:  # interleaved: a slow spell of the host hits every cell
                runs[blocks, mode].append(run(make_engine(model_dir, model, args, blocks, mode), workload(args, eos)))
                bar.update()
    reference = runs[cells[0]][0]["outputs"]
    if any(r["outputs"] != reference for rs in runs.values() for r in rs):
        print("the admissions gave different tokens: a scheduling bug", file=sys.stderr)
        return 1
    lengths = sorted(len(o) for o in reference.values())
    keys = ("seconds", "output_tok_s", "requests_s", "mean_decoding", "max_decoding", "preemptions")
    summary = {cell: {key: statistics.median(r[key] for r in rs) for key in keys} for cell, rs in runs.items()}
    text = model.cfg.text
    print(
        f"backend: real engine (torch {args.device}, {args.dtype}); model {model_dir.name}: "
        f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, {text.num_layers} layers"
    )
    print(
        f"{args.requests} requests, prompts {args.prompt_lens[0]}-{args.prompt_lens[1]} tokens, max_tokens "
        f"{args.max_tokens}, answers to EOS: mean {statistics.mean(lengths):.0f}, median "
        f"{statistics.median(lengths):.0f}, max {lengths[-1]} tokens; medians of {args.repeats}"
    )
    print(
        f"{'KV blocks':>9}  {'admission':<12}{'seconds':>9}{'out tok/s':>11}{'req/s':>8}"
        f"{'decoding (mean/max)':>22}{'preemptions':>13}{'ratio':>8}"
    )
    ratios = {}
    for blocks, mode in cells:
        s, base = summary[blocks, mode], summary[blocks, "worst-case"]
        ratios[blocks] = summary[blocks, "on-demand"]["output_tok_s"] / base["output_tok_s"]
        print(
            f"{blocks:>9}  {mode:<12}{s['seconds']:>9.2f}{s['output_tok_s']:>11.1f}{s['requests_s']:>8.2f}"
            f"{s['mean_decoding']:>15.1f} / {s['max_decoding']:<4.0f}{s['preemptions']:>13.0f}"
            f"{s['output_tok_s'] / base['output_tok_s']:>7.2f}x"
        )
    print("ratio: output tok/s over worst-case admission with the same cache (the same tokens in every run)")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "backend": f"real engine (torch {args.device}, {args.dtype})",
        "args": vars(args),
        "output_lengths": lengths,
        "summary": [{"kv_blocks": b, "admission": m, **summary[b, m]} for b, m in cells],
        "ratio_output_tok_s": ratios,
        "runs": [
            {"kv_blocks": b, "admission": m, **{k: v for k, v in r.items() if k != "outputs"}}
            for (b, m), rs in runs.items()
            for r in rs
        ],
    }
    out.write_text(json.dumps(report, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
