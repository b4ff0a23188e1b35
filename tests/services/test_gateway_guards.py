"""What the gateway does with what a user's black-box test broke it with: a bug of ours is an OpenAI 500 that is
counted and ends the request's gauge, text that cannot fit is refused before tokenizing, /health names a missing
role, and a request whose only worker of a role died waits for its replacement instead of failing."""

import asyncio
import io
import json
import time

import pybase64
import pytest
from PIL import Image
from starlette.testclient import TestClient

from common.policy.routing import PrefillPath, RoutePlan, RouteSummary, RoutingConfig
from common.request import Stage
from common.sampling import SamplingParams
from common.telemetry.metrics import GatewayMetrics
from common.workers import WorkerInfo, WorkerLoad, WorkerSnapshot
from epdmesh.v1 import mesh_pb2 as pb
from services import wire
from services.failure import Reason
from services.gateway.app import NORMALIZATION_SLACK, build_app
from services.gateway.errors import ApiError
from services.gateway.mesh import MeshBackend
from services.gateway.mesh import route_client as route_module
from services.gateway.mesh.outcome import StageError
from services.gateway.mesh.status import MeshStatus
from services.gateway.protocol import parse_chat_request
from services.routing.book import NoRoute, why_no_route

MODEL = "m"


class Processor:
    max_token_chars = 4

    def __init__(self):
        self.applied = 0

    def apply(self, conversation, finish_pixels=True, **template):
        self.applied += 1
        return [1, 2, 3], []

    def detokenize(self, ids):
        return ""


class Backend:
    """A backend whose start fails as a bug would (not an ApiError)."""

    max_model_len = 100

    def __init__(self):
        self.processor = Processor()

    async def start(self, chat, request_id, span=None):
        raise RuntimeError("something of ours broke")


def _post(client, content: str, **extra):
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], **extra}
    return client.post("/v1/chat/completions", content=json.dumps(body))


@pytest.fixture()
def app():
    metrics = GatewayMetrics(MODEL, ttft_slo_s=1, tbt_slo_s=1)
    backend = Backend()
    with TestClient(build_app(backend, MODEL, metrics=metrics)) as client:
        yield client, metrics, backend


def _sample(metrics, name, **labels):
    return metrics.registry.get_sample_value(f"epdmesh:{name}", {"model_name": MODEL, **labels}) or 0.0


def test_a_bug_before_the_first_token_is_an_openai_500_counted_and_not_left_running(app):
    client, metrics, _ = app
    for stream in (False, True):
        resp = _post(client, "hi", stream=stream)
        assert resp.status_code == 500
        error = resp.json()["error"]
        assert error["code"] == 500 and "internal error (RuntimeError: something of ours broke)" in error["message"]
    assert _sample(metrics, "request_errors_total", status="500") == 2
    assert _sample(metrics, "num_requests_running") == 0  # the gauge leaked one per such request before
    assert _post(client, "hi", seed=2**70).status_code == 400  # and the server still answers


def test_text_that_cannot_fit_is_refused_without_tokenizing(app):
    client, _, backend = app
    limit = Backend.max_model_len * Processor.max_token_chars * NORMALIZATION_SLACK
    resp = _post(client, "a" * (limit + 1))
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "messages"
    assert f"hold {limit + 1} characters of text" in resp.json()["error"]["message"]
    assert backend.processor.applied == 0
    assert _post(client, "a" * limit).status_code == 500  # at the limit it goes on (to the failing backend)


def _image_uri(width: int, height: int) -> str:
    buf = io.BytesIO()
    Image.new("RGB", (width, height), (10, 20, 30)).save(buf, format="PNG")
    return "data:image/png;base64," + pybase64.b64encode(buf.getvalue()).decode()


def _parse(**extra):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **extra}
    return parse_chat_request(json.dumps(body).encode(), [MODEL])


def _parse_image(width: int, height: int):
    content = [{"type": "image_url", "image_url": {"url": _image_uri(width, height)}}, {"type": "text", "text": "?"}]
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}]}
    return parse_chat_request(json.dumps(body).encode(), [MODEL])


