"""The toggle over a real Redis: registry with TTL, and Route over gRPC."""

import asyncio
import contextlib
import dataclasses
import uuid

import grpc
import pytest
import redis.asyncio as aioredis

from common.policy.routing import RoutingConfig
from common.request import Stage
from common.workers import WorkerInfo, WorkerLoad
from epdmesh.v1 import mesh_pb2 as pb
from epdmesh.v1 import mesh_pb2_grpc as pb_grpc
from services import wire
from services.failure import Reason, reason_of
from services.routing.registry import REDIS_CONNECTIONS, SET_TTL_FACTOR, RedisRegistry, redis_client
from services.toggle.server import ToggleOptions, run_toggle
from tests.services.servers import REDIS_URL

E, P, D = Stage.ENCODE, Stage.PREFILL, Stage.DECODE


def _profile():
    """encode 10 ms per image; prefill 0.1 ms per token; decode 5 ms + 1 ms per running sequence"""
    from common.latency import LatencyProfile, StageCost

    return LatencyProfile(
        "t",
        "analytic",
        "hw",
        "m",
        encode=StageCost(per_unit_ms=10.0),
        prefill=StageCost(per_unit_ms=0.1),
        decode=StageCost(overhead_ms=5.0, per_unit_ms=1.0),
        transfer_latency_ms=0.0,
        transfer_gbps=1.0,
        image_tokens=576,
    )


def info(wid, roles):
    return WorkerInfo(wid, f"127.0.0.1:{abs(hash(wid)) % 50000 + 10000}", frozenset(roles), "m", 4096)


@contextlib.asynccontextmanager
async def running_toggle(port: int = 0, **options):
    """A toggle in this event loop on a fresh key prefix; yields its address, stops it at the end."""
    stop, bound = asyncio.Event(), []
    prefix = f"epdmesh-test:{uuid.uuid4().hex}:"
    task = asyncio.create_task(
        run_toggle(ToggleOptions(REDIS_URL, prefix, port=port, **options), stop=stop, bound=bound)
    )
    while not bound:
        await asyncio.sleep(0.02)
    try:
        yield bound[0]
    finally:
        stop.set()
        await task


def test_more_redis_calls_at_once_than_connections_wait_for_one_instead_of_failing():
    """An overloaded gateway routes every waiting request again, each a Redis call: past its pool's connections a
    call waits for one (redis-py's default pool failed it with MaxConnectionsError, and the client got a 500)."""

    async def main():
        client = redis_client(REDIS_URL)
        key = f"epdmesh-test:{uuid.uuid4().hex}:n"
        try:
            await asyncio.gather(*(client.incr(key) for _ in range(4 * REDIS_CONNECTIONS)))
            assert int(await client.get(key)) == 4 * REDIS_CONNECTIONS  # (256 at once: the default pool fails)
        finally:
            await client.delete(key)
            await client.aclose()

    asyncio.run(main())


def test_registry_heartbeats_expire_and_deregister():
    async def main():
        client = aioredis.from_url(REDIS_URL)
        registry = RedisRegistry(client, f"epdmesh-test:{uuid.uuid4().hex}:", ttl_s=0.4)
        try:
            await registry.register(info("p-1", {P}), WorkerLoad(num_waiting=2))
            await registry.register(info("d-1", {D}), WorkerLoad())
            snap = {w.worker_id: w for w in await registry.snapshot()}
            assert set(snap) == {"p-1", "d-1"}
            assert snap["p-1"].info.roles == frozenset({P}) and snap["p-1"].load.num_waiting == 2
            assert await registry.heartbeat("p-1", WorkerLoad(num_running=5))
            assert {w.worker_id: w.load.num_running for w in await registry.snapshot()}["p-1"] == 5
            for _ in range(4):  # p-1 keeps beating, d-1 goes silent past its TTL
                await asyncio.sleep(0.15)
                assert await registry.heartbeat("p-1", WorkerLoad())
            assert [w.worker_id for w in await registry.snapshot()] == ["p-1"]
            assert not await registry.heartbeat("d-1", WorkerLoad())  # must register again
            await registry.deregister("p-1")
            assert await registry.snapshot() == []
            # the set of ids outlives its workers a while, then goes: a mesh that stopped leaves no key behind
            await registry.register(info("e-1", {E}), WorkerLoad())
            ttl_ms = await client.pttl(f"{registry.prefix}workers")
            assert registry.ttl_ms < ttl_ms <= registry.ttl_ms * SET_TTL_FACTOR
            await asyncio.sleep(0.3)
            assert await registry.heartbeat("e-1", WorkerLoad())
            assert await client.pttl(f"{registry.prefix}workers") > ttl_ms - 150  # each heartbeat renews it
        finally:
            await registry.clear()
            await client.aclose()

    asyncio.run(main())


