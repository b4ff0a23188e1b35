"""Workloads of the goodput benchmark: request shapes like the papers' datasets, arrivals from a real trace.

Shapes (TriInfer and Tropical evaluate on these; one image per request, a short prompt and a fixed
output length — `max_tokens` with EOS ignored, as TriInfer does, so every configuration gets the same
load). No dataset can be downloaded here, so prompts are drawn from templates shaped like each
dataset's and images are synthetic JPEGs of a typical size for it (every image becomes 576 tokens at
336 px on LLaVA-1.5; the source size only changes the gateway's decode/resize work):

| workload | prompt (what it looks like) | prompt words | output tokens | source image |
|---|---|---|---|---|
| textcaps | "Provide a one-sentence caption for the provided image." (+ a style hint) | 8–14 | 32 | 512×384 |
| pope     | "Is there a <object> in the image? Answer yes or no." | 10–12 | 4 | 640×480 |
| mme      | "<question about the image>? Please answer yes or no." | 12–20 | 2 | 512×512 |
| textvqa  | "<question about text in the image>? Reference OCR tokens: <6–12 words>. (a)" | 25–40 | 10 | 512×384 |
| vizwiz   | "<question>? (b) (a)" | 25–35 | 10 | 480×640 |
| detail   | "Describe this image in detail." (+ what to cover) | 5–16 | 384 | 512×384 |
| document | "Page text: <the page's OCR text>. <question>? (a)" | 370–430 | 16 | 512×384 |
| multiimage | "Here are four pictures. <a question comparing them>" (four images) | 14–20 | 32 | 4 × 512×384 |

(a) "Answer the question using a single word or phrase."
(b) "When the provided information is insufficient, respond with 'Unanswerable'."

Output lengths follow each dataset's answers (TextCaps captions ≈ 12 words; POPE/MME yes/no; TextVQA and
VizWiz a word or short phrase, padded to 10 tokens). Two shapes stand at the ends of the stage mix: `detail`,
LLaVA-Bench's detailed description, whose answers run to a few hundred tokens (decode-heavy), and `document`, a
question about a scanned page whose OCR text comes with the prompt (~1,000 text tokens; prefill-heavy); and
`multiimage`, a question over four pictures at once (multi-image benchmarks such as MMMU and BLINK; 2,304 image
tokens: encode-heavy, where the papers expect an encode stage of its own to pay).
Arrivals: the Mooncake conversation trace's timestamps (`bench/data/`, one hour of production traffic, recorded
in 3 s slots: each slot's requests are spread uniformly over it), a window of `n` consecutive requests rescaled
so its mean rate is the target rate — the trace's burstiness at any rate; or a Poisson process.
"""

from __future__ import annotations

import base64
import dataclasses
import functools
import io
import random
import statistics
from pathlib import Path

# the timestamps of the Mooncake FAST'25 conversation trace (Apache-2.0), one per line, in milliseconds
TRACE = Path(__file__).resolve().parent / "data" / "mooncake_conversation_arrivals.txt"
OBJECTS = (
    "dog",
    "cat",
    "car",
    "bus",
    "person",
    "chair",
    "bottle",
    "cup",
    "bird",
    "umbrella",
    "clock",
    "book",
    "bicycle",
    "traffic light",
    "bench",
    "horse",
    "laptop",
    "phone",
    "pizza",
    "sink",
)
WORDS = (
    "red",
    "sign",
    "street",
    "open",
    "sale",
    "coffee",
    "station",
    "exit",
    "park",
    "north",
    "main",
    "free",
    "menu",
    "hotel",
    "city",
    "bank",
    "stop",
    "book",
    "cafe",
    "market",
    "road",
    "label",
    "brand",
    "store",
)


@dataclasses.dataclass(frozen=True, slots=True)
class Shape:
    name: str
    output_tokens: int
    image_size: tuple[int, int]
    images: int = 1  # per request

    def prompt(self, rng: random.Random) -> str:
        return _PROMPTS[self.name](rng)


def _textcaps(rng: random.Random) -> str:
    hint = rng.choice(["", " Mention any visible text.", " Be specific about the setting.", " Keep it short."])
    return "Provide a one-sentence caption for the provided image." + hint


def _pope(rng: random.Random) -> str:
    return f"Is there a {rng.choice(OBJECTS)} in the image? Answer yes or no."


def _mme(rng: random.Random) -> str:
    subject = rng.choice(OBJECTS)
    question = rng.choice(
        [
            f"Is the {subject} on the left side of the picture",
            f"Are there exactly {rng.randint(2, 5)} {subject}s in this image",
            f"Is this photo taken in a place where a {subject} would usually be found",
            f"Is the {subject} in this image {rng.choice(WORDS)}",
        ]
    )
    return f"{question}? Please answer yes or no."


