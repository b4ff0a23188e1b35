"""The trace format (`common/trace.py`): prefix-block ids, reading a recorded or a Mooncake trace, writing one."""

import json

import pytest

from common import trace
from common.request import image_marks

IMAGE = 32000


def test_one_id_a_block_the_last_partial_and_equal_prefixes_equal_ids():
    a = list(range(1, 1201))  # 2 full blocks of 512 and 176 tokens
    b = a[:1100] + [7] * 100  # differs in the third block only
    ids_a, ids_b = trace.hash_ids(a, block=512), trace.hash_ids(b, block=512)
    assert len(ids_a) == 3 and len(trace.hash_ids(a[:1024], block=512)) == 2
    assert len(trace.hash_ids(a[:1025], block=512)) == 3
    assert ids_a[:2] == ids_b[:2] and ids_a[2] != ids_b[2]
    shorter = trace.hash_ids(a[:1100], block=512)
    assert shorter[:2] == ids_a[:2] and shorter[2] != ids_a[2]  # a shorter tail
    assert all(0 <= h < 2**53 for h in ids_a)  # exact in every JSON reader
    assert trace.hash_ids(a, block=512) == ids_a  # stable: a hash of the content, not of the process
    fine, fine_b = trace.hash_ids(a), trace.hash_ids(b)  # the recorder's default: the engines' 16-token KV block
    assert len(fine) == 75 and fine[:68] == fine_b[:68] and fine[68] != fine_b[68]  # 1100 = 68 × 16 + 12


def test_a_picture_changes_its_block_and_every_block_after_and_a_salt_changes_all():
    ids = list(range(1, 600)) + [IMAGE] * 10 + list(range(600, 1200))
    marks_x = image_marks(ids, IMAGE, [("x", 10)])
    marks_y = image_marks(ids, IMAGE, [("y", 10)])
    x, y = trace.hash_ids(ids, marks_x, block=512), trace.hash_ids(ids, marks_y, block=512)
    assert x[0] == y[0] and x[1] != y[1] and x[2] != y[2]  # the picture sits in the second block
    assert set(trace.hash_ids(ids, marks_x, salt="tenant", block=512)).isdisjoint(x)
    assert trace.image_id("x") == trace.image_id("x") != trace.image_id("y")


def test_a_trace_reads_in_arrival_order_from_its_first_arrival_and_writes_back(tmp_path):
    path = tmp_path / "t.jsonl"
    lines = [
        {"timestamp": 1_700_000_002_000, "input_length": 600, "output_length": 4, "hash_ids": [5, 6]},
        {
            "timestamp": 1_700_000_000_500,
            "input_length": 700,
            "output_length": 9,
            "hash_ids": [5, 7],
            "images": [{"id": 11, "tokens": 576, "at": 3}],
            "max_tokens": 9,
            "finish_reason": "length",
            "ttft_ms": 81.5,
            "block_tokens": 16,
        },
    ]
    path.write_text("# a comment\n" + "\n".join(json.dumps(x) for x in lines) + "\n\n")
    rows = trace.read(path)
    assert [r.timestamp_ms for r in rows] == [0.0, 1500.0] and [r.input_length for r in rows] == [700, 600]
    assert rows[0].images == (trace.TraceImage(11, 576, 3),) and rows[0].ttft_ms == 81.5 and rows[1].images == ()
    assert (rows[0].block_tokens, rows[1].block_tokens) == (16, trace.MOONCAKE_BLOCK)
    again = tmp_path / "again.jsonl"
    assert trace.write(rows, again) == 2
    assert trace.read(again) == rows


