"""Small failures that used to cost a lot: a client gone at its first token pinned KV until the lease
ended; one failed heartbeat or lease sweep ended it for good; a stats read raced the engine's thread."""

import asyncio
import threading
import time

import grpc
import pytest

from common.engine.config import EngineConfig
from common.engine.engine import Engine
from common.policy.routing import PrefillPath, RoutePlan
from common.request import Request, Stage
from common.sampling import SamplingParams
from common.transfer.channels import CHANNEL_OPTIONS
from common.workers import WorkerInfo, WorkerLoad, WorkerSnapshot
from epdmesh.v1 import mesh_pb2 as pb
from epdmesh.v1 import mesh_pb2_grpc as pb_grpc
from services.gateway.mesh import MeshBackend
from services.gateway.mesh.route_client import Route
from services.worker.runtime import WorkerRuntime
from services.worker.switch import Registration
from tests.support import IdleRuntime

WAIT_S = 10


class Prefiller(pb_grpc.PrefillerServicer):
    async def Prefill(self, request, context):
        handle = pb.PageHandle(
            worker_id="p-1",
            address=self.address,
            lease_id="lease-kv-1",
            block_ids=[3, 4],
            num_tokens=20,
            layout=pb.PageLayout(kind=pb.CACHE_KIND_KV, dtype="float32", block_size=16, block_shape=[1]),
        )
        return pb.PrefillResponse(first=pb.TokenChunk(token_ids=[42], num_prompt_tokens=3), kv_pages=handle)


class Worker(pb_grpc.WorkerServicer):
    def __init__(self):
        self.released: list[str] = []

    async def ReleasePages(self, request, context):
        self.released.append(request.lease_id)
        return pb.ReleasePagesResponse(released=True)


def test_a_client_gone_at_its_first_token_releases_the_kv_pages_at_once():
    """The dedicated path: the Prefill's reply carries the first token and a KV handle. A client that leaves
    as that token goes out (the stream is closed there) must not leave the KV leased until its expiry."""

    async def main():
        server = grpc.aio.server(options=CHANNEL_OPTIONS)
        port = server.add_insecure_port("127.0.0.1:0")
        prefiller, worker = Prefiller(), Worker()
        prefiller.address = f"127.0.0.1:{port}"
        pb_grpc.add_PrefillerServicer_to_server(prefiller, server)
        pb_grpc.add_WorkerServicer_to_server(worker, server)
        await server.start()
        backend = MeshBackend(None, "127.0.0.1:1", 4096)
        prefill = WorkerSnapshot(WorkerInfo("p-1", prefiller.address, frozenset({Stage.PREFILL})), WorkerLoad(), 0.0)
        decoder = WorkerSnapshot(WorkerInfo("d-1", "127.0.0.1:1", frozenset({Stage.DECODE})), WorkerLoad(), 0.0)
        route = Route(RoutePlan(None, prefill, decoder, PrefillPath.DEDICATED), "r")
        stream = backend.stages.drive(Request("r", [1, 2, 3], SamplingParams(max_tokens=4, temperature=0.0)), route)
        first = await asyncio.wait_for(anext(stream), WAIT_S)
        assert first.new_token_ids == [42]
        await stream.aclose()  # the client is gone: no Decode goes out
        for _ in range(200):
            if worker.released:
                break
            await asyncio.sleep(0.01)
        assert worker.released == ["lease-kv-1"]
        await backend.close()
        await server.stop(None)

    asyncio.run(main())


def test_a_heartbeat_that_fails_once_keeps_beating():
    beats = []

    class Toggle:
        async def Register(self, request, timeout, wait_for_ready=None):
            return pb.RegisterResponse(heartbeat_interval_s=0.01)

        async def Heartbeat(self, request, timeout):
            beats.append(request.load.num_waiting)
            return pb.HeartbeatResponse(known=True)

    class Runtime:
        calls = 0
        freed = asyncio.Event()

        def load(self):
            Runtime.calls += 1
            if Runtime.calls == 2:
                raise RuntimeError("deque mutated during iteration")
            return WorkerLoad()

        def take_admitted(self):
            return []

    async def main():
        task = asyncio.ensure_future(Registration(Toggle(), _info(), Runtime()).run())
        for _ in range(500):
            if len(beats) >= 3:
                break
            await asyncio.sleep(0.01)
        assert len(beats) >= 3 and not task.done()  # the failed beat was logged, and the next ones went out
        task.cancel()

    asyncio.run(main())


def test_a_lease_sweep_that_fails_once_keeps_sweeping():
    sweeps = []

    class Runtime:
        def _expire_leases_now(self):
            sweeps.append(len(sweeps))
            if len(sweeps) == 1:
                raise KeyError("a bug")

    async def main():
        task = asyncio.ensure_future(WorkerRuntime.expire_leases(Runtime(), interval_s=0.01))
        for _ in range(500):
            if len(sweeps) >= 3:
                break
            await asyncio.sleep(0.01)
        assert len(sweeps) >= 3 and not task.done()
        task.cancel()

    asyncio.run(main())


