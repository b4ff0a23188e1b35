"""Engine behaviour beyond greedy parity: sampling, stops, finish reasons, validation, page hygiene."""

import dataclasses

import pytest
import torch

from common.engine.config import EngineConfig, parse_roles
from common.engine.engine import Engine, RequestRejected
from common.model.loader import load_model
from common.paged_cache import PageLayoutMismatch, PagePayload
from common.request import Request, Stage
from common.sampling import SamplingParams
from common.scheduler import SchedulerConfig
from tests.support import assert_pools_full, image

PROMPT = [1, 354, 29, 405, 77, 1290, 33, 358, 29]


@pytest.fixture(scope="module")
def model(tiny_dir):
    return load_model(tiny_dir, torch.float32)


@pytest.fixture
def engine(tiny_dir, model, processors):
    config = EngineConfig(
        model=str(tiny_dir), kv_cache_gib=0.02, image_cache_gib=0.01, scheduler=SchedulerConfig(token_budget=64)
    )
    yield Engine(config, model=model, detokenize=processors["tiny"].detokenize)


def run(engine, *requests):
    return engine.generate(list(requests))


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch(engine):
    params = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, top_k=50, seed=7, ignore_eos=True)
    alone = run(engine, Request("a", PROMPT, params))["a"].output_token_ids
    batch = run(
        engine,
        Request("b", PROMPT, params),
        Request("c", PROMPT[:5], params),
        Request("d", PROMPT, SamplingParams(max_tokens=12, temperature=1.0, seed=8, ignore_eos=True)),
    )
    assert batch["b"].output_token_ids == alone
    assert batch["d"].output_token_ids != alone
    greedy = run(engine, Request("g", PROMPT, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)))["g"]
    top1 = run(engine, Request("k", PROMPT, SamplingParams(max_tokens=12, temperature=1.5, top_k=1, ignore_eos=True)))[
        "k"
    ]
    assert top1.output_token_ids == greedy.output_token_ids != alone
    assert_pools_full(engine)


def test_every_64_bit_seed_draws_its_own_stream(engine):
    """torch's CPU generator keeps 32 bits of its seed: seeds 2^32 apart drew the same tokens, and the widest
    seeds overflowed the generator's seed (a 500 through the API)."""

    def sampled(seed):
        params = SamplingParams(max_tokens=12, temperature=1.5, seed=seed, ignore_eos=True)
        return run(engine, Request(f"s{seed}", PROMPT, params))[f"s{seed}"].output_token_ids

    assert sampled(0) != sampled(2**32) and sampled(1) != sampled(2**32 + 1) and sampled(2**31) != sampled(-(2**31))
    assert sampled(2**63 - 1) == sampled(2**63 - 1) and sampled(-(2**63)) == sampled(-(2**63))
    assert_pools_full(engine)


def test_finish_reasons_length_stop_token_and_stop_string(engine, processors):
    greedy = run(engine, Request("x", PROMPT, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)))["x"]
    assert greedy.finish_reason == "length" and len(greedy.output_token_ids) == 10
    tokens = greedy.output_token_ids
    by_id = run(
        engine, Request("y", PROMPT, SamplingParams(max_tokens=10, temperature=0, stop_token_ids=(tokens[3],)))
    )["y"]
    assert by_id.output_token_ids == tokens[: tokens.index(tokens[3]) + 1]
    assert (by_id.finish_reason, by_id.stop_reason) == ("stop", tokens[3])
    text = processors["tiny"].detokenize(tokens)
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    assert stop.strip()
    by_str = run(engine, Request("z", PROMPT, SamplingParams(max_tokens=10, temperature=0, stop=(stop,))))["z"]
    assert by_str.finish_reason == "stop" and by_str.stop_reason == stop
    assert by_str.text == text[: text.index(stop)]
    assert by_str.output_token_ids == tokens[: len(by_str.output_token_ids)]
    assert_pools_full(engine)


