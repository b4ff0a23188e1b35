"""The HTTP API under generated bodies (hypothesis, `api_strategies.py`), on one process and on an `E1+P1+D1` mesh at
once: any body is served or refused with an OpenAI-shaped 4xx, never a 5xx (the tokenizer endpoints too); a request
sent over and over beside them keeps getting the same answer; every page comes back; and the two topologies answer a
served chat with the same tokens. Stage calls sent straight to workers get an answer or a precise gRPC status.

What it found when it was written: a repetition_penalty of 1e-224 overflowed the sampler and failed the engine's whole
step (every request in it got a 500), and temperature / top_p rounded to float32 on the mesh's wire.

The examples are fixed (derandomized) so CI runs the same ones each time. To explore instead:
    EPDMESH_FUZZ_EXAMPLES=3000 EPDMESH_FUZZ_RANDOM=1 make test ARGS="tests/services/test_api_fuzz.py"
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import re
import threading

import grpc
import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from common.model.config import LlavaConfig
from epdmesh.v1 import mesh_pb2 as pb
from epdmesh.v1 import mesh_pb2_grpc as rpc
from tests.services.api_strategies import ENDPOINTS, capped, chat_bodies, stage_call_specs
from tests.services.servers import MODEL, assert_pools_full, running_server

EXAMPLES = int(os.environ.get("EPDMESH_FUZZ_EXAMPLES", "40"))
TOPOLOGIES = ("local", "E1+P1+D1")
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=list(HealthCheck),
    derandomize=not os.environ.get("EPDMESH_FUZZ_RANDOM"),
    print_blob=True,
)
CANARY = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "Tell me about the kitchen window"}],
    "max_tokens": 12,
    "temperature": 0,
}


@pytest.fixture(scope="module")
def servers(tiny_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("fuzz")
    with (
        running_server(tiny_dir, "local", logs / "local.log") as local,
        running_server(tiny_dir, "E1+P1+D1", logs / "mesh.log") as mesh,
        running_server(tiny_dir, "EPD1", logs / "epd.log") as colocated,
        running_server(tiny_dir, "E1+P1+PD1", logs / "multiplexed.log", "--multiplex-max-tokens", "40") as multiplexed,
    ):
        # EPD1: a worker every stage call fits; E1+P1+PD1: prompts up to 40 tokens prefilled on the decoder (path 2)
        yield {"local": local, "E1+P1+D1": mesh, "EPD1": colocated, "E1+P1+PD1": multiplexed}


@contextlib.contextmanager
def canary(base: str):
    """A plain greedy chat sent again and again while the body under test goes in: (status, answer) → times."""
    answers: collections.Counter = collections.Counter()
    stop = threading.Event()

    def loop():
        with httpx.Client(base_url=base, timeout=120) as client:
            while not stop.is_set():
                r = client.post("/v1/chat/completions", json=CANARY)
                answers[
                    (r.status_code, r.json()["choices"][0]["message"]["content"] if r.status_code == 200 else r.text)
                ] += 1

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        yield answers
    finally:
        stop.set()
        thread.join(timeout=120)


def post(client: httpx.Client, path: str, body) -> tuple[int, str]:
    raw = json.dumps(body)  # NaN and Infinity go out as JSON's common extension, as Python clients send them
    headers = {"content-type": "application/json"}
    if isinstance(body, dict) and body.get("stream") is True:
        with client.stream("POST", path, content=raw, headers=headers) as r:
            return r.status_code, "\n".join(r.iter_lines())
    r = client.post(path, content=raw, headers=headers)
    return r.status_code, r.text


def check_answer(status: int, text: str, streamed: bool, responses_api: bool) -> int:
    assert status < 500, f"{status}: {text[:1000]}"
    if status >= 400:
        error = json.loads(text)["error"]
        assert isinstance(error["message"], str) and error["message"] and isinstance(error["type"], str), text[:500]
        return status
    assert status == 200, text[:500]
    if not streamed:
        json.loads(text)
        return status
    events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    if responses_api:  # typed events, the last one the response as it ended; no [DONE]
        types = [json.loads(event)["type"] for event in events]
        assert types and types[-1] in ("response.completed", "response.incomplete"), types
        assert "error" not in types and "response.failed" not in types, types
        return status
    assert events and events[-1] == "[DONE]", text[-500:]
    for event in events[:-1]:
        assert "error" not in json.loads(event), event
    return status


@pytest.mark.parametrize("topology", TOPOLOGIES)
@pytest.mark.parametrize("path", list(ENDPOINTS))
def test_any_body_is_served_or_refused_with_an_openai_4xx_and_nobody_else_notices(servers, topology, path):
    base = servers[topology]
    statuses, refusals = collections.Counter(), collections.Counter()
    with httpx.Client(base_url=base, timeout=120) as client, canary(base) as answers:

        @FUZZ
        @given(ENDPOINTS[path])
        def send(body):
            body = capped(body) if path.startswith("/v1/") else body
            streamed = isinstance(body, dict) and body.get("stream") is True
            status, text = post(client, path, body)
            statuses[check_answer(status, text, streamed, path == "/v1/responses")] += 1
            if status >= 400:
                refusals[json.loads(text)["error"]["message"][:60]] += 1

        send()
    assert statuses[200] >= EXAMPLES // 10, (
        "too few bodies reached the engine to show anything",
        dict(statuses),
        refusals.most_common(8),
    )
    assert len(answers) == 1 and next(iter(answers))[0] == 200, dict(answers)
    assert httpx.get(f"{base}/health", timeout=10).status_code == 200
    assert_pools_full(base)


def answer_of(r: httpx.Response):
    """What must not depend on the topology: status, and the choices' text, tool calls (less their random ids),
    tokens and finish; or the error's message."""
    body = r.json()
    if r.status_code != 200:
        return r.status_code, body["error"]["message"]
    choices = []
    for c in body["choices"]:
        message = c["message"]
        calls = re.sub(r'"call_[0-9a-f]+"', '"call"', json.dumps(message.get("tool_calls")))
        tokens = [t["token"] for t in (c.get("logprobs") or {}).get("content") or []]  # values differ by ~1e-6 with
        choices.append((c["index"], message.get("content"), calls, c["finish_reason"], c.get("token_ids"), tokens))
    usage = body["usage"]  # the batch a request ran in; cached tokens with what each server saw before
    return 200, choices, usage["prompt_tokens"], usage["completion_tokens"]