def test_engine_stats_wait_for_the_engines_lock(tiny_dir):
    """The scheduler's queues change on the engine's thread under its lock; a stats read takes it too."""
    engine = Engine(EngineConfig(model=str(tiny_dir), kv_cache_gib=0.02, image_cache_gib=0.01))
    got = []
    reader = threading.Thread(target=lambda: got.append(engine.stats()))
    with engine.lock:
        reader.start()
        reader.join(0.2)
        assert reader.is_alive() and not got
    reader.join(WAIT_S)
    assert got and got[0].kv_blocks_free == got[0].kv_blocks_total


def _info():
    return WorkerInfo("w-1", "127.0.0.1:1", frozenset({Stage.DECODE}), "m", 4096)


def test_a_worker_that_frees_pages_while_nearly_full_heartbeats_at_once():
    """A request waiting in a gateway for KV room is routed when a heartbeat shows it: a worker whose cache was nearly
    full beats as soon as it frees pages, instead of after its interval (0.5 s)."""
    beats: list[float] = []

    class Toggle:
        async def Register(self, request, timeout, wait_for_ready=None):
            return pb.RegisterResponse(heartbeat_interval_s=0.5)

        async def Heartbeat(self, request, timeout):
            beats.append(time.monotonic())
            return pb.HeartbeatResponse(known=True)

    async def main():
        runtime = IdleRuntime()
        task = asyncio.ensure_future(Registration(Toggle(), _info(), runtime).run())
        while len(beats) < 2:
            await asyncio.sleep(0.01)
        regular = beats[1] - beats[0]
        runtime.freed.set()
        while len(beats) < 3:
            await asyncio.sleep(0.005)
        early = beats[2] - beats[1]
        task.cancel()
        return regular, early

    regular, early = asyncio.run(asyncio.wait_for(main(), 30))  # (a registration that never beats: a failure)
    assert regular >= 0.45 and early < 0.3, (regular, early)


def test_a_decode_that_ends_while_the_cache_is_nearly_full_asks_for_that_heartbeat(tiny_dir, processors):
    from common.engine.async_engine import AsyncEngine
    from common.engine.config import EngineConfig
    from common.engine.engine import Engine
    from common.request import Request
    from common.sampling import SamplingParams
    from common.transfer.fake import FakeFabric, FakePuller
    from services.worker.runtime import WorkerRuntime

    async def main(pressed: bool):
        engine = Engine(EngineConfig(model=str(tiny_dir), kv_cache_gib=0.0002))  # 4 blocks
        runtime = WorkerRuntime("d", "fake://d", AsyncEngine(engine), FakePuller(FakeFabric()), offer_backend="fake")
        try:
            big = Request("big", list(range(5, 5 + (50 if pressed else 5))), SamplingParams(max_tokens=2))
            stream = runtime.decode(big, None, None)
            await anext(stream)  # its prompt is in: all 4 blocks, or 1
            runtime.load()  # the heartbeat's report: nearly full, or not
            async for _ in stream:
                pass
            return runtime.freed.is_set()
        finally:
            runtime.engine.shutdown()

    assert asyncio.run(main(pressed=True)) and not asyncio.run(main(pressed=False))


def test_a_switch_whose_engine_does_not_come_idle_keeps_the_old_roles_and_registers_again():
    from services.errors import SwitchFailed
    from services.worker.switch import RoleSwitch

    info = _info()
    events = []

    class Engine:
        async def reconfigure(self, config):
            raise RuntimeError("the engine holds 1 requests: it reconfigures only when idle")

    class Runtime:
        engine, accepting = Engine(), True

        async def quiesce(self, grace_s, settle_s):
            events.append(("quiesce", self.accepting))
            return 0

    class Registration:
        def __init__(self):
            self.info = info

        async def leave(self):
            events.append("leave")

        def join(self, again):
            events.append(("join", again))

    class Health:
        async def set(self, name, status):
            pass

    async def main():
        runtime = Runtime()
        switch = RoleSwitch(runtime, Registration(), Health(), lambda roles: None)
        with pytest.raises(SwitchFailed, match="keeps its roles D"):
            await switch.switch(frozenset({Stage.ENCODE, Stage.PREFILL}), 0.0)
        assert runtime.accepting  # serving again, as it was
        with pytest.raises(ValueError, match="at least one role"):
            await switch.switch(frozenset(), 0.0)
        assert (await switch.switch(info.roles, 0.0)).info is info  # its own roles: nothing to do

    asyncio.run(main())
    assert events == ["leave", ("quiesce", False), ("join", info)]
