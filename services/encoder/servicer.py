"""The encode stage's gRPC front.

Life of a request here:
  1. `Encode(spec with pixels)` → an engine request for the encode stage only;
  2. the vision tower fills image-cache pages (batched with other encodes under τ_e);
  3. the reply is a handle on those pages, leased until the prefill worker pulls and acks them;
     an awaited Encode also hands that handle to the next stage's `AwaitEncode` (`awaited.py`).
"""

from __future__ import annotations

from common.request import Stage
from common.transfer import PullFailed
from epdmesh.v1 import mesh_pb2 as pb
from epdmesh.v1 import mesh_pb2_grpc as pb_grpc
from services import wire
from services.errors import grpc_errors
from services.worker.runtime import WorkerRuntime


class EncoderServicer(pb_grpc.EncoderServicer):
    def __init__(self, runtime: WorkerRuntime):
        self.runtime = runtime

    @grpc_errors
    async def Encode(self, request: pb.EncodeRequest, context) -> pb.EncodeResponse:
        return await self.encode(request)

    @grpc_errors
    async def AwaitEncode(self, request: pb.AwaitEncodeRequest, context) -> pb.EncodeResponse:
        return await self.await_encode(request)

    # the stage methods, also called on a StageCalls stream (services/stage_calls)

    async def encode(self, request: pb.EncodeRequest) -> pb.EncodeResponse:
        spec = request.request
        if not request.awaited:
            return await self._encode(spec)
        awaited = self.runtime.awaited
        awaited.begin(spec.request_id)
        try:
            reply = await self._encode(spec)
        except Exception as e:
            awaited.settle(spec.request_id, error=e)
            raise
        except BaseException:  # cancelled: the gateway went away
            awaited.settle(spec.request_id, error=PullFailed(f"the Encode of {spec.request_id} was cancelled"))
            raise
        awaited.settle(spec.request_id, wire.handle_from_pb(reply.image_pages))
        return reply

    async def _encode(self, spec: pb.RequestSpec) -> pb.EncodeResponse:
        if not spec.images or any(not image.pixel_values for image in spec.images):
            raise ValueError("Encode needs a request whose images all carry pixel values")
        engine_request = wire.request_from_pb(spec, Stage.ENCODE, Stage.ENCODE, f"{spec.request_id}@encode")
        handle = await self.runtime.encode(engine_request)
        return pb.EncodeResponse(image_pages=wire.handle_to_pb(handle))

    async def await_encode(self, request: pb.AwaitEncodeRequest) -> pb.EncodeResponse:
        handle = await self.runtime.awaited.wait(request.request_id)
        return pb.EncodeResponse(image_pages=wire.handle_to_pb(handle))
