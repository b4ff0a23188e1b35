"""What an engine reports: per request after each step (`RequestOutput`), and about itself (`EngineStats`)."""

from __future__ import annotations

import dataclasses

from common.request import RequestStatus


@dataclasses.dataclass(frozen=True, slots=True)
class TokenLogprob:
    """A sampled token's log-probability under the model (its raw logits, before temperature, top-k or top-p,
    as vLLM reports them) and the most likely tokens at that position, most likely first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclasses.dataclass(slots=True)
class RequestOutput:
    request_id: str
    new_token_ids: list[int]  # sampled this step
    output_token_ids: list[int]  # all sampled so far
    status: RequestStatus
    finish_reason: str | None  # "stop", "length", "abort"; None while running or handed off
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    text: str | None = None  # final text cut at the stop string, when stop strings were given
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None  # one per new token, when the request asked for them
    pages: tuple[str, list[int], int] | None = (
        None  # handed off: (cache kind, block ids, tokens) kept for the next stage
    )

    @property
    def finished(self) -> bool:
        return self.status.finished

    @property
    def handed_off(self) -> bool:
        return self.status == RequestStatus.HANDED_OFF

    @property
    def handed_back(self) -> bool:
        """Preempted and not recomputable where it ran: no more outputs come; go on with it elsewhere."""
        return self.status == RequestStatus.HANDED_BACK

    @property
    def done_here(self) -> bool:
        return self.status.done_here


@dataclasses.dataclass(frozen=True, slots=True)
class EngineStats:
    kv_blocks_total: int
    kv_blocks_free: int
    image_blocks_total: int
    image_blocks_free: int
    num_waiting: int
    num_running: int
    num_handed_off: int
    running_decodes: int
    unfinished_decode_tokens: int  # tokens the running decodes may still produce (max_tokens left)
    queued_prefill_tokens: int = 0  # prompt tokens waiting or still to prefill
    queued_images: int = 0  # images waiting or still to encode
    decode_context_tokens: int = 0  # KV tokens of the running decodes
    num_preemptions: int = 0  # since start: running requests whose KV was freed for others (recomputed or handed back)
    long_token_budget: int = 0  # τ_t of a next iteration run long on the decodes' gap slack (0: it may not)
