"""A worker's Prometheus metrics follow its roles across a switch (`WorkerMetrics.relabel`)."""

from prometheus_client import generate_latest

from common.telemetry.metrics import WorkerMetrics


def test_after_a_switch_what_a_worker_records_carries_its_new_roles():
    metrics = WorkerMetrics("w1", "D")
    metrics.gauges(running=lambda: 3, waiting=lambda: 0, kv_usage=lambda: 0.5, preemptions=lambda: 7)
    metrics.stage("decode", 0.01, 0.2)
    metrics.relabel("EP")
    metrics.stage("prefill", 0.02, 0.1)
    text = generate_latest(metrics.registry).decode()
    running = [line for line in text.splitlines() if line.startswith("epdmesh:num_requests_running{")]
    assert running == ['epdmesh:num_requests_running{roles="EP",worker_id="w1"} 3.0']  # the gauge moved
    assert 'epdmesh:num_preemptions_total{roles="EP",worker_id="w1"} 7.0' in text
    # what was recorded as a decoder stays under D; what comes after is under EP
    assert 'epdmesh:decode_time_seconds_count{roles="D",worker_id="w1"} 1.0' in text
    assert 'epdmesh:prefill_time_seconds_count{roles="EP",worker_id="w1"} 1.0' in text
    assert 'epdmesh:prefill_time_seconds_count{roles="D"' not in text
