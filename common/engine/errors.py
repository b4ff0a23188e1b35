"""What the engine raises: a request it refuses, pages it has no room for yet, a step that failed part-way."""

from __future__ import annotations


class RequestRejected(ValueError):
    """The request cannot be served as asked; the message says what to change."""


class StepFailed(RuntimeError):
    """A step failed after its model ran. Its requests were dropped — even those it had already finished or
    handed off, whose outputs are lost with it — so their callers must be told (`request_ids`)."""

    def __init__(self, request_ids: list[str], cause: Exception):
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.request_ids = request_ids


class NoRoomForPages(RuntimeError):
    """The cache has no free blocks for a request's handed-over pages now; they free as other requests run."""