def _textvqa(rng: random.Random) -> str:
    ocr = " ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 12)))
    question = rng.choice(
        [
            "What is written on the sign",
            "What brand is shown",
            "What number is on the bus",
            "What does the label say",
            "What is the name of the store",
        ]
    )
    return f"{question}? Reference OCR tokens: {ocr}. Answer the question using a single word or phrase."


def _vizwiz(rng: random.Random) -> str:
    question = rng.choice(
        [
            "What is this",
            "What color is this shirt",
            "What does this can say",
            "Can you tell me what this box is",
            "What is the expiration date on this",
        ]
    )
    return (
        f"{question}? When the provided information is insufficient, respond with 'Unanswerable'. "
        "Answer the question using a single word or phrase."
    )


def _multiimage(rng: random.Random) -> str:
    question = rng.choice(
        [
            "What do they have in common, and how does each differ from the others?",
            f"In which of them is there a {rng.choice(OBJECTS)}?",
            "Put them in the order they were most likely taken, and say why.",
            "Which one does not belong with the others?",
        ]
    )
    return "Here are four pictures. " + question


def _detail(rng: random.Random) -> str:
    cover = rng.choice(["", " Include the objects, their colors and where they are.", " Mention any visible text."])
    return "Describe this image in detail." + cover


def _document(rng: random.Random) -> str:
    ocr = " ".join(rng.choice(WORDS) for _ in range(rng.randint(360, 420)))
    question = rng.choice(["What is the total", "Who signed the letter", "What is the date", "What is the title"])
    return f"Page text: {ocr}. {question}? Answer the question using a single word or phrase."


_PROMPTS = {
    "detail": _detail,
    "document": _document,
    "multiimage": _multiimage,
    "textcaps": _textcaps,
    "pope": _pope,
    "mme": _mme,
    "textvqa": _textvqa,
    "vizwiz": _vizwiz,
}
SHAPES = {
    "textcaps": Shape("textcaps", 32, (512, 384)),
    "pope": Shape("pope", 4, (640, 480)),
    "mme": Shape("mme", 2, (512, 512)),
    "textvqa": Shape("textvqa", 10, (512, 384)),
    "vizwiz": Shape("vizwiz", 10, (480, 640)),
    "detail": Shape("detail", 384, (512, 384)),
    "document": Shape("document", 16, (512, 384)),
    "multiimage": Shape("multiimage", 32, (512, 384), images=4),
}
WORKLOADS = (*SHAPES, "conversation")  # conversation: bench/conversation.py
TRACE_BLOCK_TOKENS = 512  # the Mooncake trace's hash ids each stand for this many prompt tokens


@dataclasses.dataclass(frozen=True, slots=True)
class TracePhase:
    """A phase of the `conversation` workload in a shifting load: the Mooncake trace's requests, lengths ÷ `scale`
    (`bench/conversation.py`; the phase's own window of the trace)."""

    scale: int
    images = 1  # per request: its conversation's picture

    @property
    def name(self) -> str:
        return f"conversation/{self.scale}"


Phase = Shape | TracePhase


def phases_of(workload: str, trace_scale: int = 16) -> list[Phase] | None:
    """A load that shifts between dataset shapes, `document>detail>document`, or between a shape and the
    `conversation` workload (`conversation>detail>conversation`; `conversation/N` names its trace scale, plain
    `conversation` takes `trace_scale`): the requests in that many equal runs, one shape each, in that order (the
    arrivals are the workload's as any other's, so each phase lasts its share of the point's time); None for any
    other workload. Raises ValueError naming an unknown shape."""
    if ">" not in workload:
        return None
    out: list[Phase] = []
    for name in (n.strip() for n in workload.split(">")):
        base, slash, scale = name.partition("/")
        if base == "conversation":
            value = int(scale) if scale.isdigit() else 0 if slash else trace_scale
            if value < 1 or TRACE_BLOCK_TOKENS % value:
                raise ValueError(f"{workload!r}: the trace scale must divide {TRACE_BLOCK_TOKENS}; got {name!r}")
            out.append(TracePhase(value))
        elif name in SHAPES:
            out.append(SHAPES[name])
        else:
            raise ValueError(
                f"{workload!r}: each phase is a dataset shape ({', '.join(SHAPES)}) or conversation[/N]; got {name!r}"
            )
    return out


