"""The CPU decode step's kernels, one against another in one process: products, attention, whole steps.

    python -m bench.decode_kernels products  [--rows 1,8,16,17,24,32,48,64,96,128]
    python -m bench.decode_kernels attention [--seqs 8,32] [--context 160,800] [--against REV]
    python -m bench.decode_kernels steps     [--batch-sizes 8,16,24,32,48,64] [--against REV] [--against-rows 16]

products   the 33 products of a `small` decode step (8 layers' q/k/v, o, gate/up, down, and the lm_head) at each
           row count: oneDNN's packed product against the AMX tiles (`kernels/cpu_amx.py`), bit-identity checked.
attention  the C decode attention (`kernels/cpu_paged.c`) on a cache laid out as the engine's, in huge pages
           (`common.memory.host_zeros`), the 8 layers called in turn (KV cold), each sequence's blocks scattered;
           GB/s = K and V bytes read / time. --against REV: the same kernel built from that commit's source, beside.
steps      `Engine.execute_step` of decode-only steps on the `small` preset (bf16), batch B of 128-token prompts
           generating 64 tokens: step time = (time for 64 tokens − time for 1) / 63. --against REV: that commit's
           attention kernel and tiles up to --against-rows rows (the kernels as they were there), beside.

Each pair is timed in alternation, the order flipped every round (this host kind is a VM whose speed drifts by tens
of percent within seconds); medians of --rounds rounds — ten rounds of the attention gave 0.91–1.16× where thirty
gave 1.14–1.24×. Host: 2 threads, bf16, AMX where the host has it.
"""

from __future__ import annotations

import argparse
import ctypes
import itertools
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if not __package__:  # run as `python bench/decode_kernels.py`: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from kernels import cbuild, cpu_amx, cpu_paged  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
SHAPES = [(1536, 512), (512, 512), (2816, 512), (512, 1408)] * 8 + [(8192, 512)]  # `small`: [N, K] a step


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def alternate(runs: dict, rounds: int) -> dict[str, float]:
    """Median seconds of each callable, timed in turn, the order reversed every other round."""
    times = {name: [] for name in runs}
    names = list(runs)
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            start = time.perf_counter()
            runs[name]()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def library_at(rev: str, source: str, int_functions: tuple[str, ...]) -> ctypes.CDLL:
    """`kernels/{source}` as commit `rev` had it, with the headers it includes as they were there, built as ours
    are; `int_functions` (without their `epdmesh_` prefix) return C ints."""

    def show(name: str) -> bytes:
        return subprocess.run(
            ["git", "-C", str(REPO), "show", f"{rev}:kernels/{name}"], capture_output=True, check=True
        ).stdout

    path = Path(tempfile.mkdtemp(prefix="epdmesh-bench-")) / source
    path.write_bytes(show(path.name))
    for header in cbuild.included(path.read_bytes()):
        path.with_name(header).write_bytes(show(header))
    lib = cbuild.load(path, f"{source} of {rev}")
    if lib is None:
        raise SystemExit(f"could not build {rev}'s kernels/{source}")
    for name in int_functions:
        getattr(lib, f"epdmesh_{name}").restype = ctypes.c_int
    return lib


def attention_library(rev: str) -> ctypes.CDLL:
    """The C decode attention as commit `rev` had it."""
    return library_at(
        rev, "cpu_paged.c", ("paged_decode_bf16", "paged_decode_f32", "write_decode_bf16", "write_decode_f32")
    )


def use_attention(lib: ctypes.CDLL | None) -> None:
    """Route `cpu_paged._decode` to `lib` (None: ours again)."""
    ours = cpu_paged.__dict__.setdefault("_ours", cpu_paged._library)
    cpu_paged._library = ours if lib is None else (lambda scalar=False: lib)


