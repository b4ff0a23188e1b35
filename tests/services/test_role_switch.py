"""Live role switching (`Worker.SwitchRoles`, `epdmesh switch-roles`) on the real tiny model, real processes, gRPC
and Redis: a worker told to take new roles under streamed load drains, hands its running decodes back (they go on
elsewhere), rebuilds its caches for the new roles and registers again — every greedy answer byte-identical to a run
without the switch, the pools full afterwards."""

import asyncio
import subprocess
import sys
import threading
import time

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.workloads import SHAPES, request_bodies
from epdmesh.v1 import mesh_pb2 as pb
from epdmesh.v1 import mesh_pb2_grpc as pb_grpc
from tests.services.servers import MODEL, assert_pools_full, running_server, streamed_token_ids
from tests.services.test_emulated_mesh import H20
from tests.services.test_mesh import LONG_STORY, _check_tokens

LONG = LONG_STORY


def _workers(base) -> list[dict]:
    workers = httpx.get(f"{base}/stats", timeout=10).json()["workers"]
    return [{**w, "worker_id": worker_id} for worker_id, w in workers.items()]


def _switch(address: str, roles: str, grace: float = 0.0) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "epdmesh.cli", "switch-roles", address, roles, "--grace", str(grace)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def _switch_now(address: str, roles: list[int], grace: float = 0.0) -> pb.SwitchRolesResponse:
    """Over gRPC from this process: at once, mid-stream (the command takes a second or two to start)."""

    async def call():
        async with grpc.aio.insecure_channel(address) as channel:
            request = pb.SwitchRolesRequest(roles=roles, grace_s=grace)
            return await pb_grpc.WorkerStub(channel).SwitchRoles(request, timeout=60)

    return asyncio.run(call())


def _until_registered(base, roles: list[str], timeout: float = 30.0) -> list[dict]:
    deadline = time.monotonic() + timeout
    while True:
        workers = _workers(base)
        if sorted(w["roles"] for w in workers) == sorted(roles):
            return workers
        if time.monotonic() > deadline:
            pytest.fail(f"the registry shows {[w['roles'] for w in workers]}, not {roles}")
        time.sleep(0.1)


def test_a_decoder_switched_mid_stream_hands_back_and_every_answer_stays_the_same(tiny_dir, chat_reference, tmp_path):
    cases, refs = chat_reference
    with running_server(tiny_dir, "EP1+D2", tmp_path / "serve.log", "--prefill-mode", "dedicated") as base:
        whole = httpx.post(f"{base}/v1/chat/completions", json=LONG, timeout=120).json()["choices"][0]["token_ids"]
        switched, others = [], []

        def switch_its_decoder():
            decoder = next(w for w in _workers(base) if w["roles"] == "D" and w["running_decode_batch"])
            # the reference chats go out while the switch drains: they are routed around it
            others.append(threading.Thread(target=lambda: others.append(_check_tokens(base, cases, refs))))
            others[0].start()
            switched.append((decoder, _switch_now(decoder["address"], [pb.STAGE_ENCODE, pb.STAGE_PREFILL])))

        streamed = streamed_token_ids(base, LONG, 20, switch_its_decoder)
        assert streamed == whole  # handed back after ≥ 20 tokens, continued on the other decoder: nothing lost or twice
        decoder, done = switched[0]
        assert done.handed_back == 1 and done.info.worker_id == decoder["worker_id"]
        assert list(done.info.roles) == [pb.STAGE_ENCODE, pb.STAGE_PREFILL] and done.info.instance
        others[0].join(180)
        assert not others[0].is_alive() and len(others) == 2  # the chats all gave transformers' tokens
        workers = _until_registered(base, ["EP", "EP", "D"])
        assert {w["address"] for w in workers} >= {decoder["address"]}  # the same process, now encoding and prefilling
        stats = httpx.get(f"{base}/stats", timeout=10).json()
        assert stats["retries"] == 0  # a hand-back is not a failure
        _check_tokens(base, cases, refs)  # its new roles serve: two prefill workers, one decoder
        assert_pools_full(base)
        log = (tmp_path / "serve.log").read_text()
        assert "now EP (1 decodes handed back" in log
        assert (
            "switching roles; its KV goes with it" in log and "prefilling again" not in log
        )  # decoded on, from its KV


