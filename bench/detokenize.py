"""What streaming text costs per token: decoding the whole output again (what the gateway's SSE and the
engine's stop-string check did until session 11) against `common.detokenizer.IncrementalDetokenizer`.

    python -m bench.detokenize [--lengths 256,1024,4096] [--repeats 3]

Runs on the default checkpoint's tokenizer (no model compute). For each output length: median over
--repeats of the mean time per token of each method, and their ratio, measured in the same run; checks
that both give the same text.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

if not __package__:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SENTENCE = "The kitchen is a small room with a table and four chairs, and the window looks at the garden."


def per_token_ms(decode, ids: list[int], incremental: bool) -> tuple[float, str]:
    from common.detokenizer import IncrementalDetokenizer

    start = time.perf_counter()
    if incremental:
        detok = IncrementalDetokenizer(decode)
        for i in range(len(ids)):
            detok.push(ids[i : i + 1])
        detok.finish()
        text = detok.text
    else:
        for i in range(1, len(ids) + 1):
            text = decode(ids[:i])
    return (time.perf_counter() - start) / len(ids) * 1e3, text


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", default="256,1024,4096")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    from common.model.processor import ChatProcessor
    from epdmesh.checkpoints import ensure_default_model

    processor = ChatProcessor(ensure_default_model())
    words = processor.tokenizer(SENTENCE, add_special_tokens=False)["input_ids"]
    rng = random.Random(0)
    print(
        f"tokenizer of the default checkpoint ({len(processor.tokenizer)} tokens); ms per streamed token, "
        f"median of {args.repeats}"
    )
    print(f"{'output tokens':>14}{'whole decode':>14}{'incremental':>14}{'ratio':>8}")
    for n in (int(x) for x in args.lengths.split(",")):
        ids = [rng.choice(words) for _ in range(n)]
        runs = {False: [], True: []}
        for _ in range(args.repeats):
            for incremental in (False, True):
                ms, text = per_token_ms(processor.detokenize, ids, incremental)
                runs[incremental].append(ms)
                if text != processor.detokenize(ids):
                    raise SystemExit(f"{'incremental' if incremental else 'whole'} text differs at {n} tokens")
        whole, inc = statistics.median(runs[False]), statistics.median(runs[True])
        print(f"{n:>14}{whole:>14.4f}{inc:>14.4f}{whole / inc:>7.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
