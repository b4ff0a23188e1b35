"""The caller's side of `StageCalls`: stage calls to workers, each worker's on one stream kept open.

Life of a call here:
  1. `call(address, kind, message)` starts it at once, as a unary call starts when made: the stream to that
     address is opened if none is (again after one ended), and the call goes out as one message;
  2. the stream's reader hands each reply to its call: the response, or a `grpc.aio.AioRpcError` with the code
     the unary rpc would have ended with, so callers handle both kinds of call alike;
  3. cancelling the call sends `cancel` for it; a stream that ends or breaks fails its open calls with its
     status (UNAVAILABLE when the worker ended it, draining), as a unary call to a dead worker fails.
A worker without the service (UNIMPLEMENTED for the whole stream) gets unary calls from then on.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging

import grpc

from common.telemetry.tracing import Tracing
from common.transfer.channels import ChannelPool
from epdmesh.v1 import mesh_pb2 as pb
from epdmesh.v1 import mesh_pb2_grpc as pb_grpc
from services.failure import REASON_KEY
from services.stage_calls.methods import METHODS, span_attributes

log = logging.getLogger(__name__)

MODES = ("stream", "unary")
_CODES = {code.value[0]: code for code in grpc.StatusCode}
_UNARY = {
    "encode": ("EncoderStub", "Encode"),
    "await_encode": ("EncoderStub", "AwaitEncode"),
    "prefill": ("PrefillerStub", "Prefill"),
}


def rpc_error(code: grpc.StatusCode, details: str, reason: str = "") -> grpc.aio.AioRpcError:
    """The error a unary rpc would have raised; `reason` in its trailing metadata, as a servicer puts it there."""
    trailing = grpc.aio.Metadata((REASON_KEY, reason)) if reason else grpc.aio.Metadata()
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), trailing, details)


class StageCalls:
    """Stage calls by worker address: on each worker's open stream (`mode="stream"`), or as unary rpcs."""

    def __init__(self, channels: ChannelPool, mode: str = "stream", tracing: Tracing | None = None):
        if mode not in MODES:
            raise ValueError(f"stage calls go by {' or '.join(MODES)}, not {mode!r}")
        self.channels = channels
        self.mode = mode
        self.tracing = tracing or Tracing()
        self._streams: dict[str, _Stream] = {}
        self._unary_only: set[str] = set()  # workers without the service

    def call(self, address: str, kind: str, message, written: asyncio.Event | None = None) -> asyncio.Task:
        """The call, under way (its reply message, or AioRpcError); cancel the task to cancel the call.
        `written` is set once its message is handed to grpc (or the call failed before that)."""
        if kind not in METHODS:
            raise ValueError(f"no stage call named {kind!r}")
        if self.mode == "unary" or address in self._unary_only:
            return asyncio.ensure_future(self._unary(address, kind, message, written))
        stream = self._streams.get(address)
        if stream is None or stream.failure is not None:
            stream = self._streams[address] = _Stream(pb_grpc.StageCallsStub(self.channels.get(address)), address)
        return asyncio.ensure_future(self._streamed(stream, kind, message, written))

    async def _streamed(self, stream: _Stream, kind: str, message, written: asyncio.Event | None):
        try:
            with self.tracing.span(METHODS[kind][0], span_attributes(METHODS[kind][0]), kind="client"):
                return await stream.call(kind, message, self.tracing.inject(), written)
        except _Unsupported:
            if stream.address not in self._unary_only:
                log.info("worker %s has no StageCalls service: unary stage calls to it", stream.address)
            self._unary_only.add(stream.address)
            return await self._unary(stream.address, kind, message, written)
        finally:
            if written is not None:
                written.set()  # failed before its write (a span, the stream): nothing to wait for

    async def _unary(self, address: str, kind: str, message, written: asyncio.Event | None = None):
        stub_name, method = _UNARY[kind]
        stub = getattr(pb_grpc, stub_name)(self.channels.get(address))
        call = getattr(stub, method)(message)  # under way in grpc's own task
        if written is not None:
            written.set()
        return await call

    async def close(self) -> None:
        streams, self._streams = list(self._streams.values()), {}
        for stream in streams:
            await stream.close()


class _Unsupported(Exception):
    """The worker has no StageCalls service: the call was never made there."""


