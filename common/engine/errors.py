"""What the engine raises: a request it refuses, pages it has no room for yet, a step that failed part-way."""

from __future__ import annotations


class RequestRejected(ValueError):
    """The request cannot be served as asked; the message says what to change."""


class StepFailed(RuntimeError):
    """A step failed in its model or after it. Its requests were dropped — even those it had already finished or
    handed off, whose outputs are lost with it — so their callers must be told (`request_ids`). The requests it
    had preempted and handed back before it ran left the engine whole: their outputs still go out (`delivered`)."""

    def __init__(self, request_ids: list[str], cause: Exception, delivered: list | None = None):
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.request_ids = request_ids
        self.delivered = delivered or []


class NoRoomForPages(RuntimeError):
    """The cache has no free blocks for a request's handed-over pages now; they free as other requests run."""
