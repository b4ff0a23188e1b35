"""A workload's request bodies and what a report keeps of its shape: a dataset shape of `bench/workloads.py` (every
request new to the server), a `conversation` window of the Mooncake trace planned on the server's own tokenizer
(`bench/conversation.py`), a trace file (`trace:PATH`, `bench/recorded.py`) or a shifting load's phases (`A>B>A`,
each trace phase its own window). `bench goodput`, `sim goodput` and `epdmesh plan` send the same bodies."""

from __future__ import annotations

import statistics

from bench import conversation, recorded
from bench.workloads import (
    SHAPES,
    TracePhase,
    phase_runs,
    phased_bodies,
    phases_of,
    request_bodies,
    trace_scale_of,
)


def workload_of(workload: str, calibrate, model: str, args) -> tuple:
    """(variant → the workload's `--num-prompts` request bodies, what the report keeps of its shape). A
    `conversation` is planned on the server's own tokenizer (`bench/conversation.py`): `calibrate()` gives its
    `Vocabulary`."""
    path = recorded.path_of(workload)
    if path is not None:  # a trace file: its own requests and arrivals (`bench/recorded.py`)
        return recorded.workload(path, args.num_prompts, args.seed, calibrate(), model)
    scale = trace_scale_of(workload, args.trace_scale)
    phases = phases_of(workload, args.trace_scale)
    if phases:
        vocab = calibrate() if any(isinstance(p, TracePhase) for p in phases) else None
        runs = phase_runs(phases, args.num_prompts, args.seed)
        planned = {  # each conversation run's requests, planned once (the variant changes only words and images)
            seed: conversation.plan(size, seed, vocab, p.scale) for p, size, seed in runs if isinstance(p, TracePhase)
        }

        def trace_run(phase: TracePhase, size: int, seed: int, variant: int) -> list[dict]:
            return conversation.request_bodies(planned[seed], vocab, model, seed, variant)

        outputs = [
            sum(q.output_tokens for q in planned[seed]) if isinstance(p, TracePhase) else p.output_tokens * size
            for p, size, seed in runs
        ]
        return (
            lambda variant: phased_bodies(phases, args.num_prompts, model, args.seed, variant, trace_run),
            {
                "output_tokens": sum(outputs) / args.num_prompts,
                "images_per_request": sum(p.images * size for p, size, _ in runs) / args.num_prompts,
                "phases": [p.name for p in phases],
            },
        )
    if scale is None:
        shape = SHAPES[workload]
        return (
            lambda variant: request_bodies(shape, args.num_prompts, model, seed=args.seed, variant=variant),
            {"output_tokens": shape.output_tokens, "images_per_request": shape.images},
        )
    vocab = calibrate()
    planned = conversation.plan(args.num_prompts, args.seed, vocab, scale)
    shared = conversation.ideal_shared_tokens(planned, vocab)
    prompts = [p.text_tokens + vocab.chat_tokens for p in planned]
    meta = {
        "output_tokens": statistics.fmean(p.output_tokens for p in planned),
        "trace_scale": scale,
        "mean_prompt_tokens": statistics.fmean(prompts),
        "ideal_shared_fraction": sum(shared) / sum(prompts),
        "requests": [
            [n, s, p.output_tokens, int(s <= p.blocks[0][1])]  # its image, unless a turn before has it
            for n, s, p in zip(prompts, shared, planned)
        ],
    }
    return (lambda variant: conversation.request_bodies(planned, vocab, model, args.seed, variant)), meta
