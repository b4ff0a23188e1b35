"""A decoder whose KV cache runs out, in a real mesh: it preempts, and no client sees anything but its answer.

Two long greedy chats meet a decoder with room for 40 blocks (640 tokens) when they need 59 at the end. The
request that reached the decoder last — the image request, which went through the encoder first — is preempted;
its image came to the decoder as KV pages, so it is handed back, and the gateway continues it (prompt + the
tokens it had, re-encoded and prefilled again) once room comes back. Both answers are the in-process engine's.
"""

import asyncio

import openai
import pytest
import torch

from common.engine.config import EngineConfig
from common.engine.engine import Engine
from common.model.loader import load_model
from common.paged_cache import PagedKVCache
from common.request import Request
from tests.services.servers import MODEL, assert_pools_full, pools, running_server
from tests.services.test_gateway import to_openai
from tests.support import build_requests, mixed_cases

KV_BLOCKS = 40
LONG = {"system": 500, "img-short": 300}  # max_tokens (EOS ignored): 537 and 569 tokens at the end, 59 blocks together


@pytest.fixture(scope="module")
def long_cases(tiny_dir, processors):
    """The two chats, and their answers from one roomy in-process engine (the parity-tested path)."""
    import dataclasses

    cases = [dataclasses.replace(c, max_tokens=LONG[c.name]) for c in mixed_cases() if c.name in LONG]
    engine = Engine(EngineConfig(model=str(tiny_dir), kv_cache_gib=0.05), model=load_model(tiny_dir, torch.float32))
    requests = [
        Request(r.request_id, r.prompt_token_ids, dataclasses.replace(r.sampling, ignore_eos=True), r.images)
        for r in build_requests(processors["tiny"], cases)
    ]
    return cases, {rid: out.output_token_ids for rid, out in engine.generate(requests).items()}


async def _ask(base, cases):
    client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="none")
    try:
        return await asyncio.gather(
            *(
                client.chat.completions.create(
                    model=MODEL,
                    messages=to_openai(c.conversation),
                    max_tokens=c.max_tokens,
                    temperature=0,
                    extra_body={"return_token_ids": True, "ignore_eos": True},
                )
                for c in cases
            )
        )
    finally:
        await client.close()


def test_a_decoder_out_of_kv_hands_back_the_image_request_and_both_answers_are_whole(tiny_dir, long_cases, tmp_path):
    cases, answers = long_cases
    per_block = PagedKVCache.bytes_per_block(16, 6, 2, 32, torch.float32)  # the tiny checkpoint's KV pages
    log = tmp_path / "serve.log"
    with running_server(
        tiny_dir,
        "E1+P1+D1",
        log,
        "--kv-cache-gib",
        repr(KV_BLOCKS * per_block / 2**30),
        "--reserved-output-tokens",
        "0",
    ) as base:
        assert {p["roles"]: p["kv_blocks_total"] for p in pools(base)}["D"] == KV_BLOCKS
        responses = asyncio.run(_ask(base, cases))
        for case, resp in zip(cases, responses):
            assert resp.choices[0].model_extra["token_ids"] == answers[case.name], case.name
            assert resp.choices[0].finish_reason == "length" and resp.usage.completion_tokens == LONG[case.name]
        decoder = next(p for p in pools(base) if p["roles"] == "D")
        assert decoder["num_preemptions"] >= 1
        assert _metric(base, "epdmesh:request_hand_backs_total") >= 1
        assert_pools_full(base)
    text = log.read_text()
    assert "preempted it after" in text and "handed it back" in text, text[-3000:]


def test_requests_the_decoders_have_no_room_for_yet_wait_for_it_and_are_served(tiny_dir, long_cases, tmp_path):
    """With the default room (prompt + 256 output tokens) the two chats do not fit the decoder's 640 tokens at once:
    the one handed over second waits at the decoder for room, its pages on the prefill worker (the route booked only
    the prefill worker's room), and goes on when the first has finished — it neither gets a 503 to retry, nor is
    preempted and handed back, nor waits for a 'dead' decoder — and both answers are whole."""
    cases, answers = long_cases
    per_block = PagedKVCache.bytes_per_block(16, 6, 2, 32, torch.float32)
    log = tmp_path / "serve.log"
    with running_server(tiny_dir, "E1+P1+D1", log, "--kv-cache-gib", repr(KV_BLOCKS * per_block / 2**30)) as base:
        responses = asyncio.run(_ask(base, cases))
        for case, resp in zip(cases, responses):
            assert resp.choices[0].model_extra["token_ids"] == answers[case.name], case.name
        assert_pools_full(base)
        assert _metric(base, "epdmesh:num_requests_waiting_for_room") == 0  # the gauge went back down
    text = log.read_text()
    assert "for room here: no free KV blocks for the handed-over KV pages and the first output tokens" in text
    assert "take over" not in text and "handed it back" not in text, text[-3000:]


def _metric(base, name: str) -> float:
    """The gateway's Prometheus sample `name` (its one series)."""
    import httpx

    lines = [line for line in httpx.get(f"{base}/metrics").text.splitlines() if line.startswith(name + "{")]
    assert len(lines) == 1, lines
    return float(lines[0].rsplit(" ", 1)[1])
