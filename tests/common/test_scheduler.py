import dataclasses
import subprocess
import sys

import pytest

from common.kv_manager import ImageBlockManager, KVBlockManager
from common.latency.budgets import IterationTime
from common.request import ImageInput, Request, RequestStatus, Stage
from common.sampling import SamplingParams
from common.scheduler import Scheduler, SchedulerConfig

TORCH_FREE = ["common.scheduler", "common.block_pool", "common.kv_manager", "common.request", "common.sampling"]


def test_scheduling_code_imports_no_torch():
    code = f"import sys; import {', '.join(TORCH_FREE)}; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def req(rid, prompt=10, max_tokens=4, images=0, **kw):
    imgs = [ImageInput(None, 4, f"{rid}-{i}") for i in range(images)]
    return Request(rid, list(range(prompt)), SamplingParams(max_tokens=max_tokens), imgs, **kw)


def make(
    token_budget=16, image_budget=2, max_num_seqs=8, chunked=True, kv_blocks=64, image_blocks=16, image_token_cost=0
):
    config = SchedulerConfig(
        token_budget=token_budget,
        image_budget=image_budget,
        max_num_seqs=max_num_seqs,
        enable_chunked_prefill=chunked,
        image_token_cost=image_token_cost,
    )
    return Scheduler(config, KVBlockManager(kv_blocks, 4), ImageBlockManager(image_blocks, 4))


def test_decodes_first_then_unfinished_chunks_then_new_work_within_the_token_budget():
    s = make(token_budget=16)
    running = req("run", prompt=4)
    s.add(running)
    plan = s.schedule()
    running.num_computed_tokens = 4
    running.output_token_ids.append(1)
    s.finish_prefill(running)
    assert [c.num_tokens for c in plan.prefills] == [4]

    long = req("long", prompt=30)
    s.add(long)
    plan = s.schedule()
    assert plan.decodes == [running]
    assert [(c.request.request_id, c.start, c.num_tokens) for c in plan.prefills] == [("long", 0, 15)]
    long.num_computed_tokens += 15
    running.num_computed_tokens += 1

    s.add(req("short", prompt=3))
    plan = s.schedule()
    assert plan.decodes == [running]
    assert [(c.request.request_id, c.start, c.num_tokens) for c in plan.prefills] == [("long", 15, 15)]
    assert plan.num_tokens == 16  # the budget is full: 'short' waits
    assert [r.request_id for r in s.waiting] == ["short"]


def test_images_are_encoded_under_the_image_budget_and_the_step_of_the_last_ones_starts_the_prefill():
    s = make(image_budget=2)
    three = req("three", prompt=12, images=3)
    s.add(three)
    plan = s.schedule()
    assert [(e.first_image, e.num_images) for e in plan.encodes] == [(0, 2)]
    assert not plan.prefills and three.status == RequestStatus.ENCODING
    assert three.image_block_table == [0, 1, 2]
    three.num_encoded_images = 2
    plan = s.schedule()  # the last image, and the prompt beside it: the runner encodes before the forward
    assert [(e.first_image, e.num_images) for e in plan.encodes] == [(2, 1)]
    assert [(c.request, c.start, c.num_tokens) for c in plan.prefills] == [(three, 0, 12)]
    assert three.block_table == [0, 1, 2, 3] and three.status == RequestStatus.PREFILLING
    three.num_encoded_images = 3
    s.finish_encode(three)  # as the engine does after the step: it stays prefilling
    assert s.prefilling == [three] and not s.encoding and not s.ready
    three.num_computed_tokens = 12
    three.output_token_ids.append(1)
    s.finish_prefill(three)
    assert s.running == [three] and s.images.pool.num_free == 16


def test_a_step_that_encodes_fills_the_token_budget_oldest_first_and_an_encoder_only_request_never_prefills():
    s = make(token_budget=16, image_budget=4)
    text, ready = req("text", prompt=16), req("ready", prompt=10, images=1)
    s.add(text)
    s.add(ready)
    plan = s.schedule()  # the text prompt fills the budget: 'ready' is encoded, its prefill waits
    assert [c.request for c in plan.prefills] == [text] and [e.request for e in plan.encodes] == [ready]
    text.num_computed_tokens, ready.num_encoded_images = 16, 1
    text.output_token_ids.append(1)
    s.finish_encode(ready)
    s.finish_prefill(text)
    assert list(s.ready) == [ready]
    new, later = req("new", prompt=10, images=1), req("later", prompt=4, images=1)
    handoff = req("handoff", prompt=6, images=1, last_stage=Stage.ENCODE)
    for r in (handoff, new, later):
        s.add(r)
    plan = s.schedule()
    assert plan.decodes == [text]
    assert [e.request.request_id for e in plan.encodes] == ["handoff", "new", "later"]
    # the one encoded before goes first; 'new' takes what is left of 15; nothing is left for 'later'
    assert [(c.request.request_id, c.num_tokens) for c in plan.prefills] == [("ready", 10), ("new", 5)]
    assert handoff.status == later.status == RequestStatus.ENCODING and s.encoding == [handoff, later]
    for r in (handoff, new, later):
        r.num_encoded_images = 1
        s.finish_encode(r)
    assert handoff.status == RequestStatus.HANDED_OFF and list(s.ready) == [later]
    assert s.prefilling == [ready, new]


