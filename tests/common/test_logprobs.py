"""Log-probabilities the engine reports are those of transformers' own logits, for every generated token."""

import dataclasses
from pathlib import Path

import pytest
import torch

from common.engine.config import EngineConfig
from common.engine.emulated import EmulatedEngine
from common.engine.engine import Engine, RequestRejected
from common.latency import LatencyProfile
from common.request import Request
from common.sampling import MAX_LOGPROBS, SamplingParams
from common.scheduler import SchedulerConfig
from tests.support import build_requests, hf_reference, mixed_cases

CASES = mixed_cases()[:6]
TOP = 3
TOLERANCE = 1e-3  # fp32 logits of two implementations (the parity tests allow the same)


def _run(engine: Engine, requests: list[Request]) -> dict[str, list]:
    logprobs: dict[str, list] = {r.request_id: [] for r in requests}
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    for r in requests:
        engine.add_request(r)
    while engine.has_unfinished:
        for out in engine.step():
            assert out.logprobs is not None and len(out.logprobs) == len(out.new_token_ids)
            logprobs[out.request_id] += out.logprobs
            tokens[out.request_id] += out.new_token_ids
    for rid in tokens:
        assert [lp.token_id for lp in logprobs[rid]] == tokens[rid]
    return logprobs


def test_logprobs_and_top_logprobs_are_those_of_transformers_logits(tiny_dir, processors):
    refs = hf_reference(tiny_dir, processors["tiny"], CASES, torch.float32)
    engine = Engine(
        EngineConfig(
            model=str(tiny_dir),
            dtype="float32",
            kv_cache_gib=0.05,
            image_cache_gib=0.02,
            scheduler=SchedulerConfig(token_budget=64, enable_chunked_prefill=True),
        )
    )
    requests = build_requests(processors["tiny"], CASES)
    for r in requests:
        r.sampling = dataclasses.replace(r.sampling, logprobs=TOP)
    got = _run(engine, requests)
    checked_top = 0
    for case in CASES:
        ref = refs[case.name]
        assert [lp.token_id for lp in got[case.name]] == ref.tokens, case.name
        for step, lp in enumerate(got[case.name]):
            want = torch.log_softmax(ref.logits[step], dim=-1)
            assert abs(lp.logprob - want[lp.token_id].item()) <= TOLERANCE, (case.name, step)
            assert len(lp.top) == TOP and lp.top[0][0] == lp.token_id  # greedy: the sampled token is the top one
            values, ids = want.topk(TOP + 1)
            for rank, (token, value) in enumerate(lp.top):
                assert abs(value - values[rank].item()) <= TOLERANCE, (case.name, step, rank)
                if values[rank] - values[rank + 1] > 2 * TOLERANCE and (
                    rank == 0 or values[rank - 1] - values[rank] > 2 * TOLERANCE
                ):
                    assert token == ids[rank].item(), (case.name, step, rank)  # unambiguous ranks: same token
                    checked_top += 1
            assert [v for _, v in lp.top] == sorted((v for _, v in lp.top), reverse=True)
    assert checked_top > 100  # the ids were compared, not only skipped as near-ties


def test_sampled_tokens_report_their_raw_logprob_and_requests_without_logprobs_get_none(tiny_dir, processors):
    engine = Engine(EngineConfig(model=str(tiny_dir), dtype="float32", kv_cache_gib=0.05, image_cache_gib=0.02))
    (sampled, plain) = build_requests(processors["tiny"], CASES[1:3])
    sampled.sampling = SamplingParams(max_tokens=6, temperature=1.5, top_k=5, seed=7, logprobs=0)
    engine.add_request(sampled)
    engine.add_request(plain)
    seen = {sampled.request_id: [], plain.request_id: []}
    while engine.has_unfinished:
        for out in engine.step():
            seen[out.request_id].append(out.logprobs)
    assert all(lps is None for lps in seen[plain.request_id])
    flat = [lp for lps in seen[sampled.request_id] for lp in lps]
    assert [lp.token_id for lp in flat] == sampled.output_token_ids and len(flat) == 6
    assert all(lp.top == () and lp.logprob <= 0.0 for lp in flat)


def test_logprobs_are_refused_where_they_cannot_be_given(emulated_dir):
    with pytest.raises(ValueError, match="top_logprobs must be between 0 and 20"):
        SamplingParams(logprobs=MAX_LOGPROBS + 1)
    profile = LatencyProfile.load(Path(__file__).resolve().parents[2] / "profiles" / "llava-1.5-7b-h20.json")
    engine = EmulatedEngine(
        EngineConfig(model=str(emulated_dir), dtype="float32", kv_cache_gib=0.05, image_cache_gib=0.02), profile
    )
    with pytest.raises(RequestRejected, match="logprobs are not available on this backend"):
        engine.add_request(Request("r", [1, 2, 3], SamplingParams(max_tokens=2, logprobs=1)))


def test_a_tokens_bytes_are_its_raw_bytes_even_when_its_text_is_part_of_a_character(tiny_dir):
    """OpenAI's `bytes` exist so a client can join tokens that split a UTF-8 character; their text alone is
    U+FFFD. Byte-level BPE (the default checkpoint) and SentencePiece with byte fallback (Llama's)."""
    from transformers import PreTrainedTokenizerFast

    from common.model.processor import ChatProcessor
    from tests.common.test_detokenizer import _llama_style

    text = "é日本 naïve 😀"
    processor = ChatProcessor(tiny_dir)
    ids = processor.tokenizer(text, add_special_tokens=False)["input_ids"]
    entries = [processor.token_text(i) for i in ids]
    assert any(t == "\ufffd" for t, _ in entries)  # some tokens are parts of a character
    assert b"".join(raw for _, raw in entries) == text.encode()
    eos = processor.tokenizer.eos_token_id
    assert processor.token_text(eos) == (processor.tokenizer.eos_token, processor.tokenizer.eos_token.encode())

    llama = ChatProcessor.__new__(ChatProcessor)
    llama.tokenizer = PreTrainedTokenizerFast(tokenizer_object=_llama_style(), eos_token="</s>", bos_token="<s>")
    unseen = "naïve 漢字ß"  # characters its training text lacked: byte-fallback pieces
    ids = llama.tokenizer(unseen, add_special_tokens=False)["input_ids"]
    pieces = llama.tokenizer.convert_ids_to_tokens(ids)
    assert any(p.startswith("<0x") for p in pieces) and any("▁" in p for p in pieces)
    assert b"".join(llama.token_text(i)[1] for i in ids) == (" " + unseen).encode()  # "▁" prepended: a space
