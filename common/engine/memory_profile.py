"""How big a KV cache the GPU holds: what `gpu_memory_utilization` of its memory leaves once the weights and the
activations of the largest iteration are in it (vLLM's `gpu_memory_utilization`, measured the way it does).

1. before the weights load, the device's free memory is read (what other processes hold is not ours);
2. the engine is built with caches just big enough for one profile iteration, and it runs: τ_e images encoded and
   τ_t prompt tokens prefilled in one step (as many requests as it takes; the longest the model allows each) —
   the most one step of this engine's scheduler computes at once;
3. the peak the allocator held meanwhile, and the memory this process holds outside it (the CUDA context), are read;
4. the profile's caches are freed, and the KV cache gets utilization × total − weights, activations and context −
   the image cache, and never more than is free less a margin (other processes sharing the GPU, fragmentation).
Not measured: a decode batch's attention over long contexts with the torch reference backend (it gathers them),
which the 1 − utilization left over has to cover; the decode CUDA graphs, captured after the cache, get a fixed
reserve (`common/model/cuda_graphs.py` GRAPH_MEMORY_BYTES: their gathers are bounded). A worker without the prefill
and decode roles gets one block.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

import torch

from common.engine.config import ALL_ROLES, EngineConfig
from common.kv_manager import blocks_for
from common.paged_cache import PagedImageCache, PagedKVCache
from common.request import ImageInput, Request, Stage
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
    outside: int = 0  # what this process holds outside the allocator (the CUDA context)


class CudaMemory:
    """The readings on a CUDA device (torch's allocator statistics and the driver's free/total). Made before the
    weights load, so what this process takes can be told from what other processes hold."""

    def __init__(self, device: torch.device):
        self.device = device
        torch.cuda.init()
        self._free_before, _ = torch.cuda.mem_get_info(device)

    def reset(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)

    def read(self) -> DeviceMemory:
        torch.cuda.synchronize(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        ours = self._free_before - free  # since this process began to load (the weights, the caches, its context)
        outside = max(0, ours - torch.cuda.memory_reserved(self.device))
        return DeviceMemory(total, free, torch.cuda.max_memory_reserved(self.device), outside)

    def release(self) -> None:
        torch.cuda.empty_cache()


def kv_cache_bytes(
    memory: DeviceMemory,
    utilization: float,
    profile_cache_bytes: int,
    image_cache_bytes: int,
    margin: int = FREE_MARGIN_BYTES,
    reserve: int = 0,
) -> int:
    """Bytes for the KV cache; KvCacheTooSmall when nothing is left (the message says what to change)."""
    # weights, activations and context: what stays when the caches are replaced
    in_use = memory.peak - profile_cache_bytes + memory.outside
    budget = int(memory.total * utilization) - in_use - image_cache_bytes - reserve
    room = memory.free + profile_cache_bytes - image_cache_bytes - margin - reserve  # the profile's caches go first
    size = min(budget, room)
    if size <= 0:
        gib = 2**30
        raise KvCacheTooSmall(
            f"no room for a KV cache: the weights and one iteration's activations take {in_use / gib:.2f} GiB and the "
            f"image cache {image_cache_bytes / gib:.2f} GiB"
            + (f" (and {reserve / gib:.2f} GiB for the decode CUDA graphs)" if reserve else "")
            + f" of {utilization:.0%} of {memory.total / gib:.1f} GiB "
            f"({memory.free / gib:.2f} GiB free); raise --gpu-memory-utilization, lower --token-budget, or give "
            "--kv-cache-gib"
        )
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


def profile_kv_cache(
    config: EngineConfig, setup: Callable[[EngineConfig], object], engine, probe, reserve: int = 0
) -> KvSizing:
    """The KV cache size for `config` (whose kv_cache_gib is None): `setup(c)` (re)builds `engine`'s caches, scheduler
    and runner for config `c`; `probe` reads the device's memory (`CudaMemory`); `reserve`: bytes kept for what is
    allocated after the cache (the decode CUDA graphs). The profile's caches are released before this returns."""
    text = engine.model.cfg.text
    dtype = getattr(torch, config.dtype)
    per_block = PagedKVCache.bytes_per_block(
        config.block_size, text.num_layers, text.num_kv_heads, text.head_dim, dtype
    )
    images_here = Stage.ENCODE in config.roles or Stage.PREFILL in config.roles
    image_bytes = int(config.image_cache_gib * 2**30) if images_here else 0  # else its image cache is one block
    if not {Stage.PREFILL, Stage.DECODE} & config.roles:  # an encoder: its KV cache is never used
        return KvSizing(probe.read(), config.gpu_memory_utilization, 0, 0, image_bytes, per_block)
    probe.reset()
    requests = _profile_requests(engine.model.cfg, config)
    tokens = sum(r.num_prompt_tokens for r in requests)
    profile_blocks = sum(blocks_for(r.num_prompt_tokens + 1, config.block_size) for r in requests) + 1
    profile = dataclasses.replace(
        config,
        roles=ALL_ROLES,
        kv_cache_gib=profile_blocks * per_block / 2**30,
        scheduler=dataclasses.replace(config.scheduler, max_num_seqs=max(config.scheduler.max_num_seqs, len(requests))),
    )
    setup(profile)
    profile_bytes = engine.kv_cache.data.nbytes + engine.image_cache.data.nbytes
    engine.generate(requests)
    memory = probe.read()
    engine.release_caches()
    probe.release()
    size = kv_cache_bytes(memory, config.gpu_memory_utilization, profile_bytes, image_bytes, reserve=reserve)
    log.info(
        "KV cache %.2f GiB: %.0f%% of %.1f GiB, less %.2f GiB of weights, activations (an iteration of %d tokens) "
        "and context, the %.2f GiB image cache and %.2f GiB kept for the decode CUDA graphs",
        size / 2**30,
        100 * config.gpu_memory_utilization,
        memory.total / 2**30,
        (memory.peak - profile_bytes + memory.outside) / 2**30,
        tokens,
        image_bytes / 2**30,
        reserve / 2**30,
    )
    return KvSizing(memory, config.gpu_memory_utilization, tokens, profile_bytes, image_bytes, size)


