"""A routed request's stages, driven by handles: Encode (awaited), Prefill, Decode, each a call to the worker its plan
names; what each returns is passed on, never the pages themselves (`mesh.MeshBackend` routes, retries and migrates;
this runs one plan).

  images on a worker other than the prefill one: `Encode` there, and at once the next stage's call with the images
  pending on that encoder (it asks the encoder for the image handle: `AwaitEncode`);
  dedicated path: `Prefill` → first token + KV handle, then `Decode(KV handle)`; colocated / multiplexed: `Decode` on
  the decoder, which prefills itself;
  a handle got here and not passed on (the client gone, a stage failed) is released at its source at once.
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
from services.gateway.stage_errors import confirmed, encoded_unless_answered, failure, stage_call
from services.stage_calls.client import StageCalls

_STATUS_OF = {reason: status for status, reason in FINISH_REASONS.items()}


class Stages:
    def __init__(self, channels: ChannelPool, calls: StageCalls, tracing: Tracing,
                 sent: Callable[[Request, str], None], spawn: Callable):
        """`sent(request, worker_id)`: the request reaches that worker now; `spawn(coro)`: run it in the background."""
        self.channels = channels
        self.calls = calls
        self.tracing = tracing
        self.sent = sent
        self.spawn = spawn

    async def drive(self, request: Request, plan: pb.RoutePlan, path: PrefillPath, span=None,
                     reserved: asyncio.Future | None = None,
                     written: asyncio.Event | None = None) -> AsyncIterator[RequestOutput]:
        """The request's outputs through the planned stages; a failed stage raises StageFailed. `reserved`: the
        plan's KV reservation under way, confirmed before the decoder gets the request (a dedicated prefill
        starts before, and sets `written` when its call's message is out; on other paths it is set at once)."""
        written = written or asyncio.Event()
        held: list[pb.PageHandle] = []  # handles we got and have not passed on yet
        encoding: asyncio.Task | None = None
        prefilling: asyncio.Task | None = None
        try:
            pending = source = None
            separate = bool(request.images) and plan.encoder.worker_id != plan.prefill.worker_id
            # the router predicts the prefill worker holds the images' KV: no Encode (it says so if it does not)
            skip_encode = separate and plan.images_cached
            if separate and not skip_encode:
                # the Encode and the next stage's call go out together: that stage asks the encoder for the
                # pages' handle (AwaitEncode) rather than waiting for it to come back through here
                encoding, pending, source = self._encode_pending(request, plan, span)
            spec = wire.spec_to_pb(request, with_pixels=not separate)
            output: list[int] = []
            cached = 0  # prompt tokens the prefilling worker found in its prefix cache
            if path != PrefillPath.DEDICATED:
                written.set()  # nothing goes out before the reservation on this path
                await confirmed(reserved, plan)
            if path == PrefillPath.DEDICATED:
                self.sent(request, plan.prefill.worker_id)
                with self.tracing.activate(span):
                    prefilling = self.calls.call(plan.prefill.address, "prefill", pb.PrefillRequest(
                        request=spec, pending_images=pending, images_cached=skip_encode), written)
                await confirmed(reserved, plan)
                if skip_encode and await _not_cached(prefilling):  # predicted wrong: encode them after all
                    encoding, pending, source = self._encode_pending(request, plan, span)
                    with self.tracing.activate(span):
                        prefilling = self.calls.call(plan.prefill.address, "prefill",
                                                     pb.PrefillRequest(request=spec, pending_images=pending))
                await encoded_unless_answered(encoding, held, prefilling)
                reply = await stage_call("prefill", wire.ref_registration(plan.prefill), source, prefilling)
                held.clear()
                if not reply.first.finish_reason:  # held before the first token goes out: a client gone right
                    held.append(reply.kv_pages)    # after it must not leave the KV pinned until its lease ends
                output.extend(reply.first.token_ids)
                cached = reply.first.num_cached_tokens
                yield _output(request.request_id, reply.first, output)
                if reply.first.finish_reason:
                    return
                spec = wire.spec_to_pb(request, with_pixels=False)
                spec.output_token_ids.extend(output)
                decode = pb.DecodeRequest(request=spec, kv_pages=reply.kv_pages)
                source, encoding = wire.ref_registration(plan.prefill), None  # the KV pages' source
            else:
                decode = pb.DecodeRequest(request=spec, pending_images=pending, images_cached=skip_encode)
            self.sent(request, plan.decoder.worker_id)
            with self.tracing.activate(span):  # the call's client span is made here, under the request's span
                call = pb_grpc.DecoderStub(self.channels.get(plan.decoder.address)).Decode(decode)
            try:
                reading = asyncio.ensure_future(call.read())  # (read(), not `async for`: grpc allows one style a call)
                if decode.images_cached and await _not_cached(reading):  # predicted wrong: encode them after all
                    call.cancel()
                    encoding, pending, source = self._encode_pending(request, plan, span)
                    decode = pb.DecodeRequest(request=spec, pending_images=pending)
                    with self.tracing.activate(span):
                        call = pb_grpc.DecoderStub(self.channels.get(plan.decoder.address)).Decode(decode)
                    reading = asyncio.ensure_future(call.read())
                try:
                    await encoded_unless_answered(encoding, held, reading)
                except BaseException:
                    reading.cancel()
                    raise
                chunk = await reading
                while chunk is not grpc.aio.EOF:
                    if chunk.handed_back:  # preempted there: no more tokens come from this call
                        raise HandedBack(plan.decoder.worker_id)
                    held.clear()
                    output.extend(chunk.token_ids)
                    cached = max(cached, chunk.num_cached_tokens)
                    yield _output(request.request_id, chunk, output, cached)
                    chunk = await call.read()
            except grpc.aio.AioRpcError as e:
                raise failure("decode", wire.ref_registration(plan.decoder), source if not output else None, e) from None
            finally:
                call.cancel()
        finally:
            written.set()  # never left waiting, however this ended
            for task in (encoding, prefilling, reserved):
                if task is not None:
                    task.cancel()  # a no-op once it is done
            for handle in held:  # never passed on: let the source free them now rather than at lease expiry
                self.spawn(release_over_grpc(self.channels, wire.handle_from_pb(handle)))

    def _encode_pending(self, request: Request, plan: pb.RoutePlan, span) -> tuple[asyncio.Task, pb.PendingImages, str]:
        """The awaited Encode under way, the next stage's pending images on that encoder, and the pages' source."""
        pending = pb.PendingImages(worker_id=plan.encoder.worker_id, address=plan.encoder.address,
                                   request_id=request.request_id)
        return self._encode(request, plan, span), pending, wire.ref_registration(plan.encoder)

    def _encode(self, request: Request, plan: pb.RoutePlan, span) -> asyncio.Task:
        """The request's awaited Encode, under way (its outcome: the encode's reply, or StageFailed)."""
        self.sent(request, plan.encoder.worker_id)
        message = pb.EncodeRequest(request=wire.spec_to_pb(request, with_pixels=True), awaited=True)
        with self.tracing.activate(span):
            call = self.calls.call(plan.encoder.address, "encode", message)  # made first, so it goes out first
        task = asyncio.ensure_future(stage_call("encode", wire.ref_registration(plan.encoder), None, call))
        task.add_done_callback(consume)  # its outcome is awaited, unless the request failed before that
        task.add_done_callback(lambda _: call.cancel())  # cancelled before it ran: the call must not go on alone
        return task