def test_without_chunking_a_prompt_waits_for_a_budget_it_fits_in():
    s = make(token_budget=10, chunked=False)
    s.add(req("a", prompt=6))
    s.add(req("b", prompt=6))
    plan = s.schedule()
    assert [(c.request.request_id, c.num_tokens) for c in plan.prefills] == [("a", 6)]
    big = make(token_budget=10, chunked=False)
    big.add(req("huge", prompt=25))
    assert [c.num_tokens for c in big.schedule().prefills] == [25]  # alone, it runs whole


def test_admission_stops_at_kv_capacity_and_max_num_seqs():
    s = make(token_budget=100, kv_blocks=6, max_num_seqs=8)
    for rid in "abc":
        s.add(req(rid, prompt=8, max_tokens=4))  # 8 + the first sampled token's slot: 3 blocks each
    plan = s.schedule()
    assert [c.request.request_id for c in plan.prefills] == ["a", "b"]
    assert [r.request_id for r in s.waiting] == ["c"]
    t = make(token_budget=100, max_num_seqs=1)
    t.add(req("x"))
    t.add(req("y"))
    assert [c.request.request_id for c in t.schedule().prefills] == ["x"]


def test_last_stage_prefill_hands_off_and_decode_first_runs_at_once():
    s = make()
    p = req("p", prompt=5, last_stage=Stage.PREFILL)
    s.add(p)
    s.schedule()
    p.num_computed_tokens = 5
    s.finish_prefill(p)
    assert p.status == RequestStatus.HANDED_OFF and not s.has_work
    d = req("d", prompt=5, first_stage=Stage.DECODE)
    d.output_token_ids.append(3)
    s.add(d)
    assert s.schedule().decodes == [d]
    s.finish(d, RequestStatus.FINISHED_LENGTH)
    s.finish(p, RequestStatus.HANDED_OFF)
    assert s.kv.pool.num_free == 64 and not s.has_work


def test_every_running_decode_runs_whatever_the_token_budget_and_a_full_batch_takes_turns():
    """TriInfer Algorithm 1: decodes first, all of them; τ_t only bounds new work. Decodes beyond the batch
    limit (requests that arrived with their KV) rotate, so none waits for the others to finish."""
    s = make(token_budget=4, max_num_seqs=8)
    decoding = [req(f"d{i}", prompt=4, first_stage=Stage.DECODE) for i in range(6)]
    for r in decoding:
        s.add(r)
    s.add(req("new", prompt=8))
    plan = s.schedule()
    assert plan.decodes == decoding and not plan.prefills  # 6 decodes > τ_t = 4: no room for the prompt
    full = make(token_budget=64, max_num_seqs=4)
    for r in decoding:
        full.add(r)
    turns = [full.schedule().decodes for _ in range(3)]
    assert all(len(t) == 4 for t in turns)
    assert {r.request_id: sum(r in t for t in turns) for r in decoding} == {r.request_id: 2 for r in decoding}


def test_join_first_gives_a_joining_requests_first_decode_a_decode_only_iteration_every_other_time():
    """A decoder that prefills while requests are handed over to it: a joiner waits for the iteration in flight,
    then decodes in one without prefill chunks; a joiner every iteration still leaves every other one to them."""

    def run(join_first: bool) -> list[tuple[list[str], int]]:
        config = SchedulerConfig(token_budget=16, image_budget=2, max_num_seqs=8, join_first=join_first)
        s = Scheduler(config, KVBlockManager(64, 4), ImageBlockManager(16, 4))
        s.add(req("long", prompt=200))
        plans = []
        for i in range(6):
            if i in (1, 3, 4):  # handed over during the iteration before
                joiner = req(f"j{i}", prompt=4, max_tokens=8, first_stage=Stage.DECODE)
                joiner.output_token_ids.append(3)
                s.add(joiner)
            plan = s.schedule()
            for chunk in plan.prefills:
                chunk.request.num_computed_tokens += chunk.num_tokens
            plans.append(([r.request_id for r in plan.decodes], sum(c.num_tokens for c in plan.prefills)))
        return plans

    assert run(join_first=True) == [
        ([], 16),  # the prompt's first chunk
        (["j1"], 0),  # j1 joined during it: decodes only
        (["j1"], 15),  # the chunk again, beside the decodes
        (["j1", "j3"], 0),  # j3 joined: decodes only
        (["j1", "j3", "j4"], 13),  # j4 joined too, but the iteration before carried no chunk: this one does
        (["j1", "j3", "j4"], 13),  # nobody new
    ]
    assert all(tokens for _, tokens in run(join_first=False))  # without it every iteration carries a chunk


