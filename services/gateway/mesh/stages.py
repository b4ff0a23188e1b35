"""One route's stages, driven by handles: Encode (awaited), Prefill, Decode, each a call to the worker its plan names;
what each returns is passed on, never the pages themselves (`failover` routes again and migrates; this runs one
route).

  1. images on a worker other than the prefill one: `Encode` there, and at once the next stage's call with the images
     pending on that encoder (it asks the encoder for the image handle: `AwaitEncode`); images whose KV the prefill
     worker is predicted to hold go without an Encode, and are encoded and sent again if it answers that it does not;
  2. dedicated path: `Prefill` → first token + KV handle, then `Decode(KV handle)`; colocated / multiplexed:
     `Decode` on the decoder, which prefills itself;
  3. a handle got here and not passed on (the client gone, a stage failed) is released at its source at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import grpc

from common.engine.outputs import RequestOutput
from common.policy.routing import PrefillPath
from common.request import FINISH_REASONS, Request, RequestStatus
from common.telemetry.tracing import Tracing
from common.transfer.channels import ChannelPool
from common.transfer.grpc_stream import release_over_grpc
from epdmesh.v1 import mesh_pb2 as pb
from epdmesh.v1 import mesh_pb2_grpc as pb_grpc
from services import wire
from services.gateway.mesh.outcome import HandedBack, answer_of, classify, consume, is_uncached, source_failed
from services.gateway.mesh.route_client import Route
from services.stage_calls.client import StageCalls

_STATUS_OF = {reason: status for status, reason in FINISH_REASONS.items()}

# sends a stage's call with (pending images or None, images predicted cached there); returns its answer under way
Send = Callable[[pb.PendingImages | None, bool], asyncio.Future]


class Stages:
    def __init__(self, channels: ChannelPool, calls: StageCalls, tracing: Tracing, spawn: Callable):
        """`spawn(coro)`: run it in the background (releasing a handle nobody took)."""
        self.channels = channels
        self.calls = calls
        self.tracing = tracing
        self.spawn = spawn

    async def drive(self, request: Request, route: Route, span=None) -> AsyncIterator[RequestOutput]:
        """The request's outputs through the route's stages; a failed stage raises StageError, a decoder that
        handed the request back HandedBack. The route's reservation is confirmed before the decoder gets the
        request (a dedicated prefill goes out before, and sets `route.written` once its message is out)."""
        run = _Run(self, request, route, span)
        try:
            stream = run.dedicated() if route.plan.path == PrefillPath.DEDICATED else run.on_decoder()
            async for out in stream:
                yield out
        finally:
            run.close()

    def release(self, handle: pb.PageHandle) -> None:
        """Let the source of pages nobody will pull free them now rather than at lease expiry."""
        self.spawn(release_over_grpc(self.channels, wire.handle_from_pb(handle)))

    async def resume(
        self, request: Request, route: Route, last: int, kv: pb.PageHandle, source: str, span=None
    ) -> AsyncIterator[RequestOutput]:
        """A request handed back with its KV (`kv`, held by `source`), decoded on from its `last` token on the
        route's decoder; only the decoder of the route is called."""
        run = _Run(self, request, route, span, encode=False)
        try:
            async for out in run.resumed(last, kv, source):
                yield out
        finally:
            run.close()


