"""A server-sent-events response that costs the first token as little as it can.

Life of a stream here:
  1. its first event is taken before anything is sent (the backend already has the first token, so this waits
     for nothing), then the headers and that event go out back to back;
  2. each later event goes out as it comes; a task reads the connection meanwhile, and when the client
     disconnects it cancels the stream's task: the events' generator is closed there, which ends the request on
     the workers and frees its pages;
  3. the stream ends with its last event, or with the client gone (then quietly: nobody is there to answer).

Starlette's `StreamingResponse` does the same with an anyio task group opened per response (~0.1 ms on this
host before the first byte, measured in bench/README.md); headers and the first event went out in two writes.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from starlette.responses import Response
from starlette.types import Receive, Scope, Send


class EventStream(Response):
    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[str]):
        self.events = events
        self.status_code = 200
        self.background = None
        # no-buffering: a proxy (nginx) in front would otherwise hold events back until its buffer fills
        self.init_headers({"cache-control": "no-cache", "x-accel-buffering": "no"})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        streaming = asyncio.current_task()
        live = True  # until the stream ends: a disconnect after that must not cancel what the task does next

        def client_gone(task: asyncio.Task) -> None:
            if task.cancelled():
                return
            task.exception()  # retrieved: a receive that failed counts as the client gone
            if live:
                streaming.cancel()

        gone = asyncio.ensure_future(_disconnect(receive))
        gone.add_done_callback(client_gone)
        try:
            async with contextlib.aclosing(self.events) as events:
                try:
                    first = await anext(events, None)
                    await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
                    if first is not None:
                        await send({"type": "http.response.body", "body": first.encode(), "more_body": True})
                        async for event in events:
                            await send({"type": "http.response.body", "body": event.encode(), "more_body": True})
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
                except OSError:  # an ASGI 2.4 server's send to a closed connection: the client left
                    live = False  # closing the events (which ends the request) must not be cut short by its notice
        except asyncio.CancelledError:
            if not gone.done() or gone.cancelled():
                raise  # cancelled from elsewhere (the server stopping): not ours to swallow
            streaming.uncancel()  # the client left; its request ended when the events' generator was closed
        finally:
            live = False
            gone.cancel()


async def _disconnect(receive: Receive) -> None:
    """Returns when the client is gone (the request's body has been read: all that can come is the disconnect)."""
    while (await receive())["type"] != "http.disconnect":
        pass
