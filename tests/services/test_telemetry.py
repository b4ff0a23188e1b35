"""Operators' view of a real E1+P1+D1 mesh: one OTLP trace per request, exact Prometheus deltas."""

import re
import time

import httpx
import openai
import pytest

from tests.services.otlp import OtlpReceiver
from tests.services.servers import MODEL, running_server
from tests.services.test_gateway import data_uri
from tests.support import image

SERVER, CLIENT = 2, 3  # OTLP SpanKind values


@pytest.fixture(scope="module")
def traced_mesh(tiny_dir, tmp_path_factory):
    with OtlpReceiver() as receiver:
        env = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, "OTEL_BSP_SCHEDULE_DELAY": "100"}
        log = tmp_path_factory.mktemp("traced") / "serve.log"
        with running_server(tiny_dir, "E1+P1+D1", log, "--prefill-mode", "dedicated", env=env) as base:
            yield base, receiver


def ask_with_image(base, max_tokens=6, **extra):
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", default_headers={"X-Request-Id": "traced-1"})
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": data_uri(image(4, 96, 80))}},
                {"type": "text", "text": "What is here?"},
            ],
        }
    ]
    return client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0, extra_body={"ignore_eos": True, **extra}
    )


def test_one_trace_spans_gateway_router_encoder_prefill_pull_and_decoder(traced_mesh):
    base, receiver = traced_mesh
    resp = ask_with_image(base)
    # serve routes in the gateway (over Redis): the toggle is not on a request's path, so not in its trace
    services = {"epdmesh-gateway", "epdmesh-worker-e", "epdmesh-worker-p", "epdmesh-worker-d"}

    def roots(spans):
        return [s for s in spans if s.name == "chat.completions" and s.attributes.get("gen_ai.response.id") == resp.id]

    def complete(spans):
        found = roots(spans)
        if not found:
            return False
        names = {s.name for s in spans if s.trace_id == found[0].trace_id}
        # a stage's server span ends with its call, after its execute span (the Decode stream: after the last token)
        served = {(s.service, s.name) for s in spans if s.trace_id == found[0].trace_id and s.kind == SERVER}
        rpcs = {
            ("epdmesh-worker-e", "/epdmesh.v1.Encoder/Encode"),
            ("epdmesh-worker-p", "/epdmesh.v1.Prefiller/Prefill"),
            ("epdmesh-worker-d", "/epdmesh.v1.Decoder/Decode"),
        }
        return (
            {"decode.execute", "page_pull", "route"} <= names
            and rpcs <= served
            and {s.service for s in spans if s.trace_id == found[0].trace_id} >= services
        )

    spans = receiver.wait_for(complete)
    [root] = roots(spans)
    assert list(root.attributes["http.request.header.x-request-id"]) == ["traced-1"]  # the client's own id for it
    trace = receiver.trace(root.trace_id)
    by_id = {s.span_id: s for s in trace}
    assert {s.service for s in trace} == services

    def one(service, name, kind=None):
        found = [s for s in trace if s.service == service and s.name == name and (kind is None or s.kind == kind)]
        assert len(found) == 1, (service, name, [(s.service, s.name) for s in trace])
        return found[0]

    def parent(span):
        return by_id[span.parent_id]

    # the root: a server span with no parent, GenAI attributes and ours
    assert root.parent_id == "" and root.kind == SERVER and root.service == "epdmesh-gateway"
    assert root.attributes["gen_ai.request.model"] == MODEL
    assert root.attributes["gen_ai.usage.input_tokens"] == resp.usage.prompt_tokens
    assert root.attributes["gen_ai.usage.output_tokens"] == resp.usage.completion_tokens == 6
    assert root.attributes["epdmesh.path"] == "dedicated"
    # routing: the gateway's `route` span carries the router's decision, and makes no call
    route = one("epdmesh-gateway", "route")
    assert parent(route) is root and not [s for s in trace if s.parent_id == route.span_id]
    assert route.attributes["epdmesh.path"] == "dedicated" and route.attributes["epdmesh.live_workers"] == 3
    # each stage: the gateway's client span → the worker's server span → its queue/execute (and pull) spans
    for service, rpc, stage in (
        ("epdmesh-worker-e", "/epdmesh.v1.Encoder/Encode", "encode"),
        ("epdmesh-worker-p", "/epdmesh.v1.Prefiller/Prefill", "prefill"),
        ("epdmesh-worker-d", "/epdmesh.v1.Decoder/Decode", "decode"),
    ):
        server = one(service, rpc, SERVER)
        client = parent(server)
        assert client.service == "epdmesh-gateway" and client.kind == CLIENT and parent(client) is root
        queue, execute = one(service, f"{stage}.queue"), one(service, f"{stage}.execute")
        assert parent(queue) is server and parent(execute) is server
    image_pull = one("epdmesh-worker-p", "page_pull")
    kv_pull = one("epdmesh-worker-d", "page_pull")
    assert parent(image_pull).name == "/epdmesh.v1.Prefiller/Prefill"
    assert parent(kv_pull).name == "/epdmesh.v1.Decoder/Decode"
    assert (
        image_pull.attributes["epdmesh.transfer.kind"] == "image"
        and kv_pull.attributes["epdmesh.transfer.kind"] == "kv"
    )
    assert image_pull.attributes["epdmesh.transfer.bytes"] > 0 and kv_pull.attributes["epdmesh.transfer.bytes"] > 0
    assert image_pull.attributes["epdmesh.transfer.source"].startswith("e-")
    assert kv_pull.attributes["epdmesh.transfer.backend"] in ("nixl", "grpc")


