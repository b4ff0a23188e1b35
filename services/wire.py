"""Protobuf ↔ domain objects, at the process edge. Only this module and the servicers touch `*_pb2`."""

from __future__ import annotations

import math

import numpy as np
import torch

from common.engine.outputs import TokenLogprob
from common.model.pixels import PixelScaling, finish
from common.paged_cache import PageLayout
from common.policy.routing import PrefillPath, RoutePlan, RouteSummary
from common.request import ImageInput, Request, Stage
from common.sampling import SamplingParams
from common.transfer.handle import PageHandle
from common.workers import WorkerInfo, WorkerLoad, WorkerSnapshot
from epdmesh.v1 import mesh_pb2 as pb

_STAGES = {Stage.ENCODE: pb.STAGE_ENCODE, Stage.PREFILL: pb.STAGE_PREFILL, Stage.DECODE: pb.STAGE_DECODE}
_KINDS = {"kv": pb.CACHE_KIND_KV, "image": pb.CACHE_KIND_IMAGE}
_PATHS = {
    PrefillPath.COLOCATED: pb.PREFILL_PATH_COLOCATED,
    PrefillPath.DEDICATED: pb.PREFILL_PATH_DEDICATED,
    PrefillPath.MULTIPLEXED: pb.PREFILL_PATH_MULTIPLEXED,
}

_STAGES_OF = {v: k for k, v in _STAGES.items()}
_KINDS_OF = {v: k for k, v in _KINDS.items()}
_PATHS_OF = {v: k for k, v in _PATHS.items()}


def roles_to_pb(roles: frozenset[Stage]) -> list[int]:
    return [_STAGES[s] for s in sorted(roles)]


def roles_from_pb(values) -> frozenset[Stage]:
    """ValueError for a value that names no stage."""
    unknown = [v for v in values if v not in _STAGES_OF]
    if unknown:
        raise ValueError(f"unknown stage value(s) {unknown}")
    return frozenset(_STAGES_OF[v] for v in values)


# ----- requests -----


def sampling_to_pb(s: SamplingParams) -> pb.SamplingParams:
    msg = pb.SamplingParams(
        max_tokens=s.max_tokens,
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k,
        stop=list(s.stop),
        stop_token_ids=list(s.stop_token_ids),
        ignore_eos=s.ignore_eos,
    )
    if s.seed is not None:
        msg.seed = s.seed
    if s.logprobs is not None:
        msg.logprobs = s.logprobs
    msg.presence_penalty, msg.frequency_penalty = s.presence_penalty, s.frequency_penalty
    if s.repetition_penalty != 1:
        msg.repetition_penalty = s.repetition_penalty
    msg.logit_bias_token_ids.extend(token for token, _ in s.logit_bias)
    msg.logit_bias_values.extend(bias for _, bias in s.logit_bias)
    msg.min_tokens, msg.min_p = s.min_tokens, s.min_p
    if s.grammar is not None:
        msg.grammar = s.grammar
    return msg


