"""The latency model's format and its pure functions.

Every stage has the same shape of cost, which a roofline gives and a least-squares fit can give:

    time(x) = overhead + max(floor, per_unit · (x + half_units)) + extra

x is the stage's batch size (images for encode, tokens for prefill, sequences for decode); `floor`
is the memory-bound time of reading the weights once; `per_unit · (x + half_units)` is the compute
time when the accelerator reaches a fraction x / (x + half_units) of its peak (small batches do not
fill it); `extra` is what grows with context: attention over the chunk's context for prefill,
reading the KV cache for decode. Throughput x / time(x) rises and flattens: the *saturation point*
(`saturation`) is the smallest x reaching 90% of the asymptote.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

FORMAT = "epdmesh-latency/1"


@dataclasses.dataclass(frozen=True, slots=True)
class StageCost:
    overhead_ms: float = 0.0
    floor_ms: float = 0.0
    per_unit_ms: float = 0.0
    half_units: float = 0.0
    quadratic_ms: float = 0.0  # prefill: per token × context token of attention; decode: per context token (KV read)

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"{f.name} must be a finite number >= 0, got {value}")

    def base_ms(self, units: float) -> float:
        if units <= 0:
            return 0.0
        return self.overhead_ms + max(self.floor_ms, self.per_unit_ms * (units + self.half_units))


@dataclasses.dataclass(frozen=True, slots=True)
class LatencyProfile:
    name: str
    source: str  # "measured" | "analytic"
    hardware: str
    model: str
    encode: StageCost
    prefill: StageCost
    decode: StageCost
    transfer_latency_ms: float
    transfer_gbps: float
    image_tokens: int  # placeholder tokens per image of this model
    notes: str = ""

    def __post_init__(self) -> None:
        if self.source not in ("measured", "analytic", "emulated"):
            raise ValueError(f"source must be measured, analytic or emulated, not {self.source!r}")
        if self.transfer_gbps <= 0 or self.image_tokens < 1:
            raise ValueError("transfer_gbps must be > 0 and image_tokens >= 1")

    def to_json(self) -> str:
        return json.dumps({"format": FORMAT, **dataclasses.asdict(self)}, indent=2) + "\n"

    @classmethod
    def from_json(cls, text: str) -> LatencyProfile:
        data = json.loads(text)
        if data.pop("format", None) != FORMAT:
            raise ValueError(f"not an {FORMAT} profile")
        for stage in ("encode", "prefill", "decode"):
            data[stage] = StageCost(**data[stage])
        return cls(**data)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json())

    @classmethod
    def load(cls, path: str | Path) -> LatencyProfile:
        return cls.from_json(Path(path).read_text())


def encode_ms(p: LatencyProfile, images: int) -> float:
    """One encode iteration over `images` images."""
    return p.encode.base_ms(images)


def prefill_chunk_ms(p: LatencyProfile, tokens: int, context: int = 0) -> float:
    """One iteration prefilling `tokens` prompt tokens that follow `context` already-cached tokens."""
    if tokens <= 0:
        return 0.0
    return p.prefill.base_ms(tokens) + p.prefill.quadratic_ms * tokens * (context + tokens / 2)


def prefill_ms(p: LatencyProfile, tokens: int, chunk: int | None = None) -> float:
    """A whole prompt of `tokens` tokens, in one iteration or in chunks of `chunk` tokens."""
    if tokens <= 0:
        return 0.0
    step = tokens if not chunk or chunk >= tokens else chunk
    return sum(prefill_chunk_ms(p, min(step, tokens - start), start) for start in range(0, tokens, step))


def decode_ms(p: LatencyProfile, batch: int, context_tokens: int) -> float:
    """One decode iteration of `batch` sequences holding `context_tokens` KV tokens between them."""
    if batch <= 0:
        return 0.0
    return p.decode.base_ms(batch) + p.decode.quadratic_ms * context_tokens


def mixed_cost(p: LatencyProfile, decodes: int, tokens: float) -> StageCost:
    """The cost curve of one forward over `decodes` decode rows and `tokens` prompt rows: the prefill's curve over
    all the rows, its roll-off at small sizes (`half_units`) the two stages' weighted by their shares of the rows.
    A batch of one kind costs what its stage's curve says; a few prompt tokens beside many decodes cost about what
    those rows add to a decode batch — not a whole prompt's roll-off (the prefill's `half_units`, calibrated on
    whole prompts, would charge a 1-token chunk ~30 ms on H20), which is what makes chunked prefill pay
    (Sarathi-Serve)."""
    if decodes <= 0 or tokens <= 0:
        return p.prefill if tokens > 0 else p.decode
    return dataclasses.replace(p.prefill, half_units=_mixed_half(p, decodes, tokens))


def mixed_ms(p: LatencyProfile, decodes: int, tokens: float) -> float:
    """`mixed_cost(p, decodes, tokens).base_ms(decodes + tokens)` without building the curve (the engine's and the
    simulator's per-iteration path)."""
    if decodes <= 0 or tokens <= 0:
        return (p.prefill if tokens > 0 else p.decode).base_ms(decodes + tokens)
    c = p.prefill
    return c.overhead_ms + max(c.floor_ms, c.per_unit_ms * (decodes + tokens + _mixed_half(p, decodes, tokens)))


def _mixed_half(p: LatencyProfile, decodes: int, tokens: float) -> float:
    return (decodes * p.decode.half_units + tokens * p.prefill.half_units) / (decodes + tokens)


def iteration_ms(
    p: LatencyProfile,
    images: int = 0,
    decodes: int = 0,
    decode_context: int = 0,
    chunks: tuple[tuple[int, int], ...] | list[tuple[int, int]] = (),
) -> float:
    """One engine iteration: `images` through the vision tower, then one forward over `decodes` sequences
    (holding `decode_context` KV tokens) and the prefill `chunks` (tokens, context before the chunk)
    flattened together — a mixed batch costs what its rows cost on the blend of the two stages' curves
    (`mixed_cost`), plus each chunk's attention and the decodes' KV reads."""
    total = encode_ms(p, images)
    prefill_tokens = sum(n for n, _ in chunks)
    if prefill_tokens:
        total += (
            mixed_ms(p, decodes, prefill_tokens)
            + p.decode.quadratic_ms * decode_context
            + sum(p.prefill.quadratic_ms * n * (c + n / 2) for n, c in chunks)
        )
    elif decodes:
        total += decode_ms(p, decodes, decode_context)
    return total


def chunked_iterations_ms(
    p: LatencyProfile, tokens: int, chunk: int, decodes: int = 0, decode_context: int = 0
) -> float:
    """The iterations that prefill `tokens` prompt tokens in chunks of `chunk`, each beside the same `decodes` (holding
    `decode_context` KV tokens): the sum of their `iteration_ms`, in closed form — k full chunks cost k times one
    chunk's rows and KV reads plus their attention, chunk² · k² / 2 token pairs in all, and the rest one more."""
    if tokens <= 0:
        return 0.0
    if chunk <= 0:
        raise ValueError(f"chunk must be > 0, got {chunk}")
    full, rest = divmod(tokens, chunk)
    total = 0.0
    if full:
        total = full * (mixed_ms(p, decodes, chunk) + p.decode.quadratic_ms * decode_context)
        total += p.prefill.quadratic_ms * chunk * chunk * full * full / 2
    if rest:
        total += iteration_ms(p, decodes=decodes, decode_context=decode_context, chunks=[(rest, full * chunk)])
    return total


def request_cost_ms(
    p: LatencyProfile, prompt_tokens: int, images: int, output_tokens: int, max_images: int = 64, cached_tokens: int = 0
) -> float:
    """The least instance time one request can take on this profile, however it is batched or placed: its
    images encoded in a full batch (`max_images`), every prompt and output token at the saturated per-token
    cost of a large mixed batch, plus its own attention (prefill) and KV reads (decode). Transfers and
    queueing are left out, so no scheduler beats it. `cached_tokens`: a prompt prefix whose KV a cache holds
    (not computed; its images neither, when it is the whole of them — pass `images` accordingly)."""
    if not 0 <= cached_tokens <= prompt_tokens:
        raise ValueError(f"cached_tokens must be within the prompt's {prompt_tokens}; got {cached_tokens}")
    encode = encode_ms(p, max_images) / max_images * images
    tokens = p.prefill.per_unit_ms * (prompt_tokens - cached_tokens + output_tokens)
    attention = p.prefill.quadratic_ms * (prompt_tokens * prompt_tokens - cached_tokens * cached_tokens) / 2
    kv_reads = p.decode.quadratic_ms * output_tokens * (prompt_tokens + output_tokens / 2)
    return encode + tokens + attention + kv_reads


def goodput_bound(p: LatencyProfile, instances: int, prompt_tokens: int, images: int, output_tokens: int) -> float:
    """Requests per second that `instances` accelerators of this profile cannot exceed on this request
    shape, at any SLO (every instance busy all the time at `request_cost_ms` per request)."""
    return instances * 1e3 / request_cost_ms(p, prompt_tokens, images, output_tokens)


def scaled(p: LatencyProfile, factor: float) -> LatencyProfile:
    """The same hardware `factor` times slower (every time × factor): time dilation, so an emulated mesh
    whose host cannot keep up in real time runs at 1/factor the rate with the same queueing."""
    if not factor > 0:
        raise ValueError("the time scale must be > 0")
    if factor == 1:
        return p

    def stage(c: StageCost) -> StageCost:
        return StageCost(
            c.overhead_ms * factor, c.floor_ms * factor, c.per_unit_ms * factor, c.half_units, c.quadratic_ms * factor
        )

    return dataclasses.replace(
        p,
        name=f"{p.name} ×{factor:g} time",
        encode=stage(p.encode),
        prefill=stage(p.prefill),
        decode=stage(p.decode),
        transfer_latency_ms=p.transfer_latency_ms * factor,
        transfer_gbps=p.transfer_gbps / factor,
        notes=f"{p.notes}; every time scaled by {factor:g}".lstrip("; "),
    )


def transfer_ms(p: LatencyProfile, num_bytes: int) -> float:
    return p.transfer_latency_ms + num_bytes / (p.transfer_gbps * 1e9) * 1e3 if num_bytes > 0 else 0.0


def saturation(time_of, limit: int = 1 << 16, fraction: float = 0.9) -> int:
    """Smallest batch x whose throughput x / time_of(x) reaches `fraction` of the best up to `limit`."""
    best = max(x / time_of(x) for x in _grid(limit))
    return next(x for x in _grid(limit) if x / time_of(x) >= fraction * best)


def _grid(limit: int):
    x = 1
    while x <= limit:
        yield x
        x = x + 1 if x < 16 else int(x * 1.0625) + 1
