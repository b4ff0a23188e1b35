"""KV blocks on demand: a cache too small for every request at once preempts, and loses no token.

A preempted request recomputes its prompt and output where it can (greedy tokens stay transformers' own, a seeded
sampled stream stays the same); one whose images are not on the engine is handed back, and its continuation
elsewhere (the gateway's `continuation`, as after a failed decoder) finishes the same answer.
"""

import asyncio
import dataclasses

import pytest
import torch

from common.engine.async_engine import AsyncEngine
from common.engine.config import EngineConfig
from common.engine.engine import Engine, NoRoomForPages
from common.model.loader import load_model
from common.paged_cache import PagedKVCache
from common.request import Request, Stage
from common.sampling import SamplingParams
from common.scheduler import SchedulerConfig
from services.gateway.mesh.migration import continuation
from tests.support import assert_pools_full, build_requests


@pytest.fixture(scope="module")
def model(tiny_dir):
    return load_model(tiny_dir, torch.float32)


def make_engine(tiny_dir, model, kv_blocks: int, roles=frozenset(Stage), **scheduler) -> Engine:
    text = model.cfg.text
    per_block = PagedKVCache.bytes_per_block(16, text.num_layers, text.num_kv_heads, text.head_dim, torch.float32)
    config = EngineConfig(
        model=str(tiny_dir),
        roles=roles,
        kv_cache_gib=kv_blocks * per_block / 2**30,
        image_cache_gib=0.02,
        scheduler=SchedulerConfig(**scheduler),
    )
    engine = Engine(config, model=model)
    assert engine.stats().kv_blocks_total == kv_blocks
    return engine


SMALL = ("hi", "img-short", "img-tall", "text-200", "system", "multi-turn")  # 83 blocks of KV, all at once


@pytest.mark.parametrize("token_budget", [2048, 64], ids=["whole-prefill", "chunked-64"])
def test_a_cache_too_small_for_all_at_once_preempts_and_still_gives_the_transformers_tokens(
    token_budget, tiny_dir, model, processors, chat_reference
):
    cases, refs = chat_reference
    cases = [c for c in cases if c.name in SMALL]
    engine = make_engine(tiny_dir, model, kv_blocks=24, token_budget=token_budget)  # the longest needs 21 blocks
    requests = build_requests(processors["tiny"], cases)
    finals = engine.generate(requests)
    assert {c.name: finals[c.name].output_token_ids for c in cases} == {c.name: refs[c.name].tokens for c in cases}
    assert engine.stats().num_preemptions >= 1 and any(r.recompute_outputs for r in requests)
    assert_pools_full(engine)


def test_a_preempted_image_request_is_encoded_again_and_goes_on_with_the_same_tokens(
    tiny_dir, model, processors, chat_reference
):
    cases, _ = chat_reference
    cases = [dataclasses.replace(c, max_tokens=64) for c in cases if c.name in ("img-short", "img-tall")]
    roomy = make_engine(tiny_dir, model, kv_blocks=512).generate(build_requests(processors["tiny"], cases))
    engine = make_engine(tiny_dir, model, kv_blocks=40)  # 333 + 380 tokens at the end: 45 blocks
    requests = build_requests(processors["tiny"], cases)
    finals = engine.generate(requests)
    assert requests[1].recompute_outputs > 0 and requests[1].num_encoded_images == 1  # the newer one, img-tall
    assert {k: v.output_token_ids for k, v in finals.items()} == {k: v.output_token_ids for k, v in roomy.items()}
    assert_pools_full(engine)


def test_worst_case_admission_gives_the_same_tokens_without_preempting(tiny_dir, model, processors, chat_reference):
    cases, refs = chat_reference
    engine = make_engine(tiny_dir, model, kv_blocks=64, kv_admission="worst-case")  # 45 blocks: one at a time
    finals = engine.generate(build_requests(processors["tiny"], cases))
    assert {c.name: finals[c.name].output_token_ids for c in cases} == {c.name: refs[c.name].tokens for c in cases}
    assert engine.stats().num_preemptions == 0
    assert_pools_full(engine)


