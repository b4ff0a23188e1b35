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
    "logit bias": (dict(logit_bias=((500, 6.0), (1002, -50.0), (3339, 4.5))),
                   dict(sequence_bias={(500,): 6.0, (1002,): -50.0, (3339,): 4.5})),
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
    original.sampling = SamplingParams(max_tokens=12, temperature=1.0, seed=11, frequency_penalty=1.5, presence_penalty=0.5)
    whole = _engine(tiny_dir).generate([original])[original.request_id].output_token_ids
    sent = whole[:5]
    rest = dataclasses.replace(original.sampling, max_tokens=7)
    continued = Request("m", original.prompt_token_ids + sent, rest, num_continued_tokens=len(sent))
    assert _engine(tiny_dir).generate([continued])["m"].output_token_ids == whole[5:]
    naive = Request("n", original.prompt_token_ids + sent, rest)  # what a continuation was before
    assert _engine(tiny_dir).generate([naive])["n"].output_token_ids != whole[5:]


def test_penalty_ranges_are_checked(tiny_dir):
    for bad in (dict(presence_penalty=2.5), dict(frequency_penalty=-3), dict(repetition_penalty=0),
                dict(logit_bias=((5, 101.0),)), dict(logit_bias=((-1, 1.0),))):
        with pytest.raises(ValueError):
            SamplingParams(**bad)
    with pytest.raises(ValueError, match="continued tokens"):
        Request("r", [1, 2], SamplingParams(), num_continued_tokens=2)
    with pytest.raises(RequestRejected, match="outside the vocabulary"):
        _engine(tiny_dir).add_request(Request("r", [1, 2], SamplingParams(logit_bias=((10**6, 1.0),))))