def phase_runs(phases: list[Phase], n: int, seed: int = 0) -> list[tuple[Phase, int, int]]:
    """(phase, requests, seed) of each of the `n` requests' runs: sizes within one of each other (`phase_sizes`), each
    run its own seed — a shape met again is not a cache hit, a conversation phase is its own window of the trace."""
    return [
        (phase, size, seed * len(phases) + i)
        for i, (phase, size) in enumerate(zip(phases, phase_sizes(n, len(phases))))
    ]


def phased_bodies(
    phases: list[Phase], n: int, model: str, seed: int = 0, variant: int = 0, trace_run=None
) -> list[dict]:
    """`n` request bodies in len(phases) consecutive runs (`phase_runs`), each run the bodies of its shape
    (`request_bodies`) with its own prompts and pictures; a conversation phase's run is `trace_run(phase, requests,
    seed, variant)` (`bench/conversation.py`'s, which needs the server's vocabulary)."""
    out = []
    for phase, size, run_seed in phase_runs(phases, n, seed):
        if not isinstance(phase, TracePhase):
            out += request_bodies(phase, size, model, seed=run_seed, variant=variant)
        elif trace_run is None:
            raise ValueError("a conversation phase needs the server's vocabulary (bench/conversation.py)")
        else:
            out += trace_run(phase, size, run_seed, variant)
    return out


