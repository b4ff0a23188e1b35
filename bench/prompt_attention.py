"""Prompt attention on the CPU: the C kernel (`kernels/cpu_prompt.c`) against torch's SDPA, in one process.

    python -m bench.prompt_attention kernel [--rounds 20] [--against REV]
    python -m bench.prompt_attention image  [--rounds 10] [--model DIR]

kernel  each shape's attention, ours and SDPA timed in alternation, bf16 (and fp32 with --dtype float32): the
        `small` preset's text (8 heads × 64, causal) at 128 / 623 / 1024 tokens and its vision tower (4 heads × 64,
        577 patches, every patch sees every patch); LLaVA-1.5-7B's (32 heads × 128 causal at 623 tokens; vision 16
        × 64 at 577). GFLOP/s counts the causal half only. --against REV: the kernel as that commit had it
        (`bench.decode_kernels.library_at`), timed beside ours and checked bit-identical to it.
image   what a 1-image request computes before its first token, in-process, on the `small` preset (bf16, the
        engine's compiled graphs): the vision tower on one 336 px picture, then a 623-token prompt through the
        compiled prefill graph — with the kernel and with SDPA (`cpu_prompt.ENABLED`; each has its own graph),
        in alternation.

Each pair is timed in alternation, the order flipped every round (bench/decode_kernels.py: this host kind drifts by
tens of percent within seconds); medians. 2 threads.
"""

from __future__ import annotations

import argparse
import ctypes
import sys
import time
from pathlib import Path

if not __package__:  # run as `python bench/prompt_attention.py`: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.decode_kernels import alternate, library_at  # noqa: E402
from kernels import cpu_prompt  # noqa: E402

SHAPES = [  # (label, tokens, heads, head_dim, causal, repeats a round)
    ("small text", 128, 8, 64, True, 20),
    ("small text", 623, 8, 64, True, 4),
    ("small text", 1024, 8, 64, True, 2),
    ("small vision", 577, 4, 64, False, 4),
    ("7B text", 623, 32, 128, True, 1),
    ("7B vision", 577, 16, 64, False, 1),
]


def kernel(args: argparse.Namespace) -> None:
    loader = cpu_prompt._library
    try:
        _kernel(args, loader())
    finally:
        cpu_prompt._library = loader  # (swapped per call below where --against is given)


def _kernel(args: argparse.Namespace, ours_lib) -> None:
    dtype = getattr(torch, args.dtype)
    other = args.against and library_at(args.against, "cpu_prompt.c", ("prompt_bf16", "prompt_f32", "prompt_supports"))
    if other:
        other.epdmesh_prompt_scratch.restype = ctypes.c_int64
        if hasattr(other, "epdmesh_prompt_tiles"):  # on the tiles where ours are (a commit before them has none)
            other.epdmesh_prompt_tiles(int(cpu_prompt.TILES))
    print(f"prompt attention, {args.dtype}, {torch.get_num_threads()} threads, medians of {args.rounds} rounds")
    print(
        f"{'shape':<14}{'tokens':>7}{'heads×dim':>10}{'ours µs':>10}{'SDPA µs':>10}{'ours GFLOP/s':>14}{'× SDPA':>8}"
        + (f"{args.against + ' µs':>14}{'× it':>7}" if other else "")
    )
    for label, n, heads, dim, causal, repeats in SHAPES:
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(1, n, heads, dim, generator=g).to(dtype) for _ in range(3))
        scale = dim**-0.5

        def through(lib):
            def run():
                cpu_prompt._library = lambda: lib  # (the module's cached loader, swapped for the call)
                for _ in range(repeats):
                    cpu_prompt.prompt_attention(q, k, v, scale, causal)

            return run

        def sdpa():
            for _ in range(repeats):
                cpu_prompt.sdpa(q, k, v, scale, causal)

        runs = {"ours": through(ours_lib), "sdpa": sdpa} | ({"it": through(other)} if other else {})
        if other:
            cpu_prompt._library = lambda: ours_lib
            mine = cpu_prompt.prompt_attention(q, k, v, scale, causal)
            cpu_prompt._library = lambda: other
            if not torch.equal(mine, cpu_prompt.prompt_attention(q, k, v, scale, causal)):
                print(f"{label} {n}: ours and {args.against}'s differ", file=sys.stderr)
        for run in runs.values():
            run()
        t = alternate(runs, args.rounds)
        flops = 4 * heads * n * n * dim * (0.5 if causal else 1.0)
        us = {name: s / repeats * 1e6 for name, s in t.items()}
        print(
            f"{label:<14}{n:>7}{f'{heads}×{dim}':>10}{us['ours']:>10.0f}{us['sdpa']:>10.0f}"
            f"{flops / us['ours'] / 1e3:>14.0f}{us['sdpa'] / us['ours']:>7.2f}×"
            + (f"{us['it']:>14.0f}{us['it'] / us['ours']:>6.2f}×" if other else "")
        )


