"""Greedy outputs of our engine are transformers' own, token for token (fp32), on two model shapes.

The reference is `processor.apply_chat_template(...)` + `LlavaForConditionalGeneration.generate(do_sample=False)`.
"""

import pytest
import torch

from common.engine.config import EngineConfig
from common.engine.engine import Engine
from common.model.loader import load_model
from common.request import Stage
from common.scheduler import SchedulerConfig
from tests.conftest import SHAPES
from tests.support import assert_pools_full, build_requests, hf_reference, mixed_cases, run_disaggregated

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


def make_engine(model_dirs, models, shape, dtype="float32", roles=frozenset(Stage), **scheduler):
    config = EngineConfig(model=str(model_dirs[shape]), dtype=dtype, roles=roles, kv_cache_gib=0.05,
                          image_cache_gib=0.02, scheduler=SchedulerConfig(**scheduler))
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


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("chunked", [False, True], ids=["whole-prefill", "chunked-64"])
def test_concurrent_batch_matches_transformers(shape, chunked, model_dirs, processors, fp32_models, references):
    scheduler = dict(token_budget=64, enable_chunked_prefill=True) if chunked else dict(enable_chunked_prefill=False)
    engine = make_engine(model_dirs, fp32_models, shape, **scheduler)
    requests = build_requests(processors[shape], CASES)
    for r, case in zip(requests, CASES):
        assert r.prompt_token_ids == references(shape, torch.float32)[case.name].prompt_ids, case.name
    finals = engine.generate(requests, capture_logits=True)
    outputs = {rid: out.output_token_ids for rid, out in finals.items()}
    assert_matches_reference(outputs, engine.captured_logits, references(shape, torch.float32))
    assert_pools_full(engine)


@pytest.mark.parametrize("shape", SHAPES)
def test_encode_prefill_decode_on_three_engines_matches_transformers(shape, model_dirs, processors, fp32_models, references):
    encoder = make_engine(model_dirs, fp32_models, shape, roles=frozenset({Stage.ENCODE}), image_budget=2)
    prefiller = make_engine(model_dirs, fp32_models, shape, roles=frozenset({Stage.PREFILL}), token_budget=128)
    decoder = make_engine(model_dirs, fp32_models, shape, roles=frozenset({Stage.DECODE}))
    outputs = run_disaggregated(encoder, prefiller, decoder, build_requests(processors[shape], CASES))
    assert_matches_reference(outputs, prefiller.captured_logits, references(shape, torch.float32))
    assert_pools_full(encoder, prefiller, decoder)


def test_bfloat16_within_the_references_own_rounding(model_dirs, processors, references):
    """bf16 tolerance: our bf16 logits may differ from transformers' bf16 logits by at most twice as much as
    transformers' bf16 differs from its own fp32 (plus 0.05) — i.e. we are within bf16's own rounding noise.
    Greedy tokens must agree at every step whose reference top-1/top-2 margin exceeds it; a step under it may
    legitimately pick the runner-up, and from there on the two continuations have different prefixes."""
    ref32, ref16 = references("tiny", torch.float32), references("tiny", torch.bfloat16)
    own_noise = max((ref16[c.name].logits[0] - ref32[c.name].logits[0]).abs().max().item() for c in CASES)
    tolerance = 2 * own_noise + 0.05
    engine = make_engine(model_dirs, None, "tiny", dtype="bfloat16", token_budget=96)
    finals = engine.generate(build_requests(processors["tiny"], CASES), capture_logits=True)
    compared = 0
    for case in CASES:
        ref, ours = ref16[case.name], finals[case.name].output_token_ids
        diff = (engine.captured_logits[case.name][0] - ref.logits[0]).abs().max().item()
        assert diff <= tolerance, f"{case.name}: bf16 first-step logits differ by {diff} > {tolerance}"
        for step, token in enumerate(ref.tokens):
            if ours[step] != token:
                assert ref.margin(step) <= tolerance, f"{case.name} step {step}: margin {ref.margin(step):.3f}"
                break
            compared += ref.margin(step) > tolerance
    assert compared >= 50, f"only {compared} tokens had margins above the tolerance {tolerance:.3f}"
    assert_pools_full(engine)
