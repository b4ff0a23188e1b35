"""A trace file as a workload (`bench/recorded.py`): requests planned to the trace's lengths on the replaying
server's count, equal leading block ids as equal words and pictures, the trace's own arrivals, and a simulated
sweep over it."""

import argparse
import json
from pathlib import Path

import pytest

from bench import recorded
from bench.bodies import workload_of
from bench.conversation import Vocabulary
from bench.workloads import arrivals, trace_scale_of, window_start
from common import trace

IMAGE_TOKENS = 20
SAMPLE = Path(__file__).resolve().parents[1] / "bench" / "data" / "mooncake_sample.jsonl"


def fake_count(body: dict) -> dict:
    """A server's `/tokenize`: 3 template tokens, 2 a message, a picture `IMAGE_TOKENS` and a newline, a word a
    token, and a separator between two parts of a message."""
    count = 3
    for message in body["messages"]:
        content = message["content"]
        if isinstance(content, str):
            content = [{"type": "text", "text": content}]
        count += 2 + max(len(content) - 1, 0)
        for part in content:
            count += IMAGE_TOKENS + 1 if part["type"] == "image_url" else len(part["text"].split())
    return {"count": count, "max_model_len": 2000}


VOCAB = Vocabulary(("a", "b", "c", "d", "e", "f", "g", "h", "i", "j"), 24, 2000, fake_count)


def row(ids, length, output=5, images=(), at=None):
    return trace.TraceRow(
        0.0,
        length,
        output,
        tuple(ids),
        tuple(trace.TraceImage(i, IMAGE_TOKENS, a) for i, a in zip(images, at or [None] * len(images))),
    )


def parts_of(body: dict) -> list[dict]:
    out = []
    for message in body["messages"]:
        content = message["content"]
        out += [{"type": "text", "text": content}] if isinstance(content, str) else content
    return out


def words_of(body: dict) -> list[str]:
    return [w for part in parts_of(body) if part["type"] == "text" for w in part["text"].split()]


def pictures_of(body: dict) -> list[str]:
    return [p["image_url"]["url"] for p in parts_of(body) if p["type"] == "image_url"]


def plan(rows):
    return recorded.plan(rows, VOCAB, recorded.Overheads(fake_count, VOCAB))


def test_each_request_is_as_long_as_the_trace_says_on_the_servers_count_pictures_where_they_were():
    rows = [
        row([1, 2, 3], 1100, images=[9], at=[600]),  # text, a picture in the second block, text
        row([4], 300),
        row([5, 6], 700, images=[9, 8], at=[0, IMAGE_TOKENS]),  # two pictures first
        row([7], 40, images=[8]),  # no position kept: the picture first
    ]
    planned = plan(rows)
    bodies = recorded.request_bodies(planned, VOCAB, "m")
    assert (
        [fake_count(b)["count"] for b in bodies] == [r.input_length for r in rows] == [p.prompt_tokens for p in planned]
    )
    layouts = [[kind for kind, _ in p.parts] for p in planned]
    assert layouts == [["system", "image", "text"], ["text"], ["image", "image", "text"], ["image", "text"]]
    assert [m["role"] for m in bodies[0]["messages"]] == ["system", "user"]  # words before a picture: rendered first
    assert [m["role"] for m in bodies[1]["messages"]] == ["user"]
    assert planned[0].parts[0][1] == ((1, 0, 512), (2, 0, 88))  # the words before the picture, by recorded position
    assert planned[0].image_ends == (620,)
    assert (
        pictures_of(bodies[0]) == pictures_of(bodies[2])[:1] and pictures_of(bodies[2])[1] == pictures_of(bodies[3])[0]
    )
    assert all(b["max_tokens"] == 5 and b["ignore_eos"] and b["stream"] for b in bodies)


def test_equal_leading_ids_are_equal_leading_words_and_each_rate_point_has_its_own():
    a, b, c = row([1, 2, 3], 1300), row([1, 2, 4], 1300), row([5, 2, 3], 1300)
    bodies = recorded.request_bodies(plan([a, b, c]), VOCAB, "m")
    wa, wb, wc = (words_of(x) for x in bodies)
    first_two = 1024 - (3 + 2)  # the template's tokens are words here: the blocks shift by them, alike everywhere
    assert wa[:first_two] == wb[:first_two] and wa[first_two:] != wb[first_two:]
    assert wa[:512] != wc[:512]
    other = recorded.request_bodies(plan([a]), VOCAB, "m", variant=1)
    assert words_of(other[0]) != wa


