from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Stage(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STAGE_UNSPECIFIED: _ClassVar[Stage]
    STAGE_ENCODE: _ClassVar[Stage]
    STAGE_PREFILL: _ClassVar[Stage]
    STAGE_DECODE: _ClassVar[Stage]

class CacheKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CACHE_KIND_UNSPECIFIED: _ClassVar[CacheKind]
    CACHE_KIND_KV: _ClassVar[CacheKind]
    CACHE_KIND_IMAGE: _ClassVar[CacheKind]

class PrefillPath(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PREFILL_PATH_UNSPECIFIED: _ClassVar[PrefillPath]
    PREFILL_PATH_COLOCATED: _ClassVar[PrefillPath]
    PREFILL_PATH_DEDICATED: _ClassVar[PrefillPath]
    PREFILL_PATH_MULTIPLEXED: _ClassVar[PrefillPath]
STAGE_UNSPECIFIED: Stage
STAGE_ENCODE: Stage
STAGE_PREFILL: Stage
STAGE_DECODE: Stage
CACHE_KIND_UNSPECIFIED: CacheKind
CACHE_KIND_KV: CacheKind
CACHE_KIND_IMAGE: CacheKind
PREFILL_PATH_UNSPECIFIED: PrefillPath
PREFILL_PATH_COLOCATED: PrefillPath
PREFILL_PATH_DEDICATED: PrefillPath
PREFILL_PATH_MULTIPLEXED: PrefillPath

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "ignore_eos", "logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias_token_ids", "logit_bias_values", "min_tokens", "min_p", "grammar")
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_VALUES_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    logprobs: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logit_bias_token_ids: _containers.RepeatedScalarFieldContainer[int]
    logit_bias_values: _containers.RepeatedScalarFieldContainer[float]
    min_tokens: int
    min_p: float
    grammar: str
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., logit_bias_token_ids: _Optional[_Iterable[int]] = ..., logit_bias_values: _Optional[_Iterable[float]] = ..., min_tokens: _Optional[int] = ..., min_p: _Optional[float] = ..., grammar: _Optional[str] = ...) -> None: ...

class Image(_message.Message):
    __slots__ = ("pixel_values", "shape", "dtype", "num_tokens", "content_hash", "scaling")
    PIXEL_VALUES_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CONTENT_HASH_FIELD_NUMBER: _ClassVar[int]
    SCALING_FIELD_NUMBER: _ClassVar[int]
    pixel_values: bytes
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    num_tokens: int
    content_hash: str
    scaling: PixelScaling
    def __init__(self, pixel_values: _Optional[bytes] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ..., num_tokens: _Optional[int] = ..., content_hash: _Optional[str] = ..., scaling: _Optional[_Union[PixelScaling, _Mapping]] = ...) -> None: ...

class PixelScaling(_message.Message):
    __slots__ = ("rescale", "mean", "std")
    RESCALE_FIELD_NUMBER: _ClassVar[int]
    MEAN_FIELD_NUMBER: _ClassVar[int]
    STD_FIELD_NUMBER: _ClassVar[int]
    rescale: float
    mean: _containers.RepeatedScalarFieldContainer[float]
    std: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, rescale: _Optional[float] = ..., mean: _Optional[_Iterable[float]] = ..., std: _Optional[_Iterable[float]] = ...) -> None: ...

class RequestSpec(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "images", "output_token_ids", "num_continued_tokens", "cache_salt")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_CONTINUED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    images: _containers.RepeatedCompositeFieldContainer[Image]
    output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_continued_tokens: int
    cache_salt: str
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., images: _Optional[_Iterable[_Union[Image, _Mapping]]] = ..., output_token_ids: _Optional[_Iterable[int]] = ..., num_continued_tokens: _Optional[int] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class PageLayout(_message.Message):
    __slots__ = ("kind", "dtype", "block_size", "block_shape")
    KIND_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SHAPE_FIELD_NUMBER: _ClassVar[int]
    kind: CacheKind
    dtype: str
    block_size: int
    block_shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, kind: _Optional[_Union[CacheKind, str]] = ..., dtype: _Optional[str] = ..., block_size: _Optional[int] = ..., block_shape: _Optional[_Iterable[int]] = ...) -> None: ...