def test_with_an_image_token_cost_images_and_prompt_chunks_share_one_iteration():
    s = make(token_budget=16, image_budget=4, image_token_cost=6)
    first, second = req("first", prompt=20, images=1), req("second", prompt=10, images=2)
    s.add(first)
    s.add(second)
    plan = step(s)  # first's image (6) + 10 of its prompt; 'second' would take 12 more: it waits
    assert [(e.request.request_id, e.num_images) for e in plan.encodes] == [("first", 1)]
    assert [(c.request.request_id, c.num_tokens) for c in plan.prefills] == [("first", 10)]
    plan = step(s)  # first's last 10 tokens leave 6: one image of 'second', none of its prompt
    assert [(c.request.request_id, c.num_tokens) for c in plan.prefills] == [("first", 10)]
    assert [(e.request.request_id, e.num_images) for e in plan.encodes] == [("second", 1)]
    plan = step(s)  # one decode, its last image (6), 9 tokens of its prompt
    assert plan.decodes == [first] and [(e.request.request_id, e.num_images) for e in plan.encodes] == [("second", 1)]
    assert [(c.request.request_id, c.num_tokens) for c in plan.prefills] == [("second", 9)]
    with pytest.raises(ValueError, match="image_token_cost"):
        SchedulerConfig(image_token_cost=-1)


def timed_scheduler() -> Scheduler:
    """τ_t 40 tokens from a 40 ms iteration limit: 1 ms per token, a decode also reading its context at 0.1 ms per KV
    token."""
    from common.latency import LatencyProfile, StageCost

    flat = StageCost(per_unit_ms=1.0)
    p = LatencyProfile(
        "t", "measured", "cpu", "m", flat, flat, StageCost(per_unit_ms=1.0, quadratic_ms=0.1), 0.0, 1.0, 4
    )
    config = SchedulerConfig(token_budget=40, iteration_time=IterationTime(p, 40.0))
    return Scheduler(config, KVBlockManager(64, 4), ImageBlockManager(16, 4))


def test_with_an_iteration_time_the_decodes_context_shrinks_the_prompt_chunk_beside_them():
    s = timed_scheduler()
    first = req("first", prompt=50, max_tokens=8)
    s.add(first)
    assert [c.num_tokens for c in step(s).prefills] == [40]  # no decodes: τ_t
    step(s)  # its last 10 tokens
    s.add(req("second", prompt=40))
    plan = step(s)  # one decode over 50 KV tokens: (1 + t) + 5 ms <= 40 leaves t = 34 beside it, not 39
    assert plan.decodes == [first] and [c.num_tokens for c in plan.prefills] == [34]
    assert plan.predicted_ms == pytest.approx(1 + 34 + 5.0)
    s.observe(plan, plan.predicted_ms + 30)  # the host took 30 ms longer than the profile says
    assert s.overrun.ms == 30
    s.add(req("third", prompt=40))
    plan = step(s)  # 40 - 30 ms leave (1 + t) + 5.1 ms: 3 of the 6 left of 'second'; 'third' waits
    assert [(c.request.request_id, c.num_tokens) for c in plan.prefills] == [("second", 3)]


def test_what_the_decodes_leave_is_priced_only_while_prompt_work_waits(monkeypatch):
    """The chunk beside the decodes (`IterationTime.tokens_beside`, a search over the latency model) is worked out
    only in iterations with an encode or a prompt to place: a decode-only batch needs none (every decoder's usual
    iteration), and its plan and predicted time are the same."""
    s = timed_scheduler()
    priced, tokens_beside = [], IterationTime.tokens_beside
    monkeypatch.setattr(IterationTime, "tokens_beside", lambda *a, **k: priced.append(1) or tokens_beside(*a, **k))
    first = req("first", prompt=10, max_tokens=8)
    s.add(first)
    step(s)  # its prompt, no decodes beside it
    n = len(priced)
    for _ in range(3):  # decode-only
        plan = step(s)
        assert plan.decodes == [first] and not plan.prefills and plan.predicted_ms > 0
    assert len(priced) == n
    s.add(req("second", prompt=20))
    plan = step(s)
    assert len(priced) > n and [c.num_tokens for c in plan.prefills] == [20]


