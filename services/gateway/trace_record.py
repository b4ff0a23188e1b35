"""The gateway's recorded trace (`serve --record-trace`): one line of `common/trace.py`'s format per request it
served — its arrival, prompt length, prefix blocks and pictures (as hashes), answer length, finish reason and
TTFT — to a file (JSON lines, appended) or to a Redis stream that every gateway of a mesh shares (`XADD` with an
approximate `MAXLEN`; `epdmesh trace export` writes it out as a file). `epdmesh sim goodput`, `epdmesh plan` and
`epdmesh bench goodput` replay it with `--workload trace:PATH`.

Every request is recorded when its output stream ends, however it ends (finished, failed, or the client gone:
`finish_reason` "abort"), so the trace is the load that arrived, not only the load served. A sink that fails
(a full disk, Redis gone) logs once and drops lines: recording never fails a request.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator

from common import trace
from common.engine.outputs import RequestOutput
from common.request import Request, image_marks

log = logging.getLogger(__name__)

FIELD = "r"  # each stream entry: one field holding the line
MAX_PENDING = 1000  # lines on their way to Redis at once; more are dropped (and counted lost)


class FileSink:
    def __init__(self, path: str):
        self.path = path
        self._file = open(path, "a", buffering=1)  # noqa: SIM115 — open for the gateway's life; a line at a time
        self._failed = False
        self.lost = lambda: None  # called for each line lost (the recorder counts them)

    def write(self, line: str) -> None:
        try:
            self._file.write(line + "\n")
        except OSError as e:
            self.lost()
            if not self._failed:
                log.warning("the trace's file %s took no more lines (%s); the requests go on unrecorded", self.path, e)
                self._failed = True

    async def close(self) -> None:
        self._file.close()


class RedisSink:
    def __init__(self, redis, key: str, maxlen: int):
        self.redis, self.key, self.maxlen = redis, key, maxlen
        self._pending: set[asyncio.Task] = set()
        self._failed = False
        self.lost = lambda: None  # called for each line lost (the recorder counts them)

    def write(self, line: str) -> None:
        if len(self._pending) >= MAX_PENDING:  # Redis slower than the requests end: lines lost, not memory
            self.lost()
            return
        task = asyncio.ensure_future(self._add(line))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _add(self, line: str) -> None:
        try:
            await self.redis.xadd(self.key, {FIELD: line}, maxlen=self.maxlen, approximate=True)
            self._failed = False
        except Exception as e:  # Redis down or refusing: routing degrades elsewhere; here a line is lost
            self.lost()
            if not self._failed:
                log.warning("the trace's Redis stream %s took no line (%s); requests go on unrecorded", self.key, e)
                self._failed = True

    async def close(self) -> None:
        if self._pending:
            await asyncio.wait(list(self._pending), timeout=2)
        await self.redis.aclose()


class TraceRecorder:
    def __init__(self, sink, image_token_id: int | None, block: int = trace.RECORD_BLOCK, metrics=None):
        """`block`: the tokens a prefix id stands for (`--record-trace-block`); `metrics`: the gateway's, whose
        `epdmesh:trace_lines_total{outcome=recorded|lost}` counts the lines."""
        self.sink = sink
        self.image_token_id = image_token_id
        self.block = block
        self.recorded = self.lost = 0
        self._metrics = metrics
        sink.lost = self._lost

    async def observe(
        self, request: Request, outputs: AsyncIterator[RequestOutput], arrival: float | None = None
    ) -> AsyncIterator[RequestOutput]:
        """The request's outputs, passed through; its line written when they end. `arrival` (monotonic): when the
        backend got it, where that is before `request.arrival_time` (the local engine's: once its prompt is made)."""
        arrival = request.arrival_time if arrival is None else arrival
        arrival_ms = time.time() * 1e3 - (time.monotonic() - arrival) * 1e3  # wall clock at arrival
        first_at = None
        final = None
        reason = "abort"
        try:
            async for out in outputs:
                if first_at is None and out.new_token_ids:
                    first_at = time.monotonic()
                final = out
                yield out
        except Exception:
            reason = "error"
            raise
        finally:
            if final is not None and final.finished:  # a stream its reader closes at its last output ended well
                reason = final.finish_reason or "stop"
            self._record(request, arrival, arrival_ms, final, reason, first_at)
            if hasattr(outputs, "aclose"):  # the request ends now (the client gone), not when it is collected
                await outputs.aclose()

    def _record(
        self, request: Request, arrival: float, arrival_ms: float, final, reason: str, first_at: float | None
    ) -> None:
        try:
            ids = request.prompt_token_ids
            marks = image_marks(ids, self.image_token_id, [(i.content_hash, i.num_tokens) for i in request.images])
            row = trace.TraceRow(
                round(arrival_ms, 3),
                len(ids),
                len(final.output_token_ids) if final is not None else 0,
                trace.hash_ids(ids, marks, request.cache_salt, self.block),
                tuple(
                    trace.TraceImage(trace.image_id(i.content_hash), i.num_tokens, at)
                    for i, (at, _) in zip(request.images, marks)
                ),
                request.sampling.max_tokens,
                reason,
                round((first_at - arrival) * 1e3, 3) if first_at is not None else None,
                self.block,
            )
            self.recorded += 1
            if self._metrics is not None:
                self._metrics.trace_lines.labels(self._metrics.model, "recorded").inc()
            self.sink.write(json.dumps(row.as_json(), separators=(",", ":")))
        except Exception:  # a bug here must not fail the request that has been answered
            log.exception("could not record request %s in the trace", request.request_id)

    def _lost(self) -> None:
        self.lost += 1
        if self._metrics is not None:
            self._metrics.trace_lines.labels(self._metrics.model, "lost").inc()

    async def close(self) -> None:
        await self.sink.close()


def recorder_of(args, image_token_id: int | None, mesh_tls=None, metrics=None) -> TraceRecorder | None:
    """`--record-trace`'s recorder: None without one; "redis": the stream `--record-trace-key` in the gateway's
    Redis (`--redis-url`); else a file's path (its folder must exist)."""
    spec = args.record_trace
    if not spec:
        return None
    if args.record_trace_block < 1:
        raise SystemExit("--record-trace-block must be at least 1")
    if spec == "redis":
        if not getattr(args, "redis_url", None):
            raise SystemExit("--record-trace redis: this gateway has no Redis (--redis-url); record to a file instead")
        if args.record_trace_max < 1:
            raise SystemExit("--record-trace-max must be at least 1")
        from services.routing.registry import redis_client

        sink = RedisSink(redis_client(args.redis_url, mesh_tls), args.record_trace_key, args.record_trace_max)
        return TraceRecorder(sink, image_token_id, args.record_trace_block, metrics)
    try:
        return TraceRecorder(FileSink(spec), image_token_id, args.record_trace_block, metrics)
    except OSError as e:
        raise SystemExit(f"--record-trace: cannot append to {spec}: {e.strerror}") from None


def export(redis_url: str, key: str, out: str, last: int = 0, mesh_tls=None) -> tuple[int, float, float]:
    """The stream's requests (the `last` most recent, 0: all) to the file `out`, in arrival order: (how many, the
    first and last arrival in ms). Lines that are not requests (another writer's) are skipped with a warning."""
    import redis

    kwargs = mesh_tls.redis_kwargs(redis_url) if mesh_tls else {}
    client = redis.Redis.from_url(redis_url, **kwargs)
    rows, skipped = [], 0
    try:
        entries = client.xrevrange(key, count=last) if last else client.xrange(key)
    finally:
        client.close()
    for entry_id, fields in entries:
        raw = fields.get(FIELD.encode())
        try:
            rows.append(trace.row_of(json.loads(raw), f"{key} {entry_id.decode()}"))
        except (TypeError, ValueError) as e:
            skipped += 1
            if skipped == 1:
                log.warning("skipped an entry that is no request: %s", e)
    rows.sort(key=lambda r: r.timestamp_ms)
    if skipped:
        log.warning("%d entries of %s skipped", skipped, key)
    trace.write(rows, out)
    return len(rows), rows[0].timestamp_ms if rows else 0.0, rows[-1].timestamp_ms if rows else 0.0