def test_route_over_grpc_and_unavailable_without_workers():
    async def main():
        async with running_toggle(routing=RoutingConfig()) as address, grpc.aio.insecure_channel(address) as channel:
            toggle = pb_grpc.ToggleStub(channel)
            ask = pb.RouteRequest(request_id="r", num_prompt_tokens=40, num_images=1, max_tokens=8)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await toggle.Route(ask)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "no live workers" in err.value.details()
            assert reason_of(err.value) == Reason.NO_WORKER  # in the call's trailing metadata
            for wid, roles in [("e-1", {E}), ("p-1", {P}), ("d-1", {D}), ("d-2", {D})]:
                await toggle.Register(
                    pb.RegisterRequest(
                        info=wire.info_to_pb(info(wid, roles)), load=pb.WorkerLoad(kv_tokens_free=100_000)
                    )
                )
            plan = await toggle.Route(ask)
            assert (plan.encoder.info.worker_id, plan.prefill.info.worker_id, plan.path) == (
                "e-1",
                "p-1",
                pb.PREFILL_PATH_DEDICATED,
            )
            # the first decoder got the request's tokens booked locally, so the next one goes to the other
            second = await toggle.Route(ask)
            assert {plan.decoder.info.worker_id, second.decoder.info.worker_id} == {"d-1", "d-2"}
            listed = await toggle.ListWorkers(pb.ListWorkersRequest())
            assert sorted(w.info.worker_id for w in listed.workers) == ["d-1", "d-2", "e-1", "p-1"]
            await toggle.Deregister(pb.DeregisterRequest(worker_id="e-1"))
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await toggle.Route(ask)
            assert "an encoder" in err.value.details()
            for wid in ("p-1", "d-1", "d-2"):
                await toggle.Deregister(pb.DeregisterRequest(worker_id=wid))

    asyncio.run(main())


def test_slo_routing_over_grpc_chooses_paths_and_refuses_what_cannot_fit():
    from common.policy.multiplex import MultiplexConfig
    from services.toggle.server import SloRouting

    profile = _profile()

    async def main():
        stop, bound = asyncio.Event(), []
        slo = SloRouting(
            profile, ttft_ms=500, tbt_ms=50, config=MultiplexConfig(short_prompt_tokens=256, admission_control=True)
        )
        options = ToggleOptions(REDIS_URL, f"epdmesh-test:{uuid.uuid4().hex}:", slo=slo)
        task = asyncio.create_task(run_toggle(options, stop=stop, bound=bound))
        while not bound:
            await asyncio.sleep(0.02)
        async with grpc.aio.insecure_channel(bound[0]) as channel:
            toggle = pb_grpc.ToggleStub(channel)
            room = 100_000
            loads = {
                "e-1": ({E}, WorkerLoad(kv_tokens_free=room)),
                "p-1": ({P}, WorkerLoad(kv_tokens_free=room)),
                "pd-1": ({P, D}, WorkerLoad(running_decode_batch=10, kv_tokens_free=room)),
            }
            for wid, (roles, load) in loads.items():
                await toggle.Register(
                    pb.RegisterRequest(info=wire.info_to_pb(info(wid, roles)), load=wire.load_to_pb(load))
                )

            async def route(tokens, **slo_fields):
                return await toggle.Route(
                    pb.RouteRequest(request_id="r", num_prompt_tokens=tokens, num_images=1, max_tokens=8, **slo_fields)
                )

            short, long = await route(100), await route(1000)
            assert (short.path, short.prefill.info.worker_id) == (pb.PREFILL_PATH_MULTIPLEXED, "pd-1")
            assert (long.path, long.prefill.info.worker_id, long.decoder.info.worker_id) == (
                pb.PREFILL_PATH_DEDICATED,
                "p-1",
                "pd-1",
            )
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await route(1000, ttft_slo_ms=20)  # its own target: no path can reach it
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "within its SLO" in err.value.details()
            for wid in loads:
                await toggle.Deregister(pb.DeregisterRequest(worker_id=wid))
        stop.set()
        await task

    asyncio.run(main())


