"""The final text of a request that moved to another worker mid-stream (request migration): the earlier and
the new tokens decoded together and cut as the engine cut the continuation — on a Llama-style tokenizer,
whose decode drops its first token's leading space, so two decodes joined would lose a space."""

from common.engine.outputs import RequestOutput
from common.request import RequestStatus
from services.gateway.mesh.migration import rebased
from tests.common.test_detokenizer import _llama_style


def _finished(tok, new_text: str, finish: str, stop_reason=None, cut: str | None = None) -> RequestOutput:
    ids = tok.encode(new_text).ids
    status = RequestStatus.FINISHED_STOPPED if finish == "stop" else RequestStatus.FINISHED_LENGTH
    return RequestOutput("r-m2", ids[-1:], ids, status, finish, stop_reason, text=cut, num_prompt_tokens=10)


def test_the_text_after_a_migration_is_the_whole_decode_cut_like_the_engine_cuts():
    tok = _llama_style()
    decode = lambda ids: tok.decode(ids, skip_special_tokens=True)  # noqa: E731
    before = tok.encode("the kitchen").ids
    for out, expected in [
        (_finished(tok, "naïve café", "length", cut="naïve café"), "the kitchen naïve café"),
        # a stop string that begins in the earlier text: the continuation could not see it
        (_finished(tok, "naïve kitchen . the", "stop", "chen na", cut="naïve kitchen "), "the kit"),
        (_finished(tok, "naïve café", "stop", "é", cut="naïve caf"), "the kitchen naïve caf"),
    ]:
        joined = rebased(out, "r", before, decode)
        assert joined.text == expected, (out.stop_reason, joined.text)
        assert joined.output_token_ids == before + out.output_token_ids and joined.num_prompt_tokens == 10 - len(before)
    out = _finished(tok, "naïve café kitchen", "stop", tok.token_to_id("▁kitchen"), cut="naïve café")
    assert rebased(out, "r", before, decode).text == "the kitchen naïve café"  # the stop token's text left out
    # a structured answer stops where its grammar ends, on a token of its own: kept (an EOS is left out)
    out = _finished(tok, 'naïve {"a":1}', "stop", None, cut='naïve {"a":1}')
    assert rebased(out, "r", before, decode).text == 'the kitchen naïve {"a":1}'
    eos = tok.token_to_id("</s>")
    out = RequestOutput(
        "r-m2",
        [eos],
        tok.encode("naïve café").ids + [eos],
        RequestStatus.FINISHED_STOPPED,
        "stop",
        None,
        text="naïve café",
        num_prompt_tokens=10,
    )
    assert rebased(out, "r", before, decode, eos_token_ids=(eos,)).text == "the kitchen naïve café"


def test_a_continuation_counts_the_tokens_already_sent_as_generated_across_the_wire():
    """Its penalties and its seeded random stream go on from where the request was (the engine side of this is
    tests/common/test_penalties.py): the continuation says how many of its prompt tokens were output."""
    from common.request import Request, Stage
    from common.sampling import SamplingParams
    from services import wire
    from services.gateway.mesh.migration import continuation

    original = Request(
        "r", [1, 2, 3], SamplingParams(max_tokens=9, seed=4, frequency_penalty=0.5, repetition_penalty=1.1)
    )
    moved = continuation(original, [7, 8, 7], attempt=2)
    assert moved.prompt_token_ids == [1, 2, 3, 7, 8, 7] and moved.sampling.max_tokens == 6
    assert moved.generated_token_ids == [7, 8, 7]
    received = wire.request_from_pb(wire.spec_to_pb(moved, with_pixels=False), Stage.PREFILL, Stage.DECODE)
    assert received.generated_token_ids == [7, 8, 7] and received.sampling == moved.sampling


def test_a_continuation_keeps_min_tokens_counted_from_the_same_point_as_max_tokens():
    """min_tokens, like max_tokens, counts the continuation's own output: both go down by what was sent (a
    min_tokens left whole was over the lowered max_tokens, and the continuation could not even be made)."""
    from common.request import Request
    from common.sampling import SamplingParams
    from services.gateway.mesh.migration import continuation

    original = Request("r", [1, 2, 3], SamplingParams(max_tokens=20, min_tokens=15))
    moved = continuation(original, list(range(10, 20)), attempt=2)
    assert (moved.sampling.max_tokens, moved.sampling.min_tokens) == (10, 5)
    assert continuation(original, list(range(10, 27)), attempt=2).sampling.min_tokens == 0
    whole = Request("w", [1, 2, 3], SamplingParams(max_tokens=20, min_tokens=20))
    assert continuation(whole, [5] * 19, attempt=3).sampling.min_tokens == 1