def test_an_image_of_extreme_aspect_ratio_is_refused_before_the_processor_sees_it():
    for width, height in ((1, 16000), (16000, 1), (2, 401)):
        with pytest.raises(ApiError) as err:
            _parse_image(width, height)
        assert err.value.status == 400 and "longer than 200:1" in err.value.message, (width, height)
    assert _parse_image(2, 400).num_images == 1 and _parse_image(400, 2).num_images == 1


def test_an_image_of_too_many_pixels_is_a_413_naming_the_limit_however_far_over_it_is():
    """A 20000x20000 one-bit PNG is 49 KB; PIL refuses to open it at all (over twice its own limit), which was a 400
    quoting PIL's limit, while a 60-megapixel one was a 413 naming ours."""
    for img in (Image.new("1", (20000, 20000)), Image.new("L", (10000, 6000))):
        buf = io.BytesIO()
        img.save(buf, "PNG")
        content = [
            {
                "type": "image_url",
                "image_url": {"url": "data:image/png;base64," + pybase64.b64encode(buf.getvalue()).decode()},
            }
        ]
        with pytest.raises(ApiError) as err:
            parse_chat_request(
                json.dumps({"model": MODEL, "messages": [{"role": "user", "content": content}]}).encode(), [MODEL]
            )
        assert err.value.status == 413 and "over 50000000 pixels" in err.value.message, err.value.message


def test_seeds_beyond_64_bits_and_negative_top_k_are_400s_naming_the_parameter():
    assert _parse(seed=2**63 - 1).sampling.seed == 2**63 - 1 and _parse(seed=-(2**63)).sampling.seed == -(2**63)
    for extra, param in (
        ({"seed": 2**63}, "seed"),
        ({"seed": -(2**63) - 1}, "seed"),
        ({"seed": 2**70}, "seed"),
        ({"top_k": -5}, "top_k"),
        ({"top_p": 0}, "top_p"),
        ({"temperature": -1}, "temperature"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"presence_penalty": 3}, "presence_penalty"),
    ):
        with pytest.raises(ApiError) as err:
            _parse(**extra)
        assert err.value.status == 400 and err.value.param == param, extra
    assert _parse(top_k=-1).sampling.top_k == 0 and _parse(top_k=0).sampling.top_k == 0


def test_the_widest_seeds_min_tokens_and_min_p_cross_the_wire():
    for params in (
        SamplingParams(seed=2**63 - 1),
        SamplingParams(seed=-(2**63)),
        SamplingParams(max_tokens=20, min_tokens=7, min_p=0.125, stop_token_ids=(9,)),
    ):
        assert wire.sampling_from_pb(wire.sampling_to_pb(params)) == params


def test_the_values_a_client_sent_cross_the_wire_unrounded():
    """temperature and top_p were float32 on the wire: 0.9 sampled as 0.8999999762 in a mesh and as 0.9 in one process,
    and a top_p of 1e-300, which the gateway accepts, arrived as 0 and was refused by the worker (fuzzing found it)."""
    for params in (
        SamplingParams(temperature=0.7, top_p=0.9),
        SamplingParams(top_p=1e-300, temperature=5e-324),
        SamplingParams(temperature=1.0000001, top_p=0.30000000000000004),
    ):
        assert wire.sampling_from_pb(wire.sampling_to_pb(params)) == params
    summary = RouteSummary("r", 10, 0, 4, ttft_slo_ms=1e-300, tbt_slo_ms=0.1)
    back = wire.summary_from_pb(wire.summary_to_pb(summary))
    assert (back.ttft_slo_ms, back.tbt_slo_ms) == (1e-300, 0.1)


def test_min_tokens_and_min_p_are_vllms_and_checked():
    sampling = _parse(max_tokens=20, min_tokens=5, min_p=0.1).sampling
    assert (sampling.min_tokens, sampling.min_p) == (5, 0.1) and sampling.adjusts_logits
    assert _parse().sampling.min_tokens == 0 and _parse().sampling.min_p == 0.0
    for extra, param in (
        ({"max_tokens": 4, "min_tokens": 5}, "min_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_p": 1.5}, "min_p"),
        ({"min_p": -0.1}, "min_p"),
        ({"min_p": "a"}, "min_p"),
    ):
        with pytest.raises(ApiError) as err:
            _parse(**extra)
        assert err.value.status == 400 and err.value.param == param, extra


# ----- /health over the registry -----


