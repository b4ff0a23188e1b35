"""Awaited encodes: the next stage gets the image handle from the encoder, whichever call arrives first."""

import asyncio

import grpc
import pytest

from common.paged_cache import PageLayout
from common.transfer import PageHandle
from epdmesh.v1 import mesh_pb2 as pb
from epdmesh.v1 import mesh_pb2_grpc as pb_grpc
from services.encoder.awaited import AwaitedEncodes
from tests.services.test_worker import image_spec, start_worker


def _handle(lease_id: str) -> PageHandle:
    layout = PageLayout("image", "float32", 16, (16, 8))
    return PageHandle("e-1", "127.0.0.1:1", lease_id, (0, 1), 20, layout, 0, "fake", b"")


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_handle_reaches_a_waiter_that_came_first_or_second_and_only_one():
    async def main():
        awaited = AwaitedEncodes(ttl_s=30)
        early = asyncio.ensure_future(awaited.wait("a"))
        await asyncio.sleep(0)
        awaited.begin("a")
        awaited.settle("a", _handle("lease-a"))
        assert (await early).lease_id == "lease-a"
        awaited.begin("b")
        awaited.settle("b", _handle("lease-b"))  # the encode was quicker than the next stage's call
        assert (await awaited.wait("b")).lease_id == "lease-b"
        assert len(awaited) == 0
        first = asyncio.ensure_future(awaited.wait("c"))
        await asyncio.sleep(0)
        with pytest.raises(KeyError, match="already asked for"):
            await awaited.wait("c")
        awaited.settle("c", error=ValueError("bad pixels"))
        with pytest.raises(ValueError, match="bad pixels"):  # the encode's own error, for its status code
            await first
        assert len(awaited) == 0

    asyncio.run(main())


def test_slots_expire_unless_their_encode_is_running_and_a_cancelled_waiter_leaves_none():
    async def main():
        clock = Clock()
        awaited = AwaitedEncodes(ttl_s=5, clock=clock)
        orphan = asyncio.ensure_future(awaited.wait("no-encode"))  # the Encode never comes (its gateway died)
        awaited.begin("slow")  # an encode queued for longer than the ttl
        awaited.begin("unasked")
        awaited.settle("unasked", _handle("lease-u"))  # nobody asks for it
        await asyncio.sleep(0)
        clock.now = 6
        assert awaited.expire() == 2
        with pytest.raises(KeyError, match="no awaited Encode of no-encode"):
            await orphan
        assert len(awaited) == 1  # "slow" still encoding
        awaited.settle("slow", _handle("lease-s"))
        clock.now = 10
        assert awaited.expire() == 0  # its ttl runs from the settle
        assert (await awaited.wait("slow")).lease_id == "lease-s"
        gone = asyncio.ensure_future(awaited.wait("x"))
        await asyncio.sleep(0)
        gone.cancel()
        with pytest.raises(asyncio.CancelledError):
            await gone
        assert len(awaited) == 0

    asyncio.run(main())


def test_a_prefill_sent_before_its_encode_gets_the_pages_from_the_encoder(tiny_dir, processors):
    """Two workers over real gRPC (E and P): the Prefill with pending images arrives first and waits; the pages move E
    → P; the first token is the one of the same request with the handle passed through the caller; every pool is full
    afterwards. An awaited Encode that fails fails the waiting Prefill with ABORTED (its source failed), not a
    hang."""
    processor = processors["tiny"]

    async def main():
        e_task, e_stop, e_addr = await start_worker(tiny_dir, processor, "E", port=0)
        p_task, p_stop, p_addr = await start_worker(tiny_dir, processor, "PD", port=0)
        try:
            async with grpc.aio.insecure_channel(e_addr) as e_ch, grpc.aio.insecure_channel(p_addr) as p_ch:
                encoder, prefiller = pb_grpc.EncoderStub(e_ch), pb_grpc.PrefillerStub(p_ch)
                e_stats, p_stats = pb_grpc.WorkerStub(e_ch), pb_grpc.WorkerStub(p_ch)
                full = [await e_stats.Stats(pb.StatsRequest()), await p_stats.Stats(pb.StatsRequest())]
                # the reference: one step after the other (the handle comes back, then goes to the Prefill)
                handed = await encoder.Encode(pb.EncodeRequest(request=image_spec(processor, "ref")))
                reference = await prefiller.Prefill(
                    pb.PrefillRequest(request=image_spec(processor, "ref"), image_pages=handed.image_pages)
                )
                await p_stats.ReleasePages(pb.ReleasePagesRequest(lease_id=reference.kv_pages.lease_id))

                spec = image_spec(processor, "r1")
                bare = pb.RequestSpec()
                bare.CopyFrom(spec)
                for img in bare.images:
                    img.ClearField("pixel_values")
                pending = pb.PendingImages(worker_id="e", address=e_addr, request_id="r1")
                prefill = prefiller.Prefill(pb.PrefillRequest(request=bare, pending_images=pending))
                await asyncio.sleep(0.3)  # the Prefill waits at the encoder before the Encode exists
                encoded = await encoder.Encode(pb.EncodeRequest(request=spec, awaited=True))
                reply = await prefill
                assert list(reply.first.token_ids) == list(reference.first.token_ids)
                assert reply.kv_pages.num_tokens == reference.kv_pages.num_tokens
                assert not (
                    await e_stats.ReleasePages(pb.ReleasePagesRequest(lease_id=encoded.image_pages.lease_id))
                ).released  # P pulled and acked them already
                await p_stats.ReleasePages(pb.ReleasePagesRequest(lease_id=reply.kv_pages.lease_id))

                broken = image_spec(processor, "r2")
                for img in broken.images:
                    img.ClearField("pixel_values")
                pending.request_id = "r2"
                prefill = prefiller.Prefill(pb.PrefillRequest(request=bare, pending_images=pending))
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await encoder.Encode(pb.EncodeRequest(request=broken, awaited=True))
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await prefill
                assert err.value.code() == grpc.StatusCode.ABORTED and "pixel values" in err.value.details()

                after = [await e_stats.Stats(pb.StatsRequest()), await p_stats.Stats(pb.StatsRequest())]
                for before, now in zip(full, after):
                    assert (now.num_leases, now.image_blocks_free, now.kv_blocks_free) == (
                        0,
                        before.image_blocks_free,
                        before.kv_blocks_free,
                    )
        finally:
            e_stop.set()
            p_stop.set()
            await asyncio.gather(e_task, p_task)

    asyncio.run(main())


