"""The encode stage's gRPC front.

Life of a request here:
  1. `Encode(spec with pixels)` → an engine request for the encode stage only;
  2. the vision tower fills image-cache pages (batched with other encodes under τ_e);
  3. the reply is a handle on those pages, leased until the prefill worker pulls and acks them.
"""

from __future__ import annotations

from common.request import Stage
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
        spec = request.request
        if not spec.images or any(not image.pixel_values for image in spec.images):
            raise ValueError("Encode needs a request whose images all carry pixel values")
        engine_request = wire.request_from_pb(spec, Stage.ENCODE, Stage.ENCODE, f"{spec.request_id}@encode")
        handle = await self.runtime.encode(engine_request)
        return pb.EncodeResponse(image_pages=wire.handle_to_pb(handle))
