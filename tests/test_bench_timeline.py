"""bench/timeline.py's aggregation: request traces only, spans matched by service, name and occurrence."""

from bench.timeline import timeline
from tests.services.otlp import Span


def _span(trace, service, name, start_ms, end_ms):
    return Span(service, name, trace, f"{trace}-{name}-{start_ms}", "", 1, {}, int(start_ms * 1e6), int(end_ms * 1e6))


def test_the_timeline_is_the_median_over_request_traces_relative_to_each_root():
    spans = []
    for trace, t0, encode_ms in (("a", 1000, 20), ("b", 5000, 30), ("c", 9000, 40)):
        spans += [
            _span(trace, "gw", "chat.completions", t0, t0 + 100),
            _span(trace, "e", "encode.execute", t0 + 10, t0 + 10 + encode_ms),
            _span(trace, "p", "page_pull", t0 + 52, t0 + 53),
            _span(trace, "p", "page_pull", t0 + 60, t0 + 62),
        ]
    spans += [_span("hb", "p", "/epdmesh.v1.Toggle/Heartbeat", 7000, 7002)]  # not a request: left out
    rows, requests = timeline(spans)
    assert requests == 3
    assert [(r.service, r.name, r.occurrence) for r in rows] == [
        ("gw", "chat.completions", 0),
        ("e", "encode.execute", 0),
        ("p", "page_pull", 0),
        ("p", "page_pull", 1),
    ]
    encode = rows[1]
    assert (encode.start_ms, encode.end_ms, encode.duration_ms, encode.count) == (10, 40, 30, 3)
    assert (rows[3].start_ms, rows[3].duration_ms) == (60, 2)
