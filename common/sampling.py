"""Sampling parameters of one request (validated; no torch)."""

from __future__ import annotations

import dataclasses

MAX_LOGPROBS = 20  # most likely tokens a request may ask for per position (OpenAI's top_logprobs limit)
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1  # what the mesh's wire carries (int64), as vLLM accepts
GREEDY_BELOW_TEMPERATURE = 1e-5  # vLLM's _SAMPLING_EPS: a lower temperature is greedy (logits / 1e-300 overflow)


class InvalidSamplingParams(ValueError):
    """A sampling parameter out of its range; `param` names it (the API's error says which)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


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
    repetition_penalty: float = (
        1.0  # transformers' / vLLM's: logits of prompt and generated tokens divided (>0) or multiplied (<0) by it
    )
    logit_bias: tuple[
        tuple[int, float], ...
    ] = ()  # OpenAI's: (token id, bias in [-100, 100]) added to that token's logit
    min_tokens: int = 0  # vLLM's: no EOS, stop token or stop string ends it before this many output tokens (like
    # max_tokens, counted from where a migrated request's continuation starts: the gateway lowers both)
    min_p: float = 0.0  # vLLM's: after temperature, drop tokens below min_p × the most likely token's probability
    grammar: str | None = None  # structured output: only tokens this grammar allows (common/engine/grammar.py)

    def __post_init__(self) -> None:
        checks = (
            ("max_tokens", self.max_tokens >= 1, f"max_tokens must be at least 1, got {self.max_tokens}"),
            ("temperature", self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}"),
            ("top_p", 0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            ("top_k", self.top_k >= 0, f"top_k must be >= 0, got {self.top_k}"),
            (
                "seed",
                self.seed is None or SEED_MIN <= self.seed <= SEED_MAX,
                f"seed must be a 64-bit signed integer ({SEED_MIN} to {SEED_MAX}), got {self.seed}",
            ),
            (
                "top_logprobs",
                self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
                f"top_logprobs must be between 0 and {MAX_LOGPROBS}, got {self.logprobs}",
            ),
            (
                "presence_penalty",
                -2.0 <= self.presence_penalty <= 2.0,
                f"presence_penalty must be between -2 and 2, got {self.presence_penalty}",
            ),
            (
                "frequency_penalty",
                -2.0 <= self.frequency_penalty <= 2.0,
                f"frequency_penalty must be between -2 and 2, got {self.frequency_penalty}",
            ),
            (
                "repetition_penalty",
                0 < self.repetition_penalty <= 100,
                f"repetition_penalty must be in (0, 100], got {self.repetition_penalty}",
            ),
            (
                "logit_bias",
                all(token >= 0 and -100 <= bias <= 100 for token, bias in self.logit_bias),
                "logit_bias maps token ids (>= 0) to biases between -100 and 100",
            ),
            ("stop", all(self.stop), "stop strings must be non-empty"),
            (
                "min_tokens",
                0 <= self.min_tokens <= self.max_tokens,
                f"min_tokens must be between 0 and max_tokens ({self.max_tokens}), got {self.min_tokens}",
            ),
            ("min_p", 0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}"),
            ("response_format", self.grammar is None or bool(self.grammar), "a grammar must not be empty"),
        )
        for param, ok, message in checks:
            if not ok:
                raise InvalidSamplingParams(param, message)

    @property
    def adjusts_logits(self) -> bool:
        """Penalties, biases or a minimum length change its logits before sampling."""
        return (
            self.presence_penalty != 0
            or self.frequency_penalty != 0
            or self.repetition_penalty != 1
            or bool(self.logit_bias)
            or self.min_tokens > 0
        )

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW_TEMPERATURE or self.top_k == 1
