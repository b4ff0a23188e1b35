"""The KV cache sized from the GPU's memory (`--gpu-memory-utilization`), checked on the CPU with the device's
readings stood in for: the profile iteration runs through the real engine, and the cache it leaves is exact."""

import pytest
import torch

from common.engine.config import EngineConfig
from common.engine.engine import Engine
from common.engine.memory_profile import FREE_MARGIN_BYTES, DeviceMemory, KvCacheTooSmall, kv_cache_bytes
from common.model.loader import load_model
from common.paged_cache import PagedKVCache
from common.request import Request
from common.sampling import SamplingParams
from common.scheduler import SchedulerConfig
from epdmesh.gpus import memory_shares

GIB, MIB = 2**30, 2**20


def test_the_budget_is_the_utilization_less_weights_activations_and_the_image_cache_and_never_more_than_is_free():
    memory = DeviceMemory(
        total=80 * GIB, free=60 * GIB, peak=16 * GIB + 1 * GIB
    )  # 16 GiB weights + activations, 1 GiB profile caches
    assert (
        kv_cache_bytes(memory, 0.9, profile_cache_bytes=1 * GIB, image_cache_bytes=GIB // 4)
        == int(72 * GIB) - 16 * GIB - GIB // 4
    )
    crowded = DeviceMemory(total=80 * GIB, free=20 * GIB, peak=17 * GIB)  # other processes hold the rest
    assert kv_cache_bytes(crowded, 0.9, GIB, GIB // 4) == 21 * GIB - GIB // 4 - FREE_MARGIN_BYTES
    with pytest.raises(KvCacheTooSmall, match="raise --gpu-memory-utilization"):
        kv_cache_bytes(DeviceMemory(total=16 * GIB, free=15 * GIB, peak=16 * GIB), 0.9, GIB, GIB // 4)
    # the decode CUDA graphs' reserve comes off both the budget and what is free
    for mem in (memory, crowded):
        assert (
            kv_cache_bytes(mem, 0.9, GIB, GIB // 4, reserve=GIB // 2)
            == kv_cache_bytes(mem, 0.9, GIB, GIB // 4) - GIB // 2
        )


class FakeGpu:
    """A GPU's readings, given: total and free memory, and the allocator's peak during the profile iteration."""

    def __init__(self, total: int, free: int, peak: int):
        self.readings = DeviceMemory(total, free, peak)
        self.calls: list[str] = []

    def reset(self) -> None:
        self.calls.append("reset")

    def read(self) -> DeviceMemory:
        self.calls.append("read")
        return self.readings

    def release(self) -> None:
        self.calls.append("release")


@pytest.fixture(scope="module")
def model(tiny_dir):
    return load_model(tiny_dir, torch.float32)


def _sized(tiny_dir, model, gpu: FakeGpu) -> Engine:
    config = EngineConfig(
        model=str(tiny_dir),
        kv_cache_gib=None,
        gpu_memory_utilization=0.5,
        image_cache_gib=0.01,
        scheduler=SchedulerConfig(token_budget=512, image_budget=2),
    )
    return Engine(config, model=model, memory=gpu)


def test_the_engine_runs_one_profile_iteration_and_takes_the_kv_cache_the_budget_leaves(tiny_dir, model):
    """The profile iteration (512 tokens, two images: the budgets) runs through the real engine on its small caches;
    the engine is then rebuilt with the KV cache the readings leave, and serves."""
    gpu = FakeGpu(total=2 * GIB, free=2 * GIB, peak=400 * MIB)
    engine = _sized(tiny_dir, model, gpu)
    sizing = engine.kv_sizing
    assert gpu.calls == ["reset", "read", "release"] and sizing.profile_tokens == 512 and sizing.profile_cache_bytes > 0
    assert sizing.kv_cache_bytes == kv_cache_bytes(gpu.readings, 0.5, sizing.profile_cache_bytes, int(0.01 * GIB))
    text = model.cfg.text
    per_block = PagedKVCache.bytes_per_block(16, text.num_layers, text.num_kv_heads, text.head_dim, torch.float32)
    assert engine.stats().kv_blocks_total == sizing.kv_cache_bytes // per_block > 10_000
    reference = Engine(EngineConfig(model=str(tiny_dir)), model=model)
    request = lambda: Request("r", [1, 405, 77, 1290, 33], SamplingParams(max_tokens=8, temperature=0.0))  # noqa: E731
    assert engine.generate([request()])["r"].output_token_ids == reference.generate([request()])["r"].output_token_ids
    assert engine.stats().kv_blocks_free == engine.stats().kv_blocks_total


def test_a_budget_longer_than_the_model_takes_several_profile_requests_and_images_fit_the_image_cache(tiny_dir, model):
    """τ_t 8192 on a model of 4,096 positions (and a max_model_len over it, which the engine clamps): the profile step
    still prefills 8192 tokens, in three requests; an image cache that holds no image gets none (it waited forever)."""
    config = EngineConfig(
        model=str(tiny_dir),
        kv_cache_gib=None,
        max_model_len=10_000,
        image_cache_gib=1e-5,
        scheduler=SchedulerConfig(token_budget=8192, image_budget=4),
    )
    engine = Engine(config, model=model, memory=FakeGpu(total=8 * GIB, free=8 * GIB, peak=600 * MIB))
    assert engine.kv_sizing.profile_tokens == 8192 and engine.stats().kv_blocks_total > 10_000


def test_an_encoder_takes_one_kv_block_and_a_decoder_no_image_cache(tiny_dir, model):
    from common.request import Stage

    def sized(roles):
        config = EngineConfig(model=str(tiny_dir), kv_cache_gib=None, roles=frozenset(roles), image_cache_gib=0.01)
        gpu = FakeGpu(total=2 * GIB, free=2 * GIB, peak=400 * MIB)
        return Engine(config, model=model, memory=gpu), gpu

    encoder, gpu = sized({Stage.ENCODE})
    assert encoder.stats().kv_blocks_total == 1 and gpu.calls == ["read"]  # nothing to profile
    decoder, _ = sized({Stage.DECODE})
    assert decoder.kv_sizing.image_cache_bytes == 0 and decoder.stats().image_blocks_total == 1


def test_no_room_for_a_kv_cache_says_what_to_change(tiny_dir, model):
    with pytest.raises(KvCacheTooSmall, match="lower --token-budget"):
        _sized(tiny_dir, model, FakeGpu(total=GIB, free=GIB, peak=600 * MIB))


def test_on_the_cpu_the_kv_cache_needs_a_size():
    with pytest.raises(ValueError, match="--kv-cache-gib"):
        Engine(EngineConfig(model="unused", kv_cache_gib=None), model=object())


def test_workers_sharing_a_gpu_share_its_memory_evenly():
    envs = [{"CUDA_VISIBLE_DEVICES": "0"}, {"CUDA_VISIBLE_DEVICES": "1"}, {"CUDA_VISIBLE_DEVICES": "0"}]
    assert memory_shares(envs, 0.9, "cuda") == [0.45, 0.9, 0.45]
    assert memory_shares([{}, {}, {}], 0.9, "cuda:1") == [0.3, 0.3, 0.3]  # every worker pinned to GPU 1
    assert memory_shares([{}, {}], 0.9, "cpu") == [None, None]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_a_real_gpu_the_engine_fits_within_its_share(tiny_dir):
    """For a session lent a GPU: the readings are the driver's and the allocator's; after the KV cache is allocated
    this process holds no more than its share of the device, and the engine serves."""
    engine = Engine(EngineConfig(model=str(tiny_dir), device="cuda", kv_cache_gib=None, gpu_memory_utilization=0.3))
    sizing = engine.kv_sizing
    assert sizing is not None and sizing.kv_cache_bytes > 0
    assert torch.cuda.memory_reserved() <= 0.3 * sizing.memory.total + 64 * MIB
    out = engine.generate([Request("r", [1, 405, 77, 1290, 33], SamplingParams(max_tokens=8, temperature=0.0))])
    assert len(out["r"].output_token_ids) == 8
