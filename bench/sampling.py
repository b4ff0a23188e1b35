"""What logprobs, penalties and logit bias cost per engine step, against plain greedy sampling.

    python -m bench.sampling [--vocab 32064] [--batches 1,8,64] [--repeats 50] [--device cpu|cuda]

No model: random logits of LLaVA-1.5-7B's vocabulary (32,064) for a batch of decoding requests, each with a
600-token prompt and 256 tokens generated, through the engine's own sampling step (`Sampler`, then
`logprobs_of` where asked). Configurations, every request of the batch alike:
  greedy        — argmax (the baseline);
  sampled       — temperature 0.8, top-p 0.9, top-k 50;
  logprobs      — greedy + each token's logprob and the top 5;
  penalties     — greedy + presence 0.5, frequency 0.5, repetition 1.1;
  logit bias    — greedy + 20 biased token ids.
Reports the median ms per step and its ratio to greedy, measured in the same run, per batch size.
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

import torch  # noqa: E402

from common.engine.sampler import Sampler, logprobs_of  # noqa: E402
from common.request import Request, Stage  # noqa: E402
from common.sampling import SamplingParams  # noqa: E402

CONFIGS = {
    "greedy": dict(temperature=0.0),
    "sampled": dict(temperature=0.8, top_p=0.9, top_k=50),
    "logprobs": dict(temperature=0.0, logprobs=5),
    "penalties": dict(temperature=0.0, presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.1),
    "logit bias": dict(temperature=0.0, logit_bias=tuple((t, 1.5) for t in range(100, 2100, 100))),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocab", type=int, default=32064)
    p.add_argument("--batches", default="1,8,64")
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--prompt", type=int, default=600)
    p.add_argument("--generated", type=int, default=256)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (the engine's per-worker setting)")
    p.add_argument("--out", default="bench/results/sampling.json")
    return p.parse_args(argv)


def requests_for(batch: int, params: dict, args) -> list[Request]:
    rng = torch.Generator().manual_seed(batch)
    out = []
    for i in range(batch):
        prompt = torch.randint(0, args.vocab, (args.prompt,), generator=rng).tolist()
        request = Request(
            f"r{i}", prompt, SamplingParams(max_tokens=args.generated + 16, seed=i, **params), first_stage=Stage.DECODE
        )
        request.output_token_ids = torch.randint(0, args.vocab, (args.generated,), generator=rng).tolist()
        out.append(request)
    return out


def step_ms(sampler: Sampler, logits: torch.Tensor, requests: list[Request], repeats: int, device: str) -> float:
    times = []
    for _ in range(repeats + 3):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        tokens = sampler(logits, requests)
        logprobs_of(logits, requests, tokens)
        if device == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times[3:])


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    sampler = Sampler(0)
    rows = []
    print(
        f"backend: the engine's sampling step alone (no model), torch {args.device}, {args.threads} thread(s); "
        f"vocab {args.vocab}, prompt {args.prompt}, generated {args.generated}; median of {args.repeats}"
    )
    print(f"{'batch':>5} {'config':<11} {'ms/step':>9} {'x greedy':>9}")
    for batch in (int(b) for b in args.batches.split(",")):
        logits = torch.randn(batch, args.vocab, generator=torch.Generator().manual_seed(7)).to(args.device)
        base = None
        for name, params in CONFIGS.items():
            ms = step_ms(sampler, logits, requests_for(batch, params, args), args.repeats, args.device)
            base = base if base is not None else ms
            rows.append(
                {"batch": batch, "config": name, "ms_per_step": round(ms, 4), "ratio_to_greedy": round(ms / base, 2)}
            )
            print(f"{batch:>5} {name:<11} {ms:>9.3f} {ms / base:>8.1f}x")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps({"backend": f"sampling step only, torch {args.device}", "args": vars(args), "rows": rows}, indent=1)
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
