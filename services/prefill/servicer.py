"""The prefill stage's gRPC front.

Life of a request here:
  1. `Prefill(spec, image handle or pending images?)`: the image pages are pulled from the encoder
     and acked — with pending images, once the encoder gave their handle (`AwaitEncode`); with
     neither, this worker encodes the pixels itself (an EP worker);
  2. the prompt is prefilled in chunks under τ_t, batched with other prefills, and the first
     token sampled;
  3. the reply carries that token and a handle on the KV pages, leased until the decoder pulls
     them — or no handle, when the first token already finished the request.
"""

from __future__ import annotations

from common.request import Stage
from epdmesh.v1 import mesh_pb2 as pb
from epdmesh.v1 import mesh_pb2_grpc as pb_grpc
from services import wire
from services.encoder.awaited import fetch_awaited, image_pages_of
from services.errors import ImagesNotCached, grpc_errors
from services.stage_calls.client import StageCalls
from services.worker.runtime import WorkerRuntime


class PrefillServicer(pb_grpc.PrefillerServicer):
    def __init__(self, runtime: WorkerRuntime, calls: StageCalls):
        self.runtime = runtime
        self.calls = calls  # to the encoders of pending images

    @grpc_errors
    async def Prefill(self, request: pb.PrefillRequest, context) -> pb.PrefillResponse:
        return await self.prefill(request)

    async def prefill(self, request: pb.PrefillRequest) -> pb.PrefillResponse:
        """The stage method, also called on a StageCalls stream (services/stage_calls)."""
        spec = request.request
        engine_request_id = f"{spec.request_id}@prefill"
        await self.runtime.supersede(engine_request_id)
        pending = request.HasField("pending_images")
        if request.images_cached or pending:  # its images' KV may be in this worker's prefix cache: no pages needed
            engine_request = wire.request_from_pb(spec, Stage.PREFILL, Stage.PREFILL, engine_request_id)
            awaited = (lambda: fetch_awaited(self.calls, request.pending_images)) if pending else None
            if await self.runtime.pin_cached_images(engine_request, awaited):
                return self._reply(*await self.runtime.prefill(engine_request, None, pinned=True))
            if not pending:  # sent without its images (predicted cached here), and they are not
                raise ImagesNotCached(spec.request_id)
            return self._reply(*await self.runtime.prefill(engine_request, await awaited()))
        images = await image_pages_of(self.calls, request)
        first = wire.first_stage_for(spec, images is not None)
        engine_request = wire.request_from_pb(spec, first, Stage.PREFILL, engine_request_id)
        return self._reply(*await self.runtime.prefill(engine_request, images))

    @staticmethod
    def _reply(out, kv) -> pb.PrefillResponse:
        chunk = wire.chunk_to_pb(
            out.new_token_ids or out.output_token_ids[-1:],
            out.finish_reason,
            out.stop_reason,
            out.text,
            out.num_prompt_tokens,
            out.logprobs,
            num_cached_tokens=out.num_cached_tokens,
        )
        return pb.PrefillResponse(first=chunk, kv_pages=wire.handle_to_pb(kv) if kv is not None else None)
