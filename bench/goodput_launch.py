"""Launching the configurations `epdmesh bench goodput` compares: one `epdmesh serve` per configuration on a
free loopback port, its server log beside the report."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import time
from pathlib import Path


@contextlib.contextmanager
def launched(serve_args: list[str], log_path: Path, timeout: float = 900.0):
    """`epdmesh serve ARGS` on a free loopback port; yields (base URL, served model name); stops it at the end."""
    import httpx

    from common.ports import free_port
    from epdmesh.launch import die_with_parent, stop_process

    port = free_port()
    cmd = [sys.executable, "-m", "epdmesh.cli", "serve", *serve_args, "--host", "127.0.0.1", "--port", str(port)]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            preexec_fn=die_with_parent,
        )  # a killed benchmark takes its mesh with it
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    try:
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"`epdmesh serve {' '.join(serve_args)}` did not come up; see {log_path}")
            if "EPDMESH_READY" in log_path.read_text(errors="replace") or _answers(base):  # a mesh, or one process
                break
            time.sleep(0.5)
        model = httpx.get(f"{base}/v1/models", timeout=10).json()["data"][0]["id"]
        yield base, model
    finally:
        stop_process(proc, 120, "the benchmarked mesh")


def _answers(base: str) -> bool:
    import httpx

    try:
        return httpx.get(f"{base}/v1/models", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def log_path(out: Path, config_name: str) -> Path:
    """Beside the JSON, one server log per configuration; its label may hold any character (`toggle, TBT/2`)."""
    return out.with_name(f"{out.stem}-{re.sub(r'[^A-Za-z0-9.-]+', '_', config_name)}.log")


def serve_args_of(config_args: str, args, profile: Path | None) -> list[str]:
    import shlex

    out = shlex.split(config_args.replace("{profile}", str(profile or "")))
    if args.backend == "emulated":
        out += ["--backend", "emulated", "--profile", str(profile)]
    out += [
        "--slo-ttft-ms",
        str(args.slo_ttft_ms * args.time_scale),
        "--slo-tbt-ms",
        str(args.slo_tbt_ms * args.time_scale),
    ]
    return out + (["--model", args.model] if args.model else [])
