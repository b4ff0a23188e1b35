"""Configuration of one engine (one worker's model, caches, roles and batching)."""

from __future__ import annotations

import dataclasses

from common.request import Stage
from common.scheduler import SchedulerConfig

ALL_ROLES = frozenset(Stage)
DTYPES = ("float32", "bfloat16", "float16")


def resolve_dtype(dtype: str, device: str) -> str:
    """'auto' → bfloat16 where the hardware computes it natively: CUDA, and CPUs whose oneDNN has bf16 (AMX or
    AVX512-BF16), as vLLM's CPU backend; float32 on other CPUs, which emulate bf16 GEMMs (~10x slower)."""
    if dtype != "auto":
        return dtype
    if device.startswith("cuda"):
        return "bfloat16"
    import torch

    from common.model.packed_linear import can_pack

    return "bfloat16" if can_pack(torch.bfloat16, torch.device(device)) else "float32"


def parse_roles(text: str) -> frozenset[Stage]:
    """'encode,prefill,decode' (or 'epd', 'e,p') → the role set."""
    names = {
        "e": Stage.ENCODE,
        "encode": Stage.ENCODE,
        "p": Stage.PREFILL,
        "prefill": Stage.PREFILL,
        "d": Stage.DECODE,
        "decode": Stage.DECODE,
    }
    parts = [p.strip().lower() for p in text.split(",") if p.strip()]
    if len(parts) == 1 and parts[0] not in names:
        parts = list(parts[0])
    try:
        return frozenset(names[p] for p in parts)
    except KeyError as e:
        raise ValueError(f"unknown role {e.args[0]!r} in {text!r}; use encode, prefill, decode") from None


@dataclasses.dataclass(frozen=True, slots=True)
class EngineConfig:
    model: str
    dtype: str = "float32"
    device: str = "cpu"
    roles: frozenset[Stage] = ALL_ROLES
    block_size: int = 16
    image_block_size: int = 16
    kv_cache_gib: float | None = (
        1.0  # None: what gpu_memory_utilization of the GPU leaves (common/engine/memory_profile.py)
    )
    image_cache_gib: float = 0.25
    gpu_memory_utilization: float = 0.9  # of the GPU's memory, for this engine's weights, activations and caches
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    attention_backend: str = "auto"
    enable_prefix_caching: bool = False
    share_weights: bool = False  # CPU: one read-only copy of the weights per host, mapped by every worker
    # CPU with AMX: the decoder's linears also as AMX tiles, for decode's and prompts' products (packed_linear.py)
    amx_tiles: bool = True
    # CPU with AVX-512: prompts' and images' attention through the C kernel, not SDPA (kernels/cpu_prompt.py; it is
    # a process-wide switch: the engine sets it before it compiles)
    prompt_kernel: bool = True
    # CPU: the KV and image caches' pages faulted in when they are built, not by the first requests that write them
    # (serve and worker do; `common/memory.py` commit)
    commit_caches: bool = False
    compile: bool = False  # the dense path through torch.compile, warmed up at start (common/model/compiled.py)
    # CUDA: steps of decodes only replayed as CUDA graphs, captured at start (common/model/cuda_graphs.py)
    cuda_graphs: bool = True
    scheduler: SchedulerConfig = SchedulerConfig()
    seed: int = 0

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not one of {DTYPES}")
        if not self.roles or not self.roles <= ALL_ROLES:
            raise ValueError(f"roles must be a non-empty subset of {sorted(s.name for s in ALL_ROLES)}")
        if self.block_size < 1 or self.image_block_size < 1:
            raise ValueError("block sizes must be positive")
        if (self.kv_cache_gib is not None and self.kv_cache_gib <= 0) or self.image_cache_gib <= 0:
            raise ValueError("cache sizes must be positive")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