@pytest.mark.parametrize("mesh", ["E1+P1+D1", "E1+P1+PD1"])
def test_one_process_and_a_mesh_answer_the_same(servers, mesh):
    """Greedy or seeded, the same chat gives the same answer on one process and on a mesh, whether its prefill ran on a
    prefill worker or on the decoder (what the mesh's wire carries is what the client sent)."""
    clients = {t: httpx.Client(base_url=servers[t], timeout=120) for t in ("local", mesh)}
    seen = collections.Counter()

    @FUZZ
    @given(chat_bodies())
    def compare(body):
        body = capped({k: v for k, v in body.items() if k not in ("stream", "stream_options")})
        body.setdefault("seed", 1234)
        raw, headers = json.dumps(body), {"content-type": "application/json"}  # Infinity, as Python's json writes it
        one, split = (
            answer_of(client.post("/v1/chat/completions", content=raw, headers=headers)) for client in clients.values()
        )
        seen[one[0]] += 1
        assert one == split, json.dumps(body)[:2000]

    try:
        compare()
    finally:
        for client in clients.values():
            client.close()
    assert seen[200] >= EXAMPLES // 10, f"too few served chats to compare: {dict(seen)}"
    if mesh == "E1+P1+PD1":  # both paths were taken
        paths = httpx.get(f"{servers[mesh]}/stats", timeout=10).json()["paths"]
        assert paths["multiplexed"] and paths["dedicated"], paths


def test_stage_calls_straight_to_each_worker_are_answered_with_a_precise_status_and_leave_nothing_behind(
    servers, tiny_dir
):
    """Encode, Prefill and Decode of generated requests sent straight to a worker of all three roles, and to the mesh's
    E, P and D whatever their roles: an answer or a precise status (never INTERNAL or UNKNOWN: a bug of ours), the
    workers still serving, and their pools full once the leases the calls made are released."""
    config = LlavaConfig.from_pretrained(str(tiny_dir))
    specs = stage_call_specs(config.image_token_id, config.vision.image_size, config.image_tokens_per_image)
    channels = {}
    for topology in ("EPD1", "E1+P1+D1"):
        for w in httpx.get(f"{servers[topology]}/stats", timeout=10).json()["workers"].values():
            channels[w["roles"]] = grpc.insecure_channel(w["address"])
    assert sorted(channels) == ["D", "E", "EPD", "P"], sorted(channels)
    codes, details = collections.Counter(), collections.Counter()
    calls = iter(range(10**9))

    @FUZZ
    @given(
        specs, st.sampled_from(["encode", "prefill", "decode"]), st.sampled_from(["EPD", "EPD", "EPD", "E", "P", "D"])
    )
    def call(spec, stage, to):
        channel = channels[to]
        spec.request_id = f"{spec.request_id}-{next(calls)}"  # one in use (its pages leased) is refused, rightly
        try:
            if stage == "encode":
                handle = rpc.EncoderStub(channel).Encode(pb.EncodeRequest(request=spec), timeout=60).image_pages
            elif stage == "prefill":
                handle = rpc.PrefillerStub(channel).Prefill(pb.PrefillRequest(request=spec), timeout=60).kv_pages
            else:
                handle = None
                for _ in rpc.DecoderStub(channel).Decode(pb.DecodeRequest(request=spec), timeout=60):
                    pass
            if handle is not None and handle.lease_id:  # as the next stage would once it has the pages
                assert (
                    rpc.WorkerStub(channel)
                    .ReleasePages(pb.ReleasePagesRequest(lease_id=handle.lease_id), timeout=10)
                    .released
                )
            codes["OK"] += 1
        except grpc.RpcError as e:
            assert e.code() not in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN), (
                stage,
                e.details(),
                str(spec)[:1500],
            )
            codes[e.code().name] += 1
            details[e.details()[:50]] += 1

    try:
        call()
        for channel in channels.values():
            rpc.WorkerStub(channel).Stats(pb.StatsRequest(), timeout=10)
    finally:
        for channel in channels.values():
            channel.close()
    assert codes["OK"] >= EXAMPLES // 10 and codes["INVALID_ARGUMENT"] >= EXAMPLES // 10, (
        dict(codes),
        details.most_common(10),
    )
    for topology in ("EPD1", "E1+P1+D1"):
        assert_pools_full(servers[topology])
