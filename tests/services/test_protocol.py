"""The parsed chat request: what decides whether the gateway tokenizes it on its event loop."""

import json

import pytest

from services.gateway.errors import ApiError
from services.gateway.protocol import INLINE_TOKENIZE_CHARS, parse_chat_request


def _chat(*texts: str):
    body = {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": t} for t in texts]}]}
    return parse_chat_request(json.dumps(body).encode(), ["m"])


def test_short_text_counts_every_text_part_against_the_inline_limit():
    half = "x" * (INLINE_TOKENIZE_CHARS // 2)
    assert _chat("hello").short_text and _chat(half, half).short_text
    assert not _chat(half, half, "y").short_text
    assert _chat(half, half, "y").num_text_chars == INLINE_TOKENIZE_CHARS + 1


def _parse(**extra):
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **extra}
    return parse_chat_request(json.dumps(body).encode(), ["m"])


def test_logprobs_and_top_logprobs_become_the_engines_logprobs_count():
    assert _parse().sampling.logprobs is None and _parse(logprobs=False).sampling.logprobs is None
    assert _parse(logprobs=True).sampling.logprobs == 0
    assert _parse(logprobs=True, top_logprobs=5).sampling.logprobs == 5
    for extra, words in [
        ({"top_logprobs": 2}, "needs 'logprobs': true"),
        ({"logprobs": True, "top_logprobs": 21}, "between 0 and 20"),
        ({"logprobs": "yes"}, "'logprobs' must be bool"),
    ]:
        with pytest.raises(ApiError) as err:
            _parse(**extra)
        assert err.value.status == 400 and words in err.value.message, extra


def test_what_this_server_does_not_implement_is_a_400_not_silently_ignored():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    for extra, param in [
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"structured_outputs": {"grammar": "root ::= x"}}, "structured_outputs"),
    ]:
        with pytest.raises(ApiError) as err:
            _parse(**extra)
        assert err.value.status == 400 and err.value.param == param and "not supported" in err.value.message, extra
    # their neutral values, which many clients send by default, are served
    assert (
        _parse(tools=tools, tool_choice="none", response_format={"type": "text"}, logit_bias={}).sampling.grammar
        is None
    )


def test_each_structured_output_form_becomes_a_grammar_and_one_that_cannot_be_followed_is_a_400():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    forms = [
        {"response_format": {"type": "json_object"}},
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}},
        {"guided_json": schema},
        {"guided_json": json.dumps(schema)},
        {"structured_outputs": {"json": schema}},
        {"guided_regex": "[0-9]+"},
        {"structured_outputs": {"regex": "[0-9]+"}},
        {"guided_choice": ["a", "b"]},
        {"structured_outputs": {"choice": ["a", "b"]}},
    ]
    grammars = [_parse(**form).sampling.grammar for form in forms]
    assert all(grammars) and grammars[2] == grammars[3] == grammars[4] and grammars[5] == grammars[6]
    assert grammars[7] == grammars[8]
    for extra, fragment in [
        ({"guided_json": {"type": "integer", "maximum": float("inf")}}, "cannot be followed"),
        ({"guided_json": "{not json"}, "not valid JSON"),
        ({"guided_regex": "(open"}, "cannot be followed"),
        ({"guided_choice": ["a", 1]}, "non-empty strings"),
        ({"structured_outputs": "x"}, "an object"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "one structured-output constraint"),
    ]:
        with pytest.raises(ApiError) as err:
            _parse(**extra)
        assert err.value.status == 400 and fragment in err.value.message, (extra, err.value.message)


def test_penalties_are_parsed_and_out_of_range_ones_refused():
    sampling = _parse(presence_penalty=0.5, frequency_penalty=-1, repetition_penalty=1.2).sampling
    assert (sampling.presence_penalty, sampling.frequency_penalty, sampling.repetition_penalty) == (0.5, -1.0, 1.2)
    assert not _parse().sampling.adjusts_logits
    assert _parse(logit_bias={"50": -100, "7": 2.5}).sampling.logit_bias == ((7, 2.5), (50, -100.0))
    for extra in (
        {"presence_penalty": 2.5},
        {"frequency_penalty": "a lot"},
        {"repetition_penalty": 0},
        {"logit_bias": {"x": 1}},
        {"logit_bias": {"5": 101}},
        {"logit_bias": [5, 1]},
        {"logit_bias": {"5": True}},
        {"logit_bias": {"4294967296": 1}},
        {"logit_bias": {"-1": 1}},
        {"stop_token_ids": [2**40]},
        {"stop_token_ids": [-1]},
        {"stop_token_ids": [True]},
    ):
        with pytest.raises(ApiError) as err:
            _parse(**extra)
        assert err.value.status == 400, extra
