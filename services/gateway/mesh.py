"""The gateway's way through the mesh: route, then drive the stages by handles.

Life of a request here:
  1. the chat is turned into prompt tokens and pixels (the checkpoint's own processor), and
     checked against the model's length limit — nothing is routed for a request that cannot run;
  2. toggle `Route` → plan (encoder, prefill path + worker, decoder);
  3. images on a worker other than the prefill one: `Encode` there → image handle;
  4. dedicated path: `Prefill` (pixels or image handle) → first token + KV handle, then
     `Decode(KV handle)`; colocated / multiplexed: `Decode` on the decoder, which prefills itself;
  5. the decode stream is the request's output. Pages never pass through here; a handle this
     gateway got but could not pass on (client gone) is released at its source.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import grpc

from common.engine.outputs import RequestOutput
from common.model.processor import ChatProcessor
from common.policy.routing import PrefillPath, RouteSummary
from common.request import FINISH_REASONS, Request, RequestStatus
from common.transfer.channels import ChannelPool
from common.transfer.grpc_stream import release_over_grpc
from epdmesh.v1 import mesh_pb2 as pb
from epdmesh.v1 import mesh_pb2_grpc as pb_grpc
from services import wire
from services.gateway.protocol import ApiError, ChatRequest

log = logging.getLogger(__name__)
_STATUS_OF = {reason: status for status, reason in FINISH_REASONS.items()}


def api_error_from_rpc(e: grpc.aio.AioRpcError, stage: str) -> ApiError:
    code = e.code()
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return ApiError(400, e.details())
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.DEADLINE_EXCEEDED):
        return ApiError(503, f"{stage} is unavailable: {e.details()}")
    log.error("%s failed: %s %s", stage, code.name, e.details())
    return ApiError(500, f"{stage} failed: {code.name}: {e.details()}")


class MeshBackend:
    def __init__(self, processor: ChatProcessor, toggle_address: str, max_model_len: int):
        self.processor = processor
        self.channels = ChannelPool()  # channels are made on first use, inside the serving event loop
        self.toggle_address = toggle_address
        self.max_model_len = max_model_len
        self.paths = {path: 0 for path in PrefillPath}
        self._background: set[asyncio.Task] = set()

    @property
    def toggle(self) -> pb_grpc.ToggleStub:
        return pb_grpc.ToggleStub(self.channels.get(self.toggle_address))

    async def start(self, chat: ChatRequest, request_id: str) -> tuple[int, AsyncIterator[RequestOutput]]:
        try:
            ids, images = await asyncio.to_thread(self.processor.apply, chat.conversation)
        except (ValueError, TypeError, KeyError) as e:
            raise ApiError(400, f"could not build the prompt from these messages: {e}") from None
        total = len(ids) + chat.sampling.max_tokens
        if total > self.max_model_len:
            raise ApiError(400, f"prompt ({len(ids)} tokens) plus max_tokens ({chat.sampling.max_tokens}) is {total}, "
                                f"over the model's limit of {self.max_model_len}; shorten the prompt or lower max_tokens")
        request = Request(request_id, ids, chat.sampling, images)
        summary = RouteSummary(request_id, len(ids), len(images), chat.sampling.max_tokens)
        try:
            plan = await self.toggle.Route(wire.summary_to_pb(summary), timeout=10)
        except grpc.aio.AioRpcError as e:
            raise api_error_from_rpc(e, "routing") from None
        path = wire.path_from_pb(plan.path)
        self.paths[path] += 1
        stream = self._drive(request, plan, path)
        first = await anext(stream)  # stage errors surface here, as 4xx/5xx before any byte is sent
        return len(ids), _prepend(first, stream)

    async def _drive(self, request: Request, plan: pb.RoutePlan, path: PrefillPath) -> AsyncIterator[RequestOutput]:
        held: list[pb.PageHandle] = []  # handles we got and have not passed on yet
        try:
            image_pages = None
            if request.images and plan.encoder.worker_id != plan.prefill.worker_id:
                image_pages = await self._encode(request, plan.encoder.address, held)
            spec = wire.spec_to_pb(request, with_pixels=image_pages is None)
            if path == PrefillPath.DEDICATED:
                reply = await self._call("prefill", pb_grpc.PrefillerStub(self.channels.get(plan.prefill.address)).Prefill(
                    pb.PrefillRequest(request=spec, image_pages=image_pages)))
                held.clear()
                first = reply.first
                output = list(first.token_ids)
                yield _output(request.request_id, first, output)
                if first.finish_reason:
                    return
                held.append(reply.kv_pages)
                spec = wire.spec_to_pb(request, with_pixels=False)
                spec.output_token_ids.extend(output)
                decode = pb.DecodeRequest(request=spec, kv_pages=reply.kv_pages)
            else:
                output = []
                decode = pb.DecodeRequest(request=spec, image_pages=image_pages)
            call = pb_grpc.DecoderStub(self.channels.get(plan.decoder.address)).Decode(decode)
            try:
                async for chunk in call:
                    held.clear()
                    output.extend(chunk.token_ids)
                    yield _output(request.request_id, chunk, output)
            except grpc.aio.AioRpcError as e:
                raise api_error_from_rpc(e, "decode") from None
            finally:
                call.cancel()
        finally:
            for handle in held:  # never passed on: let the source free them now rather than at lease expiry
                self._spawn(release_over_grpc(self.channels, wire.handle_from_pb(handle)))

    async def _encode(self, request: Request, address: str, held: list) -> pb.PageHandle:
        stub = pb_grpc.EncoderStub(self.channels.get(address))
        reply = await self._call("encode", stub.Encode(pb.EncodeRequest(request=wire.spec_to_pb(request, with_pixels=True))))
        held.append(reply.image_pages)
        return reply.image_pages

    @staticmethod
    async def _call(stage: str, call):
        try:
            return await call
        except grpc.aio.AioRpcError as e:
            raise api_error_from_rpc(e, stage) from None

    def detokenize(self, ids: list[int]) -> str:
        return self.processor.detokenize(ids)

    async def worker_stats(self) -> dict:
        reply = await self.toggle.ListWorkers(pb.ListWorkersRequest(), timeout=5)
        stats = {}
        for entry in reply.workers:
            info = wire.info_from_pb(entry.info)
            try:
                load = await pb_grpc.WorkerStub(self.channels.get(info.address)).Stats(pb.StatsRequest(), timeout=5)
            except grpc.aio.AioRpcError as e:
                stats[info.worker_id] = {"roles": info.role_label, "address": info.address, "error": e.code().name}
                continue
            stats[info.worker_id] = {"roles": info.role_label, "address": info.address,
                                     **{f.name: getattr(load, f.name) for f in pb.WorkerLoad.DESCRIPTOR.fields}}
        return stats

    async def stats(self) -> dict:
        return {"paths": {p.value: n for p, n in self.paths.items()}, "workers": await self.worker_stats()}

    async def close(self) -> None:
        await self.channels.close()

    def _spawn(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)


def _output(request_id: str, chunk: pb.TokenChunk, output: list[int]) -> RequestOutput:
    status = _STATUS_OF.get(chunk.finish_reason, RequestStatus.DECODING) if chunk.finish_reason else RequestStatus.DECODING
    return RequestOutput(
        request_id=request_id, new_token_ids=list(chunk.token_ids), output_token_ids=list(output), status=status,
        finish_reason=chunk.finish_reason or None, stop_reason=wire.chunk_stop_reason(chunk),
        text=chunk.text if chunk.HasField("text") else None, num_prompt_tokens=chunk.num_prompt_tokens,
    )


async def _prepend(first: RequestOutput, rest: AsyncIterator[RequestOutput]) -> AsyncIterator[RequestOutput]:
    yield first
    async for out in rest:
        yield out
