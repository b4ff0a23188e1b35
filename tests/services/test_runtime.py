"""Worker runtimes handing pages to each other through the fake transfer backend (no gRPC): the stage
logic alone — leases granted, pulled, acked once, freed; a source that vanished fails the pull cleanly."""

import asyncio

import pytest

from common.engine.async_engine import AsyncEngine
from common.engine.config import EngineConfig, parse_roles
from common.engine.engine import Engine
from common.request import Request, Stage
from common.sampling import SamplingParams
from common.transfer import PullFailed
from common.transfer.fake import FakeFabric, FakePuller
from services.worker.runtime import WorkerRuntime
from tests.support import build_requests


def runtime(name, roles, tiny_dir, processor, fabric) -> WorkerRuntime:
    config = EngineConfig(model=str(tiny_dir), roles=parse_roles(roles), kv_cache_gib=0.02, image_cache_gib=0.02)
    rt = WorkerRuntime(name, f"fake://{name}", AsyncEngine(Engine(config, detokenize=processor.detokenize)),
                       FakePuller(fabric), lease_ttl_s=30, offer_backend="fake")
    fabric.attach(f"fake://{name}", rt.read_lease, rt.release_lease)
    return rt


def stage_copy(r: Request, first: Stage, last: Stage, suffix: str, output=()) -> Request:
    copy = Request(f"{r.request_id}@{suffix}", r.prompt_token_ids, r.sampling, r.images, first_stage=first, last_stage=last)
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
        assert (load.num_leases, load.kv_blocks_free, load.image_blocks_free) == (0, load.kv_blocks_total, load.image_blocks_total)


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
