"""`epdmesh serve --device cuda` gives each worker a GPU of its own, round-robin, and a restarted worker the same
one (no GPU is needed: which GPUs exist is given to the functions)."""

import logging
import sys
from pathlib import Path

import pytest

from epdmesh.gpus import gpu_devices, worker_envs
from epdmesh.launch import Mesh


def test_which_gpus_workers_are_spread_over():
    assert gpu_devices("cpu") is None and gpu_devices("cuda:1") is None  # the CPU, or a GPU pinned by the user
    assert gpu_devices("cuda", "2, 3", environ={"CUDA_VISIBLE_DEVICES": "0"}) == ["2", "3"]  # --gpus first
    assert gpu_devices("cuda", environ={"CUDA_VISIBLE_DEVICES": "4,5"}) == ["4", "5"]
    assert gpu_devices("cuda", environ={}, count=lambda: 3) == ["0", "1", "2"]
    with pytest.raises(ValueError, match="no GPU is visible"):
        gpu_devices("cuda", environ={}, count=lambda: 0)


def test_one_gpu_per_worker_round_robin_with_a_warning_when_they_share(caplog):
    assert worker_envs(2, None) == [{}, {}]
    assert worker_envs(3, ["0", "1", "2", "3"]) == [{"CUDA_VISIBLE_DEVICES": d} for d in ("0", "1", "2")]
    with caplog.at_level(logging.WARNING):
        envs = worker_envs(5, ["6", "7"])
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["6", "7", "6", "7", "6"]
    assert "5 workers share 2 GPU(s) 6,7" in caplog.text


def test_a_restarted_worker_gets_its_gpu_again():
    mesh = Mesh()
    try:
        argv = [sys.executable, "-c", "import time; time.sleep(60)"]
        first = mesh.spawn("worker D#0", argv, {"CUDA_VISIBLE_DEVICES": "3"})
        first.kill()
        first.wait(10)
        again = mesh.respawn("worker D#0")
        environ = Path(f"/proc/{again.pid}/environ").read_bytes().split(b"\0")
        assert b"CUDA_VISIBLE_DEVICES=3" in environ and again.pid != first.pid
    finally:
        mesh.stop(timeout=5)


def test_on_a_gpu_workers_size_their_own_kv_cache_from_their_share_of_its_memory():
    """serve --device cuda: no --kv-cache-gib goes to the workers (each measures what its share of the GPU leaves);
    an explicit one still does; on the CPU the default 1 GiB does."""
    from common.topology import parse_topology
    from epdmesh.cli import build_parser
    from epdmesh.engine_setup import kv_cache_gib
    from epdmesh.launch import worker_argv

    def kv_flag(*flags):
        args = build_parser().parse_args(["serve", "--model", "m", *flags])
        args.kv_cache_gib = kv_cache_gib(args)
        argv = worker_argv(parse_topology("EPD1")[0], "127.0.0.1:1", args, 1)
        return argv[argv.index("--kv-cache-gib") + 1] if "--kv-cache-gib" in argv else None

    assert kv_flag("--device", "cuda") is None
    assert kv_flag("--device", "cuda", "--kv-cache-gib", "20") == "20.0"
    assert kv_flag() == "1.0"
