"""What the gateway does to every HTTP request before its app sees it (`edge`): API keys, and the client's request id.

API keys (`--api-key`, or `$EPDMESH_API_KEY`): with any set, every request to the gateway needs
`Authorization: Bearer <one of them>` — the OpenAI clients send their `api_key` so — except `GET /health` and
`GET /metrics` (load balancers' probes and Prometheus scrapes carry no key) and CORS preflights. A request without
a key it knows is a 401 in OpenAI's error form, before its body is read.

A request that carries `X-Request-Id` gets it back as a header of its answer (error or not, streamed or not), so a
client can find its request in its own logs and in the gateway's trace (the span's `http.request.header.x-request-id`);
the answer's own `id` stays the gateway's, unique across the mesh.

Pure ASGI wrappers: they add no task or copy to a request that passes (Starlette's middleware classes do).
"""

from __future__ import annotations

import hmac
import json

OPEN_PATHS = ("/health", "/metrics")
ENV = "EPDMESH_API_KEY"


MAX_REQUEST_ID = 256


def edge(app, keys: tuple[str, ...]):
    """`app` behind the API keys (if any) and with request ids echoed."""
    return echo_request_id(require_api_key(app, keys))


def echo_request_id(app):
    async def echoing(scope, receive, send):
        if scope["type"] != "http":
            return await app(scope, receive, send)
        given = next((value for name, value in scope["headers"] if name == b"x-request-id"), None)
        if not given or len(given) > MAX_REQUEST_ID or not all(0x21 <= c <= 0x7E for c in given):  # visible ASCII
            return await app(scope, receive, send)

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), (b"x-request-id", given)]}
            await send(message)

        return await app(scope, receive, send_with_id)

    return echoing


def require_api_key(app, keys: tuple[str, ...]):
    """`app`, answering only requests that carry one of `keys` (none: `app` itself)."""
    expected = [key.encode() for key in keys if key]
    if not expected:
        return app

    async def guarded(scope, receive, send):
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS or scope["method"] == "OPTIONS":
            return await app(scope, receive, send)
        given = next((value for name, value in scope["headers"] if name == b"authorization"), b"")
        scheme, _, token = given.partition(b" ")
        if scheme.lower() == b"bearer" and any(hmac.compare_digest(token.strip(), key) for key in expected):
            return await app(scope, receive, send)
        message = (
            "this server needs an API key: send it as 'Authorization: Bearer <key>' (the openai client's api_key)"
            if not given
            else "the API key sent is not one this server takes"
        )
        body = json.dumps(
            {"error": {"message": message, "type": "AuthenticationError", "param": None, "code": 401}}
        ).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"www-authenticate", b"Bearer"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})

    return guarded


def add_api_key_arg(p) -> None:
    p.add_argument(
        "--api-key",
        action="append",
        default=None,
        metavar="KEY",
        help=f"require 'Authorization: Bearer KEY' on every endpoint but /health and /metrics (repeat for "
        f"more keys; default: ${ENV}, comma-separated; none: open)",
    )


def api_keys(args, environ) -> tuple[str, ...]:
    """The keys from `--api-key`, else from the environment's EPDMESH_API_KEY (comma-separated)."""
    given = args.api_key if args.api_key else environ.get(ENV, "").split(",")
    return tuple(key.strip() for key in given if key and key.strip())
