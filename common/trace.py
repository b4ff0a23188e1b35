"""A request trace: what a gateway served, one JSON object a request, in the Mooncake trace's format (FAST'25
release: `timestamp`, `input_length`, `output_length`, `hash_ids`) with a multimodal request's images added.

A gateway records one (`serve --record-trace`, `services/gateway/trace_record.py`); `epdmesh sim goodput`,
`epdmesh plan` and `epdmesh bench goodput` replay one as a workload (`--workload trace:PATH`, `bench/recorded.py`),
a recorded trace or Mooncake's own. Fields of a line:

- `timestamp`: arrival, in milliseconds (a recorded trace: since the Unix epoch; Mooncake's: since its first request);
- `input_length`: the prompt's tokens as served, its images' placeholder tokens included;
- `output_length`: the tokens generated;
- `hash_ids`: one id per block of prompt tokens (the last block may be partial), each chained on the ones before:
  equal ids are an equal prefix, images included;
- `block_tokens` (recorded traces): the tokens a block holds — 16 as a gateway records them by default, the engines'
  KV block, so that every prefix the engines can share shows —; absent: Mooncake's 512;
- `images` (recorded traces): per image in prompt order, `id` (equal ids, equal pictures), `tokens` (its
  placeholders) and `at` (the first one's position);
- `max_tokens`, `finish_reason`, `ttft_ms` (recorded traces): what the client asked for and what it got.

The ids are hashes, not the prompt's text: a block's id is a BLAKE2b digest of the blocks before it and its tokens
(and of its images' content hashes and the request's `cache_salt`), cut to 53 bits so that every JSON reader keeps it
exact. What a trace discloses is lengths, timing, and which requests share which prefixes and pictures; whoever holds
a candidate text can still test whether a block was that text (a system prompt, say).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterable, Sequence
from pathlib import Path

from common.block_pool import chain_hashes

MOONCAKE_BLOCK = 512  # Mooncake's block: a hash id per 512 prompt tokens (a line without `block_tokens`)
RECORD_BLOCK = 16  # a recorded trace's, by default: the engines' KV block, the steps in which prefixes are cached
ID_BITS = 53  # ids a JSON number keeps exactly (a double's mantissa)
_PAD = -1  # a token id no tokenizer makes: pads the last, partial block so that it gets an id of its own


@dataclasses.dataclass(frozen=True, slots=True)
class TraceImage:
    id: int
    tokens: int
    at: int | None = None  # its first placeholder's position in the prompt


@dataclasses.dataclass(frozen=True, slots=True)
class TraceRow:
    """One request of a trace. `timestamp_ms` as the file has it (`read` makes them relative to the first)."""

    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    images: tuple[TraceImage, ...] = ()
    max_tokens: int | None = None
    finish_reason: str | None = None
    ttft_ms: float | None = None
    block_tokens: int = MOONCAKE_BLOCK

    def as_json(self) -> dict:
        out = {
            "timestamp": self.timestamp_ms,
            "input_length": self.input_length,
            "output_length": self.output_length,
            "hash_ids": list(self.hash_ids),
        }
        if self.block_tokens != MOONCAKE_BLOCK:
            out["block_tokens"] = self.block_tokens
        if self.images:
            out["images"] = [
                {"id": i.id, "tokens": i.tokens, **({"at": i.at} if i.at is not None else {})} for i in self.images
            ]
        for name in ("max_tokens", "finish_reason", "ttft_ms"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        return out


def hash_ids(
    token_ids: Sequence[int], marks: Sequence[tuple[int, int]] = (), salt: str = "", block: int = RECORD_BLOCK
) -> tuple[int, ...]:
    """One id per `block` tokens of the prompt, the last block partial, each a prefix identity (`chain_hashes`, the
    prefix cache's own hashing: `marks` are its images' (position, identity), `salt` the request's `cache_salt`)."""
    padded = list(token_ids) + [_PAD] * (-len(token_ids) % block)
    mask = (1 << ID_BITS) - 1
    return tuple(h & mask for h in chain_hashes(padded, block, marks, salt))


def image_id(content_hash: str) -> int:
    """A picture's id in a trace: its content hash cut to `ID_BITS` (equal pictures, equal ids)."""
    import hashlib

    return int.from_bytes(hashlib.blake2b(content_hash.encode(), digest_size=8).digest(), "little") & (
        (1 << ID_BITS) - 1
    )


def row_of(obj: dict, where: str = "") -> TraceRow:
    """A line's object as a row; ValueError naming `where` and the field for one that is missing or wrong."""
    try:
        images = tuple(
            TraceImage(int(i["id"]), int(i["tokens"]), int(i["at"]) if i.get("at") is not None else None)
            for i in obj.get("images") or ()
        )
        row = TraceRow(
            float(obj["timestamp"]),
            int(obj["input_length"]),
            int(obj["output_length"]),
            tuple(int(h) for h in obj.get("hash_ids") or ()),
            images,
            int(obj["max_tokens"]) if obj.get("max_tokens") is not None else None,
            obj.get("finish_reason"),
            float(obj["ttft_ms"]) if obj.get("ttft_ms") is not None else None,
            int(obj.get("block_tokens") or MOONCAKE_BLOCK),
        )
    except KeyError as e:
        raise ValueError(f"{where}: no {e.args[0]!r} field") from None
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: {e}") from None
    if row.input_length < 1 or row.output_length < 0 or row.block_tokens < 1:
        raise ValueError(f"{where}: input_length and block_tokens must be ≥ 1, output_length ≥ 0")
    if sum(i.tokens for i in row.images) > row.input_length:
        raise ValueError(f"{where}: its images' tokens exceed its input_length")
    ats = [i.at for i in row.images if i.at is not None]
    if any(a < 0 or a >= row.input_length for a in ats) or ats != sorted(ats):
        raise ValueError(f"{where}: its images' positions (`at`) must rise within the prompt")
    return row


def read(path: str | Path) -> list[TraceRow]:
    """A trace file's requests in arrival order, their timestamps made relative to the first arrival (a recorded
    trace's lines are written as requests finish, not as they arrive). A line that is not a request is a ValueError
    naming it; an empty file too."""
    path = Path(path)
    rows = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{number}: not JSON ({e.msg})") from None
        if not isinstance(obj, dict):
            raise ValueError(f"{path}:{number}: not a JSON object")
        rows.append(row_of(obj, f"{path}:{number}"))
    if not rows:
        raise ValueError(f"{path}: no requests in it")
    rows.sort(key=lambda r: r.timestamp_ms)  # stable: Mooncake's equal stamps keep their order
    first = rows[0].timestamp_ms
    return [dataclasses.replace(r, timestamp_ms=r.timestamp_ms - first) for r in rows]


def write(rows: Iterable[TraceRow | dict], path: str | Path) -> int:
    """Rows (or their JSON objects) to `path`, one a line; how many."""
    count = 0
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row.as_json() if isinstance(row, TraceRow) else row, separators=(",", ":")) + "\n")
            count += 1
    return count