def test_a_prompt_too_long_for_the_context_loses_words_from_its_end_and_pictures_that_cannot_fit_are_an_error():
    vocab = Vocabulary(VOCAB.words, 24, 300, fake_count)
    planned = recorded.plan(
        [row([1], 290, output=10, images=[3], at=[5])], vocab, recorded.Overheads(fake_count, vocab)
    )
    assert (
        planned[0].prompt_tokens == 290 and fake_count(recorded.request_bodies(planned, vocab, "m")[0])["count"] == 290
    )
    planned = recorded.plan([row([1, 2], 600, output=10)], vocab, recorded.Overheads(fake_count, vocab))
    assert planned[0].prompt_tokens == 290
    tight = Vocabulary(VOCAB.words, 24, 30, fake_count)
    with pytest.raises(ValueError, match="request 0 of the trace: its 1 pictures and 10-token answer do not fit"):
        recorded.plan([row([1], 40, output=10, images=[3])], tight, recorded.Overheads(fake_count, tight))


def test_the_window_its_arrivals_and_the_bounds_shared_prefixes(tmp_path):
    path = tmp_path / "t.jsonl"
    lines = [
        {"timestamp": 1000 * i * i, "input_length": 600, "output_length": 3, "hash_ids": [0, 10 + (i % 2)]}
        for i in range(6)
    ]
    trace.write(lines, path)
    workload = f"trace:{path}"
    assert trace_scale_of(workload, 16) is None
    with pytest.raises(ValueError, match="no such trace file"):
        trace_scale_of(f"trace:{tmp_path}/missing.jsonl", 16)
    times = recorded.arrivals_of(workload, 6, 0, None)
    assert times == [float(i * i) for i in range(6)] and recorded.arrivals_of("textcaps", 6, 0, "x") == "x"
    assert arrivals(6, 2.0, "mooncake", 0, times) == [t * 5 / 2.0 / 25 for t in times]  # mean gap 1/rate, shape kept
    window, start = recorded.window(path, 4, 3), window_start(4, 3, 6)
    assert [r.timestamp_ms / 1e3 for r in window] == recorded.arrivals_of(workload, 4, 3, None)
    assert window[0].timestamp_ms == 1000 * start * start
    assert recorded.shared_prefixes(recorded.rows_of(path)) == [0, 512, 599, 599, 599, 599]
    with pytest.raises(ValueError, match="holds 6 requests"):
        recorded.window(path, 7, 0)
    args = argparse.Namespace(num_prompts=6, seed=0, trace_scale=16)
    bodies_of, meta = workload_of(workload, lambda: VOCAB, "m", args)
    assert len(bodies_of(1)) == 6 and meta["trace_rate"] == pytest.approx(5 / 25)
    assert meta["requests"][2] == [600, 599, 3, 0] and meta["ideal_shared_fraction"] == pytest.approx(
        (512 + 4 * 599) / 3600
    )


def test_the_mooncake_sample_is_a_workload_the_simulator_sweeps(emulated_dir, tmp_path):
    from sim.goodput import main as sim_goodput

    out = tmp_path / "sim.json"
    workload = f"trace:{SAMPLE}"
    argv = ["--model", str(emulated_dir), "--config", "EPD2=--topology EPD2", "--workload", workload]
    assert sim_goodput([*argv, "--rates", "0.5,50", "--num-prompts", "40", "--out", str(out)]) == 0
    run = json.loads(out.read_text())["configs"]["EPD2"][workload]
    rows = trace.read(SAMPLE)
    assert [p["completed"] for p in run["points"]] == [40, 40] and run["images_per_request"] == 0
    assert run["points"][0]["slo_attainment"] > run["points"][1]["slo_attainment"]
    lengths = [min(r.input_length, 4096 - r.output_length) for r in rows]  # LLaVA-1.5-7B's context, answers kept
    assert run["points"][0]["total_input_tokens"] == sum(lengths)
    assert run["points"][0]["total_output_tokens"] == sum(r.output_length for r in rows)