class Toggle:
    def __init__(self, entries):
        self.entries = entries

    async def ListWorkers(self, request, timeout=None):
        return pb.ListWorkersResponse(workers=self.entries)


def _entry(worker_id: str, roles, age_s: float = 0.1) -> pb.WorkerEntry:
    info = WorkerInfo(worker_id, "127.0.0.1:1", frozenset(roles), MODEL, 100)
    return pb.WorkerEntry(info=wire.info_to_pb(info), age_s=age_s)


class Routes:
    def __init__(self, entries):
        self.toggle = Toggle(entries)


def _health(*entries) -> dict:
    return asyncio.run(MeshStatus(Routes(list(entries)), None).health())


def test_health_needs_live_workers_covering_prefill_and_decode_and_says_which_role_is_missing():
    e, p, d = _entry("e", {Stage.ENCODE}), _entry("p", {Stage.PREFILL}), _entry("d", {Stage.DECODE})
    assert _health(e, p, d) == {"status": "ok", "workers": 3, "silent_workers": 0}
    dead_d = _entry("d", {Stage.DECODE}, age_s=3.5)  # killed 3.5 s ago: still registered, routing gave up on it
    body = _health(e, p, dead_d)
    assert (
        body["status"] == "error"
        and body["reason"] == "no live worker has the decode role"
        and body["silent_workers"] == 1
    )
    assert _health(p)["reason"] == "no live worker has the decode role" and "prefill or decode" in _health(e)["reason"]
    assert _health(p, d)["status"] == "degraded" and "images fail" in _health(p, d)["reason"]
    assert _health(_entry("epd", {Stage.ENCODE, Stage.PREFILL, Stage.DECODE}))["status"] == "ok"


def test_no_route_message_lists_only_workers_the_request_could_use():
    def snap(worker_id, roles, age_s=0.1):
        return WorkerSnapshot(WorkerInfo(worker_id, "a", frozenset(roles), MODEL, 100), WorkerLoad(), age_s)

    workers = [
        snap("e", {Stage.ENCODE}),
        snap("p", {Stage.PREFILL}),
        snap("d-1", {Stage.DECODE}),
        snap("d-2", {Stage.DECODE}, age_s=9),
    ]
    summary = RouteSummary("r", 5, 1, 4, frozenset({"d-1"}))
    why = why_no_route(workers, summary, RoutingConfig().max_heartbeat_age_s)
    assert "live workers have roles ['E', 'P']" in why and "left out: d-1, d-2" in why, why


# ----- failover waits for a replacement -----


class Router:
    """Routes nowhere until `ready_after` routes were asked for (a worker registering meanwhile)."""

    def __init__(self, ready_after: int, busy: bool = False, refused: bool = False):
        self.ready_after, self.calls, self.invalidated, self.busy, self.refused = ready_after, 0, 0, busy, refused

    async def refresh_forever(self):
        await asyncio.Event().wait()

    def invalidate(self):
        self.invalidated += 1

    async def route(self, summary):
        self.calls += 1
        if self.calls <= self.ready_after and self.refused:
            raise NoRoute("no worker can serve this request within its SLO", Reason.REFUSED)
        if self.calls <= self.ready_after and self.busy:
            raise NoRoute("every decoder is full", Reason.NO_ROOM)
        if self.calls <= self.ready_after:
            raise NoRoute("no live worker set covers a prefill and a decode role", Reason.NO_WORKER)
        return RoutePlan(None, _worker("x"), _worker("x"), PrefillPath.COLOCATED)


def _worker(worker_id):
    return WorkerSnapshot(WorkerInfo(worker_id, "127.0.0.1:1", frozenset(Stage), MODEL, 100), WorkerLoad(), 0.0)


def _reroute(router, wait_s: float, monkeypatch, wait_for_worker: bool = True):
    """The plan `reroute` comes back with, or the client's error its StageError becomes."""
    monkeypatch.setattr(route_module, "FAILOVER_WAIT_S", wait_s)
    monkeypatch.setattr(route_module, "ROOM_WAIT_S", wait_s)
    monkeypatch.setattr(route_module, "FAILOVER_POLL_S", 0.01)
    backend = MeshBackend(Processor(), "127.0.0.1:1", 100, router=router)
    summary = RouteSummary("r", 5, 0, 4, frozenset({"dead"}))

    async def go():
        try:
            return (await backend.routes.reroute(lambda: summary, None, 2, wait_for_worker)).plan
        except StageError as e:
            raise e.api_error() from None
        finally:
            backend.routes._refresher.cancel()

    return asyncio.run(go())