def test_a_drained_decoder_hands_back_mid_stream_and_stays_out_of_the_mesh(tiny_dir, chat_reference, tmp_path):
    """`Worker.Drain` (`epdmesh drain`, a Kubernetes preStop hook): out of the registry, its running decode handed
    back with its KV and decoded on elsewhere, byte-identical; it stays out, idle, until stopped."""
    cases, refs = chat_reference
    with running_server(tiny_dir, "EP1+D2", tmp_path / "serve.log", "--prefill-mode", "dedicated") as base:
        whole = httpx.post(f"{base}/v1/chat/completions", json=LONG, timeout=120).json()["choices"][0]["token_ids"]
        drained = []

        def drain_its_decoder():
            decoder = next(w for w in _workers(base) if w["roles"] == "D" and w["running_decode_batch"])

            async def call():
                async with grpc.aio.insecure_channel(decoder["address"]) as channel:
                    return await pb_grpc.WorkerStub(channel).Drain(pb.DrainRequest(grace_s=0), timeout=60)

            drained.append((decoder, asyncio.run(call())))

        assert streamed_token_ids(base, LONG, 20, drain_its_decoder) == whole
        decoder, done = drained[0]
        assert done.handed_back == 1 and done.idle
        workers = _until_registered(base, ["EP", "D"])
        assert decoder["address"] not in {w["address"] for w in workers}
        with grpc.insecure_channel(decoder["address"]) as channel:  # alive, serving no stage
            check = health_pb2_grpc.HealthStub(channel).Check
            assert check(health_pb2.HealthCheckRequest(service="epdmesh.v1.Decoder"), timeout=5).status == (
                health_pb2.HealthCheckResponse.NOT_SERVING
            )
        _check_tokens(base, cases, refs)
        time.sleep(2.5)  # past a heartbeat: a drained worker does not register again by itself
        assert decoder["address"] not in {w["address"] for w in _workers(base)}
        again = subprocess.run(
            [sys.executable, "-m", "epdmesh.cli", "drain", decoder["address"], "--grace", "0"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert again.returncode == 0 and "0 decodes handed back" in again.stdout and "idle" in again.stdout, again
        with pytest.raises(grpc.RpcError) as refused, grpc.insecure_channel(decoder["address"]) as channel:
            pb_grpc.WorkerStub(channel).SwitchRoles(pb.SwitchRolesRequest(roles=[pb.STAGE_DECODE]), timeout=30)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE and "draining" in refused.value.details()
        assert decoder["address"] not in {w["address"] for w in _workers(base)}  # a drained worker stays out
        assert_pools_full(base)


def test_switching_back_and_forth_keeps_the_answers_and_refuses_what_it_cannot_take(tiny_dir, chat_reference, tmp_path):
    cases, refs = chat_reference
    with running_server(tiny_dir, "EP1+D1", tmp_path / "serve.log", "--prefill-mode", "dedicated") as base:
        workers = _workers(base)
        ep = next(w for w in workers if w["roles"] == "EP")
        d = next(w for w in workers if w["roles"] == "D")

        async def refused():
            async with grpc.aio.insecure_channel(ep["address"]) as channel:
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await pb_grpc.WorkerStub(channel).SwitchRoles(pb.SwitchRolesRequest(roles=[]), timeout=10)
                return info.value

        error = asyncio.run(refused())
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "at least one role" in error.details()
        # the two swap roles, one at a time: for a while both are EP (no decoder), then D and EP again
        assert _switch(d["address"], "EP", grace=2.0).returncode == 0
        _until_registered(base, ["EP", "EP"])
        assert _switch(ep["address"], "D").returncode == 0
        _until_registered(base, ["EP", "D"])
        _check_tokens(base, cases, refs)
        assert_pools_full(base)
        # one worker takes every role, the other is colocated too
        assert _switch(ep["address"], "EPD").returncode == 0
        assert _switch(d["address"], "EPD").returncode == 0
        _until_registered(base, ["EPD", "EPD"])
        _check_tokens(base, cases, refs)
        assert_pools_full(base)


def test_the_planner_moves_an_emulated_mesh_to_its_load_and_loses_nothing(emulated_dir, tmp_path):
    """Captions (an image, a short answer) on EP2+D2 of the emulated LLaVA-1.5-7B on H20: the planner's rate matching
    wants EP3+D1 and moves a decoder to EP under load, one switch an interval; every request is answered."""
    bodies = [
        {k: v for k, v in b.items() if k not in ("stream", "stream_options")}
        for b in request_bodies(SHAPES["textcaps"], 60, MODEL, seed=5)
    ]
    args = ["--backend", "emulated", "--profile", H20, "--kv-cache-gib", "4", "--transfer", "grpc"]
    args += ["--latency-profile", H20, "--slo-ttft-ms", "2000", "--slo-tbt-ms", "150", "--prefill-mode", "dedicated"]
    args += ["--planner", "--planner-interval", "1", "--planner-grace", "0.5"]
    with running_server(emulated_dir, "EP2+D2", tmp_path / "serve.log", *args) as base:

        async def send_all() -> list[int]:
            async with httpx.AsyncClient(timeout=120) as client:

                async def one(i, body):
                    await asyncio.sleep(i * 0.1)  # 10 requests a second for 6 s
                    return (await client.post(f"{base}/v1/chat/completions", json=body)).status_code

                return await asyncio.gather(*(one(i, b) for i, b in enumerate(bodies)))

        assert asyncio.run(send_all()) == [200] * len(bodies)
        _until_registered(base, ["EP", "EP", "EP", "D"])
        planner = httpx.get(f"{base}/stats", timeout=10).json()["planner"]
        assert planner["switches"] == 1 and planner["failed_switches"] == 0, planner
        switched = [d for d in planner["recent"] if d["action"] == "switch"]
        assert switched and switched[0]["target"] == {"D": 1, "EP": 3}
        assert switched[0]["switches"][0]["from"] == "D" and switched[0]["switches"][0]["to"] == "EP"
        assert planner["forecast"]["images"] == 1.0 and planner["forecast"]["prompt_tokens"] > 576
        metrics = httpx.get(f"{base}/metrics", timeout=10).text
        assert 'epdmesh:role_switches_total{from="D",model_name="tiny",to="EP"} 1.0' in metrics, metrics[-2000:]
        assert 'epdmesh:planner_decisions_total{action="switch",model_name="tiny"} 1.0' in metrics
        assert_pools_full(base)