def _profile_requests(cfg, config: EngineConfig) -> list[Request]:
    """τ_t prompt tokens in all, each request as long as the model allows; the first carries τ_e images (random
    pixels), as many as its length and the image cache hold, so one step encodes them all and prefills τ_t tokens."""
    token_budget, image_budget = config.scheduler.token_budget, config.scheduler.image_budget
    positions = cfg.text.max_position_embeddings
    per_image, longest = cfg.image_tokens_per_image, min(config.max_model_len or positions, positions) - 1
    image_block = PagedImageCache.bytes_per_block(
        config.image_block_size, cfg.text.hidden_size, getattr(torch, config.dtype)
    )
    fit = int(config.image_cache_gib * 2**30) // image_block * config.image_block_size // per_image
    num_images = min(image_budget, longest // per_image, fit)
    size = cfg.vision.image_size
    generator = torch.Generator().manual_seed(0)
    images = [
        ImageInput(torch.rand(3, size, size, generator=generator), per_image, f"profile-{i}") for i in range(num_images)
    ]
    text_ids = [t for t in range(5, 1005) if t != cfg.image_token_id and t < cfg.text.vocab_size]
    sampling = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    requests, left = [], max(token_budget, num_images * per_image)
    while left > 0:
        n = min(left, longest)
        ids = [cfg.image_token_id] * (len(images) * per_image) if not requests else []
        ids += [text_ids[i % len(text_ids)] for i in range(n - len(ids))]
        requests.append(Request(f"memory-profile-{len(requests)}", ids, sampling, images if not requests else []))
        left -= n
    return requests