def onednn(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def products(args: argparse.Namespace) -> None:
    if not cpu_amx.available():
        raise SystemExit("no AMX on this host: the products run on oneDNN only")
    weights = [torch.randn(n, k).bfloat16() for n, k in SHAPES]
    packed = [torch.ops.mkldnn._reorder_linear_weight(w) for w in weights]
    tiles = [cpu_amx.pack(w) for w in weights]
    megabytes = sum(w.numel() * 2 for w in weights) / 1e6
    print(f"a step's {len(SHAPES)} products, {megabytes:.0f} MB of weights; ms (GB/s)")
    for rows in args.rows:
        xs = [torch.randn(rows, k).bfloat16() for _, k in SHAPES]
        same = all(torch.equal(cpu_amx.linear(x, t), onednn(x, p)) for x, t, p in zip(xs, tiles, packed))
        runs = {
            "onednn": lambda: [onednn(x, p) for x, p in zip(xs, packed)],
            "tiles": lambda: [cpu_amx.linear(x, t) for x, t in zip(xs, tiles)],
        }
        for run in runs.values():
            run()
        t = alternate(runs, args.rounds)
        print(
            f"{rows:4d} rows  oneDNN {t['onednn'] * 1e3:6.2f} ({megabytes / t['onednn'] / 1e3:4.1f})  tiles "
            f"{t['tiles'] * 1e3:6.2f} ({megabytes / t['tiles'] / 1e3:4.1f})  {t['onednn'] / t['tiles']:.2f}x  "
            f"{'bit-identical' if same else 'not bit-identical'}"
        )


def attention(args: argparse.Namespace) -> None:
    from common.memory import host_zeros

    layers, heads, dim, block = 8, 8, 64, 16
    other = attention_library(args.against) if args.against else None
    for seqs, context in itertools.product(args.seqs, args.context):
        width = -(-context // block)
        blocks = seqs * width + 8
        cache = host_zeros((blocks, layers, 2, block, heads, dim), torch.bfloat16)
        cache.copy_(torch.randn(cache.shape))
        tables = torch.randperm(blocks)[: seqs * width].view(seqs, width).int()
        lens = torch.full((seqs,), context, dtype=torch.int32)
        q = torch.randn(seqs, heads, dim).bfloat16()

        def step(lib):
            def run():
                use_attention(lib)
                for layer in range(layers):
                    cpu_paged._decode(q, cache[:, layer, 0], cache[:, layer, 1], tables, lens, dim**-0.5)

            return run

        libs = {"ours": None} | ({args.against: other} if other else {})
        runs = {name: step(lib) for name, lib in libs.items()}
        outs = {}
        for name, lib in libs.items():
            use_attention(lib)
            outs[name] = cpu_paged._decode(q, cache[:, 0, 0], cache[:, 0, 1], tables, lens, dim**-0.5)
        use_attention(None)
        t = alternate(runs, args.rounds)
        gb = seqs * context * heads * dim * 2 * 2 * layers / 1e9
        line = "  ".join(f"{n} {s / layers * 1e6:6.0f} µs a layer ({gb / s:4.1f} GB/s)" for n, s in t.items())
        agree = "" if other is None else f"  outputs equal: {(outs['ours'] == outs[args.against]).float().mean():.3f}"
        ratio = f"  {t[args.against] / t['ours']:.2f}x" if other else ""
        print(f"{seqs:3d} seqs × {context:4d} tokens  {line}{ratio}{agree}")


def steps(args: argparse.Namespace) -> None:
    from bench import engine as be
    from common.model.loader import load_model

    opts = be.parse_args(["--preset", "small", "--dtype", "bfloat16"])
    model_dir = be.resolve_model(opts)
    model = load_model(str(model_dir), torch.bfloat16, torch.device("cpu"))
    engine = be.make_engine(model_dir, model, opts, max(args.batch_sizes))
    ids = itertools.count()
    other = attention_library(args.against) if args.against else None
    ours_rows = cpu_amx.MAX_ROWS

    def setup(name):
        cpu_amx.MAX_ROWS = ours_rows if name == "ours" else args.against_rows
        use_attention(None if name == "ours" else other)

    names = ["ours"] + ([args.against] if other else [])
    for batch in args.batch_sizes:
        prompts = be.make_prompts(batch, 128, batch)
        be.run_ours(engine, ids, prompts, 64)
        ms = {n: [] for n in names}
        for r in range(args.rounds):
            for name in names if r % 2 == 0 else names[::-1]:
                setup(name)
                first = be.run_ours(engine, ids, prompts, 1)
                full = be.run_ours(engine, ids, prompts, 64)
                ms[name].append((full - first) / 63 * 1e3)
        setup("ours")
        med = {n: statistics.median(v) for n, v in ms.items()}
        line = "  ".join(f"{n} {v:6.2f} ms" for n, v in med.items())
        ratio = f"  {med[args.against] / med['ours']:.2f}x" if other else ""
        print(f"batch {batch:3d}: a decode step {line}{ratio}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["products", "attention", "steps"])
    parser.add_argument("--rows", type=ints, default=ints("1,8,16,17,24,32,48,64,96,128"))
    parser.add_argument("--seqs", type=ints, default=ints("8,32"))
    parser.add_argument("--context", type=ints, default=ints("160,800"))
    parser.add_argument("--batch-sizes", type=ints, default=ints("8,16,24,32,48,64"))
    parser.add_argument("--against", help="a commit whose attention kernel (and, for steps, tile rows) run beside")
    parser.add_argument("--against-rows", type=int, default=16, help="the tiles' row limit at --against (steps)")
    parser.add_argument("--rounds", type=int, help="alternations (default: products 15, attention 30, steps 10)")
    args = parser.parse_args(argv)
    args.rounds = args.rounds or {"products": 15, "attention": 30, "steps": 10}[args.what]
    torch.set_num_threads(2)
    command = " ".join(argv or sys.argv[1:])
    print(f"decode_kernels {command}; torch {torch.__version__}, {torch.get_num_threads()} threads")
    {"products": products, "attention": attention, "steps": steps}[args.what](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
