"""The engine's thread and its asyncio callers: nobody waits forever, whatever ends the thread."""

import asyncio
import threading
import time

import pytest
from prometheus_client import generate_latest

from common.engine.async_engine import AsyncEngine, EngineDead
from common.engine.config import EngineConfig
from common.engine.engine import Engine, RequestRejected
from common.request import ImageInput, Request, Stage
from common.sampling import SamplingParams
from common.telemetry.metrics import WorkerMetrics
from services.worker.server import engine_gauges

WAIT_S = 30


@pytest.fixture
def engine(tiny_dir):
    return Engine(EngineConfig(model=str(tiny_dir), kv_cache_gib=0.02, image_cache_gib=0.01))


class DyingEngine:
    """Steps until told to die; then the thread's step raises what no `except Exception` catches."""

    def __init__(self):
        self.lock = threading.RLock()
        self.requests: dict = {}
        self.die = threading.Event()

    @property
    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def add_request(self, request, **_):
        self.requests[request.request_id] = request

    def abort(self, request_id):
        return self.requests.pop(request_id, None) is not None

    def step(self):
        if self.die.wait(0.01):
            raise SystemExit("the interpreter is going away")
        return []


async def _next(stream):
    return await asyncio.wait_for(anext(stream), WAIT_S)


async def _waiting(async_engine: AsyncEngine, engine: DyingEngine) -> asyncio.Future:
    """A caller waiting for the first output of a request the engine's thread has taken in."""
    first = asyncio.ensure_future(_next(async_engine.generate(Request("a", [1, 2, 3], SamplingParams(max_tokens=2)))))
    while "a" not in engine.requests:
        await asyncio.sleep(0.01)
    return first


def test_callers_waiting_when_the_thread_dies_are_told_and_later_ones_refused_at_once():
    engine = DyingEngine()
    async_engine = AsyncEngine(engine)

    async def scenario():
        first = await _waiting(async_engine, engine)
        engine.die.set()
        with pytest.raises(EngineDead, match="SystemExit"):
            await first
        with pytest.raises(EngineDead):
            await _next(async_engine.generate(Request("b", [1, 2, 3], SamplingParams(max_tokens=2))))
        with pytest.raises(EngineDead) as later:
            await asyncio.wait_for(async_engine.call(lambda e: 1), WAIT_S)
        with pytest.raises(EngineDead) as again:
            await asyncio.wait_for(async_engine.call(lambda e: 1), WAIT_S)
        assert later.value is not again.value  # one shared exception would grow a traceback with every raise

    asyncio.run(scenario())
    deadline = time.monotonic() + WAIT_S  # the callers were told before the thread returns: it ends a moment later
    while async_engine.alive and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not async_engine.alive


def test_a_shut_down_engine_tells_its_waiting_callers():
    engine = DyingEngine()
    async_engine = AsyncEngine(engine)

    async def scenario():
        first = await _waiting(async_engine, engine)
        await asyncio.to_thread(async_engine.shutdown)
        with pytest.raises(EngineDead, match="shut down"):
            await first

    asyncio.run(scenario())


def test_a_second_caller_with_a_request_id_in_use_is_refused_and_the_first_keeps_its_outputs(engine):
    async_engine = AsyncEngine(engine)
    prompt = [1, 354, 29, 405, 77]

    async def scenario():
        first = async_engine.generate(Request("same", prompt, SamplingParams(max_tokens=3)))
        out = await _next(first)
        with pytest.raises(RequestRejected, match="already in use"):
            await _next(async_engine.generate(Request("same", prompt, SamplingParams(max_tokens=3))))
        rest = [o async for o in first]
        assert (rest or [out])[-1].finished and len((rest or [out])[-1].output_token_ids) == 3

    try:
        asyncio.run(scenario())
    finally:
        async_engine.shutdown()