def test_a_seeded_sampled_stream_with_penalties_is_the_same_when_preempted(tiny_dir, model):
    def requests():
        sampling = SamplingParams(
            max_tokens=60,
            temperature=0.9,
            top_p=0.95,
            seed=11,
            presence_penalty=0.5,
            repetition_penalty=1.2,
            ignore_eos=True,
        )
        return [
            Request(f"r{i}", [1, 405 + i, 77, 1290, 33] * 6, dataclasses.replace(sampling, seed=11 + i))
            for i in range(6)
        ]

    roomy = make_engine(tiny_dir, model, kv_blocks=512).generate(requests())
    small = make_engine(tiny_dir, model, kv_blocks=20)  # 6 × 90 tokens need 36 blocks at the end
    tight = small.generate(requests())
    assert small.stats().num_preemptions >= 1
    assert {k: v.output_token_ids for k, v in tight.items()} == {k: v.output_token_ids for k, v in roomy.items()}
    assert_pools_full(small)


def test_a_decoder_hands_back_what_it_cannot_recompute_and_the_continuation_finishes_the_answer(
    tiny_dir, model, processors, chat_reference
):
    """A decode-only engine gets requests as KV pages, their images' pixels left behind (as a decoder in the mesh
    does): one it preempts leaves it with the tokens it has, and no pages held; its continuation on another engine
    (prompt + those tokens prefilled) ends with transformers' answer."""
    cases, _ = chat_reference
    cases = [dataclasses.replace(c, max_tokens=64) for c in cases if c.name in ("img-short", "img-tall", "system")]
    reference = make_engine(tiny_dir, model, kv_blocks=512).generate(build_requests(processors["tiny"], cases))
    prefiller = make_engine(tiny_dir, model, kv_blocks=512, roles=frozenset({Stage.ENCODE, Stage.PREFILL}))
    decoder = make_engine(tiny_dir, model, kv_blocks=40, roles=frozenset({Stage.DECODE}))
    requests = {r.request_id: r for r in build_requests(processors["tiny"], cases)}
    for r in requests.values():
        prefiller.add_request(Request(r.request_id, r.prompt_token_ids, r.sampling, r.images, last_stage=Stage.PREFILL))
    emitted, handed_back, arriving = {}, [], []
    while prefiller.has_unfinished or decoder.has_unfinished or arriving:
        for out in prefiller.step():
            arriving.append((out, prefiller.pages.export_kv_pages(out.request_id)))
            prefiller.pages.release(out.request_id)
        for out, pages in list(arriving):  # as a worker does, the pages wait for room
            r = requests[out.request_id]
            no_pixels = [dataclasses.replace(image, pixel_values=None) for image in r.images]
            try:
                decoder.add_request(
                    Request(
                        r.request_id,
                        r.prompt_token_ids,
                        r.sampling,
                        no_pixels,
                        first_stage=Stage.DECODE,
                        output_token_ids=list(out.output_token_ids),
                    ),
                    kv_pages=pages,
                )
            except NoRoomForPages:
                continue
            arriving.remove((out, pages))
        for out in decoder.step():
            if out.handed_back:
                assert not out.new_token_ids
                handed_back.append(out.request_id)
            if out.done_here:
                emitted[out.request_id] = out.output_token_ids
    assert handed_back and all(requests[rid].images for rid in handed_back), handed_back  # text is recomputed there
    assert decoder.stats().num_preemptions >= len(handed_back)
    assert_pools_full(prefiller, decoder)
    rest = make_engine(tiny_dir, model, kv_blocks=512)
    continued = rest.generate([continuation(requests[rid], emitted[rid], attempt=2) for rid in handed_back])
    for rid in handed_back:
        emitted[rid] = emitted[rid] + continued[f"{rid}-m2"].output_token_ids
    assert emitted == {c.name: reference[c.name].output_token_ids for c in cases}
    assert all(out.finished for out in continued.values())
    assert_pools_full(rest)


def _handed_over(tiny_dir, model, requests: list[Request]) -> dict[str, tuple[Request, object]]:
    """Each request prefilled on an encode+prefill engine, as a decoder gets it: its first token, its KV pages, and
    its images without their pixels."""
    prefiller = make_engine(tiny_dir, model, kv_blocks=512, roles=frozenset({Stage.ENCODE, Stage.PREFILL}))
    finals = prefiller.generate(
        [Request(r.request_id, r.prompt_token_ids, r.sampling, r.images, last_stage=Stage.PREFILL) for r in requests]
    )
    out = {}
    for r in requests:
        pages = prefiller.pages.export_kv_pages(r.request_id)
        prefiller.pages.release(r.request_id)
        no_pixels = [dataclasses.replace(image, pixel_values=None) for image in r.images]
        out[r.request_id] = (
            Request(
                r.request_id,
                r.prompt_token_ids,
                r.sampling,
                no_pixels,
                first_stage=Stage.DECODE,
                output_token_ids=list(finals[r.request_id].output_token_ids),
            ),
            pages,
        )
    return out