class _Run:
    """One route's stage calls and what they hold: the encode under way, handles not passed on yet, the output."""

    def __init__(self, stages: Stages, request: Request, route: Route, span, encode: bool = True):
        self.stages, self.request, self.route, self.plan, self.span = stages, request, route, route.plan, span
        self.held: list[pb.PageHandle] = []  # handles got here and not passed on yet
        self.encoding: asyncio.Task | None = None
        self.prefilling: asyncio.Future | None = None
        self.pending: pb.PendingImages | None = None  # the next stage's images, pending on the encoder
        self.source: str | None = None  # the registration of the next stage's pages' source
        self.output: list[int] = []
        self.cached = 0  # prompt tokens the prefilling worker found in its prefix cache
        separate = encode and bool(request.images) and self.plan.encoder.worker_id != self.plan.prefill.worker_id
        # the router predicts the prefill worker holds the images' KV: no Encode (it says so if it does not)
        self.skip_encode = separate and self.plan.images_cached
        if separate and not self.skip_encode:
            self._encode()  # goes out with the next stage's call, which asks the encoder for the pages' handle
        self.spec = wire.spec_to_pb(request, with_pixels=not separate)

    async def on_decoder(self) -> AsyncIterator[RequestOutput]:
        """Colocated and multiplexed paths: the decoder prefills too."""
        self.route.written.set()  # nothing goes out before the reservation on this path
        await self.route.confirmed()
        async for out in self._decode(
            lambda pending, cached: pb.DecodeRequest(request=self.spec, pending_images=pending, images_cached=cached)
        ):
            yield out

    async def dedicated(self) -> AsyncIterator[RequestOutput]:
        """Prefill on a prefill worker, its first token out at once, then Decode with its KV handle."""
        prefill = self.plan.prefill

        def send(pending: pb.PendingImages | None, cached: bool, written: asyncio.Event | None = None):
            with self.stages.tracing.activate(self.span):
                message = pb.PrefillRequest(request=self.spec, pending_images=pending, images_cached=cached)
                self.prefilling = self.stages.calls.call(prefill.info.address, "prefill", message, written)
            return self.prefilling

        self.route.reached(prefill)
        answer = send(self.pending, self.skip_encode, self.route.written)
        await self.route.confirmed()
        answer = await self._provided(answer, send)
        reply = await answer_of("prefill", answer, prefill.info.registration, self.source)
        self.held.clear()
        first = reply.first
        if not first.finish_reason:  # held before the first token goes out: a client gone right after it must
            self.held.append(reply.kv_pages)  # not leave the KV pinned until its lease ends
        self.output.extend(first.token_ids)
        self.cached = first.num_cached_tokens
        yield _output(self.request.request_id, first, self.output)
        if first.finish_reason:
            return
        spec = wire.spec_to_pb(self.request, with_pixels=False)
        spec.output_token_ids.extend(self.output)
        self.source, self.encoding, self.skip_encode = prefill.info.registration, None, False  # the KV's source
        async for out in self._decode(lambda pending, cached: pb.DecodeRequest(request=spec, kv_pages=reply.kv_pages)):
            yield out

    async def resumed(self, last: int, kv: pb.PageHandle, source: str) -> AsyncIterator[RequestOutput]:
        """Decode on a decoder given the KV pages another decoder handed back: as the dedicated path's Decode, with
        the last token sent before as the first."""
        self.held.append(kv)  # released if the decoder never takes it
        self.route.written.set()
        await self.route.confirmed()
        self.output, self.source = [last], source
        spec = wire.spec_to_pb(self.request, with_pixels=False)
        spec.output_token_ids.append(last)
        async for out in self._decode(lambda pending, cached: pb.DecodeRequest(request=spec, kv_pages=kv)):
            yield out

    async def _decode(
        self, message: Callable[[pb.PendingImages | None, bool], pb.DecodeRequest]
    ) -> AsyncIterator[RequestOutput]:
        """The decoder's stream of tokens (`message(pending, cached)`: the Decode to send)."""
        decoder, call = self.plan.decoder, None

        def send(pending: pb.PendingImages | None, cached: bool) -> asyncio.Future:
            nonlocal call
            if call is not None:
                call.cancel()
            with self.stages.tracing.activate(self.span):  # the call's client span, under the request's span
                call = pb_grpc.DecoderStub(self.stages.channels.get(decoder.info.address)).Decode(
                    message(pending, cached)
                )
            return asyncio.ensure_future(call.read())  # (read(), not `async for`: grpc allows one style a call)

        self.route.reached(decoder)
        try:
            chunk = await (await self._provided(send(self.pending, self.skip_encode), send))
            while chunk is not grpc.aio.EOF:
                if chunk.handed_back:  # preempted there, or it switches roles: no more tokens come from this call
                    kv = chunk.kv_pages if chunk.HasField("kv_pages") else None
                    raise HandedBack(decoder.worker_id, kv, decoder.info.registration)
                self.held.clear()
                self.output.extend(chunk.token_ids)
                self.cached = max(self.cached, chunk.num_cached_tokens)
                yield _output(self.request.request_id, chunk, self.output, self.cached)
                chunk = await call.read()
        except grpc.aio.AioRpcError as e:
            raise classify("decode", e, decoder.info.registration, self.source if not self.output else None) from None
        finally:
            if call is not None:
                call.cancel()

    async def _provided(self, answer: asyncio.Future, send: Send) -> asyncio.Future:
        """The stage's `answer`, once the images it waits for are provided: a stage sent without them (predicted
        cached there) that answers they are not gets them encoded and is sent again; then the awaited Encode it
        depends on is waited for — unless the stage answers first (its prefix cache held the images)."""
        if self.skip_encode and await _uncached(answer):
            self.skip_encode = False
            self._encode()
            answer = send(self.pending, False)
        try:
            await self._encoded_unless_answered(answer)
        except BaseException:
            answer.cancel()
            raise
        return answer

    async def _encoded_unless_answered(self, answer: asyncio.Future) -> None:
        """The Encode's reply (its image handle held until the stage took it), unless the stage answers first: a
        worker whose prefix cache holds the images' KV does not wait for their pages, and the Encode is cancelled.
        A failed Encode fails its waiting stage (ABORTED) at once: the Encode's own error is the request's."""
        if self.encoding is None:
            return
        await asyncio.wait((self.encoding, answer), return_when=asyncio.FIRST_COMPLETED)
        answered_failed_source = answer.done() and not answer.cancelled() and source_failed(answer.exception())
        if not self.encoding.done() and not answered_failed_source:
            self.encoding.cancel()
            return
        self.held.append((await self.encoding).image_pages)

    def _encode(self) -> None:
        """The awaited Encode, under way; the next stage's images pending on that encoder, which is their source."""
        encoder = self.plan.encoder
        self.route.reached(encoder)
        message = pb.EncodeRequest(request=wire.spec_to_pb(self.request, with_pixels=True), awaited=True)
        with self.stages.tracing.activate(self.span):
            call = self.stages.calls.call(encoder.info.address, "encode", message)  # made first: it goes out first
        self.encoding = asyncio.ensure_future(answer_of("encode", call, encoder.info.registration))
        self.encoding.add_done_callback(consume)  # its outcome is awaited, unless the request failed before that
        self.encoding.add_done_callback(lambda _: call.cancel())  # cancelled before it ran: not to go on alone
        self.pending = pb.PendingImages(
            worker_id=encoder.worker_id, address=encoder.info.address, request_id=self.request.request_id
        )
        self.source = encoder.info.registration

    def close(self) -> None:
        self.route.written.set()  # never left waiting, however this ended
        for task in (self.encoding, self.prefilling, self.route.reserved):
            if task is not None:
                task.cancel()  # a no-op once it is done
        for handle in self.held:  # never passed on
            self.stages.release(handle)


async def _uncached(answer: asyncio.Future) -> bool:
    """Whether a stage sent without its images answered that they are not cached there; any other outcome is left
    in `answer` for the caller to read."""
    try:
        await asyncio.shield(answer)
    except Exception as e:
        return is_uncached(e)
    return False


def _output(request_id: str, chunk: pb.TokenChunk, output: list[int], cached: int = 0) -> RequestOutput:
    """`cached`: the prompt tokens the prefilling worker had cached (a decoder that got the KV reports none)."""
    status = (
        _STATUS_OF.get(chunk.finish_reason, RequestStatus.DECODING) if chunk.finish_reason else RequestStatus.DECODING
    )
    return RequestOutput(
        request_id=request_id,
        new_token_ids=list(chunk.token_ids),
        output_token_ids=list(output),
        status=status,
        finish_reason=chunk.finish_reason or None,
        stop_reason=wire.chunk_stop_reason(chunk),
        text=chunk.text if chunk.HasField("text") else None,
        num_prompt_tokens=chunk.num_prompt_tokens,
        num_cached_tokens=max(cached, chunk.num_cached_tokens),
        logprobs=wire.chunk_logprobs(chunk),
    )
