"""The `conversation` workload: the trace's hash ids read back losslessly, requests planned from them exactly, equal
blocks as equal words, and the goodput bound that counts only what no earlier request shares."""

import json
from pathlib import Path

import pytest

from bench.conversation import (
    TraceRequest,
    Vocabulary,
    block_text,
    ideal_shared_tokens,
    plan,
    request_bodies,
    trace_requests,
)
from bench.workloads import trace_times, window_start

SHARED_TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "mooncake_conversation_trace.jsonl"
VOCAB = Vocabulary(("a", "b", "c", "d", "e", "f", "g", "h"), chat_tokens=100, max_model_len=400)


def test_the_stored_trace_has_every_request_of_the_arrivals_with_its_hash_ids():
    rows = trace_requests()
    assert len(rows) == len(trace_times()) == 12031
    assert rows[0] == TraceRequest(6758, 500, tuple(range(14)))
    assert rows[1] == TraceRequest(7322, 490, (0, *range(14, 28)))
    assert all(len(r.hash_ids) == -(-r.input_tokens // 512) for r in rows)  # a 512-token block each, the last partial


@pytest.mark.skipif(not SHARED_TRACE.is_file(), reason="the original trace is beside the project only")
def test_the_stored_trace_is_the_original_losslessly():
    original = [json.loads(line) for line in SHARED_TRACE.read_text().splitlines()]
    assert [(r.input_tokens, r.output_tokens, list(r.hash_ids)) for r in trace_requests()] == [
        (o["input_length"], o["output_length"], o["hash_ids"]) for o in original
    ]


def test_requests_are_the_trace_windows_lengths_scaled_and_cut_to_the_context():
    trace = (
        TraceRequest(1000, 160, (0, 1)),  # 63 text tokens at scale 16: blocks of 32
        TraceRequest(1600, 8, (0, 1, 2, 3)),  # the same conversation; a 1-token answer at least
        TraceRequest(9000, 3200, (0, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21)),  # cut
        TraceRequest(900, 16, (0, 22)),
    )
    planned = plan(4, seed=0, vocab=VOCAB, scale=16, trace=trace)
    assert [p.blocks for p in planned] == [
        ((0, 32), (1, 31)),
        ((0, 32), (1, 32), (2, 32), (3, 4)),
        ((0, 32), (5, 32), (6, 32), (7, 4)),
        ((0, 32), (22, 25)),
    ]
    assert [p.output_tokens for p in planned] == [10, 1, 200, 1]
    assert [p.conversation for p in planned] == [1, 1, 5, 22]
    assert planned[2].text_tokens == VOCAB.max_model_len - VOCAB.chat_tokens - 200  # what the context leaves
    assert (
        window_start(2, 5, 4) == window_start(2, 5, 4)
        and plan(2, 5, VOCAB, trace=trace) == planned[window_start(2, 5, 4) : window_start(2, 5, 4) + 2]
    )
    with pytest.raises(ValueError, match="divide"):
        plan(2, 0, VOCAB, scale=3, trace=trace)
    with pytest.raises(ValueError, match="no room"):
        plan(4, 0, Vocabulary(VOCAB.words, 390, 400), trace=trace)


def test_only_a_prefix_an_earlier_request_holds_counts_as_shared():
    trace = (
        TraceRequest(1000, 160, (0, 1)),
        TraceRequest(1600, 8, (0, 1, 2, 3)),
        TraceRequest(1600, 8, (0, 1, 2, 9)),
        TraceRequest(900, 16, (0, 22)),
    )
    planned = plan(4, seed=0, vocab=VOCAB, scale=16, trace=trace)
    # nothing before the first; then the system block, the image (with the template) and the blocks that match:
    # block 1 is 31 tokens in the first request and 32 in the second, so the match ends inside it
    assert ideal_shared_tokens(planned, VOCAB) == [0, 32 + 100 + 31, 32 + 100 + 32 + 32, 32]


def test_equal_blocks_are_equal_words_and_every_rate_point_has_its_own():
    trace = (TraceRequest(1000, 160, (0, 1)), TraceRequest(1600, 8, (0, 1, 2, 3)), TraceRequest(900, 16, (0, 22)))
    planned = plan(3, seed=0, vocab=VOCAB, scale=16, trace=trace)
    bodies = request_bodies(planned, VOCAB, "m", seed=0, variant=1)
    system = [b["messages"][0]["content"] for b in bodies]
    user = [b["messages"][1]["content"][1]["text"] for b in bodies]
    image = [b["messages"][1]["content"][0]["image_url"]["url"] for b in bodies]
    assert system[0] == system[1] == system[2] == block_text(VOCAB, 0, 32, 0, 1)
    assert len(system[0].split()) == 32 and set(system[0].split()) <= set(VOCAB.words)
    assert user[1].startswith(user[0]) and user[1] != user[0] and not user[2].startswith(user[0][:20])
    assert image[0] == image[1] != image[2]
    assert [b["max_tokens"] for b in bodies] == [10, 1, 1] and all(b["ignore_eos"] and b["stream"] for b in bodies)
    other = request_bodies(planned, VOCAB, "m", seed=0, variant=2)
    assert other[0]["messages"][0]["content"] != system[0]
    assert other[0]["messages"][1]["content"][0]["image_url"]["url"] != image[0]
    assert request_bodies(planned, VOCAB, "m", seed=0, variant=1) == bodies


def test_a_conversations_bound_counts_each_request_without_what_a_turn_before_holds():
    from bench.goodput_report import add_bound
    from common.latency import request_cost_ms
    from common.latency.roofline import load_profile

    h20 = load_profile("H20")
    full, cached = request_cost_ms(h20, 1000, 1, 20), request_cost_ms(h20, 1000, 0, 20, cached_tokens=800)
    assert cached < full
    assert full - cached == pytest.approx(
        request_cost_ms(h20, 1000, 1, 0) - request_cost_ms(h20, 1000, 0, 0, cached_tokens=800)
    )
    with pytest.raises(ValueError, match="within"):
        request_cost_ms(h20, 10, 1, 1, cached_tokens=11)
    result = {
        "goodput": 10.0,
        "requests": [[1000, 0, 20, 1], [1000, 800, 20, 0]],
        "points": [{"completed": 2, "total_input_tokens": 2000}],
    }
    add_bound(result, h20, 8)
    assert result["goodput_bound"] == pytest.approx(8e3 * 2 / (full + cached))
    assert result["fraction_of_bound"] == pytest.approx(10.0 / result["goodput_bound"])


def test_the_workload_is_one_the_benchmark_takes():
    from bench.goodput import parse_args

    args = parse_args(["--url", "http://127.0.0.1:1", "--workload", "pope,conversation", "--trace-scale", "8"])
    assert args.workloads == ["pope", "conversation"] and args.trace_scale == 8
    with pytest.raises(SystemExit):
        parse_args(["--url", "http://127.0.0.1:1", "--workload", "conversation", "--trace-scale", "3"])


def test_a_conversation_workload_may_name_its_own_trace_scale():
    from bench.goodput import parse_args
    from bench.workloads import trace_scale_of

    args = parse_args(["--url", "http://127.0.0.1:1", "--workload", "conversation,conversation/8,pope"])
    assert [trace_scale_of(w, args.trace_scale) for w in args.workloads] == [16, 8, None]
    for bad in ("conversation/3", "conversation/", "conversation/x", "pope/8", "vqa"):
        with pytest.raises(SystemExit):
            parse_args(["--url", "http://127.0.0.1:1", "--workload", bad])
