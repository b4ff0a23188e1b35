"""Byte-identical outputs across topologies: the same concurrent greedy chats through the HTTP API
(official openai client) give exactly transformers' tokens on every mesh shape, with real processes,
real gRPC, real Redis and real page bytes; afterwards every worker's pools are full again."""

import asyncio
import collections
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch

from tests.services.servers import MODEL, REDIS_URL, assert_pools_full, running_server, streamed_token_ids
from tests.services.test_gateway import to_openai

TOP_LOGPROBS = 2
PENALTIES = dict(presence_penalty=1.0, frequency_penalty=1.0, repetition_penalty=1.5)
LOGIT_BIAS = {500: 6.0}
TOPOLOGIES = {
    "EPD1": ("EPD1", ()),  # colocated: one worker, no pages move; serve starts its own private redis-server
    # encode+prefill together, KV pages move to the decoder — over the gRPC-stream fallback; routed by the
    # toggle's Route rpc (every other shape routes in the gateway)
    "EP1+D1": ("EP1+D1", ("--transfer", "grpc", "--route-in", "toggle")),
    # image pages move to the prefill worker, KV pages back to the encoder's process — by the default backend
    # (NIXL/UCX when installed, as `make test` does); the two workers map one shared copy of the weights
    "ED1+P1": ("ED1+P1", ("--share-weights",)),
    # decoders that prefill too: short prompts prefill on the decoder (no KV moves), long ones on P
    "multiplexed": ("E1+P1+PD1", ("--prefill-mode", "auto", "--multiplex-max-tokens", "300")),
}


async def _ask_all(base, cases):
    client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="none")
    try:
        return await asyncio.gather(
            *(
                client.chat.completions.create(
                    model=MODEL,
                    messages=to_openai(c.conversation),
                    max_tokens=c.max_tokens,
                    temperature=0,
                    logprobs=True,
                    top_logprobs=TOP_LOGPROBS,
                    extra_body={"return_token_ids": True},
                )
                for c in cases
            )
        )
    finally:
        await client.close()


@pytest.fixture(scope="module")
def penalized_reference(tiny_dir, processors, chat_reference):
    """Two chat cases (one with an image) with all three penalties and a logit bias, and transformers' answers."""
    from tests.support import hf_reference

    cases = [chat_reference[0][1], chat_reference[0][6]]  # answers the penalties change ("img-short", "system")
    bias = {(token,): value for token, value in LOGIT_BIAS.items()}
    return cases, hf_reference(tiny_dir, processors["tiny"], cases, torch.float32, sequence_bias=bias, **PENALTIES)


async def _ask_penalized(base, cases):
    client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="none")
    extra = {"return_token_ids": True, "repetition_penalty": PENALTIES["repetition_penalty"]}
    try:
        return await asyncio.gather(
            *(
                client.chat.completions.create(
                    model=MODEL,
                    messages=to_openai(c.conversation),
                    max_tokens=c.max_tokens,
                    temperature=0,
                    presence_penalty=PENALTIES["presence_penalty"],
                    frequency_penalty=PENALTIES["frequency_penalty"],
                    logit_bias={str(t): v for t, v in LOGIT_BIAS.items()},
                    extra_body=extra,
                )
                for c in cases
            )
        )
    finally:
        await client.close()


async def _stream_logprobs(base, case) -> list:
    """The logprobs entries of a streamed answer, chunk by chunk."""
    client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="none")
    try:
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=to_openai(case.conversation),
            max_tokens=case.max_tokens,
            temperature=0,
            stream=True,
            logprobs=True,
            top_logprobs=TOP_LOGPROBS,
        )
        return [
            entry
            async for chunk in stream
            if chunk.choices and chunk.choices[0].logprobs
            for entry in chunk.choices[0].logprobs.content
        ]
    finally:
        await client.close()


def _assert_logprobs_of_reference(entries, ref, label) -> None:
    """OpenAI-form logprobs entries against transformers' logits: one per token, the token's own text and bytes,
    its log-softmax value, and the top alternatives in order (the first is the greedy token itself)."""
    assert len(entries) == len(ref.tokens), label
    for step, (entry, token) in enumerate(zip(entries, ref.tokens)):
        want = torch.log_softmax(ref.logits[step], dim=-1)
        assert abs(entry.logprob - want[token].item()) <= 1e-3, (label, step)
        # a token that holds part of a UTF-8 character has the text U+FFFD but its own raw bytes
        assert entry.bytes == list(entry.token.encode()) or entry.token == "\ufffd", (label, step)
        assert len(entry.top_logprobs) == TOP_LOGPROBS, (label, step)
        assert entry.top_logprobs[0].token == entry.token and abs(entry.top_logprobs[0].logprob - entry.logprob) <= 1e-6
        values = [t.logprob for t in entry.top_logprobs]
        assert (
            values == sorted(values, reverse=True)
            and abs(values[-1] - want.topk(TOP_LOGPROBS).values[-1].item()) <= 1e-3
        )


