"""The decode stage's gRPC front.

Life of a request here:
  1. `Decode(spec, KV handle)`: the KV pages are pulled from the prefill worker and acked, and the
     request joins the running batch with its first token (dedicated path); or, with no KV handle,
     this worker prefills it itself — from pixels, or image pages pulled from an encoder (handed
     over, or pending: asked for with `AwaitEncode`) — (colocated and multiplexed paths) and its
     first token is streamed too;
  2. every engine iteration streams the new token;
  3. the last chunk carries the finish reason — or, when this worker preempted the request and cannot
     recompute it (its images came as pages), says so (`handed_back`): the caller goes on elsewhere;
     cancelling the call aborts the request and frees its pages.
"""

from __future__ import annotations

from common.request import Stage
from epdmesh.v1 import mesh_pb2 as pb
from epdmesh.v1 import mesh_pb2_grpc as pb_grpc
from services import wire
from services.encoder.awaited import fetch_awaited
from services.errors import ImagesNotCached, grpc_errors
from services.stage_calls.client import StageCalls
from services.worker.runtime import WorkerRuntime


class DecoderServicer(pb_grpc.DecoderServicer):
    def __init__(self, runtime: WorkerRuntime, calls: StageCalls):
        self.runtime = runtime
        self.calls = calls  # to the encoders of pending images

    @grpc_errors
    async def Decode(self, request: pb.DecodeRequest, context):
        spec = request.request
        engine_request_id = f"{spec.request_id}@decode"
        kv = wire.optional_handle(request, "kv_pages")
        pinned, pending = False, request.HasField("pending_images")
        if request.images_cached or pending:  # prefilled here: its images' KV may be in the prefix cache already
            engine_request = wire.request_from_pb(spec, Stage.PREFILL, Stage.DECODE, engine_request_id)
            awaited = (lambda: fetch_awaited(self.calls, request.pending_images)) if pending else None
            pinned = await self.runtime.pin_cached_images(engine_request, awaited)
            if not pinned and not pending:  # sent without its images (predicted cached here), and they are not
                raise ImagesNotCached(spec.request_id)
            images = None if pinned else await awaited()
        else:
            images = wire.optional_handle(request, "image_pages") if kv is None else None
            first = Stage.DECODE if kv is not None else wire.first_stage_for(spec, images is not None)
            engine_request = wire.request_from_pb(spec, first, Stage.DECODE, engine_request_id)
        async for out in self.runtime.decode(engine_request, kv, images, pinned=pinned):
            if out.handed_back and out.pages is not None:  # its KV goes with it: leased for the next decoder
                chunk = pb.TokenChunk(handed_back=True, num_prompt_tokens=out.num_prompt_tokens)
                chunk.kv_pages.CopyFrom(wire.handle_to_pb(await self.runtime.lease_pages(engine_request_id, out.pages)))
                yield chunk
                continue
            yield wire.chunk_to_pb(
                out.new_token_ids,
                out.finish_reason,
                out.stop_reason,
                out.text,
                out.num_prompt_tokens,
                out.logprobs,
                handed_back=out.handed_back,
                num_cached_tokens=out.num_cached_tokens,
            )