def test_a_request_handed_back_in_a_step_whose_model_fails_is_still_told(tiny_dir, model, processors, chat_reference):
    """The step that hands a request back frees it before the model runs; if the model then fails, the others of
    the step get the failure and the handed-back one its hand-back — none waits forever."""
    cases, _ = chat_reference
    cases = [dataclasses.replace(c, max_tokens=64) for c in cases if c.name in ("img-short", "img-tall")]
    arriving = _handed_over(tiny_dir, model, build_requests(processors["tiny"], cases))
    decoder = make_engine(tiny_dir, model, kv_blocks=40, roles=frozenset({Stage.DECODE}))
    schedule, execute = decoder.scheduler.schedule, decoder._execute
    last = {}

    def scheduled():
        last["plan"] = schedule()
        return last["plan"]

    def failing(plan):
        if last["plan"].handed_back:
            raise MemoryError("out of memory, as a full cache makes likely")
        return execute(plan)

    decoder.scheduler.schedule, decoder._execute = scheduled, failing

    async def main():
        engine = AsyncEngine(decoder)

        async def outcome(request, pages):
            outs = []
            try:
                async for out in engine.generate(request, kv_pages=pages):
                    outs.append(out)
            except RuntimeError as e:
                return str(e)
            return outs[-1]

        try:
            return await asyncio.wait_for(asyncio.gather(*(outcome(*a) for a in arriving.values())), 60)
        finally:
            engine.shutdown()

    short, tall = asyncio.run(main())
    assert "engine failure" in short and "out of memory" in short
    assert tall.handed_back and not tall.new_token_ids  # the newer one, told it is handed back
    assert_pools_full(decoder)


def test_no_kv_pages_come_in_while_a_preempted_request_waits_for_blocks(tiny_dir, model, processors, chat_reference):
    cases, _ = chat_reference
    [(request, pages)] = _handed_over(
        tiny_dir, model, build_requests(processors["tiny"], [c for c in cases if c.name == "system"])
    ).values()  # 37 prompt tokens: 3 blocks
    engine = make_engine(tiny_dir, model, kv_blocks=40)
    sampling = SamplingParams(max_tokens=400, ignore_eos=True)
    older, newer = Request("older", list(range(5, 205)), sampling), Request("newer", list(range(5, 155)), sampling)
    engine.add_request(older)
    engine.add_request(newer)
    while not engine.scheduler.preempted_waiting:
        engine.step()  # both grow until the cache is full: the newer one is preempted, and waits for its blocks
    assert newer.recompute_outputs and engine.stats().kv_blocks_free >= 3
    with pytest.raises(NoRoomForPages):
        engine.add_request(request, kv_pages=pages)  # it would fit, but the preempted one goes first
    while engine.scheduler.preempted_waiting:
        engine.step()
    engine.add_request(request, kv_pages=pages)  # once it has its blocks back
    engine.generate([])
    assert_pools_full(engine)


@pytest.mark.parametrize("room", [256, 0], ids=["first-256-output-tokens", "prompt-only"])
def test_handed_over_pages_wait_for_their_first_output_tokens_room_beside_what_the_running_ones_are_owed(
    tiny_dir, model, processors, chat_reference, room
):
    """The route books no decoder room on path ①: the decoder does, as the pages come. With `handover_output_tokens`
    it takes them in only where the prompt and its first that many output tokens fit beside the first that many of
    every request decoding there (else NoRoomForPages: the worker waits, the pages on the prefill worker); it then
    runs both without preempting either. With 0 it takes them in as soon as the prompt fits, and preempts later."""
    cases, _ = chat_reference
    reference = [dataclasses.replace(c, max_tokens=300) for c in cases if c.name == "system"]
    [(request, pages)] = _handed_over(tiny_dir, model, build_requests(processors["tiny"], reference)).values()
    engine = make_engine(tiny_dir, model, kv_blocks=40, handover_output_tokens=room)  # 640 tokens
    running = Request("running", list(range(5, 205)), SamplingParams(max_tokens=300, ignore_eos=True))
    engine.add_request(running)
    engine.step()  # its prompt in: 13 blocks held, 16 more owed to its first 256 output tokens
    if room:
        with pytest.raises(NoRoomForPages):  # 37 + 1 + 256 tokens: 19 blocks, and 13 + 16 + 19 > 40
            engine.add_request(request, kv_pages=pages)
        while engine.has_unfinished:
            engine.step()
    engine.add_request(request, kv_pages=pages)
    engine.generate([])
    assert (engine.stats().num_preemptions > 0) == (room == 0)
    assert_pools_full(engine)
