"""What an engine step reports per request."""

from __future__ import annotations

import dataclasses

from common.request import RequestStatus


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
    pages: tuple[str, list[int], int] | None = None  # handed off: (cache kind, block ids, tokens) kept for the next stage

    @property
    def finished(self) -> bool:
        return self.status.finished

    @property
    def handed_off(self) -> bool:
        return self.status == RequestStatus.HANDED_OFF