def test_iterations_that_encode_and_overrun_more_than_the_others_make_an_image_cost_more_tokens():
    from common.latency import LatencyProfile, StageCost

    flat = StageCost(per_unit_ms=1.0)
    p = LatencyProfile("t", "measured", "cpu", "m", flat, flat, flat, 0.0, 1.0, 4)
    s = Scheduler(
        SchedulerConfig(token_budget=40, image_token_cost=6, iteration_time=IterationTime(p, 40.0)),
        KVBlockManager(64, 4),
        ImageBlockManager(16, 4),
    )
    assert s.image_token_cost == 6
    s.add(req("img", prompt=60, images=1))
    plan = step(s)
    assert [c.num_tokens for c in plan.prefills] == [34]  # 40 less the image's 6
    s.observe(plan, plan.predicted_ms + 12)  # encoding here took 12 ms more than profiled
    assert (s.encode_overrun.ms, s.overrun.ms) == (12, 0)
    assert s.image_token_cost == 6 + 12  # 1 ms a token
    s.observe(dataclasses.replace(plan, encodes=[]), plan.predicted_ms + 5)  # and prompt-only ones 5 ms
    assert s.image_token_cost == 6 + 7


def test_an_image_costing_more_than_the_tokens_left_still_starts_an_iteration_without_other_new_work():
    s = make(token_budget=4, image_budget=2, image_token_cost=8)
    running = [req(f"d{i}", prompt=1) for i in range(4)]
    for r in running:
        s.add(r)
        step(s)
    s.add(req("img", prompt=8, images=2))
    plan = step(s)  # four decodes fill τ_t; the image goes alone, its prompt and the second image wait
    assert len(plan.decodes) == 4 and [e.num_images for e in plan.encodes] == [1] and not plan.prefills


def step(s: Scheduler):
    """One iteration as the engine runs it: images encoded, chunks computed, every sampling request gets a token (7),
    a prefill that completes starts decoding."""
    plan = s.schedule()
    for work in plan.encodes:
        work.request.num_encoded_images += work.num_images
        if not work.request.needs_encode:
            s.finish_encode(work.request)
    for chunk in plan.prefills:
        chunk.request.num_computed_tokens += chunk.num_tokens
    for r in plan.decodes:
        r.num_computed_tokens += 1
        r.output_token_ids.append(7)
    for chunk in plan.prefills:
        if chunk.completes_prefill:
            chunk.request.output_token_ids.append(7)
            s.finish_prefill(chunk.request)
    return plan


def two_growing(**b_kw) -> tuple[Scheduler, Request, Request]:
    """a and b (7-token prompts) in a 6-block pool of 4-token blocks, after six steps: 3 blocks each, all in use,
    13 tokens each — the next decode of a needs a fourth block."""
    s = make(token_budget=100, kv_blocks=6)
    a, b = req("a", prompt=7, max_tokens=40), req("b", prompt=7, max_tokens=40, **b_kw)
    s.add(a)
    s.add(b)
    for _ in range(6):
        step(s)
    assert (a.block_table, b.block_table) == ([0, 1, 4], [2, 3, 5]) and s.kv.pool.num_free == 0
    return s, a, b


def test_out_of_blocks_the_newest_running_request_is_preempted_and_recomputes_its_output_before_new_work():
    s, a, b = two_growing()
    c = req("c", prompt=3)  # would fit in what is left, but b comes first
    s.add(c)
    plan = step(s)
    assert plan.decodes == [a] and not plan.prefills and not plan.handed_back
    assert a.block_table == [0, 1, 4, 2] and s.num_preemptions == 1
    assert b.status == RequestStatus.WAITING and b.block_table == [] and b.num_computed_tokens == 0
    assert b.recompute_outputs == 6 and b.num_prefill_tokens == 13  # prompt + the six tokens it has
    assert list(s.waiting) == [b, c]  # b needs 4 blocks, 2 are free: c may not take them first
    s.finish(a, RequestStatus.FINISHED_LENGTH)
    plan = step(s)
    assert [(ch.request.request_id, ch.start, ch.num_tokens) for ch in plan.prefills] == [("b", 0, 13), ("c", 0, 3)]
    assert b.block_table == [0, 1, 4, 2] and c.block_table == [3]  # a's blocks first, as a held them
    assert b.status == RequestStatus.DECODING and len(b.output_token_ids) == 7  # it sampled where it had stopped