def test_two_toggles_routing_at_once_never_overbook_a_decoder():
    """Two toggles share one Redis; 30 concurrent requests of 100 KV tokens each meet two decoders that prefill
    their own prompts (colocated), with room for 1,000 tokens each: exactly 20 are routed, no decoder gets more than
    it holds, the rest are refused (503 upstream); an admission reported by a heartbeat frees its reservation."""

    async def main():
        prefix = f"epdmesh-test:{uuid.uuid4().hex}:"
        stops, bounds, tasks = [], [], []
        for _ in range(2):
            stop, bound = asyncio.Event(), []
            tasks.append(asyncio.create_task(run_toggle(ToggleOptions(REDIS_URL, prefix), stop=stop, bound=bound)))
            stops.append(stop)
            bounds.append(bound)
        while not all(bounds):
            await asyncio.sleep(0.02)
        channels = [grpc.aio.insecure_channel(b[0]) for b in bounds]
        toggles = [pb_grpc.ToggleStub(c) for c in channels]
        for wid in ("d-1", "d-2"):
            load = pb.WorkerLoad(kv_tokens_free=1000)
            await toggles[0].Register(pb.RegisterRequest(info=wire.info_to_pb(info(wid, {P, D})), load=load))

        async def ask(i):
            try:
                plan = await toggles[i % 2].Route(
                    pb.RouteRequest(request_id=f"r{i}", num_prompt_tokens=60, max_tokens=40)
                )
                return plan.decoder.info.worker_id
            except grpc.aio.AioRpcError as e:
                assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and reason_of(e) == Reason.NO_ROOM, e.details()
                return None

        routed = await asyncio.gather(*(ask(i) for i in range(30)))
        per_decoder = {d: routed.count(d) for d in ("d-1", "d-2")}
        assert per_decoder == {"d-1": 10, "d-2": 10} and routed.count(None) == 10
        # d-1 reports five of its requests admitted: their reservations end and five more fit
        admitted = [f"r{i}" for i, d in enumerate(routed) if d == "d-1"][:5]
        await toggles[1].Heartbeat(
            pb.HeartbeatRequest(worker_id="d-1", load=pb.WorkerLoad(kv_tokens_free=1000), admitted_request_ids=admitted)
        )
        again = await asyncio.gather(*(ask(100 + i) for i in range(6)))
        assert again.count("d-1") == 5 and again.count(None) == 1
        for wid in ("d-1", "d-2"):
            await toggles[0].Deregister(pb.DeregisterRequest(worker_id=wid))
        for channel in channels:
            await channel.close()
        for stop in stops:
            stop.set()
        await asyncio.gather(*tasks)

    asyncio.run(main())


def test_a_gateway_routing_in_process_and_a_toggle_share_one_view_of_capacity():
    """The gateway's in-process router and the toggle's Route rpc reserve in the same Redis: 30 concurrent
    requests, alternating between the two, meet two colocated workers with room for 10 each: exactly 20 go through.
    With no workers at all, the gateway answers 503 with the reason, as the toggle would."""
    from common.policy.routing import RouteSummary
    from services.gateway.mesh import MeshBackend
    from services.gateway.mesh.outcome import StageError
    from services.routing.reservations import Reservations
    from services.routing.router import NoRoute, Router

    async def main():
        prefix = f"epdmesh-test:{uuid.uuid4().hex}:"
        stop, bound = asyncio.Event(), []
        task = asyncio.create_task(run_toggle(ToggleOptions(REDIS_URL, prefix), stop=stop, bound=bound))
        while not bound:
            await asyncio.sleep(0.02)
        client = aioredis.from_url(REDIS_URL)
        router = Router(RedisRegistry(client, prefix), reservations=Reservations(client, prefix))
        channel = grpc.aio.insecure_channel(bound[0])
        toggle = pb_grpc.ToggleStub(channel)
        for wid in ("d-1", "d-2"):
            load = pb.WorkerLoad(kv_tokens_free=1000)
            await toggle.Register(pb.RegisterRequest(info=wire.info_to_pb(info(wid, {P, D})), load=load))

        async def ask(i):
            try:
                if i % 2:
                    return (await router.route(RouteSummary(f"r{i}", 60, 0, 40))).decoder.info.worker_id
                return (
                    await toggle.Route(pb.RouteRequest(request_id=f"r{i}", num_prompt_tokens=60, max_tokens=40))
                ).decoder.info.worker_id
            except NoRoute as e:
                assert e.reason == Reason.NO_ROOM, e.message
            except grpc.aio.AioRpcError as e:
                assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and reason_of(e) == Reason.NO_ROOM, e.details()

        routed = await asyncio.gather(*(ask(i) for i in range(30)))
        assert {d: routed.count(d) for d in ("d-1", "d-2", None)} == {"d-1": 10, "d-2": 10, None: 10}
        assert sum(router.decisions.values()) == sum(1 for i, d in enumerate(routed) if d and i % 2)
        for wid in ("d-1", "d-2"):
            await toggle.Deregister(pb.DeregisterRequest(worker_id=wid))
        router.invalidate()
        backend = MeshBackend(None, bound[0], 4096, router=router)
        with pytest.raises(StageError) as err:
            await backend.routes.route(RouteSummary("lonely", 60, 0, 40), None, attempt=1)
        assert err.value.reason == Reason.NO_WORKER and err.value.api_error().status == 503
        assert "no live workers are registered" in err.value.api_error().message
        await backend.close()  # closes the router's Redis client too
        await channel.close()
        stop.set()
        await task

    asyncio.run(main())


