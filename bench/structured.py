"""What structured output costs per decode step: the same engine and requests, with and without a grammar; and what a
tool-calling request's grammar costs to build, by the number of tools.

    python -m bench.structured [--model DIR] [--batches 1,8] [--tokens 48] [--repeats 3] [--tools 1,16,128]

Backend: the real engine in this process (torch CPU, float32, 1 thread), the default tiny checkpoint unless --model.
Each batch of B identical-length requests runs greedy for --tokens tokens (a grammar that cannot end sooner: JSON
whose one string field takes at least that many characters, or the same under a regular expression), and the
median step time over the decode steps is compared with the unconstrained run's — measured interleaved, medians
of --repeats runs. The grammar's share is the mask (llguidance's per-request bitmask, unpacked and applied to the
logits) and the matcher's advance. `tools` is a `tool_choice: "required"` answer over 16 tools (whichever is called
takes a string of that length).

Admission, per number of tools (each with three typed parameters): the gateway's grammar build (`tool_grammar`, on
the request's parse) and the engine's matcher for it (`GrammarMasks.attach`, off the engine thread in a worker),
medians of --repeats.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

if not __package__:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tqdm import tqdm  # noqa: E402

BACKEND = "real engine (torch CPU, float32, 1 thread)"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="checkpoint dir (default: the default tiny model)")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--tools", default="1,16,128", help="tool counts whose grammar build and matcher are timed")
    p.add_argument("--out", default="bench/results/structured.json")
    return p.parse_args(argv)


def grammars(tokens: int) -> dict[str, str | None]:
    from common.engine.grammar import json_schema_grammar, regex_grammar

    return {
        "none": None,
        "json_schema": json_schema_grammar(
            {
                "type": "object",
                "properties": {"text": {"type": "string", "minLength": 4 * tokens}},
                "required": ["text"],
            }
        ),
        "regex": regex_grammar(f"[a-z ]{{{4 * tokens},}}"),
        "tools": _tools_grammar(16, 4 * tokens),
    }


def _tools(n: int, min_length: int = 0) -> tuple:
    """n function tools of three typed parameters each, whose text takes at least `min_length` characters."""
    return tuple(
        {
            "type": "function",
            "function": {
                "name": f"tool_{i}",
                "description": f"Tool number {i}",
                "parameters": {
                    "type": "object",
                    "properties": {
                        "text": {"type": "string", "minLength": min_length},
                        "count": {"type": "integer", "minimum": 0},
                        "unit": {"enum": ["a", "b", "c"]},
                    },
                    "required": ["text", "count", "unit"],
                    "additionalProperties": False,
                },
            },
        }
        for i in range(n)
    )


def _tools_grammar(n: int, min_length: int = 0) -> str:
    from services.gateway.tools import ToolChoice, tool_grammar

    return tool_grammar(ToolChoice(_tools(n, min_length), "required", parallel=False))


def admission_ms(masks, counts: list[int], repeats: int) -> dict[int, dict[str, float]]:
    """Per tool count: the grammar's build and the matcher's creation, ms (medians)."""
    from common.request import Request
    from common.sampling import SamplingParams

    out = {}
    for n in counts:
        build, attach = [], []
        for r in range(repeats):
            start = time.perf_counter()
            grammar = _tools_grammar(n)
            build.append(time.perf_counter() - start)
            request = Request(f"t{n}-{r}", [1, 2, 3], SamplingParams(max_tokens=8, grammar=grammar))
            start = time.perf_counter()
            masks.attach(request)
            attach.append(time.perf_counter() - start)
        out[n] = {"grammar_build_ms": statistics.median(build) * 1e3, "matcher_ms": statistics.median(attach) * 1e3}
    return out


def decode_step_ms(engine, prompt: list[int], batch: int, tokens: int, grammar: str | None, tag: str) -> float:
    from common.request import Request
    from common.sampling import SamplingParams

    for i in range(batch):
        engine.add_request(
            Request(
                f"{tag}-{i}",
                list(prompt),
                SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True, grammar=grammar),
            )
        )
    steps = []
    first = True
    while engine.has_unfinished:
        start = time.perf_counter()
        engine.step()
        if not first:  # the prefill step is not a decode step
            steps.append(time.perf_counter() - start)
        first = False
    return statistics.median(steps) * 1e3


def main(argv=None) -> int:
    import torch

    from common.engine.config import EngineConfig
    from common.engine.engine import Engine
    from common.model.processor import ChatProcessor
    from epdmesh.checkpoints import ensure_default_model

    args = parse_args(argv)
    torch.set_num_threads(1)
    model_dir = args.model or str(ensure_default_model())
    processor = ChatProcessor(model_dir)
    engine = Engine(EngineConfig(model=model_dir, kv_cache_gib=0.1), detokenize=processor.detokenize)
    prompt, _ = processor.apply([{"role": "user", "content": [{"type": "text", "text": "Write a long answer."}]}])
    batches = [int(b) for b in args.batches.split(",")]
    kinds = grammars(args.tokens)
    samples = {b: {k: [] for k in kinds} for b in batches}
    with tqdm(
        total=len(batches) * len(kinds) * args.repeats, desc="structured bench", unit="run", file=sys.stderr
    ) as bar:
        for repeat in range(args.repeats):
            for b in batches:
                for kind, grammar in kinds.items():  # interleaved: a slow spell hits every kind alike
                    samples[b][kind].append(
                        decode_step_ms(engine, prompt, b, args.tokens, grammar, f"{kind}-{b}-{repeat}")
                    )
                    bar.update()
    print(f"\nbackend: {BACKEND}; {model_dir}; {args.tokens} greedy tokens per request; medians of {args.repeats} runs")
    print(f"{'batch':>6}{'grammar':>14}{'decode step ms':>16}{'× none':>10}")
    report = {"backend": BACKEND, "model": model_dir, "tokens": args.tokens, "repeats": args.repeats, "results": {}}
    for b in batches:
        base = statistics.median(samples[b]["none"])
        for kind in kinds:
            ms = statistics.median(samples[b][kind])
            report["results"].setdefault(str(b), {})[kind] = {
                "decode_step_ms": ms,
                "ratio_to_none": ms / base,
                "samples_ms": samples[b][kind],
            }
            print(f"{b:>6}{kind:>14}{ms:>16.3f}{ms / base:>9.2f}×")
    counts = [int(n) for n in args.tools.split(",") if n]
    engine.grammar.load()
    admission = report["tool_admission"] = admission_ms(engine.grammar, counts, args.repeats)
    print(f"\n{'tools':>6}{'grammar build ms':>18}{'matcher ms':>12}   (a tool-calling request's admission)")
    for n, cost in admission.items():
        print(f"{n:>6}{cost['grammar_build_ms']:>18.2f}{cost['matcher_ms']:>12.2f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
