"""Greedy outputs of our engine are transformers' own, token for token (fp32), on two model shapes.

The reference is `processor.apply_chat_template(...)` + `LlavaForConditionalGeneration.generate(do_sample=False)`.
"""

import pytest
import torch

from common.engine.config import EngineConfig
from common.engine.engine import Engine
from common.model import compiled
from common.model.cuda_graphs import DecodeGraphs
from common.model.llama import DecoderLayer
from common.model.loader import load_model
from common.request import Request, Stage
from common.scheduler import SchedulerConfig
from kernels import cpu_paged, cpu_prompt
from kernels.torch_ref import causal_attention
from tests.conftest import SHAPES
from tests.support import (
    Case,
    assert_pools_full,
    build_requests,
    hf_reference,
    image,
    mixed_cases,
    run_disaggregated,
    text_of,
)

CASES = mixed_cases()


@pytest.fixture(scope="module")
def references(model_dirs, processors):
    cache = {}

    def get(shape: str, dtype: torch.dtype):
        if (shape, dtype) not in cache:
            cache[shape, dtype] = hf_reference(model_dirs[shape], processors[shape], CASES, dtype)
        return cache[shape, dtype]

    return get


@pytest.fixture(scope="module")
def fp32_models(model_dirs):
    return {shape: load_model(model_dirs[shape], torch.float32) for shape in SHAPES}


def make_engine(
    model_dirs, models, shape, dtype="float32", roles=frozenset(Stage), prefix_caching=False, compile=False, **scheduler
):
    config = EngineConfig(
        model=str(model_dirs[shape]),
        dtype=dtype,
        roles=roles,
        kv_cache_gib=0.05,
        image_cache_gib=0.02,
        scheduler=SchedulerConfig(**scheduler),
        enable_prefix_caching=prefix_caching,
        compile=compile,
    )
    return Engine(config, model=models[shape] if models else None)


def assert_matches_reference(outputs: dict[str, list[int]], captured, refs, tolerance: float = 1e-3):
    for case in CASES:
        ref = refs[case.name]
        assert outputs[case.name] == ref.tokens, case.name
        diff = (captured[case.name][0] - ref.logits[0]).abs().max().item()
        assert diff <= tolerance, f"{case.name}: first-step logits differ by {diff}"


def test_reference_workload_is_mixed(references, processors):
    refs = references("tiny", torch.float32)
    lengths = sorted(len(r.prompt_ids) for r in refs.values())
    assert lengths[0] == 5 and lengths[-1] >= 600
    assert len({len(r.tokens) for r in refs.values()}) >= 4
    for ref in refs.values():
        assert len(set(ref.tokens)) > 1 or len(ref.tokens) == 1, "degenerate repeated output"


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("chunked", [False, True], ids=["whole-prefill", "chunked-64"])
def test_concurrent_batch_matches_transformers(
    shape, chunked, compile, model_dirs, processors, fp32_models, references
):
    scheduler = dict(token_budget=64, enable_chunked_prefill=True) if chunked else dict(enable_chunked_prefill=False)
    engine = make_engine(model_dirs, fp32_models, shape, compile=compile, **scheduler)
    assert (engine.compiled is not None) == compile
    graph_steps, prompt_steps = count_graph_steps(engine), count_graph_steps(engine, "prompts_graph")
    requests = build_requests(processors[shape], CASES)
    for r, case in zip(requests, CASES):
        assert r.prompt_token_ids == references(shape, torch.float32)[case.name].prompt_ids, case.name
    finals = engine.generate(requests, capture_logits=True)
    outputs = {rid: out.output_token_ids for rid, out in finals.items()}
    assert_matches_reference(outputs, engine.captured_logits, references(shape, torch.float32))
    assert_pools_full(engine)
    # compiled, the steps of decodes only ran as one graph (where the C attention kernel is built), and the steps of
    # several prompts (or chunks) with nothing beside them as another (where the C prompt kernel is)
    assert (graph_steps[0] > 10) == (compile and cpu_paged.available()), graph_steps
    assert (prompt_steps[0] > 0) == (compile and cpu_prompt.supports(torch.empty(1, 64))), prompt_steps