def image(args: argparse.Namespace) -> None:
    from bench.engine import resolve_model
    from common.model import compiled as compiled_module
    from common.model.compiled import CompiledModel
    from common.model.loader import load_model

    model = load_model(resolve_model(argparse.Namespace(model=args.model, preset="small")), torch.bfloat16)
    compiled_module.LONE_PROMPT_GRAPH = True  # (an engine on an AMX host runs a lone prompt through its prompts graph)
    compiled = CompiledModel(model)
    cfg, n = model.text.cfg, args.prompt_len
    with torch.inference_mode(False):  # made as the engine makes its cache
        cache = torch.zeros(
            -(-n // 16) + 1, cfg.num_layers, 2, 16, cfg.num_kv_heads, cfg.head_dim, dtype=torch.bfloat16
        )
    pixels = torch.randn(1, 3, model.cfg.vision.image_size, model.cfg.vision.image_size)
    embeds = torch.randn(n, cfg.hidden_size, dtype=torch.bfloat16)
    positions, slots = torch.arange(n), (torch.arange(n) // 16, torch.arange(n) % 16)
    for t in (embeds, positions, *slots):
        torch._dynamo.mark_dynamic(t, 0)
    parts: dict[str, list[tuple[float, float]]] = {"ours": [], "sdpa": []}

    def run(name: str) -> None:
        cpu_prompt.ENABLED = name == "ours"
        with torch.inference_mode():
            start = time.perf_counter()
            model.encode_images(pixels, compiled.vision_layer)
            middle = time.perf_counter()
            compiled.prefill(model.text, embeds, positions, cache, *slots)
            parts[name].append((middle - start, time.perf_counter() - middle))

    for name in ("ours", "sdpa", "ours", "sdpa"):  # compile both graphs, then warm
        run(name)
    parts = {"ours": [], "sdpa": []}
    total = alternate({"ours": lambda: run("ours"), "sdpa": lambda: run("sdpa")}, args.rounds)
    cpu_prompt.ENABLED = True
    print(f"1 image + {n}-token prompt, `small` preset, bf16, {torch.get_num_threads()} threads, {args.rounds} rounds")
    for name, label in (("ours", "C kernel"), ("sdpa", "SDPA")):
        vision = sorted(p[0] for p in parts[name])[len(parts[name]) // 2] * 1e3
        prefill = sorted(p[1] for p in parts[name])[len(parts[name]) // 2] * 1e3
        print(f"{label:<9} vision {vision:6.1f} ms  prefill {prefill:6.1f} ms  total {total[name] * 1e3:6.1f} ms")
    print(f"total: SDPA / C kernel = {total['sdpa'] / total['ours']:.2f}×")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["kernel", "image"])
    parser.add_argument("--rounds", type=int, help="alternations (default: kernel 20, image 10)")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16", help="kernel: inputs' dtype")
    parser.add_argument("--model", help="image: a llava-1.5 checkpoint (default: the `small` preset's, made once)")
    parser.add_argument("--prompt-len", type=int, default=623, help="image: the prompt's tokens, the image's included")
    parser.add_argument("--against", metavar="REV", help="kernel: that commit's kernel beside ours")
    args = parser.parse_args(argv)
    args.rounds = args.rounds or (20 if args.what == "kernel" else 10)
    torch.set_num_threads(2)
    if not cpu_prompt.supports(torch.empty(1, 64, dtype=getattr(torch, args.dtype))):
        print(f"the prompt kernel does not run on this host for {args.dtype} (AVX-512 / AVX512_BF16 missing)")
        return 1
    (kernel if args.what == "kernel" else image)(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
