"""The gateway's recorded trace in a Redis stream (`--record-trace redis`) and `epdmesh trace export`; a sink that
fails loses lines, never requests. (The file sink, on real servers: `test_gateway.py`.)"""

import asyncio
import json
import logging
import uuid

import pytest
import redis

from common import trace
from common.engine.outputs import RequestOutput
from common.request import ImageInput, Request, RequestStatus
from common.sampling import SamplingParams
from common.telemetry.metrics import GatewayMetrics
from epdmesh.cli import main
from services.gateway.trace_record import FileSink, RedisSink, TraceRecorder, export
from services.routing.registry import redis_client
from tests.services.servers import REDIS_URL

IMAGE = 99


def request(i: int, picture: str = "") -> Request:
    ids = [1] * 5 + ([IMAGE] * 4 if picture else []) + list(range(100, 100 + 600 + i))  # no other IMAGE
    images = [ImageInput(None, 4, picture)] if picture else []
    return Request(f"r{i}", ids, SamplingParams(max_tokens=8), images)


async def answer(tokens: int, status=RequestStatus.FINISHED_LENGTH, reason="length"):
    out = []
    for k in range(tokens):
        out.append(k)
        done = k == tokens - 1
        yield RequestOutput("r", [k], list(out), status if done else RequestStatus.DECODING, reason if done else None)


async def drain(recorder: TraceRecorder, req: Request, outputs) -> None:
    async for _ in recorder.observe(req, outputs):
        pass


@pytest.fixture
def key():
    name = f"epdmesh:test:trace:{uuid.uuid4().hex}"
    yield name
    redis.Redis.from_url(REDIS_URL).delete(name)


def test_gateways_record_into_one_stream_and_export_writes_it_in_arrival_order(key, tmp_path):
    async def record():
        recorders = [TraceRecorder(RedisSink(redis_client(REDIS_URL), key, 1000), IMAGE) for _ in range(2)]
        await drain(recorders[0], request(0, "cat"), answer(8))  # two gateways of a mesh
        await drain(recorders[1], request(1, "cat"), answer(3, RequestStatus.FINISHED_STOPPED, "stop"))
        for r in recorders:
            await r.close()  # their lines are in
        later = TraceRecorder(RedisSink(redis_client(REDIS_URL), key, 1000), IMAGE)
        await drain(later, request(2), answer(8))
        await later.close()

    asyncio.run(record())
    out = tmp_path / "t.jsonl"
    assert export(REDIS_URL, key, str(out))[0] == 3
    rows = trace.read(out)
    assert [(r.input_length, r.output_length, r.finish_reason) for r in rows] == [
        (609, 8, "length"),
        (610, 3, "stop"),
        (607, 8, "length"),
    ]
    assert rows[0].images == rows[1].images == (trace.TraceImage(trace.image_id("cat"), 4, 5),)
    assert rows[0].hash_ids[0] == rows[1].hash_ids[0] != rows[2].hash_ids[0]  # the picture is in the first block
    assert rows[0].hash_ids[:38] == rows[1].hash_ids[:38] and rows[0].hash_ids[38] != rows[1].hash_ids[38]  # 16-token
    assert len(rows[0].hash_ids) == len(rows[1].hash_ids) == 39 and rows[0].block_tokens == 16  # blocks: 1 and 2 left
    assert main(["trace", "export", "--redis-url", REDIS_URL, "--key", key, "--last", "1", "--out", str(out)]) == 0
    assert [r.input_length for r in trace.read(out)] == [607]


def test_the_stream_is_trimmed_to_about_its_maximum(key):
    async def record():
        recorder = TraceRecorder(RedisSink(redis_client(REDIS_URL), key, 10), IMAGE)
        for i in range(300):
            await drain(recorder, request(i), answer(1))
        await recorder.close()

    asyncio.run(record())
    assert 10 <= redis.Redis.from_url(REDIS_URL).xlen(key) < 300  # approximate trimming: whole nodes at a time


def test_an_empty_stream_exports_nothing_and_says_so(key, tmp_path, capsys):
    assert main(["trace", "export", "--redis-url", REDIS_URL, "--key", key, "--out", str(tmp_path / "t")]) == 1
    assert "no requests recorded" in capsys.readouterr().err


def test_a_sink_that_fails_loses_its_lines_and_warns_once_while_every_answer_goes_through(tmp_path, caplog):
    metrics = GatewayMetrics("m", 1.0, 0.1)

    async def record():
        sink = RedisSink(redis_client("redis://127.0.0.1:1/0"), "k", 10)  # nobody there
        recorder = TraceRecorder(sink, IMAGE, metrics=metrics)
        got = []
        for i in range(3):
            async for out in recorder.observe(request(i), answer(4)):
                got.append(out.new_token_ids[0])
        await recorder.close()
        return got

    with caplog.at_level(logging.WARNING, logger="services.gateway.trace_record"):
        assert asyncio.run(record()) == [0, 1, 2, 3] * 3
    assert sum("took no line" in r.message for r in caplog.records) == 1
    counted = {
        s.labels["outcome"]: s.value for s in metrics.trace_lines.collect()[0].samples if s.name.endswith("_total")
    }
    assert counted == {"recorded": 3.0, "lost": 3.0}


def test_a_file_sink_appends_a_line_a_request_and_a_failed_request_is_recorded_as_an_error(tmp_path):
    path = tmp_path / "trace.jsonl"

    async def failing():
        yield RequestOutput("r", [1], [1], RequestStatus.DECODING, None)
        raise RuntimeError("a worker died")

    async def record():
        recorder = TraceRecorder(FileSink(str(path)), IMAGE)
        await drain(recorder, request(0), answer(2))
        with pytest.raises(RuntimeError):
            await drain(recorder, request(1), failing())
        await recorder.close()

    path.write_text('{"timestamp": 0, "input_length": 5, "output_length": 1}\n')  # kept: the file is appended to
    asyncio.run(record())
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(lines) == 3 and [x.get("finish_reason") for x in lines[1:]] == ["length", "error"]
    assert lines[2]["output_length"] == 1 and lines[2]["ttft_ms"] >= 0


def test_serve_refuses_a_redis_trace_it_would_lose_with_its_own_redis(monkeypatch):
    monkeypatch.delenv("REDIS_URL", raising=False)
    with pytest.raises(SystemExit, match="serve's own Redis ends with the mesh"):
        main(["serve", "--model", "/nowhere", "--record-trace", "redis"])
    with pytest.raises(SystemExit, match="--route-in gateway"):
        main(
            [
                "serve",
                "--model",
                "/nowhere",
                "--topology",
                "E1+P1+D1",
                "--record-trace",
                "redis",
                "--redis-url",
                REDIS_URL,
                "--route-in",
                "toggle",
            ]
        )


def test_lines_past_those_on_their_way_to_a_slow_redis_are_counted_lost_not_queued():
    from services.gateway import trace_record

    class Stuck:
        def __init__(self):
            self.release = asyncio.Event()

        async def xadd(self, *args, **kwargs):
            await self.release.wait()

        async def aclose(self):
            pass

    async def record():
        redis = Stuck()
        sink = RedisSink(redis, "k", 10)
        recorder = TraceRecorder(sink, IMAGE)
        for i in range(trace_record.MAX_PENDING + 5):
            await drain(recorder, request(i), answer(1))
        held = len(sink._pending)
        redis.release.set()
        await recorder.close()
        return recorder.recorded, recorder.lost, held

    assert asyncio.run(record()) == (trace_record.MAX_PENDING + 5, 5, trace_record.MAX_PENDING)