def test_a_request_whose_worker_died_waits_for_one_to_register(monkeypatch):
    router = Router(ready_after=3)
    plan = _reroute(router, 5.0, monkeypatch)
    assert plan.decoder.worker_id == "x" and router.calls == 4


def test_a_request_waits_for_room_as_a_queued_one_but_not_out_a_refusal_or_for_a_missing_worker_when_new(monkeypatch):
    """Every decoder full: a request waits for room (bounded), new or under way, rather than get 503s to retry;
    admission control's refusal (no path meets its SLO) is answered at once; a new request does not wait for a worker
    of a role none is left of (one under way does: test above)."""
    router = Router(ready_after=3, busy=True)
    plan = _reroute(router, 5.0, monkeypatch, wait_for_worker=False)
    assert plan.decoder.worker_id == "x" and router.calls == 4
    router = Router(ready_after=10**6, busy=True)
    with pytest.raises(ApiError) as err:
        _reroute(router, 0.1, monkeypatch)  # the wait for room is bounded
    assert err.value.status == 503 and router.calls >= 2
    router = Router(ready_after=3, refused=True)
    with pytest.raises(ApiError) as err:
        _reroute(router, 5.0, monkeypatch)
    assert err.value.status == 503 and err.value.headers == {"Retry-After": "1"} and router.calls == 1
    router = Router(ready_after=3)
    with pytest.raises(ApiError) as err:
        _reroute(router, 5.0, monkeypatch, wait_for_worker=False)
    assert "routing is unavailable" in err.value.message and router.calls == 1


def test_the_wait_for_a_replacement_is_bounded(monkeypatch):
    router = Router(ready_after=10**6)
    start = time.monotonic()
    with pytest.raises(ApiError) as err:
        _reroute(router, 0.1, monkeypatch)
    assert err.value.status == 503 and "routing is unavailable" in err.value.message
    assert 0.1 <= time.monotonic() - start < 5 and router.calls >= 2


def test_a_body_that_is_not_utf8_and_a_model_that_is_not_a_string_are_named_as_such():
    with pytest.raises(ApiError) as err:
        parse_chat_request('{"model": "m", "messages": []}'.encode("utf-16"), [MODEL])
    assert err.value.status == 400 and "must be UTF-8 encoded JSON" in err.value.message
    with pytest.raises(ApiError) as err:
        parse_chat_request(json.dumps({"model": 5, "messages": []}).encode(), [MODEL])
    assert err.value.param == "model" and "'model' must be a string, got int" in err.value.message


def test_parameters_this_server_does_not_implement_are_refused_unless_neutral_and_unknown_ones_logged_once(caplog):
    from services.gateway import fields

    for extra in (
        {"use_beam_search": True},
        {"best_of": 3},
        {"guided_grammar": 'root ::= "a"'},
        {"skip_special_tokens": False},
        {"include_stop_str_in_output": True},
        {"prompt_logprobs": 1},
        {"functions": [{"name": "f"}]},
        {"modalities": ["text", "audio"]},
    ):
        with pytest.raises(ApiError) as err:
            _parse(**extra)
        (key,) = extra
        assert err.value.status == 400 and err.value.param == key and "not supported" in err.value.message, extra
    fields._warned.discard("frobnicate")
    with caplog.at_level("WARNING", logger="services.gateway.fields"):
        _parse(best_of=1, skip_special_tokens=True, user="u-1", metadata={"a": "b"}, modalities=["text"], frobnicate=2)
        _parse(frobnicate=3)
    warned = [r.getMessage() for r in caplog.records if "ignored" in r.getMessage()]
    assert warned == ["request fields ignored (not OpenAI's or this server's): frobnicate"]