async def _not_cached(answer: asyncio.Future) -> bool:
    """Whether a stage sent without its images (predicted cached there) answered that they are not; any other outcome
    is left in `answer` for the caller to read."""
    try:
        await asyncio.shield(answer)
    except grpc.aio.AioRpcError as e:
        return e.code() == grpc.StatusCode.FAILED_PRECONDITION and wire.IMAGES_NOT_CACHED in (e.details() or "")
    except Exception:
        return False
    return False


class HandedBack(Exception):
    """The decoder preempted the request and could not recompute it: go on with it elsewhere."""

    def __init__(self, worker_id: str):
        super().__init__(f"worker {worker_id} handed the request back")
        self.worker_id = worker_id


def _output(request_id: str, chunk: pb.TokenChunk, output: list[int], cached: int = 0) -> RequestOutput:
    """`cached`: the prompt tokens the prefilling worker had cached (a decoder that got the KV reports none)."""
    status = _STATUS_OF.get(chunk.finish_reason, RequestStatus.DECODING) if chunk.finish_reason else RequestStatus.DECODING
    return RequestOutput(
        request_id=request_id, new_token_ids=list(chunk.token_ids), output_token_ids=list(output), status=status,
        finish_reason=chunk.finish_reason or None, stop_reason=wire.chunk_stop_reason(chunk),
        text=chunk.text if chunk.HasField("text") else None, num_prompt_tokens=chunk.num_prompt_tokens,
        num_cached_tokens=max(cached, chunk.num_cached_tokens),
        logprobs=wire.chunk_logprobs(chunk),
    )


def consume(task: asyncio.Future) -> None:
    """Retrieve a background task's outcome (a route, an awaited Encode), so an error nobody awaited is not logged
    as unhandled."""
    if not task.cancelled():
        task.exception()
