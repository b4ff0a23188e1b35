"""One worker over real gRPC: leases expire when nobody pulls, errors carry precise codes, shutdown drains."""

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.engine.config import EngineConfig, parse_roles
from common.engine.engine import Engine
from common.request import Request
from common.sampling import SamplingParams
from epdmesh.v1 import mesh_pb2 as pb
from epdmesh.v1 import mesh_pb2_grpc as pb_grpc
from services import wire
from services.worker.server import WorkerOptions, run_worker
from tests.support import image


async def start_worker(tiny_dir, processor, roles="EPD", prefix_caching=False, **options):
    config = EngineConfig(
        model=str(tiny_dir),
        roles=parse_roles(roles),
        kv_cache_gib=0.02,
        image_cache_gib=0.02,
        enable_prefix_caching=prefix_caching,
    )
    engine = Engine(config, detokenize=processor.detokenize)
    opts = WorkerOptions(engine=config, transfer="grpc", **options)
    ready, stop, bound = asyncio.Event(), asyncio.Event(), []
    task = asyncio.create_task(run_worker(opts, engine=engine, ready=ready, stop=stop, bound=bound))
    await ready.wait()
    return task, stop, bound[0]


def image_spec(processor, request_id, max_tokens=4):
    ids, images = processor.apply(
        [{"role": "user", "content": [{"type": "image", "image": image(1, 64, 64)}, {"type": "text", "text": "what?"}]}]
    )
    return wire.spec_to_pb(Request(request_id, ids, SamplingParams(max_tokens=max_tokens, temperature=0), images), True)


def test_unpulled_pages_are_freed_when_the_lease_expires_and_errors_have_precise_codes(tiny_dir, processors):
    processor = processors["tiny"]

    async def main():
        task, stop, address = await start_worker(tiny_dir, processor, "EPD", port=0, lease_ttl_s=0.6)
        try:
            async with grpc.aio.insecure_channel(address) as channel:
                worker, encoder = pb_grpc.WorkerStub(channel), pb_grpc.EncoderStub(channel)
                full = await worker.Stats(pb.StatsRequest())
                reply = await encoder.Encode(pb.EncodeRequest(request=image_spec(processor, "r1")))
                handle = reply.image_pages
                assert (
                    handle.layout.kind == pb.CACHE_KIND_IMAGE and handle.num_tokens == 256 and handle.backend == "grpc"
                )
                held = await worker.Stats(pb.StatsRequest())
                assert held.num_leases == 1 and held.image_blocks_free == full.image_blocks_free - len(handle.block_ids)
                # a pull reads exactly the handle's bytes
                data = b"".join([c.data async for c in worker.PullPages(pb.PullPagesRequest(lease_id=handle.lease_id))])
                assert len(data) == len(handle.block_ids) * 16 * 256 * 4
                await asyncio.sleep(1.5)  # nobody acks: the lease expires and the pages come back
                after = await worker.Stats(pb.StatsRequest())
                assert (after.num_leases, after.image_blocks_free) == (0, full.image_blocks_free)
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await _drain(worker.PullPages(pb.PullPagesRequest(lease_id=handle.lease_id)))
                assert err.value.code() == grpc.StatusCode.NOT_FOUND
                assert not (await worker.ReleasePages(pb.ReleasePagesRequest(lease_id=handle.lease_id))).released
                no_pixels = image_spec(processor, "r2")
                for img in no_pixels.images:
                    img.ClearField("pixel_values")
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await encoder.Encode(pb.EncodeRequest(request=no_pixels))
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "pixel values" in err.value.details()
                too_long = pb.RequestSpec(
                    request_id="r3", prompt_token_ids=[5] * 5000, sampling=pb.SamplingParams(max_tokens=4, top_p=1)
                )
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await _drain(pb_grpc.DecoderStub(channel).Decode(pb.DecodeRequest(request=too_long)))
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "limit" in err.value.details()
        finally:
            stop.set()
            await task

    asyncio.run(main())


def test_shutdown_drains_in_flight_streams_and_refuses_new_work(tiny_dir, processors):
    processor = processors["tiny"]

    async def main():
        task, stop, address = await start_worker(tiny_dir, processor, "PD", port=0, grace_s=30)
        async with grpc.aio.insecure_channel(address) as channel:
            decoder = pb_grpc.DecoderStub(channel)
            spec = pb.RequestSpec(
                request_id="long",
                prompt_token_ids=[1, 50, 60, 70],
                sampling=pb.SamplingParams(max_tokens=120, top_p=1, ignore_eos=True),
            )
            call = decoder.Decode(pb.DecodeRequest(request=spec))
            tokens = list((await call.read()).token_ids)
            stop.set()  # SIGTERM equivalent
            await asyncio.sleep(0.2)
            health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""))
            assert health.status == health_pb2.HealthCheckResponse.NOT_SERVING
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await _drain(
                    decoder.Decode(
                        pb.DecodeRequest(
                            request=pb.RequestSpec(
                                request_id="late",
                                prompt_token_ids=[1, 2],
                                sampling=pb.SamplingParams(max_tokens=2, top_p=1),
                            )
                        )
                    )
                )
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "shutting down" in err.value.details()
            finish = ""
            while (chunk := await call.read()) != grpc.aio.EOF:
                tokens += chunk.token_ids
                finish = chunk.finish_reason or finish
            assert (len(tokens), finish) == (120, "length")
        await task

    asyncio.run(main())


async def _drain(call):
    return [chunk async for chunk in call]


def test_a_full_cache_is_a_retryable_status_not_a_bad_request():
    """No room for handed-over pages says 'come back' (RESOURCE_EXHAUSTED → 503 + Retry-After), not 'fix it'."""
    from common.engine.engine import NoRoomForPages, RequestRejected
    from services.errors import status_for

    assert status_for(NoRoomForPages("no free KV blocks")) == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert status_for(RequestRejected("over the model's limit")) == grpc.StatusCode.INVALID_ARGUMENT
