"""bench/peer.py's summary: a crossing the sweep did not bracket is shown as the bound it is, and so is its ratio."""

from bench import peer


def _server(name: str, points: list[tuple[float, float]], ttft: float, tpot: float) -> dict:
    pts = [{"request_rate": r, "slo_attainment": a} for r, a in points]
    value, kind = peer.bounded_crossing(pts)
    top = max((r for r, a in points if a >= 0.9), default=0)
    return dict(
        name=name,
        goodput=top,
        crossing=value,
        crossing_kind=kind,
        points=pts,
        low_load=dict(ttft_p50_ms=ttft, tpot_p50_ms=tpot),
    )


def test_summary_shows_bounds_where_the_sweep_missed_a_crossing():
    vllm_below = _server("vLLM", [(1.5, 0.86), (2, 0.79)], 290, 10.0)
    ours = _server("epdmesh local", [(1.5, 1.0), (4, 0.95), (6, 0.74)], 145, 5.8)
    text = peer.summary([vllm_below, ours])
    assert "< 1.50" in text and "0.00" not in text  # not a crossing at 0 req/s
    assert text.splitlines()[1].split()[-3:] == ["none", "<", "1.50"]  # no rate swept met 90%
    assert "4.48" in text  # interpolated: 4 + (0.95 − 0.9) / (0.95 − 0.74) · 2
    assert "goodput ≥ 2.98x" in text  # 4.48 over at most 1.5
    assert "TTFT 0.50x, TPOT 0.58x" in text

    vllm = _server("vLLM", [(1, 1.0), (2, 0.8)], 270, 8.8)
    ours_top = _server("epdmesh local --no-prompt-kernel", [(2, 1.0), (6, 0.95)], 104, 3.2)
    text = peer.summary([vllm, ours_top])
    assert "≥ 6.00" in text and "goodput ≥ 4.00x" in text  # 6 or more over an exact 1.5
    assert text.splitlines()[2].startswith("epdmesh local --no-prompt-kernel ")  # names never run into the columns

    assert "goodput 2.00x" in peer.summary([vllm, _server("epdmesh EPD1", [(2, 0.95), (4, 0.85)], 200, 6)])
    unknown = peer.summary([vllm_below, _server("epdmesh E1+P1+D1", [(1, 0.5)], 230, 8)])
    assert "goodput ? (neither crossing bracketed)" in unknown
