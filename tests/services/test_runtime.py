"""Worker runtimes handing pages to each other through the fake transfer backend (no gRPC): the stage
logic alone — leases granted, pulled, acked once, freed; a source that vanished fails the pull cleanly."""

import asyncio
import time

import pytest

from common.engine.async_engine import AsyncEngine
from common.engine.config import EngineConfig, parse_roles
from common.engine.engine import Engine, NoRoomForPages, RequestRejected
from common.request import Request, Stage
from common.sampling import SamplingParams
from common.transfer import PullFailed
from common.transfer.fake import FakeFabric, FakePuller
from epdmesh.v1 import mesh_pb2 as pb
from services import wire
from services.prefill.servicer import PrefillServicer
from services.worker.runtime import WorkerRuntime
from tests.support import build_requests, image


def runtime(name, roles, tiny_dir, processor, fabric, image_cache_gib=0.02, prefix_caching=False) -> WorkerRuntime:
    config = EngineConfig(
        model=str(tiny_dir),
        roles=parse_roles(roles),
        kv_cache_gib=0.02,
        image_cache_gib=image_cache_gib,
        enable_prefix_caching=prefix_caching,
    )
    rt = WorkerRuntime(
        name,
        f"fake://{name}",
        AsyncEngine(Engine(config, detokenize=processor.detokenize)),
        FakePuller(fabric),
        lease_ttl_s=30,
        offer_backend="fake",
    )
    fabric.attach(f"fake://{name}", rt.read_lease, rt.release_lease)
    return rt


def stage_copy(r: Request, first: Stage, last: Stage, suffix: str, output=()) -> Request:
    copy = Request(
        f"{r.request_id}@{suffix}", r.prompt_token_ids, r.sampling, r.images, first_stage=first, last_stage=last
    )
    copy.output_token_ids = list(output)
    return copy


def test_e_p_d_runtimes_move_pages_through_the_fake_backend(tiny_dir, processors, chat_reference):
    processor = processors["tiny"]
    cases, refs = chat_reference
    requests = build_requests(processor, cases)

    async def one(e, p, d, r):
        image_pages = None
        if r.images:
            image_pages = await e.encode(stage_copy(r, Stage.ENCODE, Stage.ENCODE, "encode"))
        first, kv = await p.prefill(stage_copy(r, Stage.PREFILL, Stage.PREFILL, "prefill"), image_pages)
        tokens = list(first.output_token_ids)
        if kv is None:
            return tokens
        async for out in d.decode(stage_copy(r, Stage.DECODE, Stage.DECODE, "decode", tokens), kv, None):
            tokens.extend(out.new_token_ids)
        return tokens

    async def main():
        fabric = FakeFabric()
        e, p, d = (runtime(n, n, tiny_dir, processor, fabric) for n in ("e", "p", "d"))
        try:
            outputs = await asyncio.gather(*(one(e, p, d, r) for r in requests))
            for _ in range(50):  # acks are fire-and-forget: give them a moment
                if not (len(e.leases) or len(p.leases)):
                    break
                await asyncio.sleep(0.02)
            return outputs, fabric, [rt.load() for rt in (e, p, d)]
        finally:
            for rt in (e, p, d):
                rt.engine.shutdown()

    outputs, fabric, loads = asyncio.run(main())
    for case, tokens in zip(cases, outputs):
        assert tokens == refs[case.name].tokens, case.name
    with_images = sum(1 for r in requests if r.images)
    assert fabric.pulls == with_images + len(requests)  # image pages once per image request, KV once per request
    for load in loads:
        assert (load.num_leases, load.kv_blocks_free, load.image_blocks_free) == (
            0,
            load.kv_blocks_total,
            load.image_blocks_total,
        )


def test_pulling_from_a_vanished_source_fails_cleanly(tiny_dir, processors):
    processor = processors["tiny"]

    async def main():
        fabric = FakeFabric()
        p, d = runtime("p", "p", tiny_dir, processor, fabric), runtime("d", "d", tiny_dir, processor, fabric)
        try:
            r = Request("r", [1, 40, 41, 42], SamplingParams(max_tokens=5, temperature=0))
            _, kv = await p.prefill(stage_copy(r, Stage.PREFILL, Stage.PREFILL, "prefill"), None)
            fabric.detach("fake://p")  # the prefill worker died
            with pytest.raises(PullFailed, match="no source"):
                async for _ in d.decode(stage_copy(r, Stage.DECODE, Stage.DECODE, "decode", [7]), kv, None):
                    pass
            assert d.load().kv_blocks_free == d.load().kv_blocks_total and d.in_flight == 0
        finally:
            p.engine.shutdown()
            d.engine.shutdown()

    asyncio.run(main())