def test_eos_ends_a_request_unless_ignored(engine):
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    tokens = run(engine, Request("x", PROMPT, params))["x"].output_token_ids
    engine.model_config = dataclasses.replace(engine.model_config, eos_token_ids=(tokens[4],))  # pretend it is EOS
    stopped = run(engine, Request("e", PROMPT, SamplingParams(max_tokens=10, temperature=0)))["e"]
    assert stopped.output_token_ids == tokens[: tokens.index(tokens[4]) + 1]
    assert (stopped.finish_reason, stopped.stop_reason) == ("stop", None)
    assert run(engine, Request("i", PROMPT, params))["i"].output_token_ids == tokens
    assert_pools_full(engine)


def test_bad_requests_are_rejected_with_a_reason_and_leave_nothing_behind(engine):
    with pytest.raises(RequestRejected, match="over the model's limit"):
        engine.add_request(Request("long", PROMPT * 500, SamplingParams(max_tokens=10)))
    with pytest.raises(RequestRejected, match="token id 999999 is outside the vocabulary"):
        engine.add_request(Request("vocab", [1, 999999], SamplingParams()))
    with pytest.raises(RequestRejected, match="token id -3 is outside the vocabulary"):  # the first bad one named
        engine.add_request(Request("negative", [1, -3, 999999], SamplingParams()))
    image_token = engine.model_config.image_token_id
    with pytest.raises(RequestRejected, match="image placeholder"):
        engine.add_request(Request("img", [1, image_token, 5], SamplingParams()))
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    run(engine, Request("ok", PROMPT, SamplingParams(max_tokens=2)))
    with pytest.raises(RequestRejected, match="already in use"):
        engine.add_request(Request("dup", PROMPT, SamplingParams()))
        engine.add_request(Request("dup", PROMPT, SamplingParams()))
    engine.abort("dup")
    assert_pools_full(engine)