def test_a_preempted_request_whose_images_are_not_here_is_handed_back():
    s, a, b = two_growing(images=1, first_stage=Stage.PREFILL)  # its image came as pages: no pixels to encode again
    plan = step(s)
    assert plan.handed_back == [b] and plan.decodes == [a]
    assert b.status == RequestStatus.HANDED_BACK and b.block_table == [] and not s.waiting
    s.finish(a, RequestStatus.FINISHED_LENGTH)
    assert s.kv.pool.num_free == 6 and not s.has_work


def test_the_oldest_decode_preempts_the_newest_and_the_ones_between_keep_running():
    s = make(token_budget=100, kv_blocks=7)
    rs = [req(r, prompt=3, max_tokens=40) for r in "abc"]  # 1 block each (3 + 1)
    for r in rs:
        s.add(r)
    step(s)  # prefills: 4 tokens each
    extra = req("x", prompt=16, max_tokens=1)  # 17 tokens: 5 blocks
    s.add(extra)
    step(s)  # decodes (4 tokens each, still 1 block); x waits: 4 blocks free
    assert s.kv.pool.num_free == 4 and list(s.waiting) == [extra]
    step(s)  # 5 tokens each: a, b, c grow to 2 blocks, 1 free
    for _ in range(3):
        step(s)  # 6, 7, 8 tokens each: still 2 blocks
    assert s.kv.pool.num_free == 1
    plan = step(s)  # 9 tokens each: a takes the last free block, b preempts c, c is out of this step
    assert plan.decodes == rs[:2] and all(r.status == RequestStatus.DECODING for r in plan.decodes)
    assert rs[2].status == RequestStatus.WAITING and list(s.waiting) == [rs[2], extra]


def test_worst_case_admission_never_preempts():
    config = SchedulerConfig(token_budget=100, kv_admission="worst-case")
    s = Scheduler(config, KVBlockManager(6, 4, worst_case=True), ImageBlockManager(16, 4))
    a, b, c = (req(r, prompt=7, max_tokens=5) for r in "abc")  # 12 tokens: 3 blocks each, from the start
    for r in (a, b, c):
        s.add(r)
    for _ in range(4):
        step(s)
    assert (a.block_table, b.block_table) == ([0, 1, 2], [3, 4, 5]) and list(s.waiting) == [c]
    assert s.num_preemptions == 0


def test_while_taking_turns_the_victim_is_the_request_that_arrived_last_not_the_one_served_last():
    s = make(token_budget=100, kv_blocks=8, max_num_seqs=2)
    rs = [req(r, prompt=4, max_tokens=40, first_stage=Stage.DECODE) for r in "abcd"]  # arrive a, b, c, d
    for r in rs:
        r.output_token_ids.append(7)
        s.add(r)  # 5 tokens: 2 blocks each, allocated at their first decode
    plans = [step(s) for _ in range(4)]  # a+b, c+d, a+b, c+d: 8 blocks in use, 7 tokens each
    assert [[r.request_id for r in p.decodes] for p in plans] == [["a", "b"], ["c", "d"]] * 2
    assert s.kv.pool.num_free == 0
    while not s.num_preemptions:
        plan = step(s)  # a and b reach 9 tokens first: a third block each, none free
    assert [r.request_id for r in plan.decodes] == ["a", "b"]
    assert [r.request_id for r in s.waiting] == ["d"]  # the newest — c was the one served last (the turn before)


def test_a_preempted_request_encoding_again_holds_back_new_work():
    s = make(token_budget=100, image_budget=1, kv_blocks=64)
    p = req("p", prompt=12, max_tokens=40, images=2)  # two images of 4 tokens, encoded one per step
    for image in p.images:
        image.pixel_values = object()  # its pixels are here: it can be encoded again
    p.output_token_ids, p.recompute_outputs = [7] * 5, 5  # as `_preempt` leaves a request
    s.waiting.appendleft(p)
    n = req("n", prompt=4)
    s.add(n)
    assert s.preempted_waiting
    plan = step(s)
    assert [e.request for e in plan.encodes] == [p] and not plan.prefills  # n waits behind p's encode
    plan = step(s)
    assert [(c.request.request_id, c.num_tokens) for c in plan.prefills] == [("p", 17), ("n", 4)]
    assert not s.preempted_waiting
