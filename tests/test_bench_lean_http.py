"""bench/lean_http.py, the client bench/mesh.py times servers with: chunked and sized bodies, keep-alive, errors."""

import asyncio

import pytest

from bench.lean_http import HttpError, LeanClient


def _chunked(*parts: bytes) -> bytes:
    body = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts)
    return (
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
        + body
        + b"0\r\n\r\n"
    )


CHUNKED = _chunked(b'data: {"a": 1}\n', b"\ndata: [DO", b"NE]\n\n")  # a line split across chunks
SIZED = b"HTTP/1.1 200 OK\r\ncontent-length: 9\r\n\r\none\ntwo\r\n"
REFUSED = b'HTTP/1.1 400 Bad Request\r\ncontent-length: 15\r\n\r\n{"error": "no"}'


async def _serve(responses: list[bytes], seen: list[tuple[bytes, bytes]], per_connection: int = 0):
    """`per_connection`: close each connection after that many responses (0: keep it open)."""
    connections = []

    async def handle(reader, writer):
        connections.append(writer)
        answered = 0
        while responses and not (per_connection and answered == per_connection):
            answered += 1
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(
                next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length"))
            )
            seen.append((head.split(b"\r\n")[0], await reader.readexactly(length)))
            writer.write(responses.pop(0))
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, connections


def test_lines_of_chunked_and_sized_bodies_over_one_connection():
    async def main():
        seen = []
        server, connections = await _serve([CHUNKED, SIZED, REFUSED], seen)
        client = LeanClient(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}")
        try:
            first = [line async for line in client.post_lines("/v1/chat/completions", b'{"x": 1}')]
            second = [line async for line in client.post_lines("/v1/chat/completions", b"{}")]
            with pytest.raises(HttpError, match='HTTP 400: {"error": "no"}'):
                async for _ in client.post_lines("/v1/chat/completions", b"{}"):
                    pass
        finally:
            await client.close()
            server.close()
        assert first == ['data: {"a": 1}', "", "data: [DONE]", ""]
        assert second == ["one", "two"]
        assert seen[0] == (b"POST /v1/chat/completions HTTP/1.1", b'{"x": 1}')
        assert len(connections) == 1  # kept alive across the three requests

    asyncio.run(asyncio.wait_for(main(), 20))


def test_a_connection_the_server_closed_is_opened_again():
    async def main():
        seen = []
        server, connections = await _serve([SIZED, SIZED], seen, per_connection=1)  # as an idle timeout would
        client = LeanClient(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}")
        try:
            for _ in range(2):
                assert [line async for line in client.post_lines("/v1/chat/completions", b"{}")] == ["one", "two"]
                await asyncio.sleep(0.05)  # the server closes after its answer
        finally:
            await client.close()
            server.close()
        assert len(connections) == 2 and len(seen) == 2

    asyncio.run(asyncio.wait_for(main(), 20))