def shared_prefixes(rows: Sequence[TraceRow]) -> list[int]:
    """Per request, the prompt tokens it shares with an earlier request of `rows`: its leading block ids that an
    earlier request had at the same places (a chained id equal at an index is an equal prefix)."""
    seen: set[tuple[int, int, int]] = set()  # (block size, index, id)
    out = []
    for row in rows:
        shared = 0
        for index, block_id in enumerate(row.hash_ids):
            if (row.block_tokens, index, block_id) not in seen:
                break
            shared = min((index + 1) * row.block_tokens, row.input_length)
        out.append(shared)
        seen.update((row.block_tokens, i, h) for i, h in enumerate(row.hash_ids))
    return out


def summary(rows: Sequence[TraceRow]) -> dict:
    """What a trace holds, as `epdmesh trace stats` prints it: its span and rates (mean, and its busiest minute's,
    minutes counted from its first arrival),
    prompt and answer lengths, pictures, the prompt tokens an earlier request of the trace shares (what a prefix
    cache that never evicts could skip), finish reasons and the recorded TTFTs."""
    import collections
    import statistics

    def quantiles(values: list[float]) -> dict:
        if not values:
            return {}
        values = sorted(values)
        pick = lambda q: values[min(len(values) - 1, int(q * len(values)))]  # noqa: E731
        return {"mean": statistics.fmean(values), "p50": pick(0.5), "p90": pick(0.9), "p99": pick(0.99)}

    times = [r.timestamp_ms / 1e3 for r in rows]
    span = times[-1] - times[0] if rows else 0.0
    per_minute = collections.Counter(int((t - times[0]) // 60) for t in times)
    shared = sum(shared_prefixes(rows))
    prompts = sum(r.input_length for r in rows)
    return {
        "requests": len(rows),
        "span_s": span,
        "mean_rate": (len(rows) - 1) / span if span > 0 else None,
        "busiest_minute_rate": max(per_minute.values()) / 60 if span >= 60 else None,
        "prompt_tokens": quantiles([r.input_length for r in rows]),
        "output_tokens": quantiles([r.output_length for r in rows]),
        "images_per_request": statistics.fmean(len(r.images) for r in rows) if rows else 0.0,
        "shared_prefix_fraction": shared / prompts if prompts else 0.0,
        "finish_reasons": dict(collections.Counter(r.finish_reason or "unrecorded" for r in rows)),
        "ttft_ms": quantiles([r.ttft_ms for r in rows if r.ttft_ms is not None]),
        "block_tokens": sorted({r.block_tokens for r in rows}),
    }


def cut(rows: Sequence[TraceRow], start_s: float | None = None, end_s: float | None = None) -> list[TraceRow]:
    """The rows that arrived in [start_s, end_s) seconds from the trace's first arrival (either end open)."""
    lo = -math.inf if start_s is None else start_s * 1e3
    hi = math.inf if end_s is None else end_s * 1e3
    return [r for r in rows if lo <= r.timestamp_ms < hi]


def busiest(rows: Sequence[TraceRow], span_s: float) -> tuple[float, float]:
    """The [start, end) seconds of the `span_s`-second window holding the most arrivals (the earliest such)."""
    times = [r.timestamp_ms / 1e3 for r in rows]
    best, best_start, j = 0, times[0] if times else 0.0, 0
    for i, t in enumerate(times):  # windows that start at an arrival
        while j < len(times) and times[j] < t + span_s:
            j += 1
        if j - i > best:
            best, best_start = j - i, t
    return best_start, best_start + span_s
