"""Start `epdmesh serve` (one process or a whole mesh) as real processes, and check their pools."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time

import httpx
import pytest

from common.ports import free_port
from epdmesh.launch import stop_process

MODEL = "tiny"
# what every tiny-model server of the tests runs with, and its small image cache (the tiny model's images take a few
# KiB: 20 MiB hold hundreds, and each encoding worker faults in 20 MiB at start instead of the default's 256)
TINY_ENGINE = ("--dtype", "float32", "--kv-cache-gib", "0.05", "--token-budget", "256", "--threads", "1")
TINY_IMAGE_CACHE = ("--image-cache-gib", "0.02")
REDIS_URL = os.environ.get("EPDMESH_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


@contextlib.contextmanager
def running_server(
    model_dir,
    topology: str,
    log_path,
    *extra: str,
    redis_url: str | None = REDIS_URL,
    env: dict | None = None,
    source: str | None = None,
):
    """`epdmesh serve --topology T` on a free loopback port; yields its base URL; stops it (SIGTERM) at the end.
    `redis_url=None`: no --redis-url and no REDIS_URL, so serve starts its own private redis-server.
    `source`: serve the code of another checkout of this repository (e.g. a `git worktree` of an older commit),
    with this environment's packages."""
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "epdmesh.cli",
        "serve",
        "--model",
        str(model_dir),
        "--served-model-name",
        MODEL,
        "--topology",
        topology,
        "--port",
        str(port),
        *TINY_ENGINE,
        # not for an emulated mesh (it counts LLaVA-1.5-7B's real image bytes) nor another checkout's serve (an older
        # one may not know the flag)
        *(() if "emulated" in extra or source is not None else TINY_IMAGE_CACHE),
        *extra,
    ]
    env = {**{k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "EPDMESH_API_KEY")}, **(env or {})}
    if source is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(source), env.get("PYTHONPATH", "")])
    if redis_url is not None:
        cmd += ["--redis-url", redis_url]
    with open(log_path, "w") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env={**env, "PYTHONUNBUFFERED": "1"}, cwd=source
        )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 240
    try:
        while True:
            try:
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"`epdmesh serve --topology {topology}` did not come up:\n{log_path.read_text()[-4000:]}")
            time.sleep(0.3)
        yield base
    finally:
        stop_process(proc, 60, f"epdmesh serve --topology {topology}")


def pools(base, headers: dict | None = None) -> list[dict]:
    """Per worker (or the one engine): free and total KV/image blocks and leases held. `headers`: e.g. an API key's."""
    stats = httpx.get(f"{base}/stats", timeout=10, headers=headers).json()
    if "workers" in stats:
        return list(stats["workers"].values())
    return [stats]


def pool_full(p: dict) -> bool:
    """One worker's (or the one engine's) stats: every KV and image block free, no lease held."""
    return (
        p["kv_blocks_free"] == p["kv_blocks_total"]
        and p["image_blocks_free"] == p["image_blocks_total"]
        and not p.get("num_leases", 0)
    )


def assert_pools_full(base, timeout: float = 15.0, headers: dict | None = None) -> None:
    deadline = time.monotonic() + timeout
    while True:
        current = pools(base, headers)
        if current and all(pool_full(p) for p in current):
            return
        if time.monotonic() > deadline:
            pytest.fail(f"pages not returned: {current}")
        time.sleep(0.1)


def streamed_token_ids(base: str, body: dict, after: int, act, timeout: float = 180) -> list[int]:
    """The token ids of `body` streamed (`return_token_ids` on), with no error event in the stream; `act()` runs
    once, when `after` tokens have come (e.g. to kill the decoder under way)."""
    streamed, acted = [], False
    with httpx.stream("POST", f"{base}/v1/chat/completions", json={**body, "stream": True}, timeout=timeout) as resp:
        for line in resp.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event
            if event["choices"]:
                streamed += event["choices"][0].get("token_ids") or []
            if not acted and len(streamed) >= after:
                act()
                acted = True
    assert acted, f"the stream ended after {len(streamed)} tokens, before {after}"
    return streamed