def phase_sizes(n: int, phases: int) -> list[int]:
    """How many of `n` requests each of `phases` runs holds: equal, the first ones one more where n does not divide."""
    return [n // phases + (i < n % phases) for i in range(phases)]


def trace_scale_of(workload: str, default: int) -> int | None:
    """A conversation workload's trace scale: `conversation/8` names its own, `conversation` takes `default`;
    None for a dataset shape or a shift between them (`phases_of`). Raises ValueError for a name that is neither,
    or a scale that does not divide the trace's 512-token blocks."""
    if workload.startswith("trace:"):  # a trace file (`bench/recorded.py`): replayed at its own lengths
        if not Path(workload[len("trace:") :]).expanduser().is_file():
            raise ValueError(f"{workload!r}: no such trace file")
        return None
    if phases_of(workload):
        return None
    name, slash, scale = workload.partition("/")
    if name != "conversation":
        if name not in SHAPES or slash:
            raise ValueError(
                f"unknown workload {workload!r}; choose from {', '.join(WORKLOADS)}, conversation/N, A>B>… "
                "(a shift between shapes) or trace:PATH (a recorded trace)"
            )
        return None
    value = default if not slash else int(scale) if scale.isdigit() else 0
    if value < 1 or TRACE_BLOCK_TOKENS % value:
        what = repr(workload) if slash else "--trace-scale"
        raise ValueError(f"{what}: the trace scale must divide {TRACE_BLOCK_TOKENS}; got {scale or default}")
    return value


def images(shape: Shape, count: int, seed: int, variant: int = 0) -> list[str]:
    """`count` distinct synthetic JPEGs (smooth gradients, blocks and noise) as data URIs. `variant` > 0: the same
    pictures with a small patch of their own (other files, so other images to a cache; a fraction of the time)."""
    import numpy as np
    from PIL import Image

    uris = []
    for i, pixels in enumerate(_pictures(shape.image_size, count, seed)):
        if variant:
            pixels = pixels.copy()
            rng = np.random.default_rng((seed, variant, i))
            pixels[:8, :8] = rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)
        buf = io.BytesIO()
        Image.fromarray(pixels).save(buf, "JPEG", quality=85)
        uris.append("data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode())
    return uris


@functools.lru_cache(maxsize=8)
def _pictures(size: tuple[int, int], count: int, seed: int) -> tuple:
    """The pictures of `images`, as uint8 arrays (made once per size, count and seed): a gradient per channel
    (wrapping at 256), six flat blocks, uniform noise of ±20 — integer arithmetic, ~3.5 ms a 512×384 picture here."""
    import numpy as np

    rng = np.random.default_rng(seed)
    w, h = size
    yy, xx = (a.astype(np.float32) for a in np.mgrid[0:h, 0:w])
    out = []
    for _ in range(count):
        base = np.empty((h, w, 3), np.int16)
        for c in range(3):
            ramp = xx * np.float32(rng.uniform(0.2, 0.6)) + yy * np.float32(rng.uniform(0.1, 0.5))
            base[..., c] = (ramp + np.float32(rng.uniform(0, 255))).astype(np.int32) & 255
        for _ in range(6):
            x0, y0 = rng.integers(0, w - 32), rng.integers(0, h - 32)
            base[y0 : y0 + rng.integers(16, h // 2), x0 : x0 + rng.integers(16, w // 2)] = rng.integers(0, 256, 3)
        base += rng.integers(-20, 21, base.shape, dtype=np.int16)
        out.append(np.clip(base, 0, 255).astype(np.uint8))
    return tuple(out)


def request_bodies(
    shape: Shape, n: int, model: str, seed: int = 0, distinct_images: int | None = None, variant: int = 0
) -> list[dict]:
    """`n` OpenAI chat-completion bodies (streaming, usage in the last chunk, fixed output length; token ids in
    each chunk, so a token that adds no text — EOS, with `ignore_eos` — still counts as a token event). Each has
    images of its own (`shape.images`), as in the datasets (`distinct_images`: that many, taken in turn): an image
    sent again would be a prefix-cache hit on a server that caches prefixes (epdmesh serve's default) — so a sweep
    gives every rate point its own `variant` of the images (the same prompts and pictures, other files)."""
    rng = random.Random(seed)
    k = shape.images
    uris = images(shape, min(n * k, distinct_images or n * k), seed, variant)
    return [
        chat_body(
            model,
            shape.output_tokens,
            [
                {
                    "role": "user",
                    "content": [
                        *({"type": "image_url", "image_url": {"url": uris[(i * k + j) % len(uris)]}} for j in range(k)),
                        {"type": "text", "text": shape.prompt(rng)},
                    ],
                }
            ],
        )
        for i in range(n)
    ]


def chat_body(model: str, max_tokens: int, messages: list[dict]) -> dict:
    """A workload's chat request: streamed with the usage last and the token ids of each chunk, greedy, exactly
    `max_tokens` tokens (EOS ignored)."""
    return {
        "model": model,
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0.0,
        "return_token_ids": True,
        "messages": messages,
    }


def trace_times(path: Path = TRACE, seed: int = 0) -> list[float]:
    """Arrival times (seconds) of the trace's requests. Its timestamps are recorded in 3-second slots
    (every request of a slot carries the slot's time), so each slot's requests are spread uniformly at
    random over their slot: the per-slot counts — the trace's burstiness — are kept, and no request
    arrives at exactly the same instant as another."""
    lines = [line.strip() for line in path.read_text().splitlines()]
    stamps = [float(line) / 1e3 for line in lines if line and not line.startswith("#")]
    slots = sorted(set(stamps))
    length = {a: b - a for a, b in zip(slots, slots[1:])}
    length[slots[-1]] = statistics.median(length.values()) if length else 1.0
    rng = random.Random(seed)
    return sorted(s + rng.random() * length[s] for s in stamps)


def window_start(n: int, seed: int, total: int) -> int:
    """The first of the `n` consecutive trace requests that `seed` picks out of `total` (the arrivals and the
    `conversation` workload's requests come from the same window)."""
    return random.Random(seed).randrange(0, total - n + 1)


def add_arrival_arg(p) -> None:
    """`--arrival`, as `bench goodput`, `sim goodput` and `plan` take it (`arrivals`' kind)."""
    p.add_argument(
        "--arrival",
        default="mooncake",
        choices=["mooncake", "poisson"],
        help="mooncake: the Mooncake trace's arrival times (a trace:PATH workload: that trace's own), rescaled to "
        "each rate; poisson: a Poisson process",
    )


def arrivals(
    n: int, rate: float, kind: str = "mooncake", seed: int = 0, trace: list[float] | None = None
) -> list[float]:
    """Send times (seconds from the start) of `n` requests at mean `rate` requests/s: a window of `n`
    consecutive trace arrivals (its start drawn by `seed`) rescaled to that mean rate, or a Poisson process."""
    if n < 1 or rate <= 0:
        raise ValueError("need n >= 1 and rate > 0")
    if kind == "poisson":
        rng = random.Random(seed)
        times, t = [0.0], 0.0
        for _ in range(n - 1):
            t += rng.expovariate(rate)
            times.append(t)
        return times
    if kind != "mooncake":
        raise ValueError(f"unknown arrival process {kind!r}; use mooncake or poisson")
    trace = trace if trace is not None else trace_times()
    if len(trace) < n:
        raise ValueError(f"the trace has {len(trace)} requests; ask for at most that many")
    start = window_start(n, seed, len(trace))
    window = [t - trace[start] for t in trace[start : start + n]]
    span = window[-1]
    if n == 1 or span <= 0:
        return [i / rate for i in range(n)]
    factor = (n - 1) / rate / span  # mean gap 1/rate
    return [t * factor for t in window]