@pytest.mark.parametrize("name", list(TOPOLOGIES))
def test_topology_gives_the_transformers_tokens(name, tiny_dir, chat_reference, penalized_reference, tmp_path):
    topology, extra = TOPOLOGIES[name]
    cases, refs = chat_reference
    assert len(cases) >= 8 and any(c.conversation for c in cases)
    redis_url = None if name == "EPD1" else REDIS_URL
    with running_server(tiny_dir, topology, tmp_path / "serve.log", *extra, redis_url=redis_url) as base:
        log = (tmp_path / "serve.log").read_text()
        if redis_url is None:
            assert "started a private redis-server" in log
        assert ("routing by the toggle" in log) == ("--route-in" in extra) != ("routing in-process" in log), log[-3000:]
        responses = asyncio.run(_ask_all(base, cases))
        for case, resp in zip(cases, responses):
            assert resp.choices[0].model_extra["token_ids"] == refs[case.name].tokens, (name, case.name)
            assert resp.usage.prompt_tokens == len(refs[case.name].prompt_ids)
            _assert_logprobs_of_reference(resp.choices[0].logprobs.content, refs[case.name], (name, case.name))
        streamed = cases[1]  # an image request: its first token comes from the prefill stage
        _assert_logprobs_of_reference(
            asyncio.run(_stream_logprobs(base, streamed)), refs[streamed.name], (name, "stream")
        )
        penalized, penalized_refs = penalized_reference  # the penalties reach the prefill stage and the decoder
        for case, resp in zip(penalized, asyncio.run(_ask_penalized(base, penalized))):
            assert resp.choices[0].model_extra["token_ids"] == penalized_refs[case.name].tokens, (name, case.name)
        assert all(penalized_refs[c.name].tokens != refs[c.name].tokens for c in penalized)  # they changed the answers
        paths = collections.Counter({k: v for k, v in httpx.get(f"{base}/stats").json()["paths"].items() if v})
        expected = {
            "EPD1": {"colocated"},
            "EP1+D1": {"dedicated"},
            "ED1+P1": {"dedicated"},
            "multiplexed": {"multiplexed", "dedicated"},
        }[name]
        assert set(paths) == expected, paths
        assert sum(paths.values()) == len(cases) + 1 + len(penalized)  # and the streamed and penalized ones
        assert_pools_full(base)