def test_routes_made_since_a_workers_last_heartbeat_stay_in_its_load_until_prefilled_or_reported():
    """Loads in Redis are the workers' last heartbeats: a refresh must not drop the routes made after them
    (a burst would pile onto the worker that looks idle), nor keep them once the heartbeat can include them."""
    from common.policy.routing import RouteSummary
    from services.routing.router import Router

    async def main():
        client = aioredis.from_url(REDIS_URL)
        registry = RedisRegistry(client, f"epdmesh-test:{uuid.uuid4().hex}:")
        try:
            for wid, roles in [("p-1", {P}), ("p-2", {P}), ("d-1", {D})]:
                await registry.register(info(wid, roles), WorkerLoad(kv_tokens_free=100_000))
            router = Router(registry)

            async def loads():
                await router.refresh()
                return {
                    w.worker_id: (w.load.num_waiting, w.load.queued_prefill_tokens, w.load.unfinished_decode_tokens)
                    for w in router.book.snapshot
                }

            first = await router.route(RouteSummary("r1", 600, 0, 40))
            second = await router.route(RouteSummary("r2", 300, 0, 20))
            assert {first.prefill.info.worker_id, second.prefill.info.worker_id} == {"p-1", "p-2"}  # spread, not piled
            p1, p2 = first.prefill.info.worker_id, second.prefill.info.worker_id
            assert await loads() == {p1: (1, 600, 0), p2: (1, 300, 0), "d-1": (0, 0, 60)}  # survives a refresh
            router.prefilled("r1")  # its first token came: its prompt is no longer queued
            assert await loads() == {p1: (0, 0, 0), p2: (1, 300, 0), "d-1": (0, 0, 60)}
            await registry.heartbeat(p2, WorkerLoad(num_waiting=1, queued_prefill_tokens=300))  # now p2 reports r2
            await registry.heartbeat("d-1", WorkerLoad(unfinished_decode_tokens=55))
            assert await loads() == {p1: (0, 0, 0), p2: (1, 300, 0), "d-1": (0, 0, 55)}  # not counted twice
            router.forget("r1")
            router.forget("r2")
            await registry.heartbeat(p1, WorkerLoad())
            assert await loads() == {p1: (0, 0, 0), p2: (1, 300, 0), "d-1": (0, 0, 55)} and not router.book.pending
        finally:
            await registry.clear()
            await client.aclose()

    asyncio.run(main())