def test_the_last_layer_computes_beyond_its_kv_only_the_rows_that_sample(
    model_dirs, processors, fp32_models, references
):
    """Chunked, a step holds decodes, chunks that end a prompt and chunks that do not: every layer computes K/V at
    every row, the last one its output (projection, MLP) at the rows that sample only — tokens still the
    reference's."""
    shape = SHAPES[0]
    engine = make_engine(model_dirs, fp32_models, shape, token_budget=64, enable_chunked_prefill=True)
    layers = fp32_models[shape].text.layers
    rows, steps = {}, []  # steps: (rows into the first layer's o_proj, into the last's, requests that sample)
    hooks = [
        m.register_forward_hook(lambda _m, args, _out, key=key: rows.__setitem__(key, args[0].shape[0]))
        for key, m in (("first", layers[0].o_proj), ("last", layers[-1].o_proj))
    ]
    run_plan = engine.runner.run

    def run(plan):
        rows.clear()
        sampling, logits = run_plan(plan)
        if plan.decodes or plan.prefills:
            steps.append((rows["first"], rows.get("last", 0), len(sampling)))
        return sampling, logits

    engine.runner.run = run
    requests = build_requests(processors[shape], CASES)
    longest = max(requests, key=lambda r: len(r.prompt_token_ids))
    try:
        finals = engine.generate([longest], capture_logits=True)  # alone: its first chunks sample nothing
        finals |= engine.generate([r for r in requests if r is not longest], capture_logits=True)
    finally:
        for hook in hooks:
            hook.remove()
    outputs = {rid: out.output_token_ids for rid, out in finals.items()}
    assert_matches_reference(outputs, engine.captured_logits, references(shape, torch.float32))
    assert all(last == sampled for _, last, sampled in steps), steps
    assert any(sampled == 0 for _, _, sampled in steps), steps  # a step of a prompt's chunk only
    assert any(first > sampled > 0 for first, _, sampled in steps), steps