def _parent_pid(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _check_tokens(base, cases, refs) -> None:
    for case, resp in zip(cases, asyncio.run(_ask_all(base, cases))):
        assert resp.choices[0].model_extra["token_ids"] == refs[case.name].tokens, case.name


def test_a_killed_decoder_is_routed_around_then_started_again(tiny_dir, chat_reference, tmp_path):
    cases, refs = chat_reference
    with running_server(tiny_dir, "E1+P1+D2", tmp_path / "serve.log") as base:
        workers = httpx.get(f"{base}/stats").json()["workers"]
        victim = next(w for w in workers.values() if w["roles"] == "D")
        supervisor = _parent_pid(victim["pid"])  # `epdmesh serve`, which deregisters and restarts dead workers
        os.kill(supervisor, signal.SIGSTOP)  # held, so the gateway meets the dead decoder through requests alone
        try:
            os.kill(victim["pid"], signal.SIGKILL)
            # at once, while the registry still lists the dead decoder (its TTL is 3 s)
            _check_tokens(base, cases, refs)
            assert httpx.get(f"{base}/stats").json()["retries"] >= 1  # some went to it and were retried elsewhere
        finally:
            os.kill(supervisor, signal.SIGCONT)
        deadline = time.monotonic() + 15
        while victim["pid"] in {w["pid"] for w in httpx.get(f"{base}/stats").json()["workers"].values()}:
            assert time.monotonic() < deadline, "the registry still lists the dead decoder"
            time.sleep(0.1)
        deadline = time.monotonic() + 120  # serve starts it again after a 1 s backoff
        while (
            len(decoders := [w for w in httpx.get(f"{base}/stats").json()["workers"].values() if w["roles"] == "D"]) < 2
        ):
            assert time.monotonic() < deadline, "the dead decoder was not started again"
            time.sleep(0.3)
        assert victim["pid"] not in {w["pid"] for w in decoders}
        log = (tmp_path / "serve.log").read_text()
        assert "worker D#" in log and "starting it again in 1 s (restart 1 of at most 5" in log, log[-3000:]
        retries = httpx.get(f"{base}/stats").json()["retries"]
        _check_tokens(base, cases, refs)  # the replacement serves: the same tokens, nothing routed to the dead one
        assert httpx.get(f"{base}/stats").json()["retries"] == retries
        assert_pools_full(base)


def _children(pid: int) -> dict[str, int]:
    """`epdmesh serve`'s children by kind (toggle, gateway, redis-server, worker roles) → pid."""
    kids = {}
    for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
        argv = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")
        kind = next((a.decode() for a in argv if a in (b"toggle", b"gateway")), None) or argv[0].decode().split("/")[-1]
        kids[kind] = int(child)
    return kids


def test_a_killed_toggle_and_gateway_are_started_again(tiny_dir, chat_reference, tmp_path):
    cases, refs = chat_reference
    with running_server(tiny_dir, "EPD1", tmp_path / "serve.log") as base:
        worker = next(iter(httpx.get(f"{base}/stats").json()["workers"].values()))
        serve = _parent_pid(worker["pid"])
        for kind in ("toggle", "gateway"):
            os.kill(_children(serve)[kind], signal.SIGKILL)
            deadline = time.monotonic() + 120
            while True:  # the same address answers again, with the worker registered again
                try:
                    if len(httpx.get(f"{base}/stats", timeout=5).json()["workers"]) == 1:
                        break
                except (httpx.HTTPError, ValueError, KeyError):
                    pass
                assert time.monotonic() < deadline, f"the {kind} did not come back"
                time.sleep(0.3)
            _check_tokens(base, cases, refs)
        log = (tmp_path / "serve.log").read_text()
        for kind in ("toggle", "gateway"):
            assert f"{kind} exited with code -9; starting it again in 1 s" in log, log[-3000:]
        assert_pools_full(base)


LONG_STORY = {  # a stream long enough to act on mid-way
    "model": MODEL,
    "messages": [{"role": "user", "content": "Tell a long story about the kitchen"}],
    "max_tokens": 150,
    "temperature": 0,
    "ignore_eos": True,
    "return_token_ids": True,
}


@pytest.mark.parametrize("topology", ["E1+P1+D2", "E1+P1+D1"])  # D1: the stream waits for the restarted decoder
def test_a_decoder_killed_mid_stream_is_replaced_without_duplicates(topology, tiny_dir, tmp_path):
    body = LONG_STORY
    with running_server(tiny_dir, topology, tmp_path / "serve.log", "--prefill-mode", "dedicated") as base:
        whole = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=120).json()["choices"][0]["token_ids"]
        killed = []

        def kill_the_decoder():
            workers = httpx.get(f"{base}/stats").json()["workers"].values()
            killed.append(next(w for w in workers if w["roles"] == "D" and w["running_decode_batch"]))
            os.kill(killed[0]["pid"], signal.SIGKILL)

        streamed = streamed_token_ids(base, body, 20, kill_the_decoder)
        assert streamed == whole  # the stream went on from another decoder: nothing lost, nothing twice
        assert httpx.get(f"{base}/stats").json()["retries"] == 1


def test_serve_without_redis_says_what_to_install(tiny_dir, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    env["PATH"] = str(Path(sys.executable).parent)  # no redis-server on it
    out = subprocess.run(
        [sys.executable, "-m", "epdmesh.cli", "serve", "--model", str(tiny_dir), "--topology", "EPD1", "--port", "0"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode != 0
    assert "REDIS_URL" in out.stderr and "apt-get install redis-server" in out.stderr


def test_slo_routing_with_admission_control_refuses_with_retry_after(tiny_dir, chat_reference, tmp_path):
    cases, refs = chat_reference
    profile = Path(__file__).resolve().parents[2] / "profiles" / "llava-1.5-7b-h20.json"
    with running_server(
        tiny_dir, "E1+P1+PD1", tmp_path / "serve.log", "--latency-profile", str(profile), "--admission-control"
    ) as base:
        case = next(c for c in cases if c.name == "img-short")
        body = {
            "model": MODEL,
            "messages": to_openai(case.conversation),
            "max_tokens": case.max_tokens,
            "temperature": 0,
            "return_token_ids": True,
        }
        ok = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=60)
        assert ok.status_code == 200 and ok.json()["choices"][0]["token_ids"] == refs[case.name].tokens
        # the policy's predicted TTFT is kept beside the measured one (/stats) and their difference is exported
        ((seq, path, predicted, actual, request_id),) = httpx.get(f"{base}/stats").json()["ttft_predictions"]["recent"]
        assert seq == 1 and path in ("dedicated", "multiplexed") and predicted > 0 and actual > 0
        assert request_id == ok.json()["id"]  # a client's request can be matched to its route
        metrics = httpx.get(f"{base}/metrics").text
        assert f'epdmesh:ttft_prediction_error_seconds_count{{model_name="{MODEL}",path="{path}"}} 1.0' in metrics
        refused = httpx.post(f"{base}/v1/chat/completions", json={**body, "slo": {"ttft_ms": 1}}, timeout=60)
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        assert "within its SLO" in refused.json()["error"]["message"]
        assert len(httpx.get(f"{base}/stats").json()["ttft_predictions"]["recent"]) == 1  # a refused request has none
        assert_pools_full(base)