def test_handed_over_pages_wait_for_cache_room_and_give_up_cleanly(tiny_dir, processors, chat_reference, monkeypatch):
    """A prefill worker whose image cache holds one image gets two images at once: the second waits for the
    first's blocks instead of failing. Room that never comes ends in NoRoomForPages (the gateway's 503 + Retry-After),
    with the source's lease released and nothing held."""
    import services.worker.runtime as runtime_module

    processor = processors["tiny"]
    cases, refs = chat_reference
    requests = [r for r in build_requests(processor, cases) if r.images][:2]
    assert len(requests) == 2

    async def main():
        fabric = FakeFabric()
        e = runtime("e", "e", tiny_dir, processor, fabric)
        layout = e.engine.engine.image_cache.layout
        per_image = -(-requests[0].num_image_tokens // layout.block_size)
        one_image = 1.5 * per_image * layout.bytes_per_block / 2**30
        p = runtime("p", "p", tiny_dir, processor, fabric, image_cache_gib=one_image)
        try:
            assert p.load().image_blocks_total < 2 * per_image  # room for one image at a time
            handles = [await e.encode(stage_copy(r, Stage.ENCODE, Stage.ENCODE, "encode")) for r in requests]
            firsts = await asyncio.gather(
                *(
                    p.prefill(stage_copy(r, Stage.PREFILL, Stage.PREFILL, "prefill"), h)
                    for r, h in zip(requests, handles)
                )
            )
            for r, (out, kv) in zip(requests, firsts):
                assert out.output_token_ids[:1] == refs[r.request_id].tokens[:1]
                await p.puller.release(kv)
            monkeypatch.setattr(runtime_module, "IMPORT_WAIT_S", 0.3)
            filler = stage_copy(requests[0], Stage.PREFILL, Stage.PREFILL, "filler")
            await p.engine.call(lambda eng: eng.pages.reserve_import(filler))  # the cache is full and stays so
            handle = await e.encode(stage_copy(requests[1], Stage.ENCODE, Stage.ENCODE, "encode-2"))
            with pytest.raises(NoRoomForPages, match="no free image-cache blocks"):
                await p.prefill(stage_copy(requests[1], Stage.PREFILL, Stage.PREFILL, "prefill-2"), handle)
            await p.engine.call(lambda eng: eng.pages.cancel_import(filler.request_id))
            for _ in range(250):  # the release of the lease, then of its blocks, is fire-and-forget
                loads = [rt.load() for rt in (e, p)]
                if all(not x.num_leases and x.image_blocks_free == x.image_blocks_total for x in loads):
                    break
                await asyncio.sleep(0.02)
            return loads
        finally:
            for rt in (e, p):
                rt.engine.shutdown()

    for load in asyncio.run(main()):
        assert (load.num_leases, load.kv_blocks_free, load.image_blocks_free) == (
            0,
            load.kv_blocks_total,
            load.image_blocks_total,
        )


def test_a_pinned_prefix_goes_back_when_its_stage_never_starts_and_the_encoders_pages_are_let_go(tiny_dir, processors):
    """`pin_cached_images` takes cached blocks for a request whose images are pending elsewhere. A worker draining
    meanwhile refuses it before the pin, a stage that fails before its engine takes the request in gives the blocks
    back, and either way the encoder's pages are released unpulled: no block and no lease is left behind."""
    from services.worker.runtime import ShuttingDown

    processor = processors["tiny"]
    conversation = [
        {
            "role": "user",
            "content": [
                {"type": "image", "image": image(5, 64, 64)},
                {"type": "text", "text": "Tell me at length what you see " * 4},
            ],
        }
    ]
    ids, images = processor.apply(conversation)
    request = Request("r", ids, SamplingParams(max_tokens=4, temperature=0), images)

    async def main():
        fabric = FakeFabric()
        e = runtime("e", "e", tiny_dir, processor, fabric)
        p = runtime("p", "p", tiny_dir, processor, fabric, prefix_caching=True)
        try:
            handle = await e.encode(stage_copy(request, Stage.ENCODE, Stage.ENCODE, "encode"))
            first, kv = await p.prefill(stage_copy(request, Stage.PREFILL, Stage.PREFILL, "prefill"), handle)
            await p.release_lease(kv.lease_id)
            full = p.engine.stats()

            async def awaited_pages(rid):
                return await e.encode(stage_copy(request, Stage.ENCODE, Stage.ENCODE, rid))

            again = stage_copy(request, Stage.PREFILL, Stage.PREFILL, "again")
            assert await p.pin_cached_images(again, lambda: awaited_pages("enc-2"))
            p.accepting = False  # draining: the stage refuses it, and the pinned blocks go back
            with pytest.raises(ShuttingDown):
                await p.prefill(again, None, pinned=True)
            late = stage_copy(request, Stage.PREFILL, Stage.PREFILL, "late")
            with pytest.raises(ShuttingDown):  # refused before anything is pinned
                await p.pin_cached_images(late, lambda: awaited_pages("enc-3"))
            for _ in range(100):
                if not len(e.leases) and not len(p.leases):
                    break
                await asyncio.sleep(0.02)
            assert not p.engine.engine.pages.importing and p.engine.stats() == full
            assert not len(e.leases)  # both awaited encodes' pages were released unpulled
        finally:
            for rt in (e, p):
                rt.engine.shutdown()

    asyncio.run(main())


def test_a_prefill_sent_again_frees_its_earlier_attempts_unpulled_kv_first(tiny_dir, processors, chat_reference):
    """The gateway gave an attempt up after its Prefill went out (no room on the decoder) and sends the Prefill
    again before the attempt's release reached this worker: the earlier pages go, and the new attempt is served
    instead of refused as a duplicate id."""
    processor = processors["tiny"]
    cases, refs = chat_reference
    request = next(r for r in build_requests(processor, cases) if not r.images)
    message = pb.PrefillRequest(request=wire.spec_to_pb(request, with_pixels=False))

    async def main():
        p = runtime("p", "p", tiny_dir, processor, FakeFabric())
        servicer = PrefillServicer(p, calls=None)
        try:
            first = await servicer.prefill(message)
            assert first.HasField("kv_pages") and len(p.leases) == 1  # never pulled, never released
            with pytest.raises(RequestRejected, match="already in use"):  # what the runtime alone refuses
                await p.prefill(stage_copy(request, Stage.PREFILL, Stage.PREFILL, "prefill"), None)
            again = await servicer.prefill(message)
            return first, again, len(p.leases)
        finally:
            p.engine.shutdown()

    first, again, leases = asyncio.run(main())
    assert list(again.first.token_ids) == list(first.first.token_ids) and again.HasField("kv_pages")
    assert leases == 1  # the new attempt's lease alone


def test_pages_waiting_for_room_are_served_first_come_first_served_and_only_the_first_tries():
    """`ImportQueue`: the first in line tries when blocks are freed (`poke`), the rest wait without trying; room for
    one goes to the oldest; a wait that runs out ends in the engine's NoRoomForPages; a waiter whose caller left just
    as its blocks were reserved gives them back."""
    from common.engine.engine import NoRoomForPages
    from services.worker.runtime import ImportQueue

    room, tries, cancelled = [0], [], []

    def reserve(request):
        tries.append(request.request_id)
        if room[0] <= 0:
            raise NoRoomForPages("no free KV blocks")
        room[0] -= 1
        return ("kv", [room[0]], 16)

    def req(rid):
        return Request(rid, [1, 2, 3], SamplingParams(max_tokens=4))

    async def main():
        queue = ImportQueue(reserve, lambda r: cancelled.append(r.request_id))
        far = time.time() + 30
        waiters = [asyncio.create_task(queue.take(req(f"r{i}"), far)) for i in range(3)]
        await asyncio.sleep(0)
        assert len(queue) == 3 and tries == ["r0"]  # the first tried at once; the others queued behind it untried
        tries.clear()
        room[0] = 1
        queue.poke()
        assert tries == ["r0", "r1"]  # r0 got the room, r1 tried next and found none; r2 never tried
        assert (await waiters[0])[0] == "kv" and len(queue) == 2
        late = asyncio.create_task(queue.take(req("late"), time.time() + 0.05))
        with pytest.raises(NoRoomForPages, match="no free KV blocks"):
            await late  # its wait ran out: the engine's own refusal
        room[0] = 1
        queue.poke()
        waiters[2].cancel()  # r2's caller leaves: it never got blocks, nothing to give back
        assert (await waiters[1])[0] == "kv"
        with pytest.raises(asyncio.CancelledError):
            await waiters[2]
        assert cancelled == [] and len(queue) == 0
        gone = asyncio.create_task(queue.take(req("gone"), far))
        await asyncio.sleep(0)
        room[0] = 1
        queue.poke()  # its blocks are reserved, and its caller is cancelled before it runs again
        gone.cancel()
        with pytest.raises(asyncio.CancelledError):
            await gone
        assert cancelled == ["gone"]

    asyncio.run(main())
