"""Stage calls on a stream kept open to a worker: the replies, errors, cancellation and failure a unary call has."""

import asyncio
import contextlib
import types

import grpc
import pytest

from common.transfer.channels import ChannelPool
from epdmesh.v1 import mesh_pb2 as pb
from epdmesh.v1 import mesh_pb2_grpc as pb_grpc
from services.errors import grpc_errors
from services.stage_calls.client import StageCalls
from services.stage_calls.server import StageCallsServicer


def _reply(request_id: str) -> pb.PrefillResponse:
    return pb.PrefillResponse(first=pb.TokenChunk(token_ids=[len(request_id)], text=request_id))


class Handlers:
    """Stage methods whose behaviour a test steers by the request id."""

    def __init__(self):
        self.started: list[str] = []
        self.cancelled: list[str] = []
        self.gates: dict[str, asyncio.Event] = {}

    async def prefill(self, request: pb.PrefillRequest) -> pb.PrefillResponse:
        rid = request.request.request_id
        self.started.append(rid)
        try:
            if rid in self.gates:
                await self.gates[rid].wait()
        except asyncio.CancelledError:
            self.cancelled.append(rid)
            raise
        if rid.startswith("bad"):
            raise ValueError(f"no good: {rid}")
        if rid.startswith("gone"):
            raise KeyError(f"no such thing as {rid}")
        if rid.startswith("bug"):
            raise RuntimeError("a bug of ours")
        return _reply(rid)


def _prefill(request_id: str) -> pb.PrefillRequest:
    return pb.PrefillRequest(request=pb.RequestSpec(request_id=request_id))