def test_a_request_posted_during_a_step_counts_in_the_stats_before_the_thread_takes_it_in(engine):
    """A request handed to the thread while a step runs waits for that step to end before `add_request`: the
    worker's reports meanwhile count it as queued (else a busy prefill worker reports an empty queue for a whole
    long step, and a router that takes the report to include what it sent there sends more), and so does its
    Prometheus gauge."""
    async_engine = AsyncEngine(engine)
    metrics = WorkerMetrics("w", "EP")
    engine_gauges(metrics, async_engine)
    stepping, release = threading.Event(), threading.Event()
    step = engine.step

    def held_step():
        stepping.set()
        release.wait(WAIT_S)
        return step()

    engine.step = held_step
    later = [7, 354, 29, 405, 77, 31, 8]

    async def scenario():
        first = asyncio.ensure_future(
            _next(async_engine.generate(Request("a", [1, 354, 29], SamplingParams(max_tokens=2))))
        )
        await asyncio.to_thread(stepping.wait, WAIT_S)
        second = async_engine.generate(Request("b", later, SamplingParams(max_tokens=2)))
        waiting = asyncio.ensure_future(_next(second))
        await asyncio.sleep(0.05)  # "b" is in the thread's inbox: the step under way holds it there
        reported, engine_only = async_engine.stats(), engine.stats()
        assert "b" not in engine.requests
        assert reported.num_waiting == engine_only.num_waiting + 1
        assert reported.queued_prefill_tokens == engine_only.queued_prefill_tokens + len(later)
        # the worker's Prometheus gauge says what its heartbeats say
        text = generate_latest(metrics.registry).decode()
        assert f'epdmesh:num_requests_waiting{{roles="EP",worker_id="w"}} {float(reported.num_waiting)}' in text
        release.set()
        await first
        await waiting
        assert async_engine.stats() == engine.stats()  # taken in: counted once, by the engine

    try:
        asyncio.run(scenario())
    finally:
        release.set()
        async_engine.shutdown()


def test_a_posted_request_counts_where_add_request_puts_it(engine):
    """Posted, an image request counts its images and prompt as queued; a handed-over one as a running decode."""
    image = Request("i", [1, 2, 3], SamplingParams(max_tokens=4), [ImageInput(None, 5, "d")])
    handed = Request("h", [1, 2, 3, 4], SamplingParams(max_tokens=6), first_stage=Stage.DECODE, output_token_ids=[9])
    base, with_posted = engine.stats(), engine.stats([image, handed])
    assert with_posted.queued_images == base.queued_images + 1
    assert with_posted.queued_prefill_tokens == base.queued_prefill_tokens + image.num_prefill_tokens
    assert with_posted.num_waiting == base.num_waiting + 1
    assert with_posted.running_decodes == base.running_decodes + 1
    assert with_posted.unfinished_decode_tokens == base.unfinished_decode_tokens + 5
    assert with_posted.decode_context_tokens == base.decode_context_tokens + handed.num_tokens


def test_an_engine_built_by_the_thread_that_steps_it_answers_and_a_failed_build_raises_here(tiny_dir):
    built_on = []

    def build():
        built_on.append(threading.current_thread().name)
        return Engine(EngineConfig(model=str(tiny_dir), kv_cache_gib=0.02, image_cache_gib=0.01))

    async def answer(engine):
        request = Request("r", [1, 5, 6, 7], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
        return [t async for out in engine.generate(request) for t in out.new_token_ids]

    engine = AsyncEngine(build=build)
    try:
        assert built_on == ["engine"] and len(asyncio.run(answer(engine))) == 3
    finally:
        engine.shutdown()

    def broken():
        raise OSError("no checkpoint here")

    with pytest.raises(OSError, match="no checkpoint here"):
        AsyncEngine(build=broken)
    with pytest.raises(ValueError, match="an engine or a function"):
        AsyncEngine()


CHILD = """
import asyncio, sys, torch
sys.path.insert(0, {root!r})
from common.engine.async_engine import AsyncEngine
from common.engine.config import EngineConfig
from common.engine.engine import Engine
engine = AsyncEngine(build=lambda: Engine(EngineConfig(model={model!r}, kv_cache_gib=0.02, image_cache_gib=0.01)),
                     threads=2)
async def counts():
    return await engine.call(lambda e: torch.get_num_threads())
torch.ones(1 << 20).add_(1)  # a parallel-sized op here: one thread, no second OpenMP team
print(asyncio.run(counts()), torch.get_num_threads())
engine.shutdown()
"""


def test_with_threads_only_the_engine_thread_computes_in_parallel(tiny_dir):
    import subprocess
    import sys
    from pathlib import Path

    root = str(Path(__file__).resolve().parents[2])
    out = subprocess.run(
        [sys.executable, "-c", CHILD.format(root=root, model=str(tiny_dir))],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["2", "1"]  # the engine thread's count, the caller's
