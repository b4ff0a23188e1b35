"""A trace file as a workload (`--workload trace:PATH`): a trace a gateway recorded (`serve --record-trace`) or one in
Mooncake's format (`common/trace.py`), replayed as image chats with its own arrivals, lengths, shared prefixes and
pictures.

How a request of the trace becomes a chat body (planned on the replaying server's tokenizer, as the `conversation`
workload is):

1. The window: `--num-prompts` consecutive requests, its start drawn by `--seed` as the arrivals' window is
   (`workloads.window_start`); arrivals are the trace's own times, rescaled to each rate point's mean rate.
2. Words, one token each, and the request's pictures where the trace has them (a recorded trace keeps each picture's
   first placeholder position; Mooncake's traces have none): the words before the first picture as the system
   message (a template such as LLaVA's renders the user's pictures before the user's text: a system message is what
   comes before them), the pictures and the words after them as the user's message, in order. Its prompt length is
   the trace's `input_length` — the server's template and picture tokens counted (`/tokenize` on the replaying
   server; pictures are synthetic 640 × 480 JPEGs, equal trace ids the same picture) — so on the model that
   recorded it the replay is that long, on another model each picture takes that model's tokens.
3. Shared prefixes: each word is drawn by the trace's block id at the word's position in the recorded prompt (the
   pictures' tokens counted), so requests with equal leading ids get equal leading words and pictures. The
   template's own tokens are words here: the words shift by those few tokens against the recorded blocks, alike in
   every request.
4. The answer: `max_tokens` = the trace's `output_length` (at least 1), EOS ignored. A prompt that would not fit the
   server's context with its answer loses words from its end; one whose pictures alone do not fit is an error.
"""

from __future__ import annotations

import dataclasses
import functools
import random
import statistics
from pathlib import Path

from bench.conversation import IMAGE_SIZE, Vocabulary
from bench.workloads import Shape, chat_body, images, window_start
from common import trace

PREFIX = "trace:"
_SHAPE = Shape("trace", 0, IMAGE_SIZE)


def path_of(workload: str) -> Path | None:
    """The trace file a `trace:PATH` workload names; None for any other workload."""
    return Path(workload[len(PREFIX) :]).expanduser() if workload.startswith(PREFIX) else None


@functools.lru_cache(maxsize=4)
def rows_of(path: Path) -> tuple[trace.TraceRow, ...]:
    if not path.is_file():
        raise ValueError(f"trace:{path}: no such file")
    return tuple(trace.read(path))


def window(path: Path, n: int, seed: int) -> tuple[trace.TraceRow, ...]:
    rows = rows_of(path)
    if n > len(rows):
        raise ValueError(f"trace:{path} holds {len(rows)} requests; ask for at most that many (--num-prompts)")
    start = window_start(n, seed, len(rows))
    return rows[start : start + n]


@dataclasses.dataclass(frozen=True, slots=True)
class Planned:
    """One request: its content in order — ("text", [(block id, offset in block, words)…]) or ("image", trace
    id) —, its answer's length, and its prompt length as the replaying server counts it."""

    parts: tuple[tuple[str, object], ...]
    output_tokens: int
    prompt_tokens: int
    image_ends: tuple[int, ...]  # where each picture's tokens end in the recorded prompt (for the bound)


class Overheads:
    """What a chat adds to its words on the replaying server (template and picture tokens), measured once per layout
    — the order of its pictures and runs of words, e.g. ("text", "image", "text") — with `count(body)`
    (`/tokenize`'s answer): the template may put a separator between parts."""

    def __init__(self, count, vocab: Vocabulary):
        self.count, self.vocab = count, vocab
        self._of: dict[tuple[str, ...], int] = {}

    def __call__(self, layout: tuple[str, ...]) -> int:
        if layout not in self._of:
            uris = iter(images(_SHAPE, layout.count("image"), 0))
            word = " " + self.vocab.words[0]
            parts = [("image", next(uris)) if kind == "image" else (kind, word) for kind in layout]
            body = {"messages": _messages(parts)}
            self._of[layout] = self.count(body)["count"] - len(layout) + layout.count("image")
        return self._of[layout]


def plan(rows, vocab: Vocabulary, overhead) -> list[Planned]:
    """Each row's parts (see the module's description), cut to `vocab.max_model_len`."""
    out = []
    for number, row in enumerate(rows):
        output = max(1, row.output_length)
        layout = ("image",) * len(row.images) + ("text",)  # a first guess, then the layout the words make
        for _ in range(3):
            cost = overhead(layout)
            room = vocab.max_model_len - output - cost
            if room < 1:
                raise ValueError(
                    f"request {number} of the trace: its {len(row.images)} pictures and {output}-token answer do not "
                    f"fit a context of {vocab.max_model_len} tokens"
                )
            words = max(1, min(row.input_length - cost, room))
            planned = _parts(row, words, output, cost + words)
            if _layout(planned) == layout:
                break
            layout = _layout(planned)
        out.append(planned)
    return out


def _layout(planned: Planned) -> tuple[str, ...]:
    return tuple(kind for kind, _ in planned.parts)