def scrape(url: str) -> dict[str, float]:
    """Prometheus text → {'name{labels}': value} (label order as exposed)."""
    samples = {}
    for line in httpx.get(url, timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            samples[key] = float(value)
    return samples


def total(samples: dict[str, float], name: str, **labels) -> float:
    """Sum of a metric's samples whose labels include `labels`."""
    out = 0.0
    for key, value in samples.items():
        m = re.fullmatch(r"([^{]+)(?:\{(.*)\})?", key)
        if m.group(1) != name:
            continue
        have = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
        if all(have.get(k) == v for k, v in labels.items()):
            out += value
    return out


def test_metrics_count_exactly_what_was_served(traced_mesh):
    base, _ = traced_mesh
    workers = httpx.get(f"{base}/stats").json()["workers"]
    urls = {w["roles"]: f"http://127.0.0.1:{w['metrics_port']}/metrics" for w in workers.values()}
    assert set(urls) == {"E", "P", "D"} and all(w["metrics_port"] for w in workers.values())
    gw_before = scrape(f"{base}/metrics")
    before = {role: scrape(url) for role, url in urls.items()}
    max_tokens = [3, 5, 7]
    responses = [ask_with_image(base, max_tokens=n) for n in max_tokens]
    bad = httpx.post(f"{base}/v1/chat/completions", json={"model": "nope", "messages": []}, timeout=30)
    assert bad.status_code == 404
    time.sleep(0.5)  # leases acked, gauges settled
    gw = scrape(f"{base}/metrics")
    after = {role: scrape(url) for role, url in urls.items()}

    def delta(name, samples_after=gw, samples_before=gw_before, **labels):
        return total(samples_after, name, **labels) - total(samples_before, name, **labels)

    prompt = sum(r.usage.prompt_tokens for r in responses)
    assert delta("epdmesh:prompt_tokens_total") == prompt
    assert delta("epdmesh:generation_tokens_total") == sum(max_tokens)
    assert delta("epdmesh:request_success_total", finished_reason="length") == 3
    assert delta("epdmesh:time_to_first_token_seconds_count") == 3
    assert delta("epdmesh:inter_token_latency_seconds_count") == sum(n - 1 for n in max_tokens)
    assert delta("epdmesh:e2e_request_latency_seconds_count") == 3
    assert delta("epdmesh:route_decisions_total", path="dedicated") == 3
    assert delta("epdmesh:request_errors_total", status="404") == 1
    assert delta("epdmesh:slo_requests_total") == 3
    assert total(gw, "epdmesh:num_requests_running") == 0
    # the workers: one encode, one prefill, one decode per request; pages pulled into P (image) and D (kv)
    for role, stage in (("E", "encode"), ("P", "prefill"), ("D", "decode")):
        assert delta(f"epdmesh:{stage}_time_seconds_count", after[role], before[role]) == 3
        assert delta("epdmesh:request_queue_time_seconds_count", after[role], before[role], stage=stage) == 3
    image_bytes = 3 * 256 * 256 * 4  # 256 image tokens × hidden 256 × fp32, whole blocks of 16 tokens
    assert delta("epdmesh:transfer_bytes_total", after["P"], before["P"], kind="image") == image_bytes
    kv_block = 16 * 6 * 2 * 2 * 32 * 4  # tokens × layers × (k, v) × kv heads × head dim × fp32
    kv_blocks = sum(-(-r.usage.prompt_tokens // 16) for r in responses)
    assert delta("epdmesh:transfer_bytes_total", after["D"], before["D"], kind="kv") == kv_blocks * kv_block
    assert delta("epdmesh:transfer_seconds_count", after["D"], before["D"]) == 3
    assert delta("epdmesh:transfer_failures_total", after["D"], before["D"]) == 0
    for role in urls:
        assert total(after[role], "epdmesh:kv_cache_usage_perc") == 0
        assert total(after[role], "epdmesh:num_requests_running") == 0


def test_tracing_is_off_and_not_even_imported_without_an_endpoint():
    import subprocess
    import sys

    code = (
        "import os, sys; [os.environ.pop(k, None) for k in list(os.environ) if k.startswith('OTEL_')]\n"
        "from common.telemetry.tracing import Tracing\n"
        "import services.gateway.app, services.worker.server, services.toggle.server\n"
        "t = Tracing('x')\n"
        "with t.span('s') as s: assert s is None\n"
        # (redis-py itself imports opentelemetry's API when it is installed; ours stays out)
        "print(t.enabled, any(m.startswith(('opentelemetry.instrumentation', 'opentelemetry.exporter'))"
        " for m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "False"]


def test_a_request_can_carry_its_own_slo(traced_mesh):
    base, _ = traced_mesh

    def outcomes():
        samples = scrape(f"{base}/metrics")
        return {o: total(samples, "epdmesh:slo_requests_total", outcome=o) for o in ("attained", "ttft_violated")}

    before = outcomes()
    ask_with_image(base, max_tokens=3, slo={"ttft_ms": 0.001})  # no first token comes that fast
    ask_with_image(base, max_tokens=3, slo={"ttft_ms": 600_000, "tbt_ms": 600_000})
    after = outcomes()
    assert after["ttft_violated"] - before["ttft_violated"] == 1
    assert after["attained"] - before["attained"] == 1
