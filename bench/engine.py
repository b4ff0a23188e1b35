"""Our engine vs transformers `generate`: prefill and decode tokens/s at batch 1 / 8 / 32.

    python -m bench.engine [--preset small] [--dtype bfloat16] [--batch-sizes 1,8,32] [--device cuda]

Both sides load the same checkpoint and get the same text-only prompts (B random prompts of
--prompt-len tokens, no images: the vision tower is idle), greedy, every request generating
exactly --output-len tokens (EOS ignored). Per batch size B, prompt length P, output length N:
  prefill tok/s = B·P / time to the first token (max_tokens=1)
  decode tok/s  = B·(N−1) / (time for N tokens − time for 1 token)
Each time is the median of --repeats runs after one warm-up, the two sides alternating (the order flipped every
round). Goal: ≥ 2× HF at batch 8, ≥ 1.5× at batch 1.

`--workload mixed` (or `both`, the default) adds what a server actually sees: --mixed-requests-per-batch × B
requests with prompt and output lengths drawn (seeded) from --mixed-prompt-lens and --mixed-output-lens, run
at concurrency B. Ours: all submitted at once, `max_num_seqs` = B (continuous batching: a finished request's
slot is refilled at the next iteration, prompts are packed without padding). HF: `generate` over consecutive
static batches of B, prompts left-padded to the batch's longest, each batch generating its longest output
(the way `vllm bench throughput --backend hf` drives it). Both count only the tokens each request asked for:
output tok/s = Σ outputs / wall time, and requests/s. Medians of --repeats runs after a warm-up batch.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

if not __package__:  # run as `python bench/engine.py`: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

from common.engine.config import EngineConfig  # noqa: E402
from common.engine.engine import Engine  # noqa: E402
from common.model import compiled  # noqa: E402
from common.model.llava import LlavaModel  # noqa: E402
from common.model.loader import load_model, model_from_state  # noqa: E402
from common.model.packed_linear import PackedLinear  # noqa: E402
from common.paged_cache import PagedKVCache  # noqa: E402
from common.request import Request  # noqa: E402
from common.sampling import SamplingParams  # noqa: E402
from common.scheduler import SchedulerConfig  # noqa: E402
from kernels import cpu_amx, cpu_prompt  # noqa: E402

BACKEND = "real engine (torch)"  # on --device: the report states it
ABLATIONS = {
    "c-attention",
    "decode-graph",
    "prefill-graph",
    "cuda-graphs",
    "prefill-varlen",
    "amx-tiles",
    "prompt-attention",
    "prompt-tiles",
    "prefill-tiles",
    "rotary-kv",
    "qkv-rope",
    "prompts-graph",
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="llava-1.5 checkpoint dir (default: generate --preset's checkpoint, cached)")
    p.add_argument("--preset", default="small", help="tiny-checkpoint preset when --model is not given")
    p.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    p.add_argument("--device", default="cpu", help="cpu, or cuda (both sides on it; timings wait for the GPU)")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--batch-sizes", default="1,8,32", help="comma-separated")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    p.add_argument(
        "--enforce-eager", action="store_true", help="ours without torch.compile (as `serve --enforce-eager`)"
    )
    p.add_argument(
        "--without",
        default="",
        help="ablation, ours only (comma list): c-attention (decode attention in torch: gathers and bmm), "
        "decode-graph (decodes through the per-layer compiled halves), prefill-graph (a lone whole prompt too; "
        "where bf16 prompts run on the AMX tiles it has none: its prompts graph takes it); "
        "c-attention takes both graphs out (they call the kernel); amx-tiles (every text product through oneDNN, "
        "not the AMX tiles); prefill-tiles (a prompt's products through oneDNN, decode's on the tiles); "
        "rotary-kv (prompt chunks' RoPE compiled and their K/V written apart, not in one C pass); "
        "qkv-rope (on AMX, a prompt's RoPE and K/V write in their own pass after the qkv product, not in it); "
        "prompt-attention (prompts' and images' attention through SDPA, not the C kernel); "
        "prompt-tiles (the C kernel's bf16 products on the vector units, not the AMX tiles); prompts-graph (a step of "
        "several prompts through the per-layer compiled halves, not as one graph); on CUDA: "
        "cuda-graphs (decode steps eager), "
        "prefill-varlen (the torch backend's prompt chunks one SDPA call each instead of one varlen call a layer)",
    )
    p.add_argument(
        "--token-budget", type=int, default=SchedulerConfig().token_budget, help="our scheduler's tokens/step"
    )
    p.add_argument(
        "--profile",
        metavar="PREFIX",
        help="also profile ours (torch.profiler) once per batch size, after the timed runs: a prefill (one token) "
        "and a whole run, each written as PREFIX-b{B}-{prefill,full}.txt (operators by self time; on CUDA by "
        "device time too)",
    )
    p.add_argument("--workload", default="both", choices=("uniform", "mixed", "both"))
    p.add_argument("--mixed-requests-per-batch", type=int, default=4, help="mixed: requests = this × B")
    p.add_argument("--mixed-prompt-lens", default="16,512", help="mixed: min,max prompt tokens (uniform draw)")
    p.add_argument("--mixed-output-lens", default="8,128", help="mixed: min,max output tokens (uniform draw)")
    p.add_argument("--out", default="bench/results/engine.json")
    args = p.parse_args(argv)
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",") if b.strip()]
    args.without = sorted({w.strip() for w in args.without.split(",") if w.strip()})
    if set(args.without) - ABLATIONS:
        p.error(f"--without takes {sorted(ABLATIONS)}")
    args.mixed_prompt_lens, args.mixed_output_lens = (
        tuple(int(x) for x in v.split(",")) for v in (args.mixed_prompt_lens, args.mixed_output_lens)
    )
    if not all(len(v) == 2 and 2 <= v[0] <= v[1] for v in (args.mixed_prompt_lens, args.mixed_output_lens)):
        p.error("--mixed-prompt-lens and --mixed-output-lens are MIN,MAX with 2 <= MIN <= MAX")
    if args.output_len < 2 or args.prompt_len < 2 or args.repeats < 1 or min(args.batch_sizes, default=0) < 1:
        p.error("need --output-len >= 2, --prompt-len >= 2, --repeats >= 1 and positive batch sizes")
    return args


def resolve_model(args: argparse.Namespace) -> Path:
    """--model, else --preset's checkpoint (written once); a full-size preset (llava-1.5-7b) is written config-only:
    both sides then get the same random weights (`load_models`)."""
    if args.model:
        return Path(args.model)
    from common.model.tiny import CONFIG_ONLY_PRESETS
    from epdmesh.checkpoints import make_model, write_once

    home = Path(os.environ.get("EPDMESH_HOME", Path.home() / ".cache" / "epdmesh"))
    path = home / "bench-models" / args.preset
    config_only = args.preset in CONFIG_ONLY_PRESETS
    marker = "config.json" if config_only else "model.safetensors"
    return write_once(path, marker, lambda tmp: make_model(tmp, args.preset, config_only=config_only))


def load_models(model_dir: Path, dtype: torch.dtype, device: torch.device):
    """(ours, transformers') on `device`. Without weights in the checkpoint (a config-only full-size shape),
    transformers' own random init, made on the device, and ours built from its tensors."""
    import transformers

    if (model_dir / "model.safetensors").is_file() or (model_dir / "model.safetensors.index.json").is_file():
        hf = transformers.LlavaForConditionalGeneration.from_pretrained(str(model_dir), dtype=dtype).to(device)
        return load_model(str(model_dir), dtype, device), hf.eval()
    config = transformers.AutoConfig.from_pretrained(str(model_dir))
    torch.manual_seed(0)
    with torch.device(device):
        hf = transformers.LlavaForConditionalGeneration._from_config(config, dtype=dtype).eval()
    return model_from_state(model_dir, hf.state_dict(), dtype, device), hf


def make_prompts(batch: int, length: int, seed: int) -> list[list[int]]:
    """Equal-length prompts (so HF needs no padding): <s> then ordinary BPE ids, far from the image token."""
    rng = random.Random(seed)
    return [[1] + [rng.randrange(5, 2000) for _ in range(length - 1)] for _ in range(batch)]


def make_engine(
    model_dir: Path,
    model: LlavaModel,
    args: argparse.Namespace,
    batch: int,
    max_len: int | None = None,
    max_num_seqs: int | None = None,
) -> Engine:
    """An engine sharing the loaded weights, with a KV cache sized to `batch` requests of `max_len` (plus slack)."""
    text, block = model.cfg.text, 16
    per_block = PagedKVCache.bytes_per_block(
        block, text.num_layers, text.num_kv_heads, text.head_dim, getattr(torch, args.dtype)
    )
    blocks = batch * -(-(max_len or args.prompt_len + args.output_len) // block) + 8
    config = EngineConfig(
        model=str(model_dir),
        dtype=args.dtype,
        device=args.device,
        block_size=block,
        kv_cache_gib=blocks * per_block / 2**30,
        image_cache_gib=1 / 1024,
        scheduler=SchedulerConfig(token_budget=args.token_budget, max_num_seqs=max_num_seqs or max(64, batch)),
        compile=not args.enforce_eager and torch.device(args.device).type == "cpu",  # as `serve`: eager on CUDA
        prompt_kernel="prompt-attention" not in args.without,
        cuda_graphs=not args.enforce_eager and "cuda-graphs" not in args.without,
    )
    engine = Engine(config, model=model)
    if args.without:  # the CPU path's parts taken out one by one, to measure what each is worth
        if {"decode-graph", "c-attention"} & set(args.without):
            engine.runner.decode_graph = None
        if {"prefill-graph", "c-attention"} & set(args.without):
            engine.runner.prefill_graph = None
        if "prompts-graph" in args.without:
            engine.runner.prompts_graph = None
        engine.runner.attention.use_c = "c-attention" not in args.without
        if "amx-tiles" in args.without:
            for module in engine.model.modules():
                if isinstance(module, PackedLinear):
                    module.tiles = None
        engine.runner.attention.varlen = "prefill-varlen" not in args.without
    cpu_prompt.use_tiles("prompt-tiles" not in args.without)
    cpu_amx.use_gemm("prefill-tiles" not in args.without)
    if "rotary-kv" in args.without:
        compiled.ROTARY_KV = False
    cpu_amx.QKV_ROPE = "qkv-rope" not in args.without
    return engine


def run_ours(engine: Engine, ids: itertools.count, prompts: list[list[int]], max_tokens: int) -> float:
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    requests = [Request(f"r{next(ids)}", list(p), sampling) for p in prompts]
    start = time.perf_counter()
    outputs = engine.generate(requests)
    elapsed = time.perf_counter() - start
    stats = engine.stats()
    assert len(outputs) == len(prompts) and all(len(o.output_token_ids) == max_tokens for o in outputs.values())
    assert stats.kv_blocks_free == stats.kv_blocks_total and not engine.has_unfinished, "blocks leaked between runs"
    return elapsed


def profile(run, path: str, args: argparse.Namespace) -> None:
    """One call of `run` under torch.profiler: its operators by self time (and by device time on CUDA) into `path`."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as profiler

    cuda = torch.device(args.device).type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profiler(activities=activities) as prof:
        seconds = run()
        _sync(torch.device(args.device))
    events = prof.key_averages()
    tables = [f"{seconds * 1e3:.1f} ms wall\n", events.table(sort_by="self_cpu_time_total", row_limit=30)]
    if cuda:
        tables.append(events.table(sort_by="self_device_time_total", row_limit=30))
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text("\n".join(tables))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def run_hf(model, input_ids: torch.Tensor, max_tokens: int, pad_id: int) -> float:
    _sync(model.device)
    start = time.perf_counter()
    out = model.generate(
        input_ids=input_ids,
        attention_mask=torch.ones_like(input_ids),
        do_sample=False,
        max_new_tokens=max_tokens,
        min_new_tokens=max_tokens,
        pad_token_id=pad_id,
    )
    _sync(model.device)
    elapsed = time.perf_counter() - start
    assert out.shape == (input_ids.shape[0], input_ids.shape[1] + max_tokens), tuple(out.shape)
    return elapsed


def measure(runs: dict, output_len: int, repeats: int, bar: tqdm, label: str) -> dict[str, tuple[float, float]]:
    """Per side of `runs` (name → run(tokens) → seconds): (median seconds to the first token, median seconds for
    all output_len tokens), after one warm-up each. The sides alternate, the order flipped every round: this host
    kind drifts by tens of percent within a minute, and a slow spell then hits both sides alike. A side's turn
    starts with an untimed first-token run: after the other side's run its weights are out of the caches (on the
    `small` preset HF's prefill took ~20% longer there, ours ~0), where a server's steps find them in."""
    for name, run in runs.items():
        bar.set_postfix_str(f"{label}: warm-up {name}")
        run(output_len)
        bar.update()
    times = {name: ([], []) for name in runs}
    for r in range(repeats):
        for name in list(runs)[:: 1 if r % 2 == 0 else -1]:
            bar.set_postfix_str(f"{label}: {name}")
            firsts, fulls = times[name]
            runs[name](1)  # untimed: the turn's timed runs find this side's weights in the caches, as in a server
            firsts.append(runs[name](1))
            fulls.append(runs[name](output_len))
            bar.update(2)
    return {name: (statistics.median(f), statistics.median(g)) for name, (f, g) in times.items()}


def rates(batch: int, args: argparse.Namespace, first: float, full: float) -> tuple[float, float]:
    """(prefill tok/s, decode tok/s) from the two medians."""
    decode_time = max(full - first, 1e-9)
    return batch * args.prompt_len / first, batch * (args.output_len - 1) / decode_time


def bench_batch(batch, args, model_dir, ours_model, hf_model, pad_id, bar) -> dict:
    prompts = make_prompts(batch, args.prompt_len, seed=batch)
    engine, ids = make_engine(model_dir, ours_model, args, batch), itertools.count()
    input_ids = torch.tensor(prompts, dtype=torch.long, device=hf_model.device)
    runs = {
        "ours": functools.partial(run_ours, engine, ids, prompts),
        "HF": lambda n: run_hf(hf_model, input_ids, n, pad_id),
    }
    medians = measure(runs, args.output_len, args.repeats, bar, f"batch {batch}")
    ours, hf = medians["ours"], medians["HF"]
    if args.profile:
        runs["ours"](1)  # untimed, as each timed turn starts: HF may have run last
        for name, tokens in (("prefill", 1), ("full", args.output_len)):
            run = functools.partial(run_ours, engine, ids, prompts, tokens)
            profile(run, f"{args.profile}-b{batch}-{name}.txt", args)
    del runs, engine
    (op, od), (hp, hd) = rates(batch, args, *ours), rates(batch, args, *hf)
    return dict(
        batch=batch,
        ours_prefill_tok_s=op,
        hf_prefill_tok_s=hp,
        prefill_ratio=op / hp,
        ours_decode_tok_s=od,
        hf_decode_tok_s=hd,
        decode_ratio=od / hd,
        ours_first_s=ours[0],
        ours_full_s=ours[1],
        hf_first_s=hf[0],
        hf_full_s=hf[1],
    )


def make_mixed(n: int, args: argparse.Namespace, seed: int) -> list[tuple[list[int], int]]:
    """n (prompt ids, output length) pairs, lengths drawn uniformly from the --mixed ranges."""
    rng = random.Random(seed)
    (p_lo, p_hi), (o_lo, o_hi) = args.mixed_prompt_lens, args.mixed_output_lens
    return [
        ([1] + [rng.randrange(5, 2000) for _ in range(rng.randint(p_lo, p_hi) - 1)], rng.randint(o_lo, o_hi))
        for _ in range(n)
    ]


def run_ours_mixed(engine: Engine, ids: itertools.count, work: list[tuple[list[int], int]]) -> float:
    requests = [
        Request(f"m{next(ids)}", list(p), SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
        for p, n in work
    ]
    start = time.perf_counter()
    outputs = engine.generate(requests)
    elapsed = time.perf_counter() - start
    assert [len(outputs[r.request_id].output_token_ids) for r in requests] == [n for _, n in work]
    stats = engine.stats()
    assert stats.kv_blocks_free == stats.kv_blocks_total and not engine.has_unfinished, "blocks leaked between runs"
    return elapsed


@torch.inference_mode()
def run_hf_mixed(model, work: list[tuple[list[int], int]], batch: int, pad_id: int) -> float:
    """Consecutive static batches of `batch`: left-padded to the longest prompt, run to the longest output."""
    _sync(model.device)
    start = time.perf_counter()
    for i in range(0, len(work), batch):
        chunk = work[i : i + batch]
        width, new = max(len(p) for p, _ in chunk), max(n for _, n in chunk)
        input_ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)
        mask = torch.zeros_like(input_ids)
        for row, (prompt, _) in enumerate(chunk):
            input_ids[row, width - len(prompt) :] = torch.tensor(prompt)
            mask[row, width - len(prompt) :] = 1
        out = model.generate(
            input_ids=input_ids.to(model.device),
            attention_mask=mask.to(model.device),
            do_sample=False,
            max_new_tokens=new,
            min_new_tokens=new,
            pad_token_id=pad_id,
        )
        assert out.shape == (len(chunk), width + new), tuple(out.shape)
    _sync(model.device)
    return time.perf_counter() - start


def bench_mixed(batch, args, model_dir, ours_model, hf_model, pad_id, bar) -> dict:
    work = make_mixed(args.mixed_requests_per_batch * batch, args, seed=1000 + batch)
    max_len = max(len(p) + n for p, n in work)
    engine, ids = (
        make_engine(model_dir, ours_model, args, batch, max_len=max_len, max_num_seqs=batch),
        itertools.count(),
    )
    times: dict[str, list[float]] = {"ours": [], "hf": []}
    runs = {
        "ours": functools.partial(run_ours_mixed, engine, ids),
        "hf": lambda w: run_hf_mixed(hf_model, w, batch, pad_id),
    }
    for side in runs:  # warm-up: the first batch
        bar.set_postfix_str(f"mixed batch {batch}: warm-up {side}")
        runs[side](work[:batch])
        bar.update()
    for _ in range(args.repeats):  # interleaved: a slow spell of the machine hits both sides
        for side, run in runs.items():
            bar.set_postfix_str(f"mixed batch {batch}: {side}")
            times[side].append(run(work))
            bar.update()
    del runs, engine
    ours, hf = statistics.median(times["ours"]), statistics.median(times["hf"])
    outputs = sum(n for _, n in work)
    return dict(
        batch=batch,
        requests=len(work),
        prompt_tokens=sum(len(p) for p, _ in work),
        output_tokens=outputs,
        ours_s=ours,
        hf_s=hf,
        ours_output_tok_s=outputs / ours,
        hf_output_tok_s=outputs / hf,
        ours_req_s=len(work) / ours,
        hf_req_s=len(work) / hf,
        ratio=hf / ours,
    )


def print_mixed(meta: dict, rows: list[dict]) -> None:
    (p_lo, p_hi), (o_lo, o_hi) = meta["mixed_prompt_lens"], meta["mixed_output_lens"]
    print(
        f"\nmixed workload: {meta['mixed_requests_per_batch']}×B requests, prompts {p_lo}-{p_hi} tokens, outputs "
        f"{o_lo}-{o_hi} tokens (seeded uniform draws), concurrency B; ours continuous batching, HF static batches"
    )
    head = ("batch", "requests", "ours out tok/s", "HF out tok/s", "ours req/s", "HF req/s", "ratio")
    print("  ".join(f"{h:>15}" if i else f"{h:>5}" for i, h in enumerate(head)))
    for r in rows:
        cells = (
            f"{r['requests']}",
            f"{r['ours_output_tok_s']:.1f}",
            f"{r['hf_output_tok_s']:.1f}",
            f"{r['ours_req_s']:.2f}",
            f"{r['hf_req_s']:.2f}",
            f"{r['ratio']:.2f}x",
        )
        print(f"{r['batch']:>5}  " + "  ".join(c.rjust(15) for c in cells))
    at8 = next((r for r in rows if r["batch"] == 8), None)
    if at8 is not None:
        print(f"mixed workload at batch 8: {at8['ratio']:.2f}x HF's throughput")


def print_meta(meta: dict) -> None:
    print(
        f"model {meta['model']} ({meta['params_m']:.1f}M params), dtype {meta['dtype']}, device {meta['device']} "
        f"({meta['accelerator']}), "
        f"torch threads {meta['threads']}, backend {meta['backend']} vs transformers {meta['transformers']} generate; "
        f"text-only prompts; median of {meta['repeats']} after 1 warm-up; weights {meta['weights']}"
        + ("; decode steps as CUDA graphs" if meta["cuda_graphs"] else "")
        + (f"; ours without {', '.join(meta['without'])}" if meta.get("without") else "")
    )


def print_report(meta: dict, rows: list[dict]) -> None:
    print(f"uniform workload: prompt {meta['prompt_len']} tokens, output {meta['output_len']} tokens, B at once")
    head = ("batch", "ours prefill tok/s", "HF prefill tok/s", "ratio", "ours decode tok/s", "HF decode tok/s", "ratio")
    print("  ".join(f"{h:>18}" if i else f"{h:>5}" for i, h in enumerate(head)))
    for r in rows:
        cells = (
            r["ours_prefill_tok_s"],
            r["hf_prefill_tok_s"],
            r["prefill_ratio"],
            r["ours_decode_tok_s"],
            r["hf_decode_tok_s"],
            r["decode_ratio"],
        )
        text = [f"{c:.2f}x" if i in (2, 5) else f"{c:.1f}" for i, c in enumerate(cells)]
        print(f"{r['batch']:>5}  " + "  ".join(t.rjust(18) for t in text))
    at8 = next((r for r in rows if r["batch"] == 8), None)
    if at8 is not None:
        print(f"goal >= 2x HF at batch 8: prefill {at8['prefill_ratio']:.2f}x, decode {at8['decode_ratio']:.2f}x")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    import transformers

    model_dir = resolve_model(args)
    dtype = getattr(torch, args.dtype)
    device = torch.device(args.device)
    ours_model, hf_model = load_models(model_dir, dtype, device)
    pad_id = hf_model.generation_config.pad_token_id or 0
    meta = dict(
        model=args.model or f"preset {args.preset!r}",
        checkpoint=str(model_dir),
        params_m=sum(p.numel() for p in ours_model.parameters()) / 1e6,
        dtype=args.dtype,
        threads=torch.get_num_threads(),
        backend=BACKEND,
        device=str(device),
        accelerator=torch.cuda.get_device_name(device) if device.type == "cuda" else "none",
        transformers=transformers.__version__,
        prompt_len=args.prompt_len,
        output_len=args.output_len,
        repeats=args.repeats,
        token_budget=args.token_budget,
        without=args.without,
        prompts="text-only (random token ids, no images)",
        weights="the checkpoint's"
        if (model_dir / "model.safetensors").is_file() or (model_dir / "model.safetensors.index.json").is_file()
        else "random (transformers' init of a config-only checkpoint; the same tensors on both sides)",
        cuda_graphs=device.type == "cuda" and not args.enforce_eager and "cuda-graphs" not in args.without,
        workload=args.workload,
        mixed_requests_per_batch=args.mixed_requests_per_batch,
        mixed_prompt_lens=args.mixed_prompt_lens,
        mixed_output_lens=args.mixed_output_lens,
    )
    uniform, mixed = args.workload in ("uniform", "both"), args.workload in ("mixed", "both")
    total = len(args.batch_sizes) * 2 * ((1 + 2 * args.repeats) * uniform + (1 + args.repeats) * mixed)
    rows, mixed_rows = [], []
    with tqdm(total=total, desc="bench", unit="run", file=sys.stderr) as bar:
        for b in args.batch_sizes:
            if uniform:
                rows.append(bench_batch(b, args, model_dir, ours_model, hf_model, pad_id, bar))
            if mixed:
                mixed_rows.append(bench_mixed(b, args, model_dir, ours_model, hf_model, pad_id, bar))
    print_meta(meta)
    if rows:
        print_report(meta, rows)
    if mixed_rows:
        print_mixed(meta, mixed_rows)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(meta, rows=rows, mixed_rows=mixed_rows), indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
