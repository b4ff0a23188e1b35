"""The gateway's one error type: what the client did wrong (or what went wrong for it), as OpenAI's error JSON."""

from __future__ import annotations


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        kind: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.headers = headers or {}
        self.status = status
        self.message = message
        self.param = param
        self.kind = kind or {
            400: "BadRequestError",
            404: "NotFoundError",
            413: "RequestTooLargeError",
            503: "ServiceUnavailableError",
        }.get(status, "InternalServerError")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.status}}
