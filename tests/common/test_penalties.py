"""Penalties and biases: transformers' repetition penalty, OpenAI's presence / frequency penalties and logit
bias give transformers' tokens (greedy), and a migrated request's continuation goes on as the request would have."""

import dataclasses

import pytest
import torch

from common.engine.config import EngineConfig
from common.engine.engine import Engine, RequestRejected
from common.request import Request
from common.sampling import SamplingParams
from tests.support import build_requests, hf_reference, mixed_cases

CASES = [dataclasses.replace(c, max_tokens=max(c.max_tokens, 20)) for c in mixed_cases()[:6]]
PENALTIES = {  # name: (our sampling parameters, transformers' generate arguments)
    "repetition": (dict(repetition_penalty=1.3), dict(repetition_penalty=1.3)),
    "presence+frequency": (dict(presence_penalty=0.8, frequency_penalty=0.6),) * 2,
    "all three": (dict(presence_penalty=-0.5, frequency_penalty=1.2, repetition_penalty=0.9),) * 2,
    "logit bias": (
        dict(logit_bias=((500, 6.0), (1002, -50.0), (3339, 4.5))),
        dict(sequence_bias={(500,): 6.0, (1002,): -50.0, (3339,): 4.5}),
    ),
}


def _engine(tiny_dir):
    return Engine(EngineConfig(model=str(tiny_dir), dtype="float32", kv_cache_gib=0.05, image_cache_gib=0.02))


@pytest.fixture(scope="module")
def plain(tiny_dir, processors):
    return hf_reference(tiny_dir, processors["tiny"], CASES, torch.float32)


@pytest.mark.parametrize("name", list(PENALTIES))
def test_penalized_greedy_outputs_are_transformers_own(name, tiny_dir, processors, plain):
    ours, theirs = PENALTIES[name]
    refs = hf_reference(tiny_dir, processors["tiny"], CASES, torch.float32, **theirs)
    requests = build_requests(processors["tiny"], CASES)
    for r in requests:
        r.sampling = dataclasses.replace(r.sampling, **ours)
    finals = _engine(tiny_dir).generate(requests)
    for case in CASES:
        assert finals[case.name].output_token_ids == refs[case.name].tokens, (name, case.name)
    changed = [c.name for c in CASES if refs[c.name].tokens != plain[c.name].tokens]
    assert len(changed) >= 2, f"{name} changed too few outputs to show anything: {changed}"


def test_a_continuation_goes_on_with_the_same_penalties_and_random_stream(tiny_dir, processors):
    """A migrated request prefills prompt + the tokens already sent and samples the rest. Counted as generated
    (`num_continued_tokens`), those tokens keep their penalties and the seeded stream's position: the
    continuation's tokens are the original's."""
    (original,) = build_requests(processors["tiny"], CASES[4:5])
    original.sampling = SamplingParams(
        max_tokens=12, temperature=1.0, seed=11, frequency_penalty=1.5, presence_penalty=0.5
    )
    whole = _engine(tiny_dir).generate([original])[original.request_id].output_token_ids
    sent = whole[:5]
    rest = dataclasses.replace(original.sampling, max_tokens=7)
    continued = Request("m", original.prompt_token_ids + sent, rest, num_continued_tokens=len(sent))
    assert _engine(tiny_dir).generate([continued])["m"].output_token_ids == whole[5:]
    naive = Request("n", original.prompt_token_ids + sent, rest)  # what a continuation was before
    assert _engine(tiny_dir).generate([naive])["n"].output_token_ids != whole[5:]


def test_penalty_ranges_are_checked(tiny_dir):
    for bad in (
        dict(presence_penalty=2.5),
        dict(frequency_penalty=-3),
        dict(repetition_penalty=0),
        dict(logit_bias=((5, 101.0),)),
        dict(logit_bias=((-1, 1.0),)),
    ):
        with pytest.raises(ValueError):
            SamplingParams(**bad)
    with pytest.raises(ValueError, match="continued tokens"):
        Request("r", [1, 2], SamplingParams(), num_continued_tokens=2)
    with pytest.raises(RequestRejected, match="outside the vocabulary"):
        _engine(tiny_dir).add_request(Request("r", [1, 2], SamplingParams(logit_bias=((10**6, 1.0),))))


