"""Sampling parameters of one request (validated; no torch)."""

from __future__ import annotations

import dataclasses

MAX_LOGPROBS = 20  # most likely tokens a request may ask for per position (OpenAI's top_logprobs limit)


@dataclasses.dataclass(frozen=True, slots=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = no top-k cut
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; k: each sampled token's log-probability and the k most likely (k ≤ 20)
    presence_penalty: float = 0.0  # OpenAI's: subtracted from the logit of every token already generated
    frequency_penalty: float = 0.0  # OpenAI's: subtracted once per time a token was already generated
    repetition_penalty: float = 1.0  # transformers' / vLLM's: logits of prompt and generated tokens divided (>0) or multiplied (<0) by it
    logit_bias: tuple[tuple[int, float], ...] = ()  # OpenAI's: (token id, bias in [-100, 100]) added to that token's logit

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"top_logprobs must be between 0 and {MAX_LOGPROBS}, got {self.logprobs}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be between -2 and 2, got {getattr(self, name)}")
        if not 0 < self.repetition_penalty <= 100:
            raise ValueError(f"repetition_penalty must be in (0, 100], got {self.repetition_penalty}")
        if any(token < 0 or not -100 <= bias <= 100 for token, bias in self.logit_bias):
            raise ValueError("logit_bias maps token ids (>= 0) to biases between -100 and 100")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")

    @property
    def adjusts_logits(self) -> bool:
        """Penalties or biases change its logits before sampling."""
        return (self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1
                or bool(self.logit_bias))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1