class PageHandle(_message.Message):
    __slots__ = ("worker_id", "address", "lease_id", "block_ids", "num_tokens", "layout", "lease_expiry_unix_ms", "backend", "backend_info")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRY_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    BACKEND_INFO_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    address: str
    lease_id: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_tokens: int
    layout: PageLayout
    lease_expiry_unix_ms: int
    backend: str
    backend_info: bytes
    def __init__(self, worker_id: _Optional[str] = ..., address: _Optional[str] = ..., lease_id: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ..., num_tokens: _Optional[int] = ..., layout: _Optional[_Union[PageLayout, _Mapping]] = ..., lease_expiry_unix_ms: _Optional[int] = ..., backend: _Optional[str] = ..., backend_info: _Optional[bytes] = ...) -> None: ...

class TokenChunk(_message.Message):
    __slots__ = ("token_ids", "finish_reason", "stop_string", "stop_token_id", "text", "num_prompt_tokens", "logprobs", "handed_back", "num_cached_tokens", "kv_pages")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_STRING_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    HANDED_BACK_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_PAGES_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: str
    stop_string: str
    stop_token_id: int
    text: str
    num_prompt_tokens: int
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    handed_back: bool
    num_cached_tokens: int
    kv_pages: PageHandle
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[str] = ..., stop_string: _Optional[str] = ..., stop_token_id: _Optional[int] = ..., text: _Optional[str] = ..., num_prompt_tokens: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., handed_back: _Optional[bool] = ..., num_cached_tokens: _Optional[int] = ..., kv_pages: _Optional[_Union[PageHandle, _Mapping]] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "top_token_ids", "top_logprobs")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top_token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top_token_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class EncodeRequest(_message.Message):
    __slots__ = ("request", "awaited")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    AWAITED_FIELD_NUMBER: _ClassVar[int]
    request: RequestSpec
    awaited: bool
    def __init__(self, request: _Optional[_Union[RequestSpec, _Mapping]] = ..., awaited: _Optional[bool] = ...) -> None: ...

class AwaitEncodeRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class PendingImages(_message.Message):
    __slots__ = ("worker_id", "address", "request_id")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    address: str
    request_id: str
    def __init__(self, worker_id: _Optional[str] = ..., address: _Optional[str] = ..., request_id: _Optional[str] = ...) -> None: ...

