"""Which GPU each worker of `epdmesh serve --device cuda` runs on: one each, round-robin over the GPUs it may use.

Without this every worker would open the first GPU (each a copy of the weights and a KV cache on one device, the
rest idle). A worker sees only its GPU (`CUDA_VISIBLE_DEVICES`), so inside it the device is `cuda` (index 0).
The GPUs: `--gpus 0,1,…`, else the launcher's own `CUDA_VISIBLE_DEVICES`, else every GPU torch can see. More workers
than GPUs share them, round-robin, with a warning; `--device cuda:N` pins every worker to GPU N as asked.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)


def gpu_devices(device: str, gpus: str | None = None, environ: dict | None = None, count=None) -> list[str] | None:
    """The GPU ids workers are spread over; None when the device is not a bare `cuda` (the CPU, or a pinned GPU)."""
    if device != "cuda":
        return None
    environ = os.environ if environ is None else environ
    listed = gpus if gpus is not None else environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        devices = [d.strip() for d in listed.split(",") if d.strip()]
    else:
        devices = [str(i) for i in range((count or _device_count)())]
    if not devices:
        raise ValueError(
            "--device cuda, but no GPU is visible (CUDA_VISIBLE_DEVICES / --gpus is empty, or torch sees none)"
        )
    return devices


def worker_envs(num_workers: int, devices: list[str] | None) -> list[dict[str, str]]:
    """The environment each worker starts with: its GPU, round-robin."""
    if devices is None:
        return [{} for _ in range(num_workers)]
    if num_workers > len(devices):
        log.warning(
            "%d workers share %d GPU(s) %s: each GPU holds the weights and KV cache of several workers",
            num_workers,
            len(devices),
            ",".join(devices),
        )
    return [{"CUDA_VISIBLE_DEVICES": devices[i % len(devices)]} for i in range(num_workers)]


def memory_shares(envs: list[dict[str, str]], utilization: float, device: str) -> list[float | None]:
    """Each worker's --gpu-memory-utilization: the launch's, split evenly among the workers on one GPU (their
    weights, activations and KV caches all fit in it) — each its own (`envs`), or all on the one `--device cuda:N`
    pins them to; None on the CPU."""
    pinned = device if device.startswith("cuda") else None
    gpus = [env.get("CUDA_VISIBLE_DEVICES", pinned) for env in envs]
    return [None if gpu is None else utilization / gpus.count(gpu) for gpu in gpus]


def _device_count() -> int:
    import torch

    return torch.cuda.device_count()
