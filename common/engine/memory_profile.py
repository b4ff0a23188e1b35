"""How big a KV cache the GPU holds: what `gpu_memory_utilization` of its memory leaves once the weights and the
activations of the largest iteration are in it (vLLM's `gpu_memory_utilization`, measured the way it does).

1. the model is loaded, and the engine built with caches just big enough for one profile iteration;
2. that iteration runs: a prompt of τ_t tokens (with τ_e images where the model has a vision tower and they fit),
   one token sampled — the most one step of this engine's scheduler computes at once;
3. the peak the allocator held meanwhile, and the device's total and free memory, are read;
4. the KV cache gets utilization × total − (that peak less the profile's own caches) − the image cache, and never
   more than is free then less a margin (the CUDA context, other processes sharing the GPU, fragmentation).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

import torch

from common.engine.config import ALL_ROLES, EngineConfig
from common.kv_manager import blocks_for
from common.paged_cache import PagedKVCache
from common.request import ImageInput, Request
from common.sampling import SamplingParams

log = logging.getLogger(__name__)
FREE_MARGIN_BYTES = 512 * 2**20  # kept free of the KV cache when it is sized by what is free


class KvCacheTooSmall(RuntimeError):
    """The weights and one iteration's activations leave no room for a KV cache within the utilization."""


@dataclasses.dataclass(frozen=True, slots=True)
class DeviceMemory:
    total: int  # the device's memory
    free: int  # free on the device after the profile iteration (its caches still held)
    peak: int  # the most this process's allocator held during it: weights, the profile's caches, activations


class CudaMemory:
    """The readings on a CUDA device (torch's allocator statistics and the driver's free/total)."""

    def __init__(self, device: torch.device):
        self.device = device

    def reset(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)

    def read(self) -> DeviceMemory:
        torch.cuda.synchronize(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        return DeviceMemory(total, free, torch.cuda.max_memory_reserved(self.device))


def kv_cache_bytes(memory: DeviceMemory, utilization: float, profile_cache_bytes: int, image_cache_bytes: int,
                   margin: int = FREE_MARGIN_BYTES) -> int:
    """Bytes for the KV cache; KvCacheTooSmall when nothing is left (the message says what to change)."""
    in_use = memory.peak - profile_cache_bytes  # weights and activations: what stays when the caches are replaced
    budget = int(memory.total * utilization) - in_use - image_cache_bytes
    room = memory.free + profile_cache_bytes - image_cache_bytes - margin  # the profile's caches are freed first
    size = min(budget, room)
    if size <= 0:
        gib = 2**30
        raise KvCacheTooSmall(
            f"no room for a KV cache: the weights and one iteration's activations take {in_use / gib:.2f} GiB and the "
            f"image cache {image_cache_bytes / gib:.2f} GiB of {utilization:.0%} of {memory.total / gib:.1f} GiB "
            f"({memory.free / gib:.2f} GiB free); raise --gpu-memory-utilization, lower --token-budget, or give "
            "--kv-cache-gib")
    return size


@dataclasses.dataclass(frozen=True, slots=True)
class KvSizing:
    """How a KV cache was sized: the readings after the profile iteration, and the bytes it came to."""

    memory: DeviceMemory
    utilization: float
    profile_tokens: int  # the profile iteration's prompt
    profile_cache_bytes: int  # its caches, freed before the real ones
    image_cache_bytes: int
    kv_cache_bytes: int


def profile_kv_cache(config: EngineConfig, setup: Callable[[EngineConfig], object], engine, probe) -> KvSizing:
    """The KV cache size for `config` (whose kv_cache_gib is None): `setup(c)` (re)builds `engine`'s caches, scheduler
    and runner for config `c`; `probe` reads the device's memory (`CudaMemory`)."""
    sched = config.scheduler
    text = engine.model.cfg.text
    tokens = min(sched.token_budget, (config.max_model_len or text.max_position_embeddings) - 1)
    per_block = PagedKVCache.bytes_per_block(config.block_size, text.num_layers, text.num_kv_heads, text.head_dim,
                                             getattr(torch, config.dtype))
    profile_blocks = blocks_for(tokens + 1, config.block_size) + 1
    profile = dataclasses.replace(config, roles=ALL_ROLES, kv_cache_gib=profile_blocks * per_block / 2**30)
    probe.reset()
    setup(profile)
    profile_bytes = engine.kv_cache.data.nbytes + engine.image_cache.data.nbytes
    engine.generate([_profile_request(engine, tokens, sched.image_budget)])
    memory = probe.read()
    image_bytes = int(config.image_cache_gib * 2**30)
    size = kv_cache_bytes(memory, config.gpu_memory_utilization, profile_bytes, image_bytes)
    log.info("KV cache %.2f GiB: %.0f%% of %.1f GiB, less %.2f GiB of weights and activations (a %d-token iteration) "
             "and the %.2f GiB image cache", size / 2**30, 100 * config.gpu_memory_utilization, memory.total / 2**30,
             (memory.peak - profile_bytes) / 2**30, tokens, image_bytes / 2**30)
    return KvSizing(memory, config.gpu_memory_utilization, tokens, profile_bytes, image_bytes, size)


def _profile_request(engine, tokens: int, image_budget: int) -> Request:
    """τ_t prompt tokens, as many of them images (random pixels) as τ_e and the prompt allow."""
    cfg = engine.model.cfg
    per_image = cfg.image_tokens_per_image
    num_images = min(image_budget, tokens // per_image)
    size = cfg.vision.image_size
    generator = torch.Generator().manual_seed(0)
    images = [ImageInput(torch.rand(3, size, size, generator=generator), per_image, f"profile-{i}")
              for i in range(num_images)]
    ids = [cfg.image_token_id] * (num_images * per_image)
    text_ids = [t for t in range(5, 1005) if t != cfg.image_token_id and t < cfg.text.vocab_size]
    ids += [text_ids[i % len(text_ids)] for i in range(tokens - len(ids))]
    return Request("memory-profile", ids, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True), images)