class EncodeResponse(_message.Message):
    __slots__ = ("image_pages",)
    IMAGE_PAGES_FIELD_NUMBER: _ClassVar[int]
    image_pages: PageHandle
    def __init__(self, image_pages: _Optional[_Union[PageHandle, _Mapping]] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request", "image_pages", "pending_images", "images_cached")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    IMAGE_PAGES_FIELD_NUMBER: _ClassVar[int]
    PENDING_IMAGES_FIELD_NUMBER: _ClassVar[int]
    IMAGES_CACHED_FIELD_NUMBER: _ClassVar[int]
    request: RequestSpec
    image_pages: PageHandle
    pending_images: PendingImages
    images_cached: bool
    def __init__(self, request: _Optional[_Union[RequestSpec, _Mapping]] = ..., image_pages: _Optional[_Union[PageHandle, _Mapping]] = ..., pending_images: _Optional[_Union[PendingImages, _Mapping]] = ..., images_cached: _Optional[bool] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("first", "kv_pages")
    FIRST_FIELD_NUMBER: _ClassVar[int]
    KV_PAGES_FIELD_NUMBER: _ClassVar[int]
    first: TokenChunk
    kv_pages: PageHandle
    def __init__(self, first: _Optional[_Union[TokenChunk, _Mapping]] = ..., kv_pages: _Optional[_Union[PageHandle, _Mapping]] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("request", "kv_pages", "image_pages", "pending_images", "images_cached")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    KV_PAGES_FIELD_NUMBER: _ClassVar[int]
    IMAGE_PAGES_FIELD_NUMBER: _ClassVar[int]
    PENDING_IMAGES_FIELD_NUMBER: _ClassVar[int]
    IMAGES_CACHED_FIELD_NUMBER: _ClassVar[int]
    request: RequestSpec
    kv_pages: PageHandle
    image_pages: PageHandle
    pending_images: PendingImages
    images_cached: bool
    def __init__(self, request: _Optional[_Union[RequestSpec, _Mapping]] = ..., kv_pages: _Optional[_Union[PageHandle, _Mapping]] = ..., image_pages: _Optional[_Union[PageHandle, _Mapping]] = ..., pending_images: _Optional[_Union[PendingImages, _Mapping]] = ..., images_cached: _Optional[bool] = ...) -> None: ...

class PullPagesRequest(_message.Message):
    __slots__ = ("lease_id", "chunk_bytes")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    chunk_bytes: int
    def __init__(self, lease_id: _Optional[str] = ..., chunk_bytes: _Optional[int] = ...) -> None: ...

class PageChunk(_message.Message):
    __slots__ = ("data",)
    DATA_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    def __init__(self, data: _Optional[bytes] = ...) -> None: ...

class ReleasePagesRequest(_message.Message):
    __slots__ = ("lease_id",)
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    def __init__(self, lease_id: _Optional[str] = ...) -> None: ...

class ReleasePagesResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerLoad(_message.Message):
    __slots__ = ("num_waiting", "num_running", "running_decode_batch", "unfinished_decode_tokens", "last_iteration_ms", "kv_blocks_free", "kv_blocks_total", "image_blocks_free", "image_blocks_total", "num_leases", "iterations", "queued_prefill_tokens", "queued_images", "decode_context_tokens", "kv_tokens_free", "iteration_elapsed_ms", "num_preemptions", "kv_block_size", "long_token_budget")
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    RUNNING_DECODE_BATCH_FIELD_NUMBER: _ClassVar[int]
    UNFINISHED_DECODE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LAST_ITERATION_MS_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_FREE_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    IMAGE_BLOCKS_FREE_FIELD_NUMBER: _ClassVar[int]
    IMAGE_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    NUM_LEASES_FIELD_NUMBER: _ClassVar[int]
    ITERATIONS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_IMAGES_FIELD_NUMBER: _ClassVar[int]
    DECODE_CONTEXT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_TOKENS_FREE_FIELD_NUMBER: _ClassVar[int]
    ITERATION_ELAPSED_MS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    LONG_TOKEN_BUDGET_FIELD_NUMBER: _ClassVar[int]
    num_waiting: int
    num_running: int
    running_decode_batch: int
    unfinished_decode_tokens: int
    last_iteration_ms: float
    kv_blocks_free: int
    kv_blocks_total: int
    image_blocks_free: int
    image_blocks_total: int
    num_leases: int
    iterations: int
    queued_prefill_tokens: int
    queued_images: int
    decode_context_tokens: int
    kv_tokens_free: int
    iteration_elapsed_ms: float
    num_preemptions: int
    kv_block_size: int
    long_token_budget: int
    def __init__(self, num_waiting: _Optional[int] = ..., num_running: _Optional[int] = ..., running_decode_batch: _Optional[int] = ..., unfinished_decode_tokens: _Optional[int] = ..., last_iteration_ms: _Optional[float] = ..., kv_blocks_free: _Optional[int] = ..., kv_blocks_total: _Optional[int] = ..., image_blocks_free: _Optional[int] = ..., image_blocks_total: _Optional[int] = ..., num_leases: _Optional[int] = ..., iterations: _Optional[int] = ..., queued_prefill_tokens: _Optional[int] = ..., queued_images: _Optional[int] = ..., decode_context_tokens: _Optional[int] = ..., kv_tokens_free: _Optional[int] = ..., iteration_elapsed_ms: _Optional[float] = ..., num_preemptions: _Optional[int] = ..., kv_block_size: _Optional[int] = ..., long_token_budget: _Optional[int] = ...) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("worker_id", "address", "roles", "model", "max_model_len", "transfer_backend", "pid", "metrics_port", "instance", "prefix_caching", "token_budget", "image_budget", "join_first")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    ROLES_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_BACKEND_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    METRICS_PORT_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHING_FIELD_NUMBER: _ClassVar[int]
    TOKEN_BUDGET_FIELD_NUMBER: _ClassVar[int]
    IMAGE_BUDGET_FIELD_NUMBER: _ClassVar[int]
    JOIN_FIRST_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    address: str
    roles: _containers.RepeatedScalarFieldContainer[Stage]
    model: str
    max_model_len: int
    transfer_backend: str
    pid: int
    metrics_port: int
    instance: str
    prefix_caching: bool
    token_budget: int
    image_budget: int
    join_first: bool
    def __init__(self, worker_id: _Optional[str] = ..., address: _Optional[str] = ..., roles: _Optional[_Iterable[_Union[Stage, str]]] = ..., model: _Optional[str] = ..., max_model_len: _Optional[int] = ..., transfer_backend: _Optional[str] = ..., pid: _Optional[int] = ..., metrics_port: _Optional[int] = ..., instance: _Optional[str] = ..., prefix_caching: _Optional[bool] = ..., token_budget: _Optional[int] = ..., image_budget: _Optional[int] = ..., join_first: _Optional[bool] = ...) -> None: ...

class SwitchRolesRequest(_message.Message):
    __slots__ = ("roles", "grace_s")
    ROLES_FIELD_NUMBER: _ClassVar[int]
    GRACE_S_FIELD_NUMBER: _ClassVar[int]
    roles: _containers.RepeatedScalarFieldContainer[Stage]
    grace_s: float
    def __init__(self, roles: _Optional[_Iterable[_Union[Stage, str]]] = ..., grace_s: _Optional[float] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("grace_s",)
    GRACE_S_FIELD_NUMBER: _ClassVar[int]
    grace_s: float
    def __init__(self, grace_s: _Optional[float] = ...) -> None: ...

class DrainResponse(_message.Message):
    __slots__ = ("handed_back", "seconds", "idle")
    HANDED_BACK_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    IDLE_FIELD_NUMBER: _ClassVar[int]
    handed_back: int
    seconds: float
    idle: bool
    def __init__(self, handed_back: _Optional[int] = ..., seconds: _Optional[float] = ..., idle: _Optional[bool] = ...) -> None: ...

class SwitchRolesResponse(_message.Message):
    __slots__ = ("info", "handed_back", "seconds")
    INFO_FIELD_NUMBER: _ClassVar[int]
    HANDED_BACK_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    info: WorkerInfo
    handed_back: int
    seconds: float
    def __init__(self, info: _Optional[_Union[WorkerInfo, _Mapping]] = ..., handed_back: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...

class StageCall(_message.Message):
    __slots__ = ("call_id", "encode", "await_encode", "prefill", "cancel", "trace_context")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    ENCODE_FIELD_NUMBER: _ClassVar[int]
    AWAIT_ENCODE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    call_id: int
    encode: EncodeRequest
    await_encode: AwaitEncodeRequest
    prefill: PrefillRequest
    cancel: CancelCall
    trace_context: _containers.ScalarMap[str, str]
    def __init__(self, call_id: _Optional[int] = ..., encode: _Optional[_Union[EncodeRequest, _Mapping]] = ..., await_encode: _Optional[_Union[AwaitEncodeRequest, _Mapping]] = ..., prefill: _Optional[_Union[PrefillRequest, _Mapping]] = ..., cancel: _Optional[_Union[CancelCall, _Mapping]] = ..., trace_context: _Optional[_Mapping[str, str]] = ...) -> None: ...

class CancelCall(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StageReply(_message.Message):
    __slots__ = ("call_id", "encode", "prefill", "error")
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    ENCODE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    call_id: int
    encode: EncodeResponse
    prefill: PrefillResponse
    error: CallError
    def __init__(self, call_id: _Optional[int] = ..., encode: _Optional[_Union[EncodeResponse, _Mapping]] = ..., prefill: _Optional[_Union[PrefillResponse, _Mapping]] = ..., error: _Optional[_Union[CallError, _Mapping]] = ...) -> None: ...

class CallError(_message.Message):
    __slots__ = ("code", "details", "reason")
    CODE_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    code: int
    details: str
    reason: str
    def __init__(self, code: _Optional[int] = ..., details: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("info", "load")
    INFO_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    info: WorkerInfo
    load: WorkerLoad
    def __init__(self, info: _Optional[_Union[WorkerInfo, _Mapping]] = ..., load: _Optional[_Union[WorkerLoad, _Mapping]] = ...) -> None: ...

class RegisterResponse(_message.Message):
    __slots__ = ("heartbeat_interval_s", "ttl_s")
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    heartbeat_interval_s: float
    ttl_s: float
    def __init__(self, heartbeat_interval_s: _Optional[float] = ..., ttl_s: _Optional[float] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("worker_id", "load", "admitted_request_ids")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    ADMITTED_REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    load: WorkerLoad
    admitted_request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, worker_id: _Optional[str] = ..., load: _Optional[_Union[WorkerLoad, _Mapping]] = ..., admitted_request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("known",)
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    known: bool
    def __init__(self, known: _Optional[bool] = ...) -> None: ...

class DeregisterRequest(_message.Message):
    __slots__ = ("worker_id",)
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    def __init__(self, worker_id: _Optional[str] = ...) -> None: ...

class DeregisterResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RouteRequest(_message.Message):
    __slots__ = ("request_id", "num_prompt_tokens", "num_images", "max_tokens", "exclude_worker_ids", "ttft_slo_ms", "tbt_slo_ms", "elapsed_ms", "prefix_hashes", "image_end")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_IMAGES_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EXCLUDE_WORKER_IDS_FIELD_NUMBER: _ClassVar[int]
    TTFT_SLO_MS_FIELD_NUMBER: _ClassVar[int]
    TBT_SLO_MS_FIELD_NUMBER: _ClassVar[int]
    ELAPSED_MS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HASHES_FIELD_NUMBER: _ClassVar[int]
    IMAGE_END_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    num_prompt_tokens: int
    num_images: int
    max_tokens: int
    exclude_worker_ids: _containers.RepeatedScalarFieldContainer[str]
    ttft_slo_ms: float
    tbt_slo_ms: float
    elapsed_ms: float
    prefix_hashes: _containers.RepeatedScalarFieldContainer[int]
    image_end: int
    def __init__(self, request_id: _Optional[str] = ..., num_prompt_tokens: _Optional[int] = ..., num_images: _Optional[int] = ..., max_tokens: _Optional[int] = ..., exclude_worker_ids: _Optional[_Iterable[str]] = ..., ttft_slo_ms: _Optional[float] = ..., tbt_slo_ms: _Optional[float] = ..., elapsed_ms: _Optional[float] = ..., prefix_hashes: _Optional[_Iterable[int]] = ..., image_end: _Optional[int] = ...) -> None: ...

class RoutePlan(_message.Message):
    __slots__ = ("encoder", "prefill", "decoder", "path", "predicted_ttft_ms", "images_cached")
    ENCODER_FIELD_NUMBER: _ClassVar[int]
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    DECODER_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    IMAGES_CACHED_FIELD_NUMBER: _ClassVar[int]
    encoder: WorkerEntry
    prefill: WorkerEntry
    decoder: WorkerEntry
    path: PrefillPath
    predicted_ttft_ms: float
    images_cached: bool
    def __init__(self, encoder: _Optional[_Union[WorkerEntry, _Mapping]] = ..., prefill: _Optional[_Union[WorkerEntry, _Mapping]] = ..., decoder: _Optional[_Union[WorkerEntry, _Mapping]] = ..., path: _Optional[_Union[PrefillPath, str]] = ..., predicted_ttft_ms: _Optional[float] = ..., images_cached: _Optional[bool] = ...) -> None: ...

class ListWorkersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerEntry(_message.Message):
    __slots__ = ("info", "load", "age_s")
    INFO_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    AGE_S_FIELD_NUMBER: _ClassVar[int]
    info: WorkerInfo
    load: WorkerLoad
    age_s: float
    def __init__(self, info: _Optional[_Union[WorkerInfo, _Mapping]] = ..., load: _Optional[_Union[WorkerLoad, _Mapping]] = ..., age_s: _Optional[float] = ...) -> None: ...

class ListWorkersResponse(_message.Message):
    __slots__ = ("workers",)
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[WorkerEntry]
    def __init__(self, workers: _Optional[_Iterable[_Union[WorkerEntry, _Mapping]]] = ...) -> None: ...