def _parts(row: trace.TraceRow, words: int, output: int, prompt_tokens: int) -> Planned:
    marks = list(enumerate(row.images))
    # the pictures' positions: `at` where the recorder kept it, else every picture first
    starts = [img.at for img in row.images]
    if any(s is None for s in starts):
        starts, position = [], 0
        for img in row.images:
            starts.append(position)
            position += img.tokens
    parts: list[tuple[str, object]] = []
    ends = []
    text: list[tuple[int, int, int]] = []
    position, left, picture = 0, words, 0  # position in the recorded prompt; words still to place

    def flush():
        if text:
            parts.append(("text", tuple(text)))
            text.clear()

    while left > 0 or picture < len(marks):
        next_image = starts[picture] if picture < len(marks) else None
        if next_image is not None and position >= next_image:
            flush()
            img = marks[picture][1]
            parts.append(("image", img.id))
            position = max(position, next_image) + img.tokens
            ends.append(position)
            picture += 1
            continue
        if left <= 0:  # words run out before a picture: it still comes (the prompt's words were cut)
            position = next_image
            continue
        stop = min(position + left, next_image) if next_image is not None else position + left
        while position < stop:  # a run of words within one block
            block = position // row.block_tokens
            end = min(stop, (block + 1) * row.block_tokens)
            block_id = row.hash_ids[block] if block < len(row.hash_ids) else -1 - block
            text.append((block_id, position - block * row.block_tokens, end - position))
            left -= end - position
            position = end
    flush()
    if len(parts) > 1 and parts[0][0] == "text":  # words before the first picture: a system message, which a
        parts[0] = ("system", parts[0][1])  # template renders before the user's turn (LLaVA's puts pictures first)
    return Planned(tuple(parts), output, prompt_tokens, tuple(ends))


def block_words(vocab: Vocabulary, block_id: int, offset: int, count: int, seed: int, variant: int) -> str:
    """Words `offset`…`offset + count` of the run that block `block_id` stands for (the same wherever it occurs)."""
    rng = random.Random(f"trace:{seed}:{variant}:{block_id}")
    drawn = [rng.choice(vocab.words) for _ in range(offset + count)]
    return "".join(" " + w for w in drawn[offset:])


def request_bodies(
    planned: list[Planned], vocab: Vocabulary, model: str, seed: int = 0, variant: int = 0
) -> list[dict]:
    """The chat bodies (streamed, usage last, token ids per chunk, as the other workloads'): each picture id its own
    synthetic picture, each rate point (`variant`) its own pictures and words."""
    ids = list(dict.fromkeys(i for p in planned for kind, i in p.parts if kind == "image"))
    uris = dict(zip(ids, images(_SHAPE, len(ids), seed, variant))) if ids else {}
    bodies = []
    for p in planned:
        parts = [
            (kind, uris[value] if kind == "image" else "".join(block_words(vocab, *b, seed, variant) for b in value))
            for kind, value in p.parts
        ]
        bodies.append(chat_body(model, p.output_tokens, _messages(parts)))
    return bodies


def _messages(parts: list[tuple[str, str]]) -> list[dict]:
    """(kind, text or picture URI) parts as chat messages: a leading "system" part the system message, the rest the
    user's, in order."""
    out = []
    if parts and parts[0][0] == "system":
        out.append({"role": "system", "content": parts[0][1]})
        parts = parts[1:]
    content = [
        {"type": "image_url", "image_url": {"url": value}} if kind == "image" else {"type": "text", "text": value}
        for kind, value in parts
    ]
    return out + [{"role": "user", "content": content}]


def shared_prefixes(rows) -> list[int]:
    """Per request, the recorded prompt tokens it shares with an earlier request of the window (`trace.
    shared_prefixes`), less its last token, which a prefix cache never skips."""
    return [max(min(s, r.input_length - 1), 0) for s, r in zip(trace.shared_prefixes(rows), rows)]


def workload(path: Path, n: int, seed: int, vocab: Vocabulary, model: str) -> tuple:
    """(variant → the `n` bodies, what the report keeps of the workload) for `bench.bodies.workload_of`; `vocab`
    from `conversation.calibrate` (its `count` asks the replaying server)."""
    rows = window(path, n, seed)
    planned = plan(rows, vocab, Overheads(vocab.count, vocab))
    shared = shared_prefixes(rows)
    times = [r.timestamp_ms / 1e3 for r in rows]
    span = times[-1] - times[0]
    meta = {
        "trace": str(path),
        "trace_rate": (len(rows) - 1) / span if span > 0 else None,
        "output_tokens": statistics.fmean(p.output_tokens for p in planned),
        "images_per_request": statistics.fmean(len(r.images) for r in rows),
        "mean_prompt_tokens": statistics.fmean(p.prompt_tokens for p in planned),
        "ideal_shared_fraction": sum(shared) / sum(r.input_length for r in rows),
        "requests": [  # [prompt, shared prefix, output, pictures not in the shared prefix]: the bound's input
            [p.prompt_tokens, min(s, p.prompt_tokens - 1), p.output_tokens, sum(e > s for e in p.image_ends)]
            for p, s in zip(planned, shared)
        ],
    }
    return (lambda variant: request_bodies(planned, vocab, model, seed, variant)), meta


def arrivals_of(workload: str, n: int, seed: int, default):
    """The arrival times a sweep of `workload` rescales: a trace file's own, for the window of `n` requests its
    requests come from (`window`); else `default` (the Mooncake trace's)."""
    path = path_of(workload)
    if path is None:
        return default
    return [r.timestamp_ms / 1e3 for r in window(path, n, seed)]


def requests_in(workload: str) -> int | None:
    """How many requests a trace file holds; None for any other workload."""
    path = path_of(workload)
    return None if path is None else len(rows_of(path))