class _Stream:
    """One open `StageCalls.Open` stream: its calls awaiting replies, and the task reading them."""

    def __init__(self, stub: pb_grpc.StageCallsStub, address: str):
        self.address = address
        self.rpc = stub.Open()
        self.pending: dict[int, asyncio.Future] = {}
        self.failure: tuple[grpc.StatusCode, str] | None = None  # why the stream ended, once it has
        self._ids = itertools.count(1)
        self._writing = asyncio.Lock()  # one write at a time on a grpc stream
        self._opened = asyncio.Event()  # the worker took the stream, or it ended first
        self._reader = asyncio.ensure_future(self._read())

    def error(self) -> Exception:
        """A fresh exception for a call the ended stream fails (a shared one would grow a traceback per raise)."""
        code, details = self.failure
        return _Unsupported() if code == grpc.StatusCode.UNIMPLEMENTED else rpc_error(code, details)

    async def call(self, kind: str, message, trace_context: dict[str, str], written: asyncio.Event | None = None):
        if self.failure is not None:
            raise self.error()
        call_id = next(self._ids)
        reply = self.pending[call_id] = asyncio.get_running_loop().create_future()
        try:
            try:
                await self._write(pb.StageCall(call_id=call_id, trace_context=trace_context, **{kind: message}))
            finally:
                if written is not None:
                    written.set()
            return await reply
        except asyncio.CancelledError:
            if self.failure is None and (reply.cancelled() or not reply.done()):  # no reply yet: stop its work
                asyncio.ensure_future(self._cancel(call_id))
            raise
        finally:
            self.pending.pop(call_id, None)
            if reply.done() and not reply.cancelled():
                reply.exception()  # read: the error was raised by the write, not by this future

    async def _write(self, message: pb.StageCall) -> None:
        await self._opened.wait()  # a write that fails masks the stream's own status (as INTERNAL)
        async with self._writing:
            if self.failure is not None:
                raise self.error()
            # grpc.aio cancels the whole stream when a write is cancelled part-way, failing every call on it: the
            # write goes on in a task of its own, and a caller cancelled meanwhile lets it finish before it leaves
            write = asyncio.ensure_future(self.rpc.write(message))
            try:
                await asyncio.shield(write)
            except asyncio.CancelledError:
                while not write.done():
                    with contextlib.suppress(asyncio.CancelledError):
                        await asyncio.shield(write)
                if not write.cancelled():
                    write.exception()  # read: the stream's reader reports its end
                raise
            except Exception:  # the stream ended (AioRpcError, InvalidStateError): its reader says why
                await asyncio.shield(self._reader)
                raise self.error() from None

    async def _cancel(self, call_id: int) -> None:
        with contextlib.suppress(Exception):
            await self._write(pb.StageCall(call_id=call_id, cancel=pb.CancelCall()))

    async def _read(self) -> None:
        try:
            await self.rpc.initial_metadata()  # the worker sends it at once; a stream refused ends here
            self._opened.set()
            async for reply in self.rpc:
                self._settle(reply)
            self.failure = grpc.StatusCode.UNAVAILABLE, f"worker {self.address} ended its stage-call stream (draining)"
        except grpc.aio.AioRpcError as e:
            # the worker is gone or going (a write into an ended stream fails it as INTERNAL): as a unary call to a
            # dead worker would, its calls fail UNAVAILABLE, so the gateway routes around it
            code = (
                e.code()
                if e.code() in (grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.CANCELLED)
                else grpc.StatusCode.UNAVAILABLE
            )
            self.failure = code, f"the stage-call stream of {self.address} ended: {e.code().name}: {e.details()}"
        except asyncio.CancelledError:
            self.failure = grpc.StatusCode.CANCELLED, "the stage-call stream was closed"
        except Exception as e:  # not expected; the calls must not hang on it
            log.exception("reading the stage-call stream of %s failed", self.address)
            self.failure = grpc.StatusCode.UNAVAILABLE, f"the stage-call stream of {self.address} failed: {e}"
        self._opened.set()
        for reply in self.pending.values():
            if not reply.done():
                reply.set_exception(self.error())

    def _settle(self, reply: pb.StageReply) -> None:
        future = self.pending.get(reply.call_id)
        if future is None or future.done():
            return  # cancelled meanwhile
        body = reply.WhichOneof("body")
        if body == "error":
            code = _CODES.get(reply.error.code, grpc.StatusCode.UNKNOWN)
            future.set_exception(rpc_error(code, reply.error.details, reply.error.reason))
        elif body is None:
            future.set_exception(rpc_error(grpc.StatusCode.INTERNAL, f"an empty reply to call {reply.call_id}"))
        else:
            future.set_result(getattr(reply, body))

    async def close(self) -> None:
        self.rpc.cancel()
        self._reader.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self._reader