def test_a_request_the_gateway_is_done_with_releases_its_reservations():
    """A request can end before its worker admits it (done at its first token, its client gone): its KV
    reservations end with it, not 10 s later, so they do not turn later requests away. On path ① the route books
    the prefill worker alone: the decoder takes the pages in when it has room."""
    from common.policy.routing import RouteSummary
    from services.routing.reservations import Reservations
    from services.routing.router import NoRoute

    async def main():
        async with _p_and_d(Reservations) as (router, reservations):
            await router.route(RouteSummary("r1", 600, 0, 40))
            await router.route(RouteSummary("r2", 300, 0, 20))
            assert (await reservations.held("p-1"), await reservations.held("d-1")) == (900, 0)
            with pytest.raises(NoRoute) as full:
                await router.route(RouteSummary("r3", 200, 0, 8))
            assert full.value.reason == Reason.NO_ROOM
            router.forget("r1")
            await router.settle()
            assert (await reservations.held("p-1"), await reservations.held("d-1")) == (300, 0)
            await router.route(RouteSummary("r3", 200, 0, 8))  # room again on p-1
            await reservations.release("p-1", ["r2", "r3"])  # the prefill worker admitted them and reported it first
            for rid in ("r2", "r3", "r3"):  # twice, or never routed: nothing to release
                router.forget(rid)
            await router.settle()
            assert (await reservations.held("p-1"), await reservations.held("d-1")) == (0, 0)
            await router.route(RouteSummary("r4", 1000, 0, 300))  # the whole of p-1 again

    asyncio.run(main())


def test_with_admission_control_a_missing_role_is_reported_as_such_not_as_an_slo_refusal():
    from common.policy.multiplex import MultiplexConfig
    from common.policy.routing import RouteSummary
    from services.routing.router import NoRoute, Router, SloRouting

    profile = _profile()

    async def main():
        client = aioredis.from_url(REDIS_URL)
        registry = RedisRegistry(client, f"epdmesh-test:{uuid.uuid4().hex}:")
        try:
            await registry.register(info("p-1", {P}), WorkerLoad(kv_tokens_free=100_000))  # no decoder is up
            slo = SloRouting(profile, ttft_ms=500, tbt_ms=50, config=MultiplexConfig(admission_control=True))
            with pytest.raises(NoRoute) as err:
                await Router(registry, slo=slo).route(RouteSummary("r", 100, 0, 8))
            assert err.value.reason == Reason.NO_WORKER and "no live worker set covers" in err.value.message
        finally:
            await registry.clear()
            await client.aclose()

    asyncio.run(main())


def test_a_route_loads_a_worker_until_the_gateway_has_handed_it_the_request():
    """A path-① decoder gets its request only after the encode and the prefill, most of a TTFT later: its
    heartbeats before then cannot include the route, which keeps loading it (else a burst piles onto it)."""
    from common.policy.routing import RouteSummary
    from services.routing.router import Router

    async def main():
        client = aioredis.from_url(REDIS_URL)
        registry = RedisRegistry(client, f"epdmesh-test:{uuid.uuid4().hex}:")
        try:
            for wid, roles in [("p-1", {P}), ("d-1", {D})]:
                await registry.register(info(wid, roles), WorkerLoad(kv_tokens_free=100_000))
            router = Router(registry, reports_delivery=True)

            async def loads():
                await router.refresh()
                return {
                    w.worker_id: (w.load.num_waiting, w.load.queued_prefill_tokens, w.load.unfinished_decode_tokens)
                    for w in router.book.snapshot
                }

            await router.route(RouteSummary("r1", 600, 0, 40))
            assert await loads() == {"p-1": (1, 600, 0), "d-1": (0, 0, 40)}
            router.sent("r1", "p-1")
            await registry.heartbeat("p-1", WorkerLoad(num_waiting=1, queued_prefill_tokens=600))  # p-1 has it
            await registry.heartbeat("d-1", WorkerLoad())  # d-1 has not got it yet
            assert await loads() == {"p-1": (1, 600, 0), "d-1": (0, 0, 40)}
            router.sent("r1", "d-1")
            await registry.heartbeat("d-1", WorkerLoad(unfinished_decode_tokens=39))
            assert await loads() == {"p-1": (1, 600, 0), "d-1": (0, 0, 39)} and not router.book.pending
        finally:
            await registry.clear()
            await client.aclose()

    asyncio.run(main())