def test_an_image_whose_pixels_the_vision_tower_cannot_take_is_refused_and_the_rest_of_the_batch_is_not_touched(
    engine, processors
):
    """Pixels of another size or a non-float dtype (a worker's Encode built by another client, say) failed inside the
    step, where the error ends every request the step holds: they are refused when the request is added."""
    conversation = [
        {"role": "user", "content": [{"type": "image", "image": image(3, 64, 48)}, {"type": "text", "text": "Hi"}]}
    ]
    ids, (img,) = processors["tiny"].apply(conversation)
    size = engine.model_config.vision.image_size
    good = Request("good", ids, SamplingParams(max_tokens=4, temperature=0), [img])
    engine.add_request(good)
    for pixels in (
        torch.zeros(3, size // 2, size),
        torch.zeros(size, size, 3),
        torch.zeros(3, size, size, dtype=torch.int64),
        torch.zeros(1, 3, size, size),
    ):
        bad = Request(
            f"bad-{tuple(pixels.shape)}-{pixels.dtype}",
            ids,
            SamplingParams(max_tokens=4),
            [dataclasses.replace(img, pixel_values=pixels)],
        )
        with pytest.raises(RequestRejected, match=rf"\[3, {size}, {size}\]"):
            engine.add_request(bad)
    finals = engine.generate([])
    assert (
        finals["good"].output_token_ids
        == run(engine, Request("again", ids, SamplingParams(max_tokens=4, temperature=0), [img]))[
            "again"
        ].output_token_ids
    )
    assert_pools_full(engine)


def test_an_engine_refuses_only_what_its_own_stages_cannot_hold(tiny_dir, model, processors):
    """An encoder sized from a GPU's memory keeps one KV block (it never uses them): it refused every image request of
    more than 16 tokens, as if it had to hold their KV. A prefill engine holds a prompt, not what a decoder adds."""
    conversation = [
        {"role": "user", "content": [{"type": "image", "image": image(4, 64, 48)}, {"type": "text", "text": "Hi"}]}
    ]
    ids, images = processors["tiny"].apply(conversation)
    sampling = SamplingParams(max_tokens=200, temperature=0)
    encoder = Engine(
        EngineConfig(model=str(tiny_dir), roles=frozenset({Stage.ENCODE}), kv_cache_gib=1e-9, image_cache_gib=0.01),
        model=model,
    )
    assert encoder.stats().kv_blocks_total == 1
    encoded = run(encoder, Request("e", ids, sampling, images, last_stage=Stage.ENCODE))["e"]
    assert encoded.handed_off and encoder.pages.export_image_pages("e").num_tokens == len(images) * images[0].num_tokens
    encoder.pages.release("e")
    prompt_blocks = -(-len(ids) // 16)
    prefiller = Engine(
        EngineConfig(
            model=str(tiny_dir),
            roles=frozenset({Stage.ENCODE, Stage.PREFILL}),
            kv_cache_gib=prompt_blocks * encoder.kv_cache.layout.bytes_per_block / 2**30,
            image_cache_gib=0.01,
        ),
        model=model,
    )
    assert prefiller.stats().kv_blocks_total == prompt_blocks
    assert run(prefiller, Request("p", ids, sampling, images, last_stage=Stage.PREFILL))["p"].handed_off
    prefiller.pages.release("p")
    with pytest.raises(RequestRejected, match="shorten the prompt"):
        prefiller.add_request(Request("long", ids + PROMPT * 3, sampling, images, last_stage=Stage.PREFILL))
    with pytest.raises(RequestRejected, match="lower max_tokens"):
        Engine(
            EngineConfig(model=str(tiny_dir), kv_cache_gib=prefiller.config.kv_cache_gib, image_cache_gib=0.01),
            model=model,
        ).add_request(Request("whole", ids, sampling, images))
    assert_pools_full(encoder, prefiller)


def test_abort_mid_decode_frees_pages_and_others_continue(engine):
    keep = Request("keep", PROMPT, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    drop = Request("drop", PROMPT, SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))
    engine.add_request(keep)
    engine.add_request(drop)
    engine.step()
    engine.step()
    assert engine.abort("drop") and not engine.abort("drop")
    final = None
    while engine.has_unfinished:
        for out in engine.step():
            final = out
    assert final.request_id == "keep" and len(final.output_token_ids) == 8
    assert_pools_full(engine)


def test_roles_are_enforced_and_page_layouts_checked(tiny_dir, model):
    encoder = Engine(
        EngineConfig(model=str(tiny_dir), roles=parse_roles("encode"), kv_cache_gib=0.01, image_cache_gib=0.01),
        model=model,
    )
    with pytest.raises(RequestRejected, match="lacks the role"):
        encoder.add_request(Request("t", PROMPT, SamplingParams()))
    decoder = Engine(
        EngineConfig(model=str(tiny_dir), roles=parse_roles("d"), kv_cache_gib=0.01, block_size=8), model=model
    )
    foreign = PagePayload(
        decoder.kv_cache.layout.__class__("kv", "float32", 16, (6, 2, 16, 2, 32)), 9, bytes(16 * 6 * 2 * 2 * 32 * 4)
    )
    request = Request("d", PROMPT, SamplingParams(), first_stage=Stage.DECODE, output_token_ids=[5])
    with pytest.raises(PageLayoutMismatch):
        decoder.add_request(request, kv_pages=foreign)
    assert_pools_full(encoder, decoder)
    assert parse_roles("encode,prefill") == frozenset({Stage.ENCODE, Stage.PREFILL}) == parse_roles("ep")
    with pytest.raises(ValueError, match="unknown role"):
        parse_roles("x,y")


def test_prefix_caching_reuses_blocks_and_keeps_outputs(tiny_dir, model):
    config = EngineConfig(model=str(tiny_dir), kv_cache_gib=0.02, enable_prefix_caching=True)
    engine = Engine(config, model=model)
    starts = []
    run_plan = engine.runner.run
    engine.runner.run = lambda plan: (starts.extend(c.start for c in plan.prefills), run_plan(plan))[1]
    prompt = list(range(100, 180))  # 80 tokens: 4 full blocks reusable, the 5th holds the last token
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    first = run(engine, Request("p1", prompt, params))["p1"]
    second = run(engine, Request("p2", prompt, params))["p2"]
    assert starts == [0, 64]
    assert second.output_token_ids == first.output_token_ids
    assert_pools_full(engine)


def test_the_async_engine_reports_how_long_the_step_under_way_has_run():
    """What a worker's load reports, so a router knows what is left of a long prefill iteration."""
    import threading
    import time

    from common.engine.async_engine import AsyncEngine

    release = threading.Event()

    class OneSlowStep:
        requests: dict = {}
        steps = 0
        lock = threading.RLock()

        @property
        def has_unfinished(self) -> bool:
            return self.steps < 1

        def step(self):
            release.wait(10)
            self.steps += 1
            return []

    engine = AsyncEngine(OneSlowStep())
    try:
        time.sleep(0.2)
        assert 150 <= engine.iteration_elapsed_ms < 10_000
        release.set()
        for _ in range(100):
            if engine.iterations:
                break
            time.sleep(0.01)
        assert engine.iteration_elapsed_ms == 0 and engine.last_iteration_ms >= 150
    finally:
        engine.shutdown()


def test_blocks_for_incoming_pages_are_reserved_while_a_step_runs_not_after_it(engine):
    """A decoder reserves the blocks a handed-over request's KV goes into at once (`now`), not after the step
    under way (`call`): waiting for it, then for the next boundary to add the request, made a joining
    request's first gap three iterations long. The step's model keeps running meanwhile."""
    import asyncio
    import threading

    from common.engine.async_engine import AsyncEngine

    running, release = threading.Event(), threading.Event()
    execute = engine._execute

    def held_execute(plan):
        running.set()
        release.wait(30)
        return execute(plan)

    engine._execute = held_execute
    async_engine = AsyncEngine(engine)

    async def scenario():
        stream = async_engine.generate(Request("busy", PROMPT, SamplingParams(max_tokens=2)))
        first = asyncio.ensure_future(stream.__anext__())
        assert await asyncio.to_thread(running.wait, 30)
        joining = Request("join", PROMPT, SamplingParams(max_tokens=3), first_stage=Stage.DECODE, output_token_ids=[5])
        kind, blocks, tokens = async_engine.now(lambda e: e.pages.reserve_import(joining))
        assert not release.is_set() and async_engine.iteration_elapsed_ms > 0  # the step is still under way
        assert kind == "kv" and tokens == len(PROMPT) and len(blocks) == 1
        assert blocks[0] not in engine.requests["busy"].block_table
        release.set()
        await first
        rest = [out async for out in stream]
        assert rest[-1].finished
        outs = [out async for out in async_engine.generate(joining, preloaded=True)]
        assert outs[-1].finished and len(outs[-1].output_token_ids) == 3
        assert async_engine.now(lambda e: e.pages.cancel_import("join")) is False  # it left `importing` when added

    try:
        asyncio.run(scenario())
    finally:
        release.set()
        async_engine.shutdown()
    assert_pools_full(engine)


def test_a_step_that_fails_after_a_handoff_fails_that_request_too_and_frees_its_pages(tiny_dir, model):
    """A step that raises part-way (here: while putting out a handed-off prefill) has already moved some of its
    requests out of the running set. Each of them still gets the error, instead of its caller waiting forever,
    its pages are freed, and the engine serves the next request."""
    import asyncio

    from common.engine.async_engine import AsyncEngine

    engine = Engine(
        EngineConfig(model=str(tiny_dir), roles=frozenset({Stage.PREFILL}), kv_cache_gib=0.02, image_cache_gib=0.01),
        model=model,
    )
    handoff = engine._handoff
    calls = []

    def failing_once(request, new=None):
        calls.append(request.request_id)
        if len(calls) == 1:
            handoff(request, new)  # it is handed off by now: out of `requests`, its pages held for the next stage
            raise KeyError("a bug after the handoff")
        return handoff(request, new)

    engine._handoff = failing_once
    async_engine = AsyncEngine(engine)

    def prefill(name):
        return Request(name, PROMPT, SamplingParams(max_tokens=4), last_stage=Stage.PREFILL)

    async def scenario():
        with pytest.raises(RuntimeError, match="engine failure: KeyError"):
            await asyncio.wait_for(_drain(async_engine.generate(prefill("broken"))), 30)
        assert "broken" not in engine.pages.handed_off and not engine.requests
        outs = await asyncio.wait_for(_drain(async_engine.generate(prefill("next"))), 30)
        assert outs[-1].handed_off
        engine.pages.release("next")

    try:
        asyncio.run(scenario())
    finally:
        async_engine.shutdown()
    assert calls == ["broken", "next"]
    assert_pools_full(engine)


async def _drain(stream):
    return [out async for out in stream]


def test_the_tiny_checkpoint_answers_in_words_its_tokenizer_makes(engine, processors):
    """Its vocabulary is bigger than its small tokenizer: ids past the tokenizer, <image> and lone UTF-8 bytes have
    zero logit rows, so a greedy answer decodes to text (30 of 40 tokens decoded to nothing when they did not)."""
    tokenizer = processors["tiny"].tokenizer
    ids, _ = processors["tiny"].apply(
        [{"role": "user", "content": [{"type": "text", "text": "What is in the picture?"}]}]
    )
    out = run(engine, Request("demo", ids, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)))["demo"]
    assert all(t < len(tokenizer) and t != engine.model_config.image_token_id for t in out.output_token_ids)
    text = processors["tiny"].detokenize(out.output_token_ids)
    assert "\ufffd" not in text and len(text.split()) >= 8


def test_request_after_request_the_engine_reuses_the_same_few_kv_blocks(engine):
    """A freed block is handed out again before one never used: the cache's working set stays as small as one request
    needs (warm, already faulted in) instead of walking the whole cache (bench/README.md, `bench/soak.py`)."""
    pool = engine.scheduler.kv.pool
    block_size = engine.scheduler.kv.block_size
    seen, allocate = set(), pool.allocate

    def spy(n):
        ids = allocate(n)
        seen.update(ids)
        return ids

    pool.allocate = spy
    needed = 0
    for i in range(12):
        prompt, max_tokens = PROMPT * (1 + i % 3), 8 + i
        run(engine, Request(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True)))
        needed = max(needed, -(-(len(prompt) + max_tokens) // block_size))
    assert pool.num_blocks > 10 * needed  # room to walk, had the pool not reused
    assert len(seen) == needed
    assert_pools_full(engine)


def test_each_iteration_is_logged_at_debug_with_what_it_carried(engine, caplog):
    sampling = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    with caplog.at_level("DEBUG", logger="epdmesh.iterations"):
        run(engine, Request("a", PROMPT, sampling))
    lines = [r.getMessage() for r in caplog.records if r.name == "epdmesh.iterations"]
    assert len(lines) == 3  # the prefill (which samples the first token), then two decodes
    assert lines[0].startswith(f"decodes 0 (context 0) prompt tokens {len(PROMPT)} images 0: ")
    assert lines[2].startswith(f"decodes 1 (context {len(PROMPT) + 1}) prompt tokens 0 images 0: ")


def test_committed_caches_are_faulted_in_when_the_engine_is_built(tiny_dir, model):
    import resource

    def faults_writing(engine) -> tuple[int, int]:
        counts = []
        for cache in (engine.kv_cache, engine.image_cache):
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            cache.data.fill_(0)  # as the first requests' writes would, all at once
            counts.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
        return counts[0], counts[1]

    def built(commit: bool, roles: str = "encode,prefill,decode") -> Engine:
        config = EngineConfig(
            model=str(tiny_dir), roles=parse_roles(roles), kv_cache_gib=0.02, image_cache_gib=0.02, commit_caches=commit
        )
        return Engine(config, model=model)

    lazy_kv, lazy_image = faults_writing(built(False))
    kv, image_faults = faults_writing(built(True))
    assert lazy_kv >= 8 and lazy_image >= 8  # 20 MiB each: 10 huge pages, or 5,120 small ones
    assert kv < lazy_kv // 4 and image_faults < lazy_image // 4
    kv, image_faults = faults_writing(built(True, "encode"))
    assert kv >= 8 and image_faults < lazy_image // 4  # an encoder never writes its KV cache: not committed
