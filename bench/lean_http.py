"""A minimal HTTP/1.1 client for timing a server's SSE stream, so the client's own cost stays out of it.

One keep-alive connection per server; a POST with a Content-Length body; a chunked (or Content-Length)
response read as lines. Nothing else of HTTP: no redirects, TLS, proxies or compression. httpx's request
and response handling costs about 1.5 ms per streamed request on this host (bench/README.md), which a
TTFT measured through it would count as the server's.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from urllib.parse import urlsplit


class HttpError(RuntimeError):
    pass


class LeanClient:
    def __init__(self, base: str):
        url = urlsplit(base)
        if url.scheme != "http" or not url.hostname:
            raise ValueError(f"need an http://host:port base URL, not {base!r}")
        self.host, self.port = url.hostname, url.port or 80
        self._conn: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None

    async def post_lines(self, path: str, body: bytes) -> AsyncIterator[str]:
        """POST `body` (JSON) to `path`; yield the response body's lines as they arrive (without newlines)."""
        request = (
            f"POST {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        done = False
        try:
            reader, status, headers = await self._send(request)
            if status != 200:
                text = b"".join([chunk async for chunk in _body(reader, headers)])
                raise HttpError(f"HTTP {status}: {text[:500].decode(errors='replace')}")
            pending = b""
            async for chunk in _body(reader, headers):
                *lines, pending = (pending + chunk).split(b"\n")
                for line in lines:
                    yield line.rstrip(b"\r").decode()
            if pending:
                yield pending.rstrip(b"\r").decode()
            done = headers.get("connection", "").lower() != "close"
        finally:
            if not done:  # a body not read to its end leaves the connection unusable
                await self.close()

    async def _send(self, request: bytes) -> tuple[asyncio.StreamReader, int, dict[str, str]]:
        """Send on the kept connection; if the server had closed it (an idle timeout), once more on a new one."""
        reused = self._conn is not None
        try:
            return await self._send_once(request)
        except (HttpError, ConnectionError) as e:
            await self.close()
            if not (reused and (isinstance(e, ConnectionError) or "closed the connection" in str(e))):
                raise
        return await self._send_once(request)

    async def _send_once(self, request: bytes) -> tuple[asyncio.StreamReader, int, dict[str, str]]:
        if self._conn is None:
            self._conn = await asyncio.open_connection(self.host, self.port)
        reader, writer = self._conn
        writer.write(request)
        await writer.drain()
        return (reader, *await _head(reader))

    async def close(self) -> None:
        if self._conn is not None:
            writer = self._conn[1]
            self._conn = None
            writer.close()
            try:
                await writer.wait_closed()
            except OSError:
                pass


async def _head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    status_line = await reader.readline()
    if not status_line:
        raise HttpError("the server closed the connection")
    status = int(status_line.split()[1])
    headers = {}
    while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    return status, headers


async def _body(reader: asyncio.StreamReader, headers: dict[str, str]) -> AsyncIterator[bytes]:
    if headers.get("transfer-encoding", "").lower() == "chunked":
        while size := int((await reader.readline()).split(b";")[0], 16):
            yield await reader.readexactly(size)
            await reader.readexactly(2)  # the chunk's CRLF
        while (await reader.readline()) not in (b"\r\n", b"\n", b""):  # trailers
            pass
    elif "content-length" in headers:
        yield await reader.readexactly(int(headers["content-length"]))
    else:
        raise HttpError("a response without Content-Length or chunked encoding")
