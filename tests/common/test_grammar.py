"""Structured output in the engine: only what the grammar allows is sampled, on one engine or across prefill →
decode, after a migration, and the request stops where the grammar ends."""

import json
import re

import pytest

from common.engine.config import EngineConfig, parse_roles
from common.engine.engine import Engine, RequestRejected
from common.engine.grammar import GrammarRejected, json_schema_grammar, regex_grammar
from common.request import Request, RequestStatus
from common.sampling import SamplingParams
from tests.support import assert_pools_full, run_disaggregated

SCHEMA = {
    "type": "object",
    "properties": {
        "answer": {"type": "string", "maxLength": 12},
        "ok": {"type": "boolean"},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["answer", "ok", "n"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def model(tiny_dir):
    from common.model.loader import load_model

    return load_model(tiny_dir)


def engine(tiny_dir, model, roles="epd"):
    return Engine(EngineConfig(model=str(tiny_dir), roles=parse_roles(roles), kv_cache_gib=0.01), model=model)


def prompt(processors, text="Describe it as JSON."):
    return processors["tiny"].apply([{"role": "user", "content": [{"type": "text", "text": text}]}])[0]


def run(e: Engine, request: Request) -> Request:
    e.add_request(request)
    while e.has_unfinished:
        e.step()
    return request


def test_a_json_schema_request_gives_json_of_that_schema_and_stops_where_it_closes(tiny_dir, model, processors):
    e = engine(tiny_dir, model)
    free = run(e, Request("free", prompt(processors), SamplingParams(max_tokens=80, temperature=0)))
    assert free.status == RequestStatus.FINISHED_LENGTH  # the tiny model, left alone, writes no JSON
    with pytest.raises(ValueError):
        json.loads(processors["tiny"].detokenize(free.output_token_ids))
    r = run(
        e,
        Request(
            "json",
            prompt(processors),
            SamplingParams(max_tokens=80, temperature=0, grammar=json_schema_grammar(SCHEMA)),
        ),
    )
    value = json.loads(processors["tiny"].detokenize(r.output_token_ids))
    assert r.status == RequestStatus.FINISHED_STOPPED and len(r.output_token_ids) < 80
    assert set(value) == {"answer", "ok", "n"} and isinstance(value["answer"], str) and len(value["answer"]) <= 12
    assert isinstance(value["ok"], bool) and isinstance(value["n"], int) and 0 <= value["n"] <= 99
    sampled = run(
        e,
        Request(
            "seeded",
            prompt(processors),
            SamplingParams(max_tokens=80, temperature=1.0, seed=3, grammar=json_schema_grammar(SCHEMA)),
        ),
    )
    assert set(json.loads(processors["tiny"].detokenize(sampled.output_token_ids))) == {"answer", "ok", "n"}
    assert_pools_full(e)


def test_a_regex_request_matches_the_whole_pattern(tiny_dir, model, processors):
    e = engine(tiny_dir, model)
    r = run(
        e,
        Request(
            "rx",
            prompt(processors, "Answer"),
            SamplingParams(max_tokens=30, temperature=0, grammar=regex_grammar(r"(yes|no), [0-9]{3}")),
        ),
    )
    assert re.fullmatch(r"(yes|no), [0-9]{3}", processors["tiny"].detokenize(r.output_token_ids))
    assert r.status == RequestStatus.FINISHED_STOPPED


def test_prefill_here_and_decode_there_give_the_tokens_of_one_engine(tiny_dir, model, processors):
    """The decoder's matcher goes on from the prefill worker's first token (and the first token was masked too)."""
    grammar = json_schema_grammar(SCHEMA)
    whole = run(
        engine(tiny_dir, model),
        Request("a", prompt(processors), SamplingParams(max_tokens=80, temperature=0, grammar=grammar)),
    )
    prefill, decode = engine(tiny_dir, model, "p"), engine(tiny_dir, model, "d")
    split = run_disaggregated(
        engine(tiny_dir, model, "e"),
        prefill,
        decode,
        [Request("a", prompt(processors), SamplingParams(max_tokens=80, temperature=0, grammar=grammar))],
    )
    assert split["a"] == whole.output_token_ids
    assert_pools_full(prefill, decode)


def test_a_continuation_goes_on_where_the_grammar_was(tiny_dir, model, processors):
    """A migrated request: its earlier output is the end of its prompt, and its grammar has seen it."""
    grammar = json_schema_grammar(SCHEMA)
    ids = prompt(processors)
    whole = run(
        engine(tiny_dir, model), Request("w", ids, SamplingParams(max_tokens=80, temperature=0, grammar=grammar))
    )
    k = 5
    rest = run(
        engine(tiny_dir, model),
        Request(
            "c",
            ids + whole.output_token_ids[:k],
            SamplingParams(max_tokens=80 - k, temperature=0, grammar=grammar),
            num_continued_tokens=k,
        ),
    )
    assert whole.output_token_ids[:k] + rest.output_token_ids == whole.output_token_ids


def test_what_a_grammar_cannot_follow_is_refused(tiny_dir, model, processors):
    with pytest.raises(GrammarRejected, match="objectx"):
        json_schema_grammar({"type": "objectx"})
    with pytest.raises(GrammarRejected):
        regex_grammar("(unclosed")
    e = engine(tiny_dir, model)
    off = processors["tiny"].tokenizer(" not json", add_special_tokens=False)["input_ids"]
    ids = prompt(processors)
    with pytest.raises(RequestRejected, match="response_format"):  # its earlier output already breaks the grammar
        e.add_request(
            Request(
                "bad",
                ids + off,
                SamplingParams(max_tokens=8, grammar=json_schema_grammar(SCHEMA)),
                num_continued_tokens=len(off),
            )
        )
    assert_pools_full(e)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_min_tokens_does_not_hold_a_structured_answer_open_past_its_grammar(tiny_dir, model, processors, temperature):
    """A grammar that lets only EOS follow, with min_tokens not reached: masking EOS too left no token at all (greedy
    drew token 0, a sampled draw failed the whole step). The grammar decides where it ends."""
    e = engine(tiny_dir, model)
    plain = run(e, Request("plain", prompt(processors), SamplingParams(max_tokens=12, temperature=temperature, seed=1)))
    r = run(
        e,
        Request(
            "short",
            prompt(processors),
            SamplingParams(
                max_tokens=12, min_tokens=6, temperature=temperature, seed=1, grammar=regex_grammar("yes|no")
            ),
        ),
    )
    assert processors["tiny"].detokenize(r.output_token_ids) in ("yes", "no")
    assert r.status == RequestStatus.FINISHED_STOPPED and plain.status == RequestStatus.FINISHED_LENGTH
    assert_pools_full(e)


def test_structured_requests_preempted_and_recomputed_keep_their_grammar_and_their_tokens(tiny_dir, model, processors):
    """Preemption recomputes prompt + output and samples on from there: the matcher, which saw that output, is
    neither fed it again nor lost."""
    from tests.common.test_preemption import make_engine

    grammar = regex_grammar(r"[a-z ]{60,}")
    ids = prompt(processors)

    def requests():
        return [
            Request(
                f"r{i}", ids + [5 + i], SamplingParams(max_tokens=60, temperature=0, ignore_eos=True, grammar=grammar)
            )
            for i in range(6)
        ]

    roomy = make_engine(tiny_dir, model, kv_blocks=256).generate(requests())
    tight = make_engine(tiny_dir, model, kv_blocks=14)  # six requests of 2 blocks growing to 5: they take turns
    squeezed = requests()
    finals = tight.generate(squeezed)
    assert tight.stats().num_preemptions >= 1 and any(r.recompute_outputs for r in squeezed)
    assert {k: v.output_token_ids for k, v in finals.items()} == {k: v.output_token_ids for k, v in roomy.items()}
    assert all(re.fullmatch(r"[a-z ]{60,}", processors["tiny"].detokenize(v.output_token_ids)) for v in finals.values())
    assert_pools_full(tight)


def test_a_constraint_nothing_satisfies_is_refused_and_one_the_matcher_gives_up_on_ends_as_abort(
    tiny_dir, model, processors
):
    """Not an empty answer reported as a clean stop: refused at admission when no token can start it; ended as
    "abort" when llguidance gives up part-way (a lexer limit), since what came out does not hold to it."""
    e = engine(tiny_dir, model)
    for grammar in (regex_grammar(r"[^\s\S]"), json_schema_grammar({"$ref": "#"})):
        with pytest.raises(RequestRejected, match="no output satisfies"):
            e.add_request(Request("none", prompt(processors), SamplingParams(max_tokens=8, grammar=grammar)))
    r = run(
        e,
        Request(
            "huge",
            prompt(processors),
            SamplingParams(max_tokens=20, temperature=0, grammar=regex_grammar("a{1000000}")),
        ),
    )
    assert r.status == RequestStatus.FINISHED_ABORTED and len(r.output_token_ids) < 20
    assert_pools_full(e)


def test_the_async_engine_builds_a_matcher_off_the_engine_thread_and_refuses_a_bad_one(
    tiny_dir, model, processors, monkeypatch
):
    import asyncio
    import threading

    from common.engine.async_engine import AsyncEngine
    from common.engine.grammar import GrammarMasks

    where = []
    attach = GrammarMasks.attach

    def recording(self, request):
        if request.sampling.grammar is not None and request.grammar_matcher is None:
            where.append(threading.current_thread().name)
        return attach(self, request)

    monkeypatch.setattr(GrammarMasks, "attach", recording)

    async def main():
        e = AsyncEngine(engine(tiny_dir, model))
        try:
            r = Request(
                "ok",
                prompt(processors),
                SamplingParams(max_tokens=40, temperature=0, grammar=json_schema_grammar(SCHEMA)),
            )
            outs = [out async for out in e.generate(r)]
            assert outs[-1].finish_reason == "stop"
            with pytest.raises(RequestRejected, match="no output satisfies"):
                async for _ in e.generate(
                    Request("bad", prompt(processors), SamplingParams(max_tokens=4, grammar=regex_grammar(r"[^\s\S]")))
                ):
                    pass
        finally:
            e.shutdown()

    asyncio.run(main())
    assert len(where) == 2 and "engine" not in where and "MainThread" not in where