@pytest.mark.parametrize("path", ["dedicated", "colocated"])
def test_a_stage_sent_without_its_images_encodes_them_when_they_are_not_cached_after_all(path, tiny_dir, processors):
    """The router predicted the prefill worker holds the images' KV, so the gateway sends no Encode: where that
    worker's cache does not hold them (FAILED_PRECONDITION, reason IMAGES_NOT_CACHED) the gateway encodes them and
    calls it again — the same tokens either way; once they are cached the encoder is not called at all. Real workers
    over gRPC (E + P + D, or E + PD), the gateway's own stage driver."""
    from common.policy.routing import PrefillPath, RoutePlan
    from common.request import Request, Stage
    from common.sampling import SamplingParams
    from common.telemetry.tracing import Tracing
    from common.transfer.channels import ChannelPool
    from common.workers import WorkerInfo, WorkerLoad, WorkerSnapshot
    from services.gateway.mesh.route_client import Route
    from services.gateway.mesh.stages import Stages
    from services.stage_calls.client import StageCalls
    from tests.support import image

    processor = processors["tiny"]
    conversation = [
        {
            "role": "user",
            "content": [
                {"type": "image", "image": image(3, 96, 64)},
                {"type": "text", "text": "Tell me at length what you see " * 4},
            ],
        }
    ]
    ids, images = processor.apply(conversation, finish_pixels=False)

    async def main():
        e_task, e_stop, e_addr = await start_worker(tiny_dir, processor, "E", port=0)
        roles = "P" if path == "dedicated" else "PD"
        p_task, p_stop, p_addr = await start_worker(tiny_dir, processor, roles, port=0, prefix_caching=True)
        tasks, stops = [e_task, p_task], [e_stop, p_stop]
        d_addr = p_addr
        if path == "dedicated":
            d_task, d_stop, d_addr = await start_worker(tiny_dir, processor, "D", port=0)
            tasks.append(d_task)
            stops.append(d_stop)
        channels = ChannelPool()
        calls = StageCalls(channels)
        stages = Stages(channels, calls, Tracing(), spawn=lambda coro: asyncio.ensure_future(coro))
        try:
            decoder = "d" if path == "dedicated" else "p"

            async def drive(rid, prompt, images_cached):
                def worker(worker_id, address, *roles):
                    return WorkerSnapshot(WorkerInfo(worker_id, address, frozenset(roles)), WorkerLoad(), 0.0)

                plan = RoutePlan(
                    worker("e", e_addr, Stage.ENCODE),
                    worker("p", p_addr, Stage.PREFILL),
                    worker(decoder, d_addr, Stage.DECODE),
                    PrefillPath(path),
                    images_cached=images_cached,
                )
                request = Request(rid, prompt[0], SamplingParams(max_tokens=6, temperature=0), prompt[1])
                outs = [out async for out in stages.drive(request, Route(plan, rid))]
                return outs[-1].output_token_ids, outs[-1].num_cached_tokens

            async def encoder_iterations():
                async with grpc.aio.insecure_channel(e_addr) as channel:
                    return (await pb_grpc.WorkerStub(channel).Stats(pb.StatsRequest())).iterations

            reference, cached = await drive("ref", (ids, images), images_cached=False)  # Encode + pending images
            assert cached == 0
            before = await encoder_iterations()
            again, cached = await drive("hit", (ids, images), images_cached=True)  # predicted cached, and it is
            assert again == reference and cached == (len(ids) - 1) // 16 * 16
            assert await encoder_iterations() == before  # the encoder was not called
            # predicted cached, but it is not (another image before the same text): the worker says so, and the
            # gateway encodes it after all
            other = processor.apply(
                [
                    {
                        "role": "user",
                        "content": [{"type": "image", "image": image(4, 96, 64)}, conversation[0]["content"][1]],
                    }
                ],
                finish_pixels=False,
            )
            missed, cached = await drive("miss", other, images_cached=True)
            assert await encoder_iterations() > before and cached == 0
            assert missed == (await drive("miss-again", other, images_cached=False))[0] != reference
            await asyncio.sleep(0.1)  # acks of pulled pages go out 2 ms after the pulls
            for address in {e_addr, p_addr, d_addr}:
                async with grpc.aio.insecure_channel(address) as channel:
                    stats = await pb_grpc.WorkerStub(channel).Stats(pb.StatsRequest())
                assert stats.num_leases == 0 and stats.kv_blocks_free == stats.kv_blocks_total, address
                assert stats.image_blocks_free == stats.image_blocks_total, address
        finally:
            await calls.close()
            await channels.close()
            for stop in stops:
                stop.set()
            await asyncio.gather(*tasks)

    asyncio.run(main())
