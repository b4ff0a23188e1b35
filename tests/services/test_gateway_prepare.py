"""The gateway's first milliseconds of an image request: the processor runs on a thread while the prompt is
counted and routed on the event loop, and a failure of either ends the request with a clear error and no
reservation left behind."""

import asyncio
import threading

import pytest

from common.sampling import SamplingParams
from services.gateway.errors import ApiError
from services.gateway.mesh import MeshBackend
from services.gateway.protocol import ChatRequest

WAIT_S = 5.0


class Processor:
    """Stands in for ChatProcessor: `apply` blocks (on its thread) until the route was asked for."""

    def __init__(self, routed: threading.Event, refuse: bool = False, num_tokens: int = 12):
        self.routed, self.refuse, self.num_tokens = routed, refuse, num_tokens
        self.started, self.applied = threading.Event(), threading.Event()

    config = type("Config", (), {"image_token_id": 32000, "image_tokens_per_image": 576})

    def prompt_ids(self, conversation, *template):
        if not self.started.wait(WAIT_S):  # the pixels (`apply`, on its thread) are under way before this
            raise TimeoutError("the prompt was counted before the processor's thread started")
        return list(range(self.num_tokens))

    def apply(self, conversation, finish_pixels=True, **template):
        self.started.set()
        try:
            if not self.routed.wait(WAIT_S):
                raise TimeoutError("the route was not asked for while the pixels were being made")
            if self.refuse:
                raise ValueError("this conversation has no user turn")
            return [1, 2, 3], []
        finally:
            self.applied.set()


class Router:
    def __init__(self, routed: threading.Event):
        self.routed = routed
        self.forgotten: list[str] = []

    async def refresh_forever(self):
        await asyncio.Event().wait()

    async def route(self, summary):
        self.routed.set()
        await asyncio.sleep(0.01)  # a Redis round trip
        raise Routed(summary)

    def forget(self, request_id):
        self.forgotten.append(request_id)


class Routed(Exception):
    """Ends the test's request right after routing (the stages are not what this file tests)."""


def _chat(max_tokens=8):
    return ChatRequest(
        "tiny",
        [{"role": "user", "content": [{"type": "image", "image": None}, {"type": "text", "text": "what is it?"}]}],
        SamplingParams(max_tokens=max_tokens, temperature=0.0),
    )


def _backend(processor, router, max_model_len=64):
    return MeshBackend(processor, "127.0.0.1:1", max_model_len, router=router)


def test_the_route_is_asked_for_while_the_pixels_are_made():
    """The processor's thread starts first; the prompt is counted and the route asked for while it runs (were
    either done before it started, or after it ended, a wait below would time out)."""
    routed = threading.Event()
    processor, router = Processor(routed), Router(routed)

    async def main():
        backend = _backend(processor, router)
        with pytest.raises(Routed):
            await backend.start(_chat(), "r1")
        assert await asyncio.to_thread(processor.applied.wait, WAIT_S)
        if backend.routes._refresher is not None:
            backend.routes._refresher.cancel()

    asyncio.run(main())


def test_a_prompt_the_processor_refuses_after_routing_is_a_400_and_its_route_is_forgotten(monkeypatch):
    routed = threading.Event()
    processor, router = Processor(routed, refuse=True), Router(routed)

    async def route(summary):  # routes, as a real router would, and returns
        routed.set()
        return None

    monkeypatch.setattr(router, "route", route)

    async def main():
        backend = _backend(processor, router)
        with pytest.raises(ApiError) as err:
            await backend.start(_chat(), "r2")
        assert err.value.status == 400 and "no user turn" in err.value.message
        assert router.forgotten == ["r2"]  # its reservation ends now rather than at its expiry
        backend.routes._refresher.cancel()

    asyncio.run(main())


def test_a_prompt_too_long_for_the_model_is_a_400_before_any_route():
    routed = threading.Event()
    processor, router = Processor(routed, num_tokens=60), Router(routed)

    async def main():
        backend = _backend(processor, router, max_model_len=64)
        with pytest.raises(ApiError) as err:
            await backend.start(_chat(max_tokens=8), "r3")
        assert err.value.status == 400 and "over the model's limit of 64" in err.value.message
        assert not routed.is_set()
        routed.set()  # let the processor's thread end

    asyncio.run(main())
