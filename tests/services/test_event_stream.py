"""The gateway's SSE response, at the ASGI level: what goes out, in what order, and what a disconnect ends."""

import asyncio
import functools
import itertools

import pytest

from services.gateway.event_stream import EventStream


class Connection:
    """An ASGI server's side of one request: what was sent, and a client that leaves when told to."""

    def __init__(self):
        self.sent: list[dict] = []
        self.left = asyncio.Event()

    async def receive(self):
        await self.left.wait()
        return {"type": "http.disconnect"}

    async def send(self, message):
        self.sent.append(message)
        await asyncio.sleep(0)

    @property
    def bodies(self) -> list[bytes]:
        return [m["body"] for m in self.sent if m["type"] == "http.response.body"]


async def _endless(produced: list[int], closed: list[bool], pause: float):
    """Events until it is closed (which it notes in `closed`)."""
    try:
        for i in itertools.count():
            produced.append(i)
            yield f"data: {i}\n\n"
            await asyncio.sleep(pause)
    finally:
        closed.append(True)


def test_the_headers_and_the_first_event_go_out_together_once_it_is_there_then_the_rest_and_the_end():
    log: list[str] = []

    async def events():
        log.append("first asked")
        yield "data: 1\n\n"
        yield "data: 2\n\n"

    async def main():
        conn = Connection()

        async def send(message):
            log.append(message["type"])
            await conn.send(message)

        await EventStream(events())({"type": "http"}, conn.receive, send)
        return conn

    conn = asyncio.run(main())
    assert log == [
        "first asked",
        "http.response.start",
        "http.response.body",
        "http.response.body",
        "http.response.body",
    ]
    start = conn.sent[0]
    assert start["status"] == 200
    headers = dict(start["headers"])
    assert headers[b"content-type"] == b"text/event-stream; charset=utf-8"
    assert headers[b"cache-control"] == b"no-cache" and headers[b"x-accel-buffering"] == b"no"
    assert conn.bodies == [b"data: 1\n\n", b"data: 2\n\n", b""]
    assert [m.get("more_body") for m in conn.sent[1:]] == [True, True, False]


def test_no_events_is_an_empty_stream_that_ends():
    async def events():
        return
        yield

    async def main():
        conn = Connection()
        await EventStream(events())({"type": "http"}, conn.receive, conn.send)
        return conn

    conn = asyncio.run(main())
    assert [m["type"] for m in conn.sent] == ["http.response.start", "http.response.body"]
    assert conn.bodies == [b""]


def test_a_client_that_leaves_closes_the_events_generator_at_once_and_the_response_ends_quietly():
    produced, closed = [], []

    endless = functools.partial(_endless, produced, closed, 0.001)

    async def main():
        conn = Connection()

        async def send(message):
            await conn.send(message)
            if len(conn.bodies) == 3:
                conn.left.set()

        async def serve():  # as the server's task for the request runs the response, then goes on
            await EventStream(endless())({"type": "http"}, conn.receive, send)
            assert asyncio.current_task().cancelling() == 0  # nothing left to hit the task's next await
            await asyncio.sleep(0.01)
            return "served"

        assert await asyncio.wait_for(serve(), 5) == "served"
        return conn

    conn = asyncio.run(main())
    assert closed == [True]
    assert len(produced) <= 5, produced  # ended within a couple of events, not run on for the gone client
    assert conn.bodies[-1] != b""  # no end of stream was sent: nobody was there


def test_a_stream_cancelled_from_elsewhere_is_cancelled_and_still_closes_its_events():
    closed = []

    async def slow():
        try:
            yield "data: 1\n\n"
            await asyncio.sleep(60)
            yield "data: 2\n\n"
        finally:
            closed.append(True)

    async def main():
        conn = Connection()
        task = asyncio.ensure_future(EventStream(slow())({"type": "http"}, conn.receive, conn.send))
        while len(conn.bodies) < 1:
            await asyncio.sleep(0.001)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert closed == [True]


def test_a_send_that_fails_as_the_connection_closes_ends_the_stream_quietly_and_closes_the_events():
    """What an ASGI 2.4 server does for a client that left: its send raises OSError."""
    closed = []

    endless = functools.partial(_endless, [], closed, 0)

    async def main():
        conn = Connection()

        async def send(message):
            await conn.send(message)
            if len(conn.bodies) == 2:
                raise OSError("connection closed")

        await asyncio.wait_for(EventStream(endless())({"type": "http"}, conn.receive, send), 5)
        return conn

    conn = asyncio.run(main())
    assert closed == [True] and len(conn.bodies) == 2
