"""How a request stops and the text it ends with, one sampled token at a time (`common.engine.stopping`)."""

import pytest

from common.engine.outputs import RequestOutput
from common.engine.stopping import check_stop
from common.request import Request, RequestStatus
from common.sampling import SamplingParams
from services.gateway.mesh.migration import continuation, rebased

EOS = 2


@pytest.fixture(scope="module")
def tok(processors):
    return processors["tiny"]


def _run(tok, text: str, sampling: SamplingParams, first: list[int] = (), then: list[int] = ()):
    """Sample `text`'s tokens then `then` one by one on a request that arrived with `first` already out (as a
    decoder gets it after a prefill handoff); the status and text it stops with."""
    request = Request("r", [1, 5, 6], sampling)
    request.output_token_ids.extend(first)
    for token in tok.tokenizer(text, add_special_tokens=False)["input_ids"] + list(then):
        request.output_token_ids.append(token)
        status = check_stop(request, token, {EOS}, 4096, tok.detokenize)
        if status is not None:
            return status, request.output_text, request.stop_reason
    return None, request.output_text, request.stop_reason


def test_a_stop_string_cuts_the_text_and_is_found_across_tokens(tok):
    status, text, reason = _run(
        tok, "the kitchen is warm and the table", SamplingParams(stop=("warm a",), max_tokens=50)
    )
    assert (status, text, reason) == (RequestStatus.FINISHED_STOPPED, "the kitchen is ", "warm a")


def test_eos_ends_with_the_text_before_it_also_on_a_worker_that_got_the_request_midway(tok):
    first = tok.tokenizer("the kitchen", add_special_tokens=False)["input_ids"]
    status, text, _ = _run(tok, "", SamplingParams(stop=("zzz",), max_tokens=50), first=first, then=[EOS])
    assert (status, text) == (RequestStatus.FINISHED_STOPPED, "the kitchen")  # the first token's text is kept


def test_a_stop_token_is_the_reason_and_its_text_is_left_out(tok):
    stop_token = tok.tokenizer(" table", add_special_tokens=False)["input_ids"][-1]
    status, text, reason = _run(
        tok, "the kitchen", SamplingParams(stop=("zzz",), stop_token_ids=(stop_token,)), then=[stop_token]
    )
    assert (status, text, reason) == (RequestStatus.FINISHED_STOPPED, "the kitchen", stop_token)


def test_the_length_limit_ends_with_the_whole_text(tok):
    ids = tok.tokenizer("the kitchen is warm and the table is set", add_special_tokens=False)["input_ids"]
    status, text, reason = _run(
        tok, "the kitchen is warm and the table is set", SamplingParams(stop=("zzz",), max_tokens=len(ids))
    )
    assert (status, text, reason) == (RequestStatus.FINISHED_LENGTH, tok.detokenize(ids), None)
    assert _run(tok, "the kitchen", SamplingParams(max_tokens=50), then=[EOS])[:2] == (
        RequestStatus.FINISHED_STOPPED,
        "",
    )


def test_min_tokens_leaves_stops_unchecked_until_that_many_tokens_as_vllm_does(tok):
    """Before min_tokens, neither EOS nor a stop token nor a stop string ends the request; a stop string that
    completed before then is not found afterwards either (vLLM looks only at the text new since its last check)."""
    n = len(tok.tokenizer("the kitchen is warm", add_special_tokens=False)["input_ids"])
    status, text, reason = _run(
        tok,
        "the kitchen is warm and the kitchen is cold",
        SamplingParams(stop=("kitchen",), max_tokens=50, min_tokens=n),
    )
    assert (status, reason) == (RequestStatus.FINISHED_STOPPED, "kitchen") and text == "the kitchen is warm and the "
    status, text, _ = _run(tok, "", SamplingParams(max_tokens=50, min_tokens=3, stop_token_ids=(7,)), then=[EOS, 7, 9])
    assert status is None  # three tokens out, none of them a stop (in the engine they are masked)
    status, _, reason = _run(
        tok, "", SamplingParams(max_tokens=50, min_tokens=3, stop_token_ids=(7,)), then=[9, 9, 9, 7]
    )
    assert (status, reason) == (RequestStatus.FINISHED_STOPPED, 7)