class Streaming(Backend):
    """Each request streams `tokens` one at a time; the id says which choice (…-i) it is."""

    tokens = 4

    def __init__(self):
        super().__init__()
        self.closed: list[str] = []

    def detokenize(self, ids):
        return " ".join(map(str, ids))

    async def start(self, chat, request_id, span=None):
        from common.engine.outputs import RequestOutput
        from common.request import RequestStatus

        async def outputs():
            try:
                for n in range(1, self.tokens + 1):
                    await asyncio.sleep(0.001)
                    done = n == self.tokens
                    yield RequestOutput(
                        request_id,
                        [n],
                        list(range(1, n + 1)),
                        RequestStatus.FINISHED_LENGTH if done else RequestStatus.DECODING,
                        "length" if done else None,
                    )
            finally:
                self.closed.append(request_id)

        return 7, outputs()


def test_n_choices_count_as_sequences_in_the_metrics_and_the_request_ends_once():
    metrics = GatewayMetrics(MODEL, ttft_slo_s=1, tbt_slo_s=1)
    backend = Streaming()
    with TestClient(build_app(backend, MODEL, metrics=metrics)) as client:
        whole = _post(client, "hi", n=3, max_tokens=4).json()
        events = [
            line
            for line in _post(
                client, "hi", n=3, max_tokens=4, stream=True, stream_options={"include_usage": True}
            ).text.splitlines()
            if line
        ]
    assert [c["index"] for c in whole["choices"]] == [0, 1, 2]
    assert whole["usage"] == {
        "prompt_tokens": 7,
        "completion_tokens": 12,
        "total_tokens": 19,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    chunks = [json.loads(e[6:]) for e in events if e != "data: [DONE]"]
    assert sorted(c["choices"][0]["index"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]) == [
        0,
        1,
        2,
    ]
    assert chunks[-1]["usage"]["completion_tokens"] == 12 and events[-1] == "data: [DONE]"
    assert _sample(metrics, "request_success_total", finished_reason="length") == 6  # one per choice
    assert _sample(metrics, "generation_tokens_total") == 24 and _sample(metrics, "num_requests_running") == 0
    assert sorted(rid.rsplit("-", 1)[1] for rid in backend.closed) == [
        "0",
        "0",
        "1",
        "1",
        "2",
        "2",
    ]  # every choice ran out


def test_a_request_routes_around_the_run_of_a_worker_that_failed_it_not_a_restart_under_the_same_id():
    """docker compose gives workers fixed ids (and a fixed port fixes the default one): a decoder restarted after
    failing a request registers under the same id, and the request waiting for it must be able to use it."""
    from common.policy.routing import route

    def snap(worker_id, roles, instance):
        return WorkerSnapshot(
            WorkerInfo(worker_id, "127.0.0.1:1", frozenset(roles), MODEL, 100, instance=instance), WorkerLoad(), 0.1
        )

    prefill = snap("prefill", {Stage.PREFILL}, "p1")
    dead, restarted = snap("decoder", {Stage.DECODE}, "run1"), snap("decoder", {Stage.DECODE}, "run2")
    failed = RouteSummary("r", 5, 0, 4, frozenset({dead.info.registration}))
    assert dead.info.registration == "decoder#run1"
    assert route([prefill, dead], failed, RoutingConfig()) is None
    plan = route([prefill, restarted], failed, RoutingConfig())
    assert plan is not None and plan.decoder.info.instance == "run2"
    full = RouteSummary("r", 5, 0, 4, frozenset({"decoder"}))  # no KV room there (a reservation): any run of it
    assert route([prefill, restarted], full, RoutingConfig()) is None
    decoder = wire.plan_from_pb(wire.plan_to_pb(plan)).decoder  # as the gateway gets it from the toggle
    assert (
        decoder.info.registration == "decoder#run2"
        and wire.info_from_pb(wire.info_to_pb(restarted.info)) == restarted.info
    )


def test_body_guards_bom_content_length_and_a_chunked_body_over_the_limit(app, monkeypatch):
    from services.gateway import app as app_module

    client, metrics, _ = app
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}).encode()
    assert (
        client.post("/v1/chat/completions", content=b"\xef\xbb\xbf" + body).status_code == 500
    )  # parsed: on to the backend
    resp = client.post("/v1/chat/completions", content=body, headers={"content-length": "many"})
    assert resp.status_code == 400 and "Content-Length" in resp.json()["error"]["message"]
    monkeypatch.setattr(app_module, "MAX_BODY_BYTES", 1000)
    resp = client.post("/v1/chat/completions", content=iter([body, b" " * 2000]))  # chunked: no Content-Length
    assert resp.status_code == 413 and _sample(metrics, "num_requests_running") == 0