def test_routing_ahead_gives_the_plan_before_its_reservation_and_a_worker_full_meanwhile_is_named():
    """`route_ahead`: the plan comes back with its reservation still under way; it ends reserved, or — when
    another router took the room meanwhile — with NoRoute naming the full worker, nothing reserved anywhere and
    the route forgotten. The gateway then routes around that worker (its registration), as for a failed one."""
    from common.policy.routing import RouteSummary
    from services.gateway.mesh.outcome import StageError
    from services.gateway.mesh.route_client import Route
    from services.routing.reservations import Reservations
    from services.routing.router import NoRoute, Router

    async def main():
        client = aioredis.from_url(REDIS_URL)
        prefix = f"epdmesh-test:{uuid.uuid4().hex}:"
        registry = RedisRegistry(client, prefix)
        try:
            for wid, roles in [("p-1", {P}), ("d-1", {D})]:
                await registry.register(info(wid, roles), WorkerLoad(kv_tokens_free=1000))
            reservations = Reservations(client, prefix)
            router = Router(registry, reservations=reservations)
            plan, reserved = await router.route_ahead(RouteSummary("r1", 600, 0, 40))
            assert (plan.prefill.info.worker_id, plan.decoder.info.worker_id) == ("p-1", "d-1") and not reserved.done()
            assert await reserved is None
            assert (await reservations.held("p-1"), await reservations.held("d-1")) == (600, 0)  # path ①: p-1 only
            # another router reserves the rest of p-1; this one's snapshot does not know it yet
            assert await reservations.reserve("elsewhere", {"p-1": (350, 1000)}) is None
            plan, reserved = await router.route_ahead(RouteSummary("r2", 100, 0, 20))
            assert plan.prefill.info.worker_id == "p-1"
            with pytest.raises(NoRoute) as refused:
                await reserved
            assert refused.value.reason == Reason.NO_ROOM and refused.value.full == "p-1"
            assert (await reservations.held("p-1"), await reservations.held("d-1")) == (950, 0)  # r2 got nothing
            assert "r2" not in router.book.pending
            _, again = await router.route_ahead(RouteSummary("r3", 100, 0, 20))
            with pytest.raises(StageError) as failed:  # the gateway's side
                await Route(plan, "r3", reserved=again).confirmed()
            assert failed.value.no_room and failed.value.blame == plan.prefill.info.registration
            error = failed.value.api_error()
            assert error.status == 503 and error.headers == {"Retry-After": "1"}
        finally:
            await registry.clear()
            await client.delete(f"{prefix}resv:p-1", f"{prefix}resv:d-1")
            await client.aclose()

    asyncio.run(main())


def test_a_reservation_ahead_goes_to_redis_only_once_its_stage_call_is_written():
    """The client side of the reservation script costs the gateway's loop ~0.1 ms: made ahead, it waits until the
    stage call it overlaps has been written (the `after` event), so the call's message does not wait behind it."""
    from common.policy.routing import RouteSummary
    from services.routing.reservations import Reservations

    class Recording(Reservations):
        calls: list[str] = []

        async def reserve(self, request_id, amounts):
            self.calls.append(request_id)
            return await super().reserve(request_id, amounts)

    async def main():
        async with _p_and_d(Recording) as (router, reservations):
            written = asyncio.Event()
            _, reserved = await router.route_ahead(RouteSummary("r1", 100, 0, 20), written)
            for _ in range(20):  # loop turns: nothing goes to Redis while the call is not written
                await asyncio.sleep(0)
            assert reservations.calls == [] and not reserved.done()
            written.set()
            assert await reserved is None and reservations.calls == ["r1"]
            assert await reservations.held("p-1") == 100
            _, alone = await router.route_ahead(RouteSummary("r2", 100, 0, 20))  # nothing to wait for: one turn
            assert await alone is None and reservations.calls == ["r1", "r2"]

    asyncio.run(main())


@contextlib.asynccontextmanager
async def _p_and_d(reservations_type):
    """A router over a real Redis registry of a prefill worker p-1 and a decoder d-1 with 1,000 KV tokens free each,
    reserving through `reservations_type`; everything removed after."""
    from services.routing.router import Router

    client = aioredis.from_url(REDIS_URL)
    prefix = f"epdmesh-test:{uuid.uuid4().hex}:"
    registry = RedisRegistry(client, prefix)
    try:
        for wid, roles in [("p-1", {P}), ("d-1", {D})]:
            await registry.register(info(wid, roles), WorkerLoad(kv_tokens_free=1000))
        reservations = reservations_type(client, prefix)
        yield Router(registry, reservations=reservations), reservations
    finally:
        await registry.clear()
        await client.delete(f"{prefix}resv:p-1", f"{prefix}resv:d-1")
        await client.aclose()


