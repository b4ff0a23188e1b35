"""The `conversation` workload: the Mooncake trace's own lengths and shared prefixes, as image chats.

The dataset shapes of `bench/workloads.py` take only the trace's arrival times; every request there is new to
the server. This one also takes, for the same window of requests, each one's prompt and output length and its
`hash_ids` — the 512-token prefix blocks it shares with earlier requests (a system prompt every request shares,
and the earlier turns of its conversation) — so a server that caches prefixes, and a router that sends a
conversation back to the worker holding it, are measured on the trace's own reuse. What is assumed, since the
trace is text-only and its prompts are longer than LLaVA-1.5's context:

1. Lengths are the trace's ÷ `scale` (default 16: 512-token blocks become 32 tokens; median prompt 6,909 → 432
   text tokens, median answer 350 → 22 tokens), both, so prefill and decode keep the trace's proportions; a prompt
   is cut to fit the server's context with its image and answer.
2. Block `h` of the trace is the same run of words wherever it occurs (words drawn by `h`, the seed and the rate
   point's variant), so equal hash ids are equal text and equal tokens. Words are calibrated on the server's
   tokenizer (`POST /tokenize`) and joined with spaces; a block holds exactly its share of tokens.
3. The first block (the trace's hash id 0 in every request: its system prompt) is the system message. The
   conversation — the requests that share the second block — has one image, chosen by that block, sent with the
   user message that holds the rest: an image chat's later turns send the same picture again, as clients do.
4. The answers are `max_tokens` with EOS ignored, as in the dataset shapes.

Within a window of 320 consecutive requests about 9% of the trace's blocks repeat one before them (6% of the
requests continue a conversation of the window); 1,000 requests: 19%. `ideal_shared_tokens` gives each request's
prefix held by an earlier one of the window — what a cache that never evicts, on one worker, could skip; the
goodput bound of this workload counts only the rest.
"""

from __future__ import annotations

import dataclasses
import functools
import gzip
import random
from pathlib import Path

from bench.workloads import TRACE_BLOCK_TOKENS, Shape, chat_body, images, window_start

BLOCKS = Path(__file__).resolve().parent / "data" / "mooncake_conversation_blocks.txt.gz"
IMAGE_SIZE = (640, 480)
# candidate words; those the served tokenizer makes one token with a leading space are used
CANDIDATES = (
    "a",
    "the",
    "and",
    "is",
    "of",
    "in",
    "to",
    "on",
    "it",
    "with",
    "what",
    "this",
    "that",
    "image",
    "photo",
    "picture",
    "there",
    "are",
    "you",
    "can",
    "see",
    "left",
    "right",
    "top",
    "bottom",
    "behind",
    "front",
    "color",
    "red",
    "blue",
    "green",
    "black",
    "white",
    "small",
    "big",
    "man",
    "woman",
    "child",
    "dog",
    "cat",
    "car",
    "bus",
    "street",
    "sign",
    "table",
    "chair",
    "book",
    "cup",
    "bottle",
    "clock",
    "tree",
    "sky",
    "building",
    "window",
    "door",
    "water",
    "food",
    "text",
    "word",
    "name",
    "number",
    "question",
    "answer",
    "describe",
    "briefly",
    "caption",
    "object",
    "person",
    "people",
    "background",
    "day",
    "night",
    "light",
    "dark",
    "open",
    "closed",
    "yes",
    "no",
    "one",
    "two",
    "three",
    "many",
    "some",
    "all",
    "any",
    "how",
    "where",
    "which",
    "who",
    "why",
    "when",
    "bird",
    "horse",
    "phone",
    "laptop",
    "pizza",
    "umbrella",
)


@dataclasses.dataclass(frozen=True, slots=True)
class TraceRequest:
    input_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...]


@functools.lru_cache(maxsize=1)
def trace_requests(path: Path = BLOCKS) -> tuple[TraceRequest, ...]:
    """Every request of the trace in its order, with its hash ids (stored as the ids shared with earlier requests
    and the count of new ones, numbered on from the last id used)."""
    out, next_id = [], 0
    for line in gzip.decompress(path.read_bytes()).decode().splitlines():
        if not line or line.startswith("#"):
            continue
        fields = line.split(" ")
        new = int(fields[2])
        shared = tuple(int(h) for h in fields[3].split(",")) if len(fields) > 3 and fields[3] else ()
        out.append(TraceRequest(int(fields[0]), int(fields[1]), shared + tuple(range(next_id, next_id + new))))
        next_id += new
    return tuple(out)


@dataclasses.dataclass(frozen=True, slots=True)
class Vocabulary:
    """What a server's tokenizer makes of the workload's text: words that are one token each with a leading
    space, the tokens a one-image chat adds beyond its text (template, image), and the server's context."""

    words: tuple[str, ...]
    chat_tokens: int
    max_model_len: int
    count: object = dataclasses.field(default=None, compare=False, repr=False)  # the server's `/tokenize`

    def __post_init__(self):
        if len(self.words) < 8:
            raise ValueError(f"only {len(self.words)} one-token words; the workload needs at least 8")


def calibrate(base: str, client=None) -> Vocabulary:
    """Ask the server at `base` (its `POST /tokenize`, as vLLM serves it) how it tokenizes the candidate words and
    a one-image chat."""
    import httpx

    client = client or httpx.Client(timeout=30)

    def count(body: dict) -> dict:
        response = client.post(f"{base}/tokenize", json=body)
        response.raise_for_status()
        return response.json()

    return calibrate_with(count)