def test_a_left_out_max_tokens_is_the_rest_of_the_context_and_images_that_cannot_fit_are_refused_early():
    assert not _parse().max_tokens_given and _parse().sampling_for(100, 1000).max_tokens == 900  # as vLLM
    assert _parse(min_tokens=40).sampling_for(990, 1000).max_tokens == 40  # never below min_tokens
    assert _parse(max_tokens=5).sampling_for(100, 1000).max_tokens == 5
    assert _parse(max_completion_tokens=7, max_tokens=5).sampling_for(100, 1000).max_tokens == 7

    class Config:
        image_tokens_per_image = 576

    backend = Backend()
    backend.max_model_len = 1200
    backend.processor.config = Config()
    with TestClient(build_app(backend, MODEL, metrics=GatewayMetrics(MODEL, ttft_slo_s=1, tbt_slo_s=1))) as client:
        part = {"type": "image_url", "image_url": {"url": _image_uri(8, 8)}}
        body = {"model": MODEL, "messages": [{"role": "user", "content": [part] * 3}]}
        resp = client.post("/v1/chat/completions", content=json.dumps(body))
        assert resp.status_code == 400 and "3 images take 1728 tokens" in resp.json()["error"]["message"]
        body["messages"][0]["content"] = [part] * 2
        assert (
            client.post("/v1/chat/completions", content=json.dumps(body)).status_code == 500
        )  # fits: on to the backend


class FailsMidStream(Streaming):
    async def start(self, chat, request_id, span=None):
        num_prompt, outputs = await super().start(chat, request_id, span)

        async def broken():
            async for out in outputs:
                yield out
                raise KeyError("a bug of ours")

        return num_prompt, broken()


def test_a_bug_of_ours_mid_stream_ends_the_stream_with_an_error_event_and_done():
    metrics = GatewayMetrics(MODEL, ttft_slo_s=1, tbt_slo_s=1)
    with TestClient(build_app(FailsMidStream(), MODEL, metrics=metrics)) as client:
        lines = [line for line in _post(client, "hi", stream=True).text.splitlines() if line]
    assert lines[-1] == "data: [DONE]" and '"code": 500' in lines[-2] and "KeyError" in lines[-2]
    assert _sample(metrics, "request_errors_total", status="500") == 1 and _sample(metrics, "num_requests_running") == 0


def test_a_request_no_decoder_could_ever_hold_is_a_400_not_a_retry_later():
    """Admission reserves prompt + max_tokens: a request over every decoder's whole KV cache would get 'retry
    later' 503s forever."""
    from services.routing.book import check_fits

    def snap(worker_id, roles, blocks_total, blocks_free, age_s=0.1):
        load = WorkerLoad(kv_blocks_total=blocks_total, kv_blocks_free=blocks_free, kv_tokens_free=blocks_free * 16)
        return WorkerSnapshot(WorkerInfo(worker_id, "a", frozenset(roles), MODEL, 4096), load, age_s)

    workers = [
        snap("p", {Stage.PREFILL}, 1000, 1000),
        snap("d1", {Stage.DECODE}, 65, 10),
        snap("d2", {Stage.DECODE}, 50, 50),
    ]
    assert workers[1].load.kv_tokens_total == 1040
    check_fits(workers, RouteSummary("r", 21, 0, 1019, frozenset()), 3.0)  # 1040 tokens: fits d1 when it is empty
    with pytest.raises(NoRoute) as err:
        check_fits(workers, RouteSummary("r", 21, 0, 1100, frozenset()), 3.0)
    assert (
        err.value.reason == Reason.TOO_LARGE
        and "needs 1121 tokens of KV" in err.value.message
        and "(1040)" in err.value.message
    )
    check_fits(
        workers + [snap("d3", {Stage.DECODE}, 100, 0)], RouteSummary("r", 21, 0, 1100, frozenset()), 3.0
    )  # d3's size unknown
    with pytest.raises(NoRoute):  # a dead or excluded decoder's size does not count
        check_fits(
            workers + [snap("d4", {Stage.DECODE}, 999, 999, age_s=9)], RouteSummary("r", 21, 0, 1100, frozenset()), 3.0
        )