def test_a_continuation_finds_a_stop_string_that_began_in_the_output_before_it_and_the_joined_text_is_cut_there(tok):
    """A request preempted and handed back (or whose decoder died) goes on as a continuation: prompt + the tokens
    sent. A stop string that spans the two parts ends it where the whole request would have ended."""
    sampling = SamplingParams(stop=("warm a",), max_tokens=50)
    whole = _run(tok, "the kitchen is warm and the table", sampling)
    sent = tok.tokenizer("the kitchen is warm", add_special_tokens=False)["input_ids"]  # "warm a" is cut in two
    rest = continuation(Request("r", [1, 5, 6], sampling), sent, attempt=2)
    for token in tok.tokenizer(" and the table", add_special_tokens=False)["input_ids"]:
        rest.output_token_ids.append(token)
        status = check_stop(rest, token, {EOS}, 4096, tok.detokenize)
        if status is not None:
            break
    assert (status, rest.stop_reason) == (RequestStatus.FINISHED_STOPPED, "warm a")
    out = RequestOutput(
        rest.request_id, [token], list(rest.output_token_ids), status, "stop", rest.stop_reason, text=rest.output_text
    )
    assert rebased(out, "r", sent, tok.detokenize).text == whole[1] == "the kitchen is "


def test_generated_outputs_stop_where_a_rescan_of_the_whole_text_would(tok):
    """Random outputs (any token ids, EOS among them), stop strings taken from their own text and others, min_tokens:
    the check stops at the token, with the text and reason, that a plain scan after every token gives. (It found the
    check taking a short stop string that was whole before min_tokens ended, within the longest one's length.)"""
    from hypothesis import HealthCheck, example, given, settings
    from hypothesis import strategies as st

    from common.detokenizer import IncrementalDetokenizer

    vocab = len(tok.tokenizer)

    def rescan(ids: list[int], params: SamplingParams):
        detok = IncrementalDetokenizer(tok.detokenize)
        for n, token in enumerate(ids, 1):
            early = n < params.min_tokens
            if not early and (token == EOS or token in params.stop_token_ids):
                text = detok.text + detok.finish()  # the output before this token, whole
                return RequestStatus.FINISHED_STOPPED, text, None if token == EOS else token
            before = len(detok.text)
            detok.push([token])
            # a stop string counts where it ends in the text this token added (vLLM's rule: one that was whole during
            # min_tokens, unchecked, does not count later)
            hits = (
                []
                if early
                else sorted(
                    (at, s) for s in params.stop if (at := detok.text.find(s, max(before - len(s) + 1, 0))) >= 0
                )
            )
            if hits:
                return RequestStatus.FINISHED_STOPPED, detok.text[: hits[0][0]], hits[0][1]
            if n >= params.max_tokens:
                return RequestStatus.FINISHED_LENGTH, detok.text + detok.finish(), None
        return None, detok.text, None

    @settings(max_examples=150, deadline=None, database=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(
        st.lists(st.one_of(st.integers(0, vocab - 1), st.just(EOS), st.integers(3, 300)), min_size=1, max_size=40),
        st.lists(st.tuples(st.integers(0, 40), st.integers(1, 6)), max_size=3),
        st.lists(st.text(min_size=1, max_size=3), max_size=2),
        st.integers(0, 10),
        st.integers(1, 50),
        st.lists(st.integers(3, 300), max_size=2),
    )
    @example(
        ids=[2, 469, 0], cuts=[(0, 2), (4, 1)], others=[], min_tokens=3, max_tokens=3, stop_ids=[]
    )  # the one found
    def check(ids, cuts, others, min_tokens, max_tokens, stop_ids):
        whole = tok.detokenize(ids)
        stop = tuple(dict.fromkeys([whole[a : a + n] for a, n in cuts if whole[a : a + n]] + others))[:4]
        params = SamplingParams(
            stop=stop, max_tokens=max_tokens, min_tokens=min(min_tokens, max_tokens), stop_token_ids=tuple(stop_ids)
        )
        request = Request("r", [1, 5, 6], params)
        status = None
        for token in ids:
            request.output_token_ids.append(token)
            if (status := check_stop(request, token, {EOS}, 4096, tok.detokenize)) is not None:
                break
        expected = rescan(ids, params)
        assert (status, request.stop_reason) == (expected[0], expected[2]), (ids, params)
        if params.stop:  # the text is kept (and cut) only where stop strings are watched; the gateway decodes the rest
            assert request.output_text == expected[1], (ids, params)

    check()
