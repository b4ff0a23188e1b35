"""What a role switch asks of the engine: its running decodes handed back with their KV, decoded on elsewhere to
transformers' tokens; and new roles and budgets taken on an idle engine, on the same weights and cache memory."""

import dataclasses

import pytest
import torch

from common.engine.config import EngineConfig
from common.engine.engine import Engine
from common.model.loader import load_model
from common.request import Request, Stage
from common.sampling import SamplingParams
from common.scheduler import SchedulerConfig
from services.gateway.mesh.migration import resumed
from tests.support import assert_pools_full, build_requests

CASES = ("hi", "img-short", "img-tall", "system")


@pytest.fixture(scope="module")
def model(tiny_dir):
    return load_model(tiny_dir, torch.float32)


def _engine(tiny_dir, model, roles=frozenset(Stage), token_budget=2048) -> Engine:
    config = EngineConfig(
        model=str(tiny_dir),
        roles=roles,
        kv_cache_gib=0.02,
        image_cache_gib=0.01,
        scheduler=SchedulerConfig(token_budget=token_budget),
    )
    return Engine(config, model=model)


def test_decodes_handed_back_with_their_kv_go_on_elsewhere_to_the_transformers_tokens(
    tiny_dir, model, processors, chat_reference
):
    cases, _ = chat_reference
    cases = [dataclasses.replace(c, max_tokens=24) for c in cases if c.name in CASES]
    reference = _engine(tiny_dir, model).generate(build_requests(processors["tiny"], cases))
    switching = _engine(tiny_dir, model)
    requests = {r.request_id: r for r in build_requests(processors["tiny"], cases)}
    late = Request("late", list(requests["hi"].prompt_token_ids), requests["hi"].sampling)
    for r in requests.values():
        switching.add_request(r)
    emitted = {rid: [] for rid in requests}
    while min(len(t) for t in emitted.values()) < 5:
        for out in switching.step():
            emitted[out.request_id] += out.new_token_ids
    switching.add_request(late)  # not prefilled yet: handed back without pages, to start again
    outputs = {out.request_id: out for out in switching.hand_back_decodes()}
    assert set(outputs) == {*requests, "late"} and all(out.handed_back for out in outputs.values())
    assert outputs["late"].pages is None and not switching.requests
    rest = _engine(tiny_dir, model, roles=frozenset({Stage.DECODE}))
    for rid, r in requests.items():
        kind, blocks, n = outputs[rid].pages
        assert kind == "kv" and n == r.num_prompt_tokens + len(emitted[rid]) - 1  # all but the last token's KV
        pages = switching.kv_cache.read_blocks(blocks, n)
        switching.pages.release(rid)
        on = resumed(r, emitted[rid], attempt=2)
        no_pixels = [dataclasses.replace(image, pixel_values=None) for image in on.images]
        rest.add_request(
            dataclasses.replace(on, images=no_pixels, first_stage=Stage.DECODE, output_token_ids=[emitted[rid][-1]]),
            kv_pages=pages,
        )
    assert_pools_full(switching)
    finals = {}
    while rest.has_unfinished:
        for out in rest.step():
            if out.done_here:
                finals[out.request_id.removesuffix("-m2")] = out.output_token_ids
    for rid in requests:  # the last token sent went again as the first: nothing twice
        assert emitted[rid][:-1] + finals[rid] == reference[rid].output_token_ids, rid
    assert_pools_full(rest)


def test_an_idle_engine_takes_new_roles_and_budgets_on_the_same_cache_memory(tiny_dir, model):
    engine = _engine(tiny_dir, model, roles=frozenset({Stage.DECODE, Stage.PREFILL}), token_budget=512)
    kv = engine.kv_cache.data.data_ptr()
    engine.add_request(Request("r", [1, 5, 9], SamplingParams(max_tokens=3, temperature=0.0)))
    target = dataclasses.replace(
        engine.config, roles=frozenset({Stage.ENCODE, Stage.PREFILL}), scheduler=SchedulerConfig(token_budget=64)
    )
    with pytest.raises(RuntimeError, match="only when idle"):
        engine.reconfigure(target)
    while engine.has_unfinished:
        engine.step()
    engine.reconfigure(target)
    assert engine.config.roles == {Stage.ENCODE, Stage.PREFILL} and engine.scheduler.config.token_budget == 64
    assert engine.kv_cache.data.data_ptr() == kv  # the memory a transfer backend registered
    with pytest.raises(ValueError, match="cannot change its dtype"):
        engine.reconfigure(dataclasses.replace(target, dtype="bfloat16"))
    out = engine.generate([Request("p", [1, 5, 9, 11], SamplingParams(max_tokens=4), last_stage=Stage.PREFILL)])["p"]
    assert out.handed_off and len(out.output_token_ids) == 1  # it prefills for another decoder now
    engine.pages.release("p")
    assert_pools_full(engine)


def test_a_decoder_that_takes_the_encode_role_gets_an_image_cache(tiny_dir, model):
    engine = _engine(tiny_dir, model, roles=frozenset({Stage.DECODE}))
    assert engine.image_cache.num_blocks == 1  # a decoder has no use for one
    engine.reconfigure(dataclasses.replace(engine.config, roles=frozenset(Stage)))
    assert engine.image_cache.num_blocks > 1 and engine.stats().image_blocks_total == engine.image_cache.num_blocks