async def _serve(handlers: Handlers, streamed: bool = True):
    server = grpc.aio.server()
    servicer = None
    if streamed:
        servicer = StageCallsServicer({"prefill": handlers.prefill})
        pb_grpc.add_StageCallsServicer_to_server(servicer, server)

    class Unary(pb_grpc.PrefillerServicer):  # as the worker's servicers map errors
        @grpc_errors
        async def Prefill(self, request, context):
            return await handlers.prefill(request)

    pb_grpc.add_PrefillerServicer_to_server(Unary(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, servicer, f"127.0.0.1:{port}"


@contextlib.asynccontextmanager
async def _calling(mode: str = "stream", streamed: bool = True, gated: tuple[str, ...] = ()):
    """A worker serving `Handlers` (with the StageCalls stream, or only unary), and a caller to it; `gated`: request
    ids whose handler waits for its gate."""
    handlers = Handlers()
    handlers.gates.update((rid, asyncio.Event()) for rid in gated)
    server, servicer, address = await _serve(handlers, streamed)
    channels = ChannelPool()
    calls = StageCalls(channels, mode)
    try:
        yield handlers, server, servicer, address, calls
    finally:
        await calls.close()
        await channels.close()
        await server.stop(0)


async def _until(predicate, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


@pytest.mark.parametrize("mode", ["stream", "unary"])
def test_replies_reach_their_calls_in_whatever_order_they_finish(mode):
    async def main():
        async with _calling(mode, gated=("slow",)) as (handlers, server, servicer, address, calls):
            slow = calls.call(address, "prefill", _prefill("slow"))
            quick = [calls.call(address, "prefill", _prefill(f"quick-{i}")) for i in range(5)]
            replies = await asyncio.gather(*quick)
            assert [r.first.text for r in replies] == [f"quick-{i}" for i in range(5)]
            assert not slow.done()
            handlers.gates["slow"].set()
            assert (await slow).first.token_ids == [4]
            assert servicer.num_open == (1 if mode == "stream" else 0)  # one stream carried all six

    asyncio.run(main())


@pytest.mark.parametrize("mode", ["stream", "unary"])
def test_an_error_is_the_status_code_the_unary_rpc_ends_with_and_the_stream_goes_on(mode):
    async def main():
        async with _calling(mode) as (handlers, server, servicer, address, calls):
            for rid, code, details in (
                ("bad-1", grpc.StatusCode.INVALID_ARGUMENT, "no good: bad-1"),
                ("gone-1", grpc.StatusCode.NOT_FOUND, "no such thing as gone-1"),
                ("bug-1", grpc.StatusCode.INTERNAL, "a bug of ours"),
            ):
                with pytest.raises(grpc.aio.AioRpcError) as failed:
                    await calls.call(address, "prefill", _prefill(rid))
                assert failed.value.code() == code
                assert details in failed.value.details()
            assert (await calls.call(address, "prefill", _prefill("fine"))).first.text == "fine"

    asyncio.run(main())


def test_a_method_the_worker_does_not_serve_is_unimplemented_for_that_call_only():
    async def main():
        async with _calling() as (handlers, server, servicer, address, calls):
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                await calls.call(address, "await_encode", pb.AwaitEncodeRequest(request_id="x"))
            assert failed.value.code() == grpc.StatusCode.UNIMPLEMENTED
            assert "does not serve await_encode" in failed.value.details()
            assert (await calls.call(address, "prefill", _prefill("after"))).first.text == "after"
            with pytest.raises(ValueError, match="no stage call named 'decode'"):
                calls.call(address, "decode", _prefill("x"))

    asyncio.run(main())


@pytest.mark.parametrize("mode", ["stream", "unary"])
def test_cancelling_a_call_cancels_its_work_on_the_worker_and_nothing_else(mode):
    async def main():
        async with _calling(mode, gated=("doomed", "kept")) as (handlers, server, servicer, address, calls):
            doomed = calls.call(address, "prefill", _prefill("doomed"))
            kept = calls.call(address, "prefill", _prefill("kept"))
            await _until(lambda: {"doomed", "kept"} <= set(handlers.started))
            doomed.cancel()
            await _until(lambda: handlers.cancelled == ["doomed"])
            handlers.gates["kept"].set()
            assert (await kept).first.text == "kept"
            assert (await calls.call(address, "prefill", _prefill("next"))).first.text == "next"
            assert handlers.cancelled == ["doomed"]

    asyncio.run(main())


def test_a_draining_worker_ends_the_stream_its_open_calls_fail_unavailable_and_new_calls_open_another():
    async def main():
        async with _calling(gated=("stuck",)) as (handlers, server, servicer, address, calls):
            assert (await calls.call(address, "prefill", _prefill("first"))).first.text == "first"
            stuck = calls.call(address, "prefill", _prefill("stuck"))
            await _until(lambda: "stuck" in handlers.started)
            servicer.end()
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                await stuck
            assert failed.value.code() == grpc.StatusCode.UNAVAILABLE  # the gateway routes around the worker
            assert "ended its stage-call stream" in failed.value.details()
            await _until(lambda: handlers.cancelled == ["stuck"])  # the worker does not carry on alone
            await _until(lambda: servicer.num_open == 0)
            assert (await calls.call(address, "prefill", _prefill("again"))).first.text == "again"
            assert servicer.num_open == 1

    asyncio.run(main())


def test_a_worker_that_goes_away_fails_the_open_calls_unavailable():
    async def main():
        async with _calling(gated=("orphan",)) as (handlers, server, servicer, address, calls):
            orphan = calls.call(address, "prefill", _prefill("orphan"))
            await _until(lambda: "orphan" in handlers.started)
            await server.stop(0)
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                await orphan
            assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
            with pytest.raises(grpc.aio.AioRpcError) as failed:  # a new stream to a dead address: the same
                await calls.call(address, "prefill", _prefill("late"))
            assert failed.value.code() == grpc.StatusCode.UNAVAILABLE

    asyncio.run(main())


def test_a_worker_without_the_stream_service_gets_unary_calls():
    async def main():
        async with _calling(streamed=False) as (handlers, server, servicer, address, calls):
            replies = await asyncio.gather(*(calls.call(address, "prefill", _prefill(f"old-{i}")) for i in range(3)))
            assert [r.first.text for r in replies] == ["old-0", "old-1", "old-2"]
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                await calls.call(address, "prefill", _prefill("bad-old"))
            assert failed.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert sorted(handlers.started) == ["bad-old", "old-0", "old-1", "old-2"]  # each ran once, unary

    asyncio.run(main())


def test_a_mode_other_than_stream_or_unary_is_refused():
    with pytest.raises(ValueError, match="stream or unary"):
        StageCalls(ChannelPool(), "carrier-pigeon")


def test_a_call_cancelled_while_its_message_is_being_written_leaves_the_stream_and_the_other_calls_alone():
    """grpc.aio cancels a whole stream when a write on it is cancelled part-way (as it does, the fake below does):
    one request cancelled then (its client gone, its route refused) failed every call on the worker's stream with
    CANCELLED — a 500 for requests that had nothing to do with it (seen in a black-box run)."""
    from services.stage_calls.client import _Stream

    class Rpc:
        def __init__(self):
            self.cancelled, self.written, self.replies = False, [], asyncio.Queue()
            self.writing = asyncio.Event()
            self.may_finish = asyncio.Event()

        async def initial_metadata(self):
            return ()

        async def write(self, message):
            self.writing.set()
            try:
                await self.may_finish.wait()  # a big message, waiting for the HTTP/2 window
            except asyncio.CancelledError:
                self.cancelled = True  # grpc.aio's _write: `if not self.cancelled(): self.cancel()`
                raise
            self.written.append(message)

        def cancel(self):
            self.cancelled = True

        def __aiter__(self):
            return self

        async def __anext__(self):
            return await self.replies.get()

    async def main():
        rpc = Rpc()
        stream = _Stream(types.SimpleNamespace(Open=lambda: rpc), "127.0.0.1:1")
        slow = asyncio.ensure_future(stream.call("prefill", _prefill("slow"), {}))
        await rpc.writing.wait()
        slow.cancel()  # while its message is being written
        other = asyncio.ensure_future(stream.call("prefill", _prefill("other"), {}))
        await asyncio.sleep(0.01)
        rpc.may_finish.set()
        with pytest.raises(asyncio.CancelledError):
            await slow
        while len(rpc.written) < 2:
            await asyncio.sleep(0.01)
        rpc.replies.put_nowait(pb.StageReply(call_id=rpc.written[1].call_id, prefill=_reply("other")))
        assert (await asyncio.wait_for(other, 5)).first.text == "other"
        assert not rpc.cancelled and stream.failure is None
        while len(rpc.written) < 3:
            await asyncio.sleep(0.01)
        assert sorted(m.WhichOneof("body") for m in rpc.written) == ["cancel", "prefill", "prefill"]  # slow's cancel
        await stream.close()

    asyncio.run(main())


@pytest.mark.parametrize("mode", ["stream", "unary"])
def test_written_is_set_once_the_calls_message_is_out_while_its_reply_is_still_to_come(mode):
    """What a reservation made ahead waits for (`Router.route_ahead(after=)`): set when the message is handed to
    grpc — the worker gets it, the reply has not come — and set too when the call fails before any write."""

    async def main():
        async with _calling(mode, gated=("slow",)) as (handlers, server, servicer, address, calls):
            written = asyncio.Event()
            slow = calls.call(address, "prefill", _prefill("slow"), written)
            assert not written.is_set()  # the call's task has not run yet
            await asyncio.wait_for(written.wait(), 5)
            await _until(lambda: handlers.started == ["slow"])
            assert not slow.done()
            handlers.gates["slow"].set()
            assert (await slow).first.text == "slow"
        failed = asyncio.Event()
        calls = StageCalls(ChannelPool(), mode)
        gone = calls.call("127.0.0.1:1", "prefill", _prefill("nowhere"), failed)  # nothing listens there
        with pytest.raises(grpc.aio.AioRpcError):
            await asyncio.wait_for(gone, 30)
        assert failed.is_set()
        await calls.close()

    asyncio.run(main())