@pytest.mark.parametrize(
    "params",
    [
        dict(temperature=0.7),
        dict(temperature=1.0, top_k=40),
        dict(temperature=0.9, top_p=0.9),
        dict(temperature=1.3, top_k=300, top_p=0.8),
        dict(temperature=2.0, top_p=0.999),
        dict(temperature=1.5, min_p=0.05),
        dict(temperature=1.2, min_p=0.01, top_k=100, top_p=0.9),
    ],
    ids=["temperature", "top-k", "top-p", "top-k+top-p", "wide top-p", "min-p", "min-p+top-k+top-p"],
)
def test_sampling_among_candidates_draws_from_the_masked_full_distribution(params):
    """The sampler draws among the candidates top-k / top-p leave rather than sorting the whole vocabulary; the
    distribution is the one masking the full vocabulary gives (the step-by-step definition)."""
    from common.engine.sampler import distribution

    params = SamplingParams(**params)
    logits = torch.randn(32064, generator=torch.Generator().manual_seed(3)) * 3
    probs, candidates = distribution(logits, params)
    got = torch.zeros(logits.numel()).index_put_((candidates,), probs) if candidates is not None else probs.clone()
    scaled = logits / params.temperature  # the definition, over the whole vocabulary
    if params.min_p:  # vLLM's: a probability below min_p × the largest one's is dropped, before top-k and top-p
        probs_all = torch.softmax(scaled, dim=-1)
        scaled = scaled.masked_fill(probs_all < params.min_p * probs_all.max(), float("-inf"))
    if params.top_k:
        scaled = scaled.masked_fill(scaled < torch.topk(scaled, params.top_k).values[-1], float("-inf"))
    want = torch.softmax(scaled, dim=-1)
    if params.top_p < 1.0:
        ordered, order = want.sort(descending=True)
        want = want.scatter(0, order, ordered.masked_fill(ordered.cumsum(0) - ordered > params.top_p, 0.0))
    assert torch.allclose(got / got.sum(), want / want.sum(), atol=1e-6)
    # the same tokens, but for one at the very edge of a 30,000-token nucleus, where two float32 cumulative
    # sums over differently computed probabilities may round to opposite sides of top_p
    assert abs(int((got > 0).sum()) - int((want > 0).sum())) <= (1 if params.top_p > 0.99 else 0)


def test_the_logit_bias_comes_before_the_penalties_as_in_vllm_and_transformers():
    from common.engine.sampler import apply_penalties

    logits = torch.tensor([[2.0, 1.0, -1.0, 0.5]])
    request = Request("r", [0, 2], SamplingParams(repetition_penalty=1.5, logit_bias=((0, -3.0), (3, 1.0))))
    got = apply_penalties(logits, [request])[0].tolist()
    assert got == pytest.approx([(2.0 - 3.0) * 1.5, 1.0, -1.0 * 1.5, 1.5])  # biased, then penalized (seen: 0, 2)
    assert logits.tolist() == [[2.0, 1.0, -1.0, 0.5]]  # a copy was changed


def test_min_tokens_holds_off_eos_and_stop_tokens_as_transformers_min_new_tokens(tiny_dir, processors, plain):
    """vLLM's min_tokens masks EOS and the stop tokens until that many tokens were generated, as transformers'
    min_new_tokens does for its EOS ids: a token greedy decoding makes third, made a stop token, ends the plain
    request there, and with min_tokens 8 the request goes on to transformers' own tokens."""
    cases = [c for c in CASES if plain[c.name].tokens[2] not in plain[c.name].tokens[:2]][:3]
    assert len(cases) >= 2
    eos = list(_engine(tiny_dir).model_config.eos_token_ids)
    for case in cases:
        stop = plain[case.name].tokens[2]
        (request,) = build_requests(processors["tiny"], [case])
        request.sampling = dataclasses.replace(request.sampling, stop_token_ids=(stop,))
        early = _engine(tiny_dir).generate([request])[case.name]
        assert early.output_token_ids == plain[case.name].tokens[:3] and early.finish_reason == "stop"
        (request,) = build_requests(processors["tiny"], [case])
        request.sampling = dataclasses.replace(request.sampling, stop_token_ids=(stop,), min_tokens=8)
        held = _engine(tiny_dir).generate([request])[case.name].output_token_ids
        ref = hf_reference(
            tiny_dir, processors["tiny"], [case], torch.float32, min_new_tokens=8, eos_token_id=eos + [stop]
        )[case.name].tokens
        assert held == ref and len(held) >= 8 and stop not in held[:8], (case.name, held, ref)