def test_stop_and_stream_options_are_checked_as_vllm_does():
    for extra, param in (
        ({"stop": ""}, "stop"),
        ({"stop": [""]}, "stop"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
    ):
        with pytest.raises(ApiError) as err:
            _parse(**extra)
        assert err.value.status == 400 and err.value.param == param, extra
    assert (
        _parse(stream=True, stream_options={"include_usage": True}).include_usage
        and _parse(stop=None).sampling.stop == ()
    )


class StopsAt(Streaming):
    """Every request ends with a stop string, like the engine's outputs do (text cut before it)."""

    async def start(self, chat, request_id, span=None):
        from common.engine.outputs import RequestOutput
        from common.request import RequestStatus

        async def outputs():
            yield RequestOutput(request_id, [5], [5], RequestStatus.DECODING, None)
            yield RequestOutput(request_id, [6], [5, 6], RequestStatus.FINISHED_STOPPED, "stop", " where", text="5")

        return 7, outputs()


def test_the_streamed_finish_chunk_names_the_stop_reason_as_the_whole_answer_does():
    with TestClient(build_app(StopsAt(), MODEL, metrics=GatewayMetrics(MODEL, ttft_slo_s=1, tbt_slo_s=1))) as client:
        whole = _post(client, "hi").json()["choices"][0]
        lines = [
            json.loads(line[6:])
            for line in _post(client, "hi", stream=True).text.splitlines()
            if line.startswith("data: {")
        ]
    last = [c["choices"][0] for c in lines if c["choices"]][-1]
    assert (whole["finish_reason"], whole["stop_reason"]) == ("stop", " where")
    assert (last["finish_reason"], last["stop_reason"]) == ("stop", " where")


class OneChoiceRefused(Streaming):
    """Choice 1 cannot start (no room); the others had started on their workers."""

    async def start(self, chat, request_id, span=None):
        from services.gateway.responses import Prepended

        if request_id.endswith("-1"):
            await asyncio.sleep(0.01)
            raise ApiError(503, "routing: no worker has KV room", headers={"Retry-After": "1"})
        _, outputs = await super().start(chat, request_id, span)
        first = await anext(outputs)  # as the mesh's start does: the request runs on its workers
        return 7, Prepended(first, outputs)


def test_when_one_choice_cannot_start_the_others_end_at_once():
    backend = OneChoiceRefused()
    with TestClient(build_app(backend, MODEL, metrics=GatewayMetrics(MODEL, ttft_slo_s=1, tbt_slo_s=1))) as client:
        resp = _post(client, "hi", n=3)
        assert resp.status_code == 503 and resp.headers["retry-after"] == "1"
        assert sorted(backend.closed) == sorted(rid for rid in backend.closed if not rid.endswith("-1"))
        assert len(backend.closed) == 2  # ended before the 503 went out, not when collected


class OthersStuck(Streaming):
    """Choice 1 is refused at once; the others wait for a prefill that never ends."""

    def __init__(self):
        super().__init__()
        self.cancelled: list[str] = []

    async def start(self, chat, request_id, span=None):
        if request_id.endswith("-1"):
            raise ApiError(503, "routing: no worker has KV room", headers={"Retry-After": "1"})
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled.append(request_id)
            raise


def test_a_refused_choice_cancels_the_choices_still_starting():
    backend = OthersStuck()
    with TestClient(build_app(backend, MODEL, metrics=GatewayMetrics(MODEL, ttft_slo_s=1, tbt_slo_s=1))) as client:
        assert _post(client, "hi", n=3).status_code == 503  # at once: waiting for the others would never end here
    assert sorted(rid.rsplit("-", 1)[1] for rid in backend.cancelled) == ["0", "2"]


def test_a_prompt_that_fills_the_context_is_told_so_without_naming_a_max_tokens_it_never_sent():
    from services.gateway.protocol import check_length

    with pytest.raises(ApiError) as err:
        check_length(640, 1, 640, max_tokens_given=False)
    assert err.value.status == 400 and "leaves no room to generate" in err.value.message
    assert "max_tokens" not in err.value.message
    with pytest.raises(ApiError) as err:
        check_length(600, 50, 640)
    assert "plus max_tokens (50) is 650" in err.value.message
    check_length(639, 1, 640, max_tokens_given=False)