def test_the_mooncake_trace_reads_as_it_is():
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "bench" / "data" / "mooncake_sample.jsonl"
    rows = trace.read(path)
    assert len(rows) == 40 and rows[0].timestamp_ms == 0 and all(r.images == () for r in rows)
    assert all(r.block_tokens == 512 and len(r.hash_ids) == -(-r.input_length // 512) for r in rows)


@pytest.mark.parametrize(
    "line, fragment",
    [
        ("not json", ":2: not JSON"),
        ("[1, 2]", ":2: not a JSON object"),
        ('{"timestamp": 0, "output_length": 3}', ":2: no 'input_length' field"),
        ('{"timestamp": 0, "input_length": 0, "output_length": 3}', "input_length and block_tokens must be ≥ 1"),
        ('{"timestamp": 0, "input_length": 5, "output_length": 3, "block_tokens": -4}', "block_tokens must be ≥ 1"),
        ('{"timestamp": 0, "input_length": 9, "output_length": 1, "images": [{"id": 1, "tokens": 10}]}', "exceed"),
        (
            '{"timestamp": 0, "input_length": 900, "output_length": 1, '
            '"images": [{"id": 1, "tokens": 10, "at": 50}, {"id": 2, "tokens": 10, "at": 5}]}',
            "must rise",
        ),
        ('{"timestamp": "soon", "input_length": 9, "output_length": 1}', ":2:"),
    ],
)
def test_a_bad_line_is_an_error_that_names_the_line_and_the_field(tmp_path, line, fragment):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1]}\n' + line + "\n")
    with pytest.raises(ValueError, match=fragment):
        trace.read(path)


def test_an_empty_trace_is_an_error(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n# nothing\n")
    with pytest.raises(ValueError, match="no requests"):
        trace.read(path)


def test_a_summary_counts_rates_lengths_shared_prefixes_and_outcomes(tmp_path, capsys):
    from epdmesh.cli import main

    rows = [
        trace.TraceRow(0.0, 40, 5, (1, 2, 3), (trace.TraceImage(9, 8, 0),), 5, "length", 50.0, 16),
        trace.TraceRow(30_000.0, 40, 3, (1, 2, 4), (), 5, "stop", 70.0, 16),  # shares its first 32 tokens
        trace.TraceRow(90_000.0, 20, 0, (1, 7), (), 5, "abort", None, 16),  # and its first 16
        trace.TraceRow(91_000.0, 20, 4, (8, 2), (), 5, "length", 90.0, 16),
    ]
    s = trace.summary(rows)
    assert s["requests"] == 4 and s["span_s"] == 91.0 and s["mean_rate"] == pytest.approx(3 / 91)
    assert s["busiest_minute_rate"] == pytest.approx(2 / 60)  # the second minute holds two
    assert s["prompt_tokens"]["mean"] == 30 and s["output_tokens"]["p50"] == 4 and s["images_per_request"] == 0.25
    assert s["shared_prefix_fraction"] == pytest.approx((32 + 16) / 120)
    assert s["finish_reasons"] == {"length": 2, "stop": 1, "abort": 1} and s["ttft_ms"]["p90"] == 90.0
    path = tmp_path / "t.jsonl"
    trace.write(rows, path)
    assert main(["trace", "stats", str(path)]) == 0
    out = capsys.readouterr().out
    assert "4 requests over 91.0 s (0.03 req/s, busiest minute 0.03 req/s)" in out and "40.0% of prompt" in out
    assert "abort 1, length 2, stop 1" in out and "p90 90.0 ms" in out
    with pytest.raises(SystemExit, match="no requests"):
        main(["trace", "stats", str(_empty(tmp_path))])


def _empty(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("")
    return path


def test_a_trace_is_cut_by_time_or_to_its_busiest_window(tmp_path, capsys):
    from epdmesh.cli import main

    stamps = [0, 1_000, 10_000, 10_500, 11_000, 11_400, 30_000]  # ms: a burst of four in 1.4 s at 10 s
    rows = [trace.TraceRow(float(t), 10, 2, (i,)) for i, t in enumerate(stamps)]
    assert [r.timestamp_ms for r in trace.cut(rows, 1, 11)] == [1_000, 10_000, 10_500]
    assert len(trace.cut(rows, None, 10.5)) == 3 and len(trace.cut(rows, 11)) == 3
    assert trace.busiest(rows, 2.0) == (10.0, 12.0) and trace.busiest(rows, 100.0) == (0.0, 100.0)
    path, out = tmp_path / "t.jsonl", tmp_path / "cut.jsonl"
    trace.write(rows, path)
    assert main(["trace", "cut", str(path), "--busiest", "2", "--out", str(out)]) == 0
    assert [r.hash_ids for r in trace.read(out)] == [(2,), (3,), (4,), (5,)]  # read back from its own first arrival
    assert "wrote 4 of 7 requests" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="no request"):
        main(["trace", "cut", str(path), "--from", "40", "--out", str(out)])
    with pytest.raises(SystemExit, match="not both"):
        main(["trace", "cut", str(path), "--busiest", "2", "--from", "1", "--out", str(out)])