def test_the_prefill_graphs_last_layer_computes_beyond_its_kv_the_last_position_only(model_dirs, fp32_models):
    """`prefill_step` (run eagerly here: the graph is its trace): the last layer's projection and MLP see one row,
    the logits are those of the full computation's last position, and every layer's K/V are in the cache."""
    text = fp32_models[SHAPES[0]].text
    cfg, n = text.cfg, 37
    text.rotary_for(text.embed_tokens.weight)
    embeds = torch.randn(n, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    positions = torch.arange(n)
    cache = torch.zeros(-(-n // 16), cfg.num_layers, 2, 16, cfg.num_kv_heads, cfg.head_dim)
    rows = []
    hook = text.layers[-1].o_proj.register_forward_hook(lambda _m, args, _out: rows.append(args[0].shape[0]))
    try:
        with torch.inference_mode():
            logits = compiled.prefill_step(text, embeds, positions, cache, positions // 16, positions % 16)
    finally:
        hook.remove()
    assert rows == [1] and logits.shape == (1, cfg.vocab_size)
    # the same from every position's outputs, layer by layer (the K/V each layer wrote, read back)
    x, (cos, sin) = embeds, text.rotary.cos_sin(positions, embeds.dtype)
    for i, layer in enumerate(text.layers):
        q, k, v = DecoderLayer.qkv(layer, x, cos, sin)
        torch.testing.assert_close(cache[:, i, 0].flatten(0, 1)[:n], k, rtol=0, atol=0)
        torch.testing.assert_close(cache[:, i, 1].flatten(0, 1)[:n], v, rtol=0, atol=0)
        x = DecoderLayer.finish(layer, x, causal_attention(q, k, v, cfg.head_dim**-0.5))
    torch.testing.assert_close(logits, text.logits(x[-1:]), rtol=1e-5, atol=1e-5)


def count_graph_steps(engine, graph_name: str = "decode_graph") -> list[int]:
    """Counts the steps the engine's runner runs through one of its compiled step graphs, from now on."""
    count, graph = [0], getattr(engine.runner, graph_name)
    if graph is not None:

        def counted(*args):
            count[0] += 1
            return graph(*args)

        setattr(engine.runner, graph_name, counted)
    return count


@pytest.mark.parametrize("shape", SHAPES)
def test_one_request_at_a_time_matches_transformers_through_the_prefill_graph(
    shape, model_dirs, processors, fp32_models, references
):
    """Alone, each prompt is computed whole in one step: compiled, that step runs as one graph."""
    engine = make_engine(model_dirs, fp32_models, shape, compile=True, enable_chunked_prefill=False)
    prefill_steps = count_graph_steps(engine, "prefill_graph")
    outputs, logits = {}, {}
    for request in build_requests(processors[shape], CASES):
        finals = engine.generate([request], capture_logits=True)
        outputs.update({rid: out.output_token_ids for rid, out in finals.items()})
        logits.update(engine.captured_logits)
    assert_matches_reference(outputs, logits, references(shape, torch.float32))
    assert_pools_full(engine)
    assert prefill_steps[0] == (len(CASES) if cpu_paged.available() else 0), prefill_steps


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("shape", SHAPES)
def test_encode_prefill_decode_on_three_engines_matches_transformers(
    shape, compile, model_dirs, processors, fp32_models, references
):
    encoder = make_engine(
        model_dirs, fp32_models, shape, roles=frozenset({Stage.ENCODE}), image_budget=2, compile=compile
    )
    prefiller = make_engine(
        model_dirs, fp32_models, shape, roles=frozenset({Stage.PREFILL}), token_budget=128, compile=compile
    )
    decoder = make_engine(model_dirs, fp32_models, shape, roles=frozenset({Stage.DECODE}), compile=compile)
    outputs = run_disaggregated(encoder, prefiller, decoder, build_requests(processors[shape], CASES))
    assert_matches_reference(outputs, prefiller.captured_logits, references(shape, torch.float32))
    assert_pools_full(encoder, prefiller, decoder)


@pytest.mark.parametrize("shape", SHAPES)
def test_prefix_cache_hits_give_the_reference_tokens_and_skip_cached_images(
    shape, model_dirs, processors, fp32_models, references
):
    """The same ten requests twice on one engine with prefix caching, chunked: the second pass computes only what
    its cached prefix lacks — images whose placeholders' KV is all cached are not encoded again — and every token
    and first-step logit is still transformers'."""
    engine = make_engine(model_dirs, fp32_models, shape, prefix_caching=True, token_budget=64)
    refs = references(shape, torch.float32)
    image_ends = {
        r.request_id: r.image_end(engine.model_config.image_token_id) for r in build_requests(processors[shape], CASES)
    }
    encoded = []
    run_plan = engine.runner.run
    engine.runner.run = lambda plan: (encoded.extend(w.request.request_id for w in plan.encodes), run_plan(plan))[1]
    first = engine.generate(build_requests(processors[shape], CASES), capture_logits=True)
    assert_matches_reference({rid: out.output_token_ids for rid, out in first.items()}, engine.captured_logits, refs)
    assert all(out.num_cached_tokens == 0 for out in first.values())  # concurrent, nothing committed before they began
    encoded.clear()
    engine.captured_logits.clear()
    second = engine.generate(build_requests(processors[shape], CASES), capture_logits=True)
    assert_matches_reference({rid: out.output_token_ids for rid, out in second.items()}, engine.captured_logits, refs)
    cached = {rid: out.num_cached_tokens for rid, out in second.items()}
    for case in CASES:  # every full block but the one holding the last prompt token
        assert cached[case.name] == (len(refs[case.name].prompt_ids) - 1) // 16 * 16, case.name
    skipped = {rid for rid, end in image_ends.items() if end and cached[rid] >= end}
    assert {"img-tall", "img-long"} <= skipped  # their text runs a block or more past the image
    assert set(encoded) == {rid for rid, end in image_ends.items() if end} - skipped
    assert engine.scheduler.num_encodes_skipped == len(skipped)
    assert_pools_full(engine)


@pytest.mark.parametrize("shape", SHAPES)
def test_a_prefill_engine_with_the_images_kv_cached_needs_no_image_pages(
    shape, model_dirs, processors, fp32_models, references
):
    """encode → prefill → decode on three engines, twice: the second time the prefill engine pins its cached
    prefix for the image requests it covers (`pin_cached`) and prefills them without their image pages, as a
    prefill worker does while the encoder's pages are still on their way. Tokens: transformers'."""
    encoder = make_engine(model_dirs, fp32_models, shape, roles=frozenset({Stage.ENCODE}), image_budget=2)
    prefiller = make_engine(
        model_dirs, fp32_models, shape, roles=frozenset({Stage.PREFILL}), token_budget=128, prefix_caching=True
    )
    decoder = make_engine(model_dirs, fp32_models, shape, roles=frozenset({Stage.DECODE}))
    refs = references(shape, torch.float32)
    assert_matches_reference(
        run_disaggregated(encoder, prefiller, decoder, build_requests(processors[shape], CASES)),
        prefiller.captured_logits,
        refs,
    )
    prefiller.captured_logits.clear()
    pinned = []
    for r in build_requests(processors[shape], CASES):
        if not r.images:
            continue
        again = Request(
            r.request_id, r.prompt_token_ids, r.sampling, r.images, first_stage=Stage.PREFILL, last_stage=Stage.PREFILL
        )
        if prefiller.pages.pin_cached(again):
            prefiller.add_request(again, capture_logits=True, preloaded=True)
            pinned.append(r.request_id)
    assert {"img-tall", "img-long"} <= set(pinned)
    rest = [r for r in build_requests(processors[shape], CASES) if r.request_id not in pinned]
    outputs = run_disaggregated(encoder, prefiller, decoder, rest)  # steps the pinned ones too, and decodes them
    assert set(outputs) == {case.name for case in CASES}
    assert_matches_reference(outputs, prefiller.captured_logits, refs)
    assert_pools_full(encoder, prefiller, decoder)


def test_a_decoder_that_prefills_too_serves_later_prompts_from_the_kv_pages_it_imported(
    model_dirs, processors, fp32_models, references
):
    """A PD decoder with prefix caching keeps the prompt KV it was handed (path ①) for prompts it prefills itself
    later (path ②): the same text chats again on it compute only what the imported pages lack — transformers' tokens."""
    encoder = make_engine(model_dirs, fp32_models, "tiny", roles=frozenset({Stage.ENCODE}), image_budget=2)
    prefiller = make_engine(model_dirs, fp32_models, "tiny", roles=frozenset({Stage.PREFILL}), token_budget=128)
    decoder = make_engine(
        model_dirs, fp32_models, "tiny", roles=frozenset({Stage.PREFILL, Stage.DECODE}), prefix_caching=True
    )
    refs = references("tiny", torch.float32)
    assert_matches_reference(
        run_disaggregated(encoder, prefiller, decoder, build_requests(processors["tiny"], CASES)),
        prefiller.captured_logits,
        refs,
    )
    texts = [r for r in build_requests(processors["tiny"], CASES) if not r.images]
    again = decoder.generate(
        [Request(r.request_id, r.prompt_token_ids, r.sampling, first_stage=Stage.PREFILL) for r in texts]
    )
    for r in texts:
        assert again[r.request_id].output_token_ids == refs[r.request_id].tokens, r.request_id
        assert again[r.request_id].num_cached_tokens == (r.num_prompt_tokens - 1) // 16 * 16, r.request_id
    assert sum(again[r.request_id].num_cached_tokens for r in texts) > 0
    assert_pools_full(encoder, prefiller, decoder)


def test_a_system_prompt_before_an_image_is_cached_for_chats_with_other_images(model_dirs, processors, fp32_models):
    """The blocks before an image's first placeholder are shared by prompts with another image there (the image's
    identity enters the hashes where it begins, as vLLM keys them): a second picture after the same system prompt
    computes from the image's block on, the first picture again from the last block only — and all give
    transformers' tokens."""
    system = [{"role": "system", "content": [{"type": "text", "text": text_of(70, 12)}]}]

    def chat(seed):
        picture = [{"type": "image", "image": image(seed, 240, 200)}, {"type": "text", "text": text_of(30, 13)}]
        return system + [{"role": "user", "content": picture}]

    cases = [Case("first", chat(21), 10), Case("other-image", chat(22), 10)]
    refs = hf_reference(model_dirs["tiny"], processors["tiny"], cases, torch.float32)
    engine = make_engine(model_dirs, fp32_models, "tiny", prefix_caching=True)
    image_token = engine.model_config.image_token_id
    start = refs["first"].prompt_ids.index(image_token)
    assert start >= 64 and refs["other-image"].prompt_ids[:start] == refs["first"].prompt_ids[:start]
    first, other = build_requests(processors["tiny"], cases)
    again = build_requests(processors["tiny"], cases[:1])[0]
    outputs = []
    for request in (first, other, again):
        out = engine.generate([request])[request.request_id]
        outputs.append((out.output_token_ids, out.num_cached_tokens))
    assert outputs == [
        (refs["first"].tokens, 0),
        (refs["other-image"].tokens, start // 16 * 16),
        (refs["first"].tokens, (len(refs["first"].prompt_ids) - 1) // 16 * 16),
    ]
    assert engine.scheduler.num_encodes_skipped == 1
    assert_pools_full(engine)


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_bfloat16_within_the_references_own_rounding(compile, model_dirs, processors, references, monkeypatch):
    from kernels import cpu_amx, cpu_paged

    calls = {"linear": 0, "gemm": 0, "mlp": 0, "swiglu_rows": 0, "qkv_rope": 0, "rotary_kv": 0}
    kernels = [(cpu_amx, n) for n in ("linear", "gemm", "mlp", "swiglu_rows", "qkv_rope")] + [(cpu_paged, "rotary_kv")]
    for module, name in kernels:
        kernel = getattr(module, name)
        monkeypatch.setattr(
            module, name, lambda *a, n=name, k=kernel, **kw: calls.update({n: calls[n] + 1}) or k(*a, **kw)
        )
    engine = make_engine(model_dirs, None, "tiny", dtype="bfloat16", token_budget=96, compile=compile)
    assert_bf16_within_rounding(engine, processors, references)
    # the CPU's fast paths were on the way where this host has them: a decode step's products on the weights' tiles
    # (AMX, or the vector units of a host with AVX512-BF16 and no AMX); on AMX a prompt's products too (its MLP in
    # one op) and a decode step's SwiGLU in one call; compiled, prompt chunks' RoPE and K/V write in one pass — on
    # AMX, a prompt's (> 48 rows) in its qkv product's pass
    tiles = any(getattr(m, "tiles", None) is not None for m in engine.model.modules())
    assert tiles == (cpu_amx.available() or cpu_amx.vector_available())
    assert (calls["linear"] > 0) == tiles
    amx = tiles and cpu_amx.available()
    assert (calls["gemm"] > 0 and calls["mlp"] > 0 and calls["swiglu_rows"] > 0) == amx  # prompts'; decode steps'
    fused = compile and cpu_paged.rotary_kv_supported(torch.bfloat16, 32)
    assert (calls["qkv_rope"] > 0) == (fused and amx)
    assert (calls["rotary_kv"] + calls["qkv_rope"] > 0) == fused


def test_a_lone_bf16_prompt_runs_through_the_graph_its_host_gives_it(model_dirs, processors, references):
    """Compiled bf16, one request at a time: a whole prompt alone runs through the prompts graph where bf16 prompts
    run on the AMX tiles (no lone-prompt graph is made there: it computes a lone prompt no faster and only adds its
    compile to a cold start), elsewhere through the lone-prompt graph where the host has one — within the
    reference's rounding either way."""
    from kernels import cpu_amx

    engine = make_engine(model_dirs, None, "tiny", dtype="bfloat16", compile=True, enable_chunked_prefill=False)
    runner = engine.runner
    tiles = runner.prompts_graph is not None and cpu_amx.available()
    assert (runner.prefill_graph is None) == (tiles or runner.decode_graph is None)
    lone, prompts = count_graph_steps(engine, "prefill_graph"), count_graph_steps(engine, "prompts_graph")
    assert_bf16_within_rounding(engine, processors, references, alone=True)
    if tiles:
        assert (lone[0], prompts[0]) == (0, len(CASES))
    elif runner.decode_graph is not None:
        assert lone[0] == len(CASES) and prompts[0] == 0


def assert_bf16_within_rounding(engine: Engine, processors, references, alone: bool = False) -> None:
    """bf16 tolerance: our bf16 logits may differ from transformers' bf16 logits by at most twice as much as
    transformers' bf16 differs from its own fp32 (plus 0.05) — i.e. we are within bf16's own rounding noise.
    Greedy tokens must agree at every step whose reference top-1/top-2 margin exceeds it; a step under it may
    legitimately pick the runner-up, and from there on the two continuations have different prefixes.
    `alone`: the requests one at a time (each prompt computed alone), else all at once."""
    ref32, ref16 = references("tiny", torch.float32), references("tiny", torch.bfloat16)
    own_noise = max((ref16[c.name].logits[0] - ref32[c.name].logits[0]).abs().max().item() for c in CASES)
    tolerance = 2 * own_noise + 0.05
    requests = build_requests(processors["tiny"], CASES)
    finals = {}
    for batch in [[r] for r in requests] if alone else [requests]:
        finals.update(engine.generate(batch, capture_logits=True))
    compared = 0
    for case in CASES:
        ref, ours = ref16[case.name], finals[case.name].output_token_ids
        diff = (engine.captured_logits[case.name][0].cpu() - ref.logits[0]).abs().max().item()
        assert diff <= tolerance, f"{case.name}: bf16 first-step logits differ by {diff} > {tolerance}"
        for step, token in enumerate(ref.tokens):
            if ours[step] != token:
                assert ref.margin(step) <= tolerance, f"{case.name} step {step}: margin {ref.margin(step):.3f}"
                break
            compared += ref.margin(step) > tolerance
    assert compared >= 50, f"only {compared} tokens had margins above the tolerance {tolerance:.3f}"
    assert_pools_full(engine)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_a_gpu_bf16_prompt_chunks_in_one_varlen_call_stay_within_the_references_rounding(
    model_dirs, processors, references, monkeypatch
):
    """The torch backend's prompt chunks through torch's varlen flash kernel (bf16 only), chunked prefill with
    several prompts a step and decodes beside them."""
    from kernels import varlen

    packs = []
    kernel = varlen.flash_varlen
    monkeypatch.setattr(varlen, "flash_varlen", lambda *a: packs.append(a[3]) or kernel(*a))
    config = EngineConfig(
        model=str(model_dirs["tiny"]),
        dtype="bfloat16",
        device="cuda",
        attention_backend="torch",
        kv_cache_gib=0.05,
        image_cache_gib=0.02,
        scheduler=SchedulerConfig(token_budget=96, enable_chunked_prefill=True),
    )
    assert_bf16_within_rounding(Engine(config), processors, references)
    assert len({id(p) for p in packs}) > 5 and any(p.cu_q.shape[0] > 2 for p in packs)  # steps of several chunks


@pytest.mark.parametrize("shape", SHAPES)
def test_decode_steps_padded_to_cuda_graph_buckets_match_transformers(
    shape, model_dirs, processors, fp32_models, references
):
    """The decode CUDA graphs' step, run eagerly on the CPU (what a graph replays, without the capture): rows padded
    to a batch bucket with copies of the first, block tables to a width bucket."""
    engine = make_engine(model_dirs, fp32_models, shape, enable_chunked_prefill=False)
    graphs = DecodeGraphs(
        engine.model.text, engine.kv_cache.layers, 16, engine.config.scheduler.max_num_seqs, engine.max_model_len
    )
    graphs.capture()
    engine.runner.decode_graphs = graphs
    padded, bucket = [], graphs.bucket
    graphs.bucket = lambda n, width: padded.append((n, width, key := bucket(n, width))) or key
    finals = engine.generate(build_requests(processors[shape], CASES), capture_logits=True)
    outputs = {rid: out.output_token_ids for rid, out in finals.items()}
    assert_matches_reference(outputs, engine.captured_logits, references(shape, torch.float32))
    assert_pools_full(engine)
    assert graphs.replays == len(padded) > 10
    assert any(b > n for n, _, (b, _) in padded) and any(w > width for _, width, (_, w) in padded)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("cuda_graphs", [False, True], ids=["eager", "cuda-graphs"])
@pytest.mark.parametrize("shape", SHAPES)
def test_on_a_gpu_the_engine_matches_transformers(shape, cuda_graphs, model_dirs, processors, references):
    config = EngineConfig(
        model=str(model_dirs[shape]),
        device="cuda",
        kv_cache_gib=0.05,
        image_cache_gib=0.02,
        cuda_graphs=cuda_graphs,
        scheduler=SchedulerConfig(token_budget=64, enable_chunked_prefill=True),
    )
    engine = Engine(config)
    finals = engine.generate(build_requests(processors[shape], CASES), capture_logits=True)
    outputs = {rid: out.output_token_ids for rid, out in finals.items()}
    captured = {rid: [t.cpu() for t in logits] for rid, logits in engine.captured_logits.items()}
    assert_matches_reference(outputs, captured, references(shape, torch.float32))
    assert_pools_full(engine)
    graphs = engine.runner.decode_graphs
    assert (graphs is not None and graphs.replays > 10) == cuda_graphs, graphs and graphs.replays