def sampling_from_pb(msg: pb.SamplingParams) -> SamplingParams:
    return SamplingParams(
        max_tokens=msg.max_tokens,
        temperature=msg.temperature,
        top_p=msg.top_p,
        top_k=msg.top_k,
        seed=msg.seed if msg.HasField("seed") else None,
        stop=tuple(msg.stop),
        stop_token_ids=tuple(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos,
        logprobs=msg.logprobs if msg.HasField("logprobs") else None,
        presence_penalty=msg.presence_penalty,
        frequency_penalty=msg.frequency_penalty,
        repetition_penalty=msg.repetition_penalty if msg.HasField("repetition_penalty") else 1.0,
        logit_bias=tuple(zip(msg.logit_bias_token_ids, msg.logit_bias_values)),
        min_tokens=msg.min_tokens,
        min_p=msg.min_p,
        grammar=msg.grammar if msg.HasField("grammar") else None,
    )


def image_to_pb(image: ImageInput, with_pixels: bool) -> pb.Image:
    msg = pb.Image(num_tokens=image.num_tokens, content_hash=image.content_hash)
    if with_pixels and image.pixel_values is not None:
        pixels = image.pixel_values.contiguous()
        msg.pixel_values = pixels.numpy().tobytes()
        msg.shape.extend(pixels.shape)
        msg.dtype = str(pixels.dtype).removeprefix("torch.")
        if image.scaling is not None:
            msg.scaling.CopyFrom(
                pb.PixelScaling(rescale=image.scaling.rescale, mean=image.scaling.mean, std=image.scaling.std)
            )
    return msg


def image_from_pb(msg: pb.Image) -> ImageInput:
    """An image as the engine takes it: pixels that travelled unfinished (uint8) are finished here."""
    pixels = None
    if msg.pixel_values:
        dtype = getattr(torch, msg.dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"unknown pixel dtype {msg.dtype!r}")
        array = np.frombuffer(msg.pixel_values, dtype=np.uint8)
        if array.size != math.prod(msg.shape) * torch.empty((), dtype=dtype).element_size():
            raise ValueError(f"{array.size} bytes of pixels for shape {list(msg.shape)} of {msg.dtype}")
        pixels = torch.from_numpy(array.copy()).view(dtype).reshape(tuple(msg.shape))
        if msg.HasField("scaling"):
            pixels = finish(pixels, PixelScaling(msg.scaling.rescale, tuple(msg.scaling.mean), tuple(msg.scaling.std)))
    return ImageInput(pixels, msg.num_tokens, msg.content_hash)


def spec_to_pb(request: Request, with_pixels: bool) -> pb.RequestSpec:
    return pb.RequestSpec(
        request_id=request.request_id,
        prompt_token_ids=request.prompt_token_ids,
        sampling=sampling_to_pb(request.sampling),
        images=[image_to_pb(i, with_pixels) for i in request.images],
        output_token_ids=request.output_token_ids,
        num_continued_tokens=request.num_continued_tokens,
        cache_salt=request.cache_salt,
    )


def request_from_pb(
    msg: pb.RequestSpec, first_stage: Stage, last_stage: Stage, request_id: str | None = None
) -> Request:
    """A fresh engine request for the stages [first_stage, last_stage] of the spec. Raises ValueError on bad input."""
    request = Request(
        request_id or msg.request_id,
        list(msg.prompt_token_ids),
        sampling_from_pb(msg.sampling),
        [image_from_pb(i) for i in msg.images],
        first_stage=first_stage,
        last_stage=last_stage,
        num_continued_tokens=msg.num_continued_tokens,
        cache_salt=msg.cache_salt,
    )
    request.output_token_ids = list(msg.output_token_ids)
    return request


def first_stage_for(spec: pb.RequestSpec, has_image_pages: bool) -> Stage:
    """ENCODE when the images still need the vision tower here, else PREFILL."""
    if not spec.images or has_image_pages:
        return Stage.PREFILL
    if any(not image.pixel_values for image in spec.images):
        raise ValueError("the request's images have neither pixel values nor encoded image pages")
    return Stage.ENCODE


# ----- pages -----


def layout_to_pb(layout: PageLayout) -> pb.PageLayout:
    return pb.PageLayout(
        kind=_KINDS[layout.kind], dtype=layout.dtype, block_size=layout.block_size, block_shape=list(layout.block_shape)
    )


def layout_from_pb(msg: pb.PageLayout) -> PageLayout:
    kind = _KINDS_OF.get(msg.kind)
    if kind is None:
        raise ValueError("page layout without a cache kind")
    return PageLayout(kind, msg.dtype, msg.block_size, tuple(msg.block_shape))


def handle_to_pb(h: PageHandle) -> pb.PageHandle:
    return pb.PageHandle(
        worker_id=h.worker_id,
        address=h.address,
        lease_id=h.lease_id,
        block_ids=list(h.block_ids),
        num_tokens=h.num_tokens,
        layout=layout_to_pb(h.layout),
        lease_expiry_unix_ms=int(h.lease_expiry * 1e3),
        backend=h.backend,
        backend_info=h.backend_info,
    )


def handle_from_pb(msg: pb.PageHandle) -> PageHandle:
    return PageHandle(
        msg.worker_id,
        msg.address,
        msg.lease_id,
        tuple(msg.block_ids),
        msg.num_tokens,
        layout_from_pb(msg.layout),
        msg.lease_expiry_unix_ms / 1e3,
        msg.backend,
        msg.backend_info,
    )


def optional_handle(parent, field: str) -> PageHandle | None:
    return handle_from_pb(getattr(parent, field)) if parent.HasField(field) else None


# ----- outputs -----


def chunk_to_pb(
    new_token_ids: list[int],
    finish_reason: str | None,
    stop_reason,
    text: str | None,
    num_prompt_tokens: int,
    logprobs: list[TokenLogprob] | None = None,
    handed_back: bool = False,
    num_cached_tokens: int = 0,
) -> pb.TokenChunk:
    msg = pb.TokenChunk(
        token_ids=new_token_ids,
        finish_reason=finish_reason or "",
        num_prompt_tokens=num_prompt_tokens,
        handed_back=handed_back,
        num_cached_tokens=num_cached_tokens,
    )
    for lp in logprobs or ():
        msg.logprobs.add(
            token_id=lp.token_id,
            logprob=lp.logprob,
            top_token_ids=[t for t, _ in lp.top],
            top_logprobs=[v for _, v in lp.top],
        )
    if isinstance(stop_reason, str):
        msg.stop_string = stop_reason
    elif isinstance(stop_reason, int):
        msg.stop_token_id = stop_reason
    if text is not None:
        msg.text = text
    return msg


def chunk_logprobs(msg: pb.TokenChunk) -> list[TokenLogprob] | None:
    if not msg.logprobs:
        return None
    return [TokenLogprob(lp.token_id, lp.logprob, tuple(zip(lp.top_token_ids, lp.top_logprobs))) for lp in msg.logprobs]


def chunk_stop_reason(msg: pb.TokenChunk) -> str | int | None:
    which = msg.WhichOneof("stop_reason")
    return getattr(msg, which) if which else None


# ----- registry -----


def info_to_pb(info: WorkerInfo) -> pb.WorkerInfo:
    return pb.WorkerInfo(
        worker_id=info.worker_id,
        address=info.address,
        roles=roles_to_pb(info.roles),
        model=info.model,
        max_model_len=info.max_model_len,
        transfer_backend=info.transfer_backend,
        pid=info.pid,
        metrics_port=info.metrics_port,
        instance=info.instance,
        prefix_caching=info.prefix_caching,
        token_budget=info.token_budget,
        image_budget=info.image_budget,
        join_first=info.join_first,
    )


def info_from_pb(msg: pb.WorkerInfo) -> WorkerInfo:
    roles = frozenset(_STAGES_OF[r] for r in msg.roles if r in _STAGES_OF)
    return WorkerInfo(
        msg.worker_id,
        msg.address,
        roles,
        msg.model,
        msg.max_model_len,
        msg.transfer_backend or "grpc",
        msg.pid,
        msg.metrics_port,
        msg.instance,
        msg.prefix_caching,
        msg.token_budget,
        msg.image_budget,
        msg.join_first,
    )


_LOAD_FIELDS = [f.name for f in pb.WorkerLoad.DESCRIPTOR.fields]


def load_to_pb(load: WorkerLoad) -> pb.WorkerLoad:
    return pb.WorkerLoad(**{name: getattr(load, name) for name in _LOAD_FIELDS})


def load_from_pb(msg: pb.WorkerLoad) -> WorkerLoad:
    return WorkerLoad(**{name: getattr(msg, name) for name in _LOAD_FIELDS})


def summary_to_pb(s: RouteSummary) -> pb.RouteRequest:
    return pb.RouteRequest(
        request_id=s.request_id,
        num_prompt_tokens=s.num_prompt_tokens,
        num_images=s.num_images,
        max_tokens=s.max_tokens,
        exclude_worker_ids=sorted(s.exclude),
        ttft_slo_ms=s.ttft_slo_ms or 0,
        tbt_slo_ms=s.tbt_slo_ms or 0,
        elapsed_ms=s.elapsed_ms,
        prefix_hashes=s.prefix_hashes,
        image_end=s.image_end,
    )


def summary_from_pb(msg: pb.RouteRequest) -> RouteSummary:
    return RouteSummary(
        msg.request_id,
        msg.num_prompt_tokens,
        msg.num_images,
        msg.max_tokens,
        frozenset(msg.exclude_worker_ids),
        msg.ttft_slo_ms or None,
        msg.tbt_slo_ms or None,
        msg.elapsed_ms,
        prefix_hashes=tuple(msg.prefix_hashes),
        image_end=msg.image_end,
    )


def plan_to_pb(plan: RoutePlan) -> pb.RoutePlan:
    return pb.RoutePlan(
        encoder=snapshot_to_pb(plan.encoder) if plan.encoder is not None else None,
        prefill=snapshot_to_pb(plan.prefill),
        decoder=snapshot_to_pb(plan.decoder),
        path=_PATHS[plan.path],
        predicted_ttft_ms=plan.predicted_ttft_ms,
        images_cached=plan.images_cached,
    )


def plan_from_pb(msg: pb.RoutePlan) -> RoutePlan:
    return RoutePlan(
        snapshot_from_pb(msg.encoder) if msg.HasField("encoder") else None,
        snapshot_from_pb(msg.prefill),
        snapshot_from_pb(msg.decoder),
        _PATHS_OF[msg.path],
        msg.predicted_ttft_ms if msg.HasField("predicted_ttft_ms") else None,
        msg.images_cached,
    )


def snapshot_to_pb(w: WorkerSnapshot) -> pb.WorkerEntry:
    return pb.WorkerEntry(info=info_to_pb(w.info), load=load_to_pb(w.load), age_s=w.age_s)


def snapshot_from_pb(msg: pb.WorkerEntry) -> WorkerSnapshot:
    return WorkerSnapshot(info_from_pb(msg.info), load_from_pb(msg.load), msg.age_s)
