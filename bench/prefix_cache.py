"""Multi-turn chats with images: what prefix caching and cache-aware routing do to TTFT.

    python -m bench.prefix_cache [--conversations 4] [--turns 4] [--repeats 3] [--topology E1+P2+D1]

A conversation opens with an image (its own, 320×240) and a question; each later turn sends the whole chat so
far — the answers it got, then a new question — as a client of a chat API does. `--conversations` of them run at
once, each turn after the one before, on three `epdmesh serve --topology T` meshes up side by side, which answer
with the same tokens (greedy), so every configuration sees the same prompts:
  no-cache  — `--no-enable-prefix-caching`: every prompt computed whole;
  cache     — prefix caching on (serve's default), `--no-cache-aware-routing`: each turn goes to the least
              loaded prefill worker, which holds the chat's earlier turns or not;
  affinity  — prefix caching and cache-aware routing (serve's defaults): a turn goes back to the prefill worker
              that prefilled the chat before.
Each repeat runs the configurations one after another in a rotating order with conversations of its own (new
images and questions, so nothing is cached from an earlier repeat). Reports TTFT p50/p90 of the first turns
(nothing cached) and of the later ones, and the share of prompt tokens served from the cache (`usage.
prompt_tokens_details.cached_tokens`). Backend: the real engine (torch CPU, fp32, 1 thread per process).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import io
import json
import statistics
import sys
import time
from pathlib import Path

if not __package__:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx  # noqa: E402
import numpy as np  # noqa: E402
from PIL import Image  # noqa: E402
from tqdm import tqdm  # noqa: E402

BACKEND = "real engine (torch CPU, float32, 1 thread per process)"
SERVED_NAME = "tiny"  # what tests.services.servers.running_server serves as
CONFIGS = {"no-cache": ("--no-enable-prefix-caching",), "cache": ("--no-cache-aware-routing",), "affinity": ()}
QUESTIONS = [
    "What is in this picture?",
    "Which colours stand out the most, and where are they?",
    "Describe the top left corner in more detail.",
    "Is there any text or writing visible?",
    "What would you call this picture if it were a painting?",
    "Count the distinct shapes you can see.",
]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="checkpoint dir (default: the default tiny model)")
    p.add_argument("--topology", default="E1+P2+D1")
    p.add_argument("--conversations", type=int, default=4, help="chats at once")
    p.add_argument("--turns", type=int, default=4, help="turns per chat")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--out", default="bench/out/prefix_cache.json")
    return p.parse_args(argv)


def image_uri(seed: int) -> str:
    pixels = (np.random.RandomState(seed).rand(240, 320, 3) * 255).astype("uint8")
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


async def ask(
    client: httpx.AsyncClient, base: str, messages: list[dict], max_tokens: int
) -> tuple[float, str, int, int]:
    """(TTFT s, answer text, prompt tokens, cached prompt tokens) of one streamed greedy chat."""
    body = {
        "model": SERVED_NAME,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start, ttft, text, usage = time.perf_counter(), None, [], {}
    async with client.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=120) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices", ()):
                if choice.get("delta", {}).get("content") and ttft is None:
                    ttft = time.perf_counter() - start
                text.append(choice.get("delta", {}).get("content") or "")
            usage = chunk.get("usage") or usage
    return (
        (ttft if ttft is not None else time.perf_counter() - start),
        "".join(text),
        usage.get("prompt_tokens", 0),
        (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
    )


async def conversation(client, base: str, seed: int, turns: int, max_tokens: int) -> list[dict]:
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": image_uri(seed)}},
                {"type": "text", "text": QUESTIONS[seed % len(QUESTIONS)]},
            ],
        }
    ]
    results = []
    for turn in range(turns):
        ttft, answer, prompt, cached = await ask(client, base, messages, max_tokens)
        results.append(
            {"turn": turn, "ttft_ms": ttft * 1e3, "prompt_tokens": prompt, "cached_tokens": cached, "answer": answer}
        )
        messages += [
            {"role": "assistant", "content": answer},
            {"role": "user", "content": QUESTIONS[(seed + turn + 1) % len(QUESTIONS)]},
        ]
    return results


async def run_config(base: str, seeds: list[int], args) -> list[dict]:
    async with httpx.AsyncClient() as client:
        chats = await asyncio.gather(*(conversation(client, base, s, args.turns, args.max_tokens) for s in seeds))
    return [dict(r, seed=s) for s, chat in zip(seeds, chats) for r in chat]


def summarize(rows: list[dict]) -> dict:
    def pct(values, q):
        values = sorted(values)
        return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")

    first = [r["ttft_ms"] for r in rows if r["turn"] == 0]
    later = [r["ttft_ms"] for r in rows if r["turn"] > 0]
    later_prompt = sum(r["prompt_tokens"] for r in rows if r["turn"] > 0)
    return {
        "first_turn_p50_ttft_ms": statistics.median(first),
        "later_turns_p50_ttft_ms": statistics.median(later),
        "later_turns_p90_ttft_ms": pct(later, 0.9),
        "num_requests": len(rows),
        "later_turns_cached_fraction": sum(r["cached_tokens"] for r in rows if r["turn"] > 0) / max(later_prompt, 1),
    }


def main(argv=None) -> int:
    from epdmesh.checkpoints import ensure_default_model
    from tests.services.servers import running_server

    args = parse_args(argv)
    model_dir = args.model or str(ensure_default_model())
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    names = list(CONFIGS)
    rows: dict[str, list[dict]] = {name: [] for name in names}
    total = len(names) * args.repeats * args.conversations * args.turns
    with (
        tqdm(total=total, desc="prefix-cache bench", unit="req", file=sys.stderr) as bar,
        contextlib.ExitStack() as stack,
    ):
        bar.set_postfix_str("starting " + ", ".join(names))
        bases = {
            name: stack.enter_context(
                running_server(model_dir, args.topology, out.parent / f"prefix-{name}.log", *CONFIGS[name])
            )
            for name in names
        }
        bar.set_postfix_str("warm-up")
        for name in names:  # one short chat each: the first requests of a fresh server pay its start-up
            asyncio.run(run_config(bases[name], [7], argparse.Namespace(turns=2, max_tokens=args.max_tokens)))
        for repeat in range(args.repeats):
            seeds = [1000 * (repeat + 1) + c for c in range(args.conversations)]
            for k in range(len(names)):
                name = names[(repeat + k) % len(names)]  # a rotating order: no configuration always goes first
                bar.set_postfix_str(f"repeat {repeat + 1}: {name}")
                rows[name] += [dict(r, repeat=repeat) for r in asyncio.run(run_config(bases[name], seeds, args))]
                bar.update(args.conversations * args.turns)
    answers = {name: {(r["seed"], r["turn"]): r["answer"] for r in rows[name]} for name in names}
    same = all(answers[name] == answers[names[0]] for name in names)
    results = {name: summarize(rows[name]) for name in names}
    report = {
        "backend": BACKEND,
        "topology": args.topology,
        "conversations": args.conversations,
        "turns": args.turns,
        "repeats": args.repeats,
        "max_tokens": args.max_tokens,
        "same_answers": same,
        "results": results,
        "rows": rows,
    }
    out.write_text(json.dumps(report, indent=1))
    print(
        f"backend: {BACKEND}; topology {args.topology}; {args.conversations} chats at once × {args.turns} turns × "
        f"{args.repeats} repeats per configuration; same answers everywhere: {same}"
    )
    print(
        f"{'config':<10}{'turn 1 p50':>12}{'later p50':>11}{'later p90':>11}{'cached':>9}{'later p50 vs no-cache':>24}"
    )
    base = results["no-cache"]["later_turns_p50_ttft_ms"]
    for name in names:
        r = results[name]
        print(
            f"{name:<10}{r['first_turn_p50_ttft_ms']:>9.1f} ms{r['later_turns_p50_ttft_ms']:>8.1f} ms"
            f"{r['later_turns_p90_ttft_ms']:>8.1f} ms{100 * r['later_turns_cached_fraction']:>8.1f}%"
            f"{base / r['later_turns_p50_ttft_ms']:>23.2f}×"
        )
    print(f"wrote {out}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