async def _register_caching(registry, workers, instance="", by_id_length=False):
    """Workers that cache prefixes, each with room for 16,000 tokens in 16-token blocks (`by_id_length`: as many
    unfinished decode tokens as its id has characters, so the shorter id decodes less)."""
    for wid, roles in workers:
        await registry.register(
            dataclasses.replace(info(wid, roles), prefix_caching=True, instance=instance),
            WorkerLoad(
                kv_tokens_free=100_000,
                kv_blocks_total=1000,
                kv_block_size=16,
                unfinished_decode_tokens=len(wid) if by_id_length else 0,
            ),
        )


def test_a_router_sends_a_prompt_it_routed_before_back_to_the_worker_it_sent_it_to():
    """Prefix-cache affinity over the registry: the first route records the prompt's blocks under its prefill worker;
    the same prompt (or one extending it) goes back there while that worker is not too much busier, a new prompt to
    the least loaded one, and a restarted worker (a new registration) is predicted to hold nothing."""
    from common.policy.affinity import prompt_hashes
    from common.policy.routing import RouteSummary
    from services.routing.router import Router

    def summary(rid, ids):
        return RouteSummary(rid, len(ids), 0, 8, prefix_hashes=prompt_hashes(ids, []))

    async def main():
        client = aioredis.from_url(REDIS_URL)
        registry = RedisRegistry(client, f"epdmesh-test:{uuid.uuid4().hex}:")
        try:
            await _register_caching(registry, [("p-1", {P}), ("p-2", {P}), ("d-1", {D})])
            router = Router(registry)
            chat = list(range(100, 400))
            first = (await router.route(summary("a", chat))).prefill.info.worker_id
            other = "p-2" if first == "p-1" else "p-1"
            router.prefilled("a")
            # `first` now looks busier (a route pending there); a new prompt goes to the other worker
            assert (await router.route(summary("b", list(range(500, 800))))).prefill.info.worker_id == other
            router.prefilled("b")
            assert (await router.route(summary("c", chat + list(range(900, 950))))).prefill.info.worker_id == first
            router.prefilled("c")
            registration = info(first, {P}).registration
            assert (
                router.book.affinity.routed.matched_tokens(registration, prompt_hashes(chat, [])) == 288
            )  # 18 whole blocks
            assert (
                router.book.affinity.routed.matched_tokens(registration, prompt_hashes(chat, [("img", 576)])) == 0
            )  # another image
            await _register_caching(registry, [(first, {P})], instance="restarted")
            await router.refresh()
            assert router.book.affinity.routed.matched_tokens(registration, prompt_hashes(chat, [])) == 0
            # a worker that caches no prefix is predicted to hold nothing, whatever was sent to it
            await registry.register(info(first, {P}), WorkerLoad(kv_tokens_free=100_000))
            await router.refresh()
            router.book.affinity.routed.record(registration, prompt_hashes(chat, []), 0)
            seen, plan_of = [], router.book.policy_plan
            router.book.policy_plan = lambda workers, s: (seen.append(s.cached_tokens), plan_of(workers, s))[1]
            await router.route(summary("e", chat))
            assert seen == [()]
        finally:
            await registry.clear()
            await client.aclose()

    asyncio.run(main())


def test_a_decoder_that_prefills_is_recorded_as_holding_the_prompts_handed_to_it():
    """Path ①: the decoder imports the prompt's KV and, when it prefills too and caches prefixes, keeps it for later
    prompts: the router records the prompt under both workers (a decode-only decoder never prefills: not recorded)."""
    from common.policy.affinity import prompt_hashes
    from common.policy.routing import RouteSummary
    from services.routing.router import Router

    async def main():
        client = aioredis.from_url(REDIS_URL)
        registry = RedisRegistry(client, f"epdmesh-test:{uuid.uuid4().hex}:")
        try:
            await _register_caching(registry, [("p-1", {P}), ("pd-1", {P, D}), ("d-1", {D})], by_id_length=True)
            router = Router(registry, RoutingConfig(prefill_mode="dedicated"))
            ids = list(range(100, 400))
            hashes = prompt_hashes(ids, [])
            plan = await router.route(RouteSummary("a", len(ids), 0, 8, prefix_hashes=hashes))
            assert (plan.prefill.info.worker_id, plan.decoder.info.worker_id) == (
                "p-1",
                "d-1",
            )  # fewest unfinished tokens
            assert router.book.affinity.routed.matched_tokens(info("d-1", {D}).registration, hashes) == 0
            await registry.heartbeat("d-1", WorkerLoad(unfinished_decode_tokens=1000))
            await router.refresh()
            plan = await router.route(RouteSummary("b", len(ids), 0, 8, prefix_hashes=hashes))
            assert (plan.prefill.info.worker_id, plan.decoder.info.worker_id) == ("p-1", "pd-1")
            assert router.book.affinity.routed.matched_tokens(info("pd-1", {P, D}).registration, hashes) == 288
        finally:
            await registry.clear()
            await client.aclose()

    asyncio.run(main())


