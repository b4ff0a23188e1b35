"""A request's state inside one engine (no torch: the scheduler reads and writes it).

Life of a request in an engine:
  1. WAITING      — queued; holds no pages.
  2. ENCODING     — some of its images are encoded into image-cache pages.
  3. PREFILLING   — KV blocks allocated for the whole prompt; chunks computed in order.
  4. DECODING     — one token per iteration until a stop condition; its KV blocks grow as it
                    does. When the cache runs out, the newest running request is preempted: its
                    blocks are freed and it goes back to WAITING, to recompute prompt + output so far
                    (`recompute_outputs`) and go on; one this engine cannot recompute (its images came
                    as pages, their pixels are elsewhere) is HANDED_BACK instead, for its caller to
                    continue elsewhere.
  5. finished     — FINISHED_* (pages freed), or HANDED_OFF: its last stage here is done
                    and its pages wait to be exported to the next stage's engine.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import time
from typing import Any

from common.sampling import SamplingParams


class Stage(enum.IntEnum):
    ENCODE = 0
    PREFILL = 1
    DECODE = 2


class RequestStatus(enum.IntEnum):
    WAITING = 0
    ENCODING = 1
    PREFILLING = 2
    DECODING = 3
    HANDED_OFF = 4
    HANDED_BACK = 5  # preempted, and not recomputable here: its caller continues it elsewhere (pages freed)
    FINISHED_STOPPED = 6
    FINISHED_LENGTH = 7
    FINISHED_ABORTED = 8

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def done_here(self) -> bool:
        return self >= RequestStatus.HANDED_OFF


FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


IMAGE_DIGEST_KEY = "epdmesh.digest"  # a decoded PIL image's `info` entry: the digest of the file it came from


def image_end(token_ids: list[int], image_token_id: int) -> int:
    """The position after the last image placeholder of `token_ids` (0 without images)."""
    for pos in range(len(token_ids) - 1, -1, -1):
        if token_ids[pos] == image_token_id:
            return pos + 1
    return 0


def image_marks(
    token_ids: list[int], image_token_id: int | None, images: list[tuple[str, int]]
) -> list[tuple[int, int]]:
    """(position of its first placeholder, its identity as an integer) for each image, given as (identity, placeholder
    tokens) in prompt order: what `block_pool.chain_hashes` mixes into a prompt's block hashes. Where the placeholders
    cannot be matched to the images (or `image_token_id` is None) every image is marked at 0: no block is shared with
    a prompt that has other images."""
    if not images:
        return []
    keys = [
        int.from_bytes(hashlib.blake2b(identity.encode(), digest_size=16).digest(), "little") for identity, _ in images
    ]
    positions = [i for i, t in enumerate(token_ids) if t == image_token_id] if image_token_id is not None else []
    starts, seen = [], 0
    for _, num_tokens in images:
        starts.append(positions[seen] if seen < len(positions) else -1)
        seen += num_tokens
    if seen != len(positions) or min(starts) < 0:
        return [(0, key) for key in keys]
    return list(zip(starts, keys))


@dataclasses.dataclass(slots=True)
class ImageInput:
    """One image of a request: its preprocessed pixels (opaque here) and how many placeholder tokens it fills.
    `scaling` (a `common.model.pixels.PixelScaling`): the pixels are uint8 and still to be rescaled and
    normalized by the worker that encodes them (only on their way there; an engine gets finished pixels)."""

    pixel_values: Any
    num_tokens: int
    content_hash: str = ""
    scaling: Any = None


@dataclasses.dataclass(slots=True, eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    images: list[ImageInput] = dataclasses.field(default_factory=list)
    first_stage: Stage = Stage.ENCODE
    last_stage: Stage = Stage.DECODE
    arrival_time: float = dataclasses.field(default_factory=time.monotonic)
    num_continued_tokens: int = (
        0  # a migrated request's continuation: the prompt's last n tokens are its earlier output
    )
    cache_salt: str = ""  # vLLM's: its prefix-cache blocks are shared only with requests of the same salt
    # mutable state
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = dataclasses.field(default_factory=list)
    num_computed_tokens: int = 0
    num_encoded_images: int = 0
    num_cached_tokens: int = 0  # leading prompt tokens whose KV the prefix cache held at admission (not computed)
    recompute_outputs: int = 0  # output tokens the next prefill computes with the prompt (set when preempted)
    num_slow_gaps: int = 0  # decodes here whose iteration outlasted the TBT target (`GapSlack`)
    block_table: list[int] = dataclasses.field(default_factory=list)
    image_block_table: list[int] = dataclasses.field(default_factory=list)
    output_text: str = ""
    stop_reason: str | int | None = None
    detokenizer: Any = None  # the output's text so far, kept by the engine while stop strings are watched
    grammar_matcher: Any = (
        None  # structured output: where its grammar is, kept by the engine (common/engine/grammar.py)
    )
    prompt_hashes: tuple[int, list[int]] | None = None  # (block size, its prompt's chained block hashes): kv_manager's
    # engine clock (time.monotonic): first step that scheduled it, and when it finished or was handed off here
    first_scheduled_time: float | None = None
    done_time: float | None = None

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError("prompt must contain at least one token")
        if not 0 <= self.num_continued_tokens < len(self.prompt_token_ids):
            raise ValueError(
                f"{self.num_continued_tokens} continued tokens in a prompt of {len(self.prompt_token_ids)}"
            )
        if self.first_stage > self.last_stage:
            raise ValueError(f"first stage {self.first_stage.name} comes after last stage {self.last_stage.name}")
        if self.first_stage == Stage.ENCODE and not self.images:
            self.first_stage = Stage.PREFILL if self.last_stage >= Stage.PREFILL else Stage.ENCODE
        if self.first_stage > Stage.ENCODE:
            self.num_encoded_images = len(self.images)

    @property
    def generated_token_ids(self) -> list[int]:
        """Everything sampled for it so far: a continuation's earlier output (the end of its prompt) included —
        what penalties count and what a seeded request's random stream is indexed by."""
        if not self.num_continued_tokens:
            return self.output_token_ids
        return self.prompt_token_ids[-self.num_continued_tokens :] + self.output_token_ids

    @property
    def sure_gaps(self) -> int:
        """Gaps between output tokens it will have at least: its next token's, or all its answer's when its length
        is fixed (`ignore_eos` without other stops, or `min_tokens`)."""
        s = self.sampling
        fixed = s.ignore_eos and not (s.stop or s.stop_token_ids or s.grammar)
        return max(s.max_tokens if fixed else s.min_tokens, len(self.output_token_ids) + 1) - 1

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_image_tokens(self) -> int:
        return sum(image.num_tokens for image in self.images)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def needs_encode(self) -> bool:
        return self.num_encoded_images < len(self.images)

    def image_end(self, image_token_id: int) -> int:
        """The prompt position after its last image placeholder (0 without images): a prefill that starts there
        reads no image embeddings."""
        return image_end(self.prompt_token_ids, image_token_id)

    @property
    def num_prefill_tokens(self) -> int:
        """Tokens a prefill computes before it samples: the prompt, and after a preemption the output so far."""
        return len(self.prompt_token_ids) + self.recompute_outputs

    @property
    def prefill_remaining(self) -> int:
        return max(0, self.num_prefill_tokens - self.num_computed_tokens)

    @property
    def can_recompute(self) -> bool:
        """Its KV can be rebuilt where it is: it has no images, or their pixels (images that came as encoded
        pages have none)."""
        return all(image.pixel_values is not None for image in self.images)

    def token_ids(self, start: int, end: int) -> list[int]:
        """Prompt and output token ids at positions [start, end)."""
        if end <= len(self.prompt_token_ids):
            return self.prompt_token_ids[start:end]
        return self.all_token_ids[start:end]

    @property
    def finish_reason(self) -> str | None:
        return FINISH_REASONS.get(self.status)