def calibrate_with(count) -> Vocabulary:
    """The vocabulary from `count(body)`: a `/tokenize` answer (`count`, `max_model_len`) to a body."""
    words = tuple(w for w in CANDIDATES if count({"prompt": " " + w, "add_special_tokens": False})["count"] == 1)
    if not words:
        raise ValueError("the server's tokenizer makes no candidate word one token")
    probe = chat_messages(" " + words[0], " " + words[0], images(_SHAPE, 1, 0)[0])
    answer = count({"messages": probe})
    return Vocabulary(words, answer["count"] - 2, answer["max_model_len"], count)


def chat_messages(system: str, user: str, image: str) -> list[dict]:
    return [
        {"role": "system", "content": system},
        {
            "role": "user",
            "content": [{"type": "image_url", "image_url": {"url": image}}, {"type": "text", "text": user}],
        },
    ]


@dataclasses.dataclass(frozen=True, slots=True)
class Planned:
    """One request of the workload: its blocks (hash id, tokens) — the first is the system message —, its
    conversation (which image), and its answer's length."""

    blocks: tuple[tuple[int, int], ...]
    conversation: int
    output_tokens: int

    @property
    def text_tokens(self) -> int:
        return sum(n for _, n in self.blocks)


def plan(
    n: int, seed: int, vocab: Vocabulary, scale: int = 16, trace: tuple[TraceRequest, ...] | None = None
) -> list[Planned]:
    """The `n` requests of the trace window `seed` picks (the same window as `workloads.arrivals`), lengths ÷ `scale`
    and cut to fit the server's context."""
    if scale < 1 or TRACE_BLOCK_TOKENS % scale:
        raise ValueError(f"scale must divide {TRACE_BLOCK_TOKENS}; got {scale}")
    trace = trace if trace is not None else trace_requests()
    start = window_start(n, seed, len(trace))
    block = TRACE_BLOCK_TOKENS // scale
    out = []
    for row in trace[start : start + n]:
        output = max(1, round(row.output_tokens / scale))
        room = vocab.max_model_len - vocab.chat_tokens - output
        text = min(-(-row.input_tokens // scale), room)
        if text < 2:
            raise ValueError(
                f"a context of {vocab.max_model_len} tokens leaves no room for the trace's requests "
                f"at scale {scale}; use a larger scale"
            )
        blocks, left = [], text
        for h in row.hash_ids:
            take = min(block, left - (1 if len(blocks) == 0 else 0))  # the user message keeps at least a token
            if take <= 0:
                break
            blocks.append((h, take))
            left -= take
        if left:  # the trace's last block is partial: ceil(input / 512) blocks; rounding may leave a token
            h, k = blocks[-1]
            blocks[-1] = (h, k + left)
        conversation = row.hash_ids[1] if len(row.hash_ids) > 1 else row.hash_ids[0]
        out.append(Planned(tuple(blocks), conversation, output))
    return out


def block_text(vocab: Vocabulary, hash_id: int, tokens: int, seed: int, variant: int) -> str:
    """`tokens` words, each one token with its leading space: a prefix of the same run wherever `hash_id` occurs."""
    rng = random.Random(f"{seed}:{variant}:{hash_id}")
    return "".join(" " + rng.choice(vocab.words) for _ in range(tokens))


def request_bodies(
    planned: list[Planned], vocab: Vocabulary, model: str, seed: int = 0, variant: int = 0
) -> list[dict]:
    """The chat bodies of `planned` (streamed, usage last, token ids per chunk, as the dataset shapes'): every
    conversation's image and every block's words are the variant's own, so no rate point reuses another's."""
    conversations = list(dict.fromkeys(p.conversation for p in planned))
    uris = dict(zip(conversations, images(_SHAPE, len(conversations), seed, variant)))
    bodies = []
    for p in planned:
        (h0, n0), rest = p.blocks[0], p.blocks[1:]
        user = "".join(block_text(vocab, h, k, seed, variant) for h, k in rest)
        system = block_text(vocab, h0, n0, seed, variant)
        bodies.append(chat_body(model, p.output_tokens, chat_messages(system, user, uris[p.conversation])))
    return bodies


def ideal_shared_tokens(planned: list[Planned], vocab: Vocabulary) -> list[int]:
    """Per request, its longest prompt prefix (tokens) equal to an earlier request's of the window: the system
    block, then — in the same conversation — the template and image and the user blocks that match. The template
    tokens are all counted with the image, so this errs high, as a bound's input should."""
    seen: list[Planned] = []
    out = []
    for p in planned:
        out.append(max((_common(p, q, vocab.chat_tokens) for q in seen), default=0))
        seen.append(p)
    return out


def _common(p: Planned, q: Planned, chat_tokens: int) -> int:
    (h, n), (g, m) = p.blocks[0], q.blocks[0]
    if h != g:
        return 0
    if n != m or p.conversation != q.conversation:
        return min(n, m)
    total = n + chat_tokens
    for (h, n), (g, m) in zip(p.blocks[1:], q.blocks[1:]):
        if h != g:
            break
        total += min(n, m)
        if n != m:
            break
    return total


_SHAPE = Shape("conversation", 0, IMAGE_SIZE)  # what `images` needs: the pictures' size