def test_no_encode_is_skipped_before_a_prefill_covering_the_images_has_finished_on_that_worker():
    """`images_cached` (the gateway sends no Encode) needs a prefill of the prompt *finished* on the worker, not just
    routed there — a burst of one image would otherwise all be refused by the worker and encoded after — and never
    counts the block holding the prompt's last token, which a worker computes again."""
    from common.policy.affinity import prompt_hashes
    from common.policy.routing import RouteSummary
    from services.routing.router import Router

    ids = list(range(100, 164)) + [7] * 300 + list(range(200, 237))  # 401 tokens; "images" end at 364

    def summary(rid, n=len(ids), image_end=364):
        return RouteSummary(rid, n, 1, 8, prefix_hashes=prompt_hashes(ids[:n], [("img", 576)]), image_end=image_end)

    async def main():
        client = aioredis.from_url(REDIS_URL)
        registry = RedisRegistry(client, f"epdmesh-test:{uuid.uuid4().hex}:")
        try:
            await _register_caching(registry, [("e-1", {E}), ("p-1", {P}), ("d-1", {D})])
            router = Router(registry)
            assert not (await router.route(summary("a"))).images_cached  # nothing there yet
            assert not (await router.route(summary("b"))).images_cached  # "a" routed there, not prefilled yet
            router.prefilled("a")
            assert (await router.route(summary("c"))).images_cached
            # a prompt of 368 tokens whose images end at 364: its 23rd block holds its last token — not reused
            assert not (await router.route(summary("d", n=368))).images_cached
            assert (await router.route(summary("e", n=369))).images_cached  # 369: that block is whole before it
            router.forget("b")
            assert "b" not in router.book.affinity._awaiting
        finally:
            await registry.clear()
            await client.aclose()

    asyncio.run(main())


def test_a_gateway_told_to_wait_for_workers_opens_once_the_toggle_lists_that_many():
    """serve starts its gateway beside its workers (`--wait-for-workers N`): it opens its port only once N are
    registered, as if it had started after them."""
    from epdmesh.gateway_process import wait_for_workers

    async def main():
        async with running_toggle() as address, grpc.aio.insecure_channel(address) as channel:
            waiting = asyncio.create_task(asyncio.to_thread(wait_for_workers, address, 2, None))
            toggle = pb_grpc.ToggleStub(channel)
            for wid, roles in [("p-1", {P}), ("d-1", {D})]:
                await asyncio.sleep(0.5)
                assert not waiting.done()  # fewer than two registered
                await toggle.Register(pb.RegisterRequest(info=wire.info_to_pb(info(wid, roles))))
            await asyncio.wait_for(waiting, 10)
            for wid in ("p-1", "d-1"):
                await toggle.Deregister(pb.DeregisterRequest(worker_id=wid))

    asyncio.run(main())


def test_a_worker_started_before_its_toggle_registers_once_it_answers_without_a_warning(caplog):
    """serve starts the workers beside the toggle: a worker's first registration waits for the toggle to answer (up
    to its 5 s deadline) instead of failing at once and warning that the toggle is unreachable."""
    import logging

    from common.ports import free_port
    from services.worker.switch import Registration
    from tests.support import IdleRuntime

    async def main():
        port = free_port()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            registration = Registration(pb_grpc.ToggleStub(channel), info("d-1", {D}), IdleRuntime())
            beating = asyncio.create_task(registration.run())
            await asyncio.sleep(1.0)  # nothing listens yet
            assert not registration.registered
            async with running_toggle(port=port):
                for _ in range(200):
                    if registration.registered:
                        break
                    await asyncio.sleep(0.05)
                assert registration.registered
                beating.cancel()
                await pb_grpc.ToggleStub(channel).Deregister(pb.DeregisterRequest(worker_id="d-1"))

    with caplog.at_level(logging.WARNING, logger="services.worker.switch"):
        asyncio.run(main())
    assert not [r for r in caplog.records if "unreachable" in r.getMessage()]
