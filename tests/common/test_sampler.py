"""The sampler on the edges of the parameters' ranges: every value the API accepts draws a token. A draw that raised
failed the engine's whole step, and with it every other request in that batch (found by fuzzing the HTTP API)."""

import pytest
import torch

from common.engine.sampler import Sampler, distribution
from common.request import Request
from common.sampling import SamplingParams

VOCAB = 64


def _logits(seed: int = 0) -> torch.Tensor:
    return torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(seed)) * 4


def _request(prompt: list[int], **sampling) -> Request:
    return Request("r", prompt, SamplingParams(max_tokens=8, **sampling))


@pytest.mark.parametrize("temperature", [1e-300, 5e-324, 9.99e-6])
def test_a_temperature_below_vllms_epsilon_is_greedy(temperature):
    logits = _logits(1)
    request = _request([1, 2, 3], temperature=temperature, seed=7)
    assert request.sampling.greedy
    assert Sampler()(logits, [request]) == [int(logits.argmax())]


def test_a_temperature_at_the_epsilon_samples_and_draws_the_top_token_of_a_clear_margin():
    logits = _logits(2)
    request = _request([1], temperature=1e-5, seed=3)
    assert not request.sampling.greedy
    assert Sampler()(logits, [request]) == [int(logits.argmax())]


@pytest.mark.parametrize("penalty", [1e-224, 1e-30, 5e-324])
def test_a_repetition_penalty_that_overflows_the_logits_puts_the_mass_on_the_tokens_it_pushed_up(penalty):
    """Dividing a positive logit by 1e-224 is +inf in float32; softmax over it was NaN and the draw raised. The limit
    of the distribution is all the mass on those tokens, which is what is drawn now."""
    logits = _logits(3)
    seen = [i for i in range(VOCAB) if logits[0, i] > 0][:3]
    assert len(seen) == 3
    sampler = Sampler(seed=11)
    for seed in range(20):
        request = _request([0, *seen], repetition_penalty=penalty, seed=seed)
        (token,) = sampler(logits, [request])
        assert token in seen


def test_the_distribution_after_an_overflow_is_finite_and_sums_to_one():
    logits = torch.zeros(VOCAB)
    logits[[5, 9]] = float("inf")
    probs, candidates = distribution(logits, SamplingParams(temperature=0.7))
    assert candidates is None and torch.isfinite(probs).all()
    assert probs[[5, 9]].tolist() == [0.5, 0.5] and float(probs.sum()) == 1.0


def test_a_row_with_every_token_masked_still_answers_without_raising():
    """min_tokens forbids every stop token; when the stop tokens are the whole vocabulary nothing is left to draw."""
    logits = _logits(4)
    request = _request([1], temperature=1.0, top_p=0.9, stop_token_ids=tuple(range(VOCAB)), min_tokens=4, seed=1)
    (token,) = Sampler()(logits, [request])
    assert 0 <= token < VOCAB


def test_one_rows_extreme_parameters_leave_the_other_rows_draws_as_they_were():
    logits = torch.cat([_logits(5), _logits(6)])
    calm = _request([1, 2], temperature=0.8, seed=42)
    alone = Sampler()(logits[1:], [calm])
    wild = _request([1, 2], temperature=1e-300, repetition_penalty=1e-224)
    assert Sampler()(logits, [wild, calm])[1] == alone[0]
