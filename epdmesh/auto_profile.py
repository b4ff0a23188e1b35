"""A latency profile for `serve` when none is given: measured once per model, dtype, device, threads and host.

`serve` without `--latency-profile` (and without `--no-auto-profile`) looks for a profile of this very setup in
`$EPDMESH_HOME/profiles` (default ~/.cache/epdmesh/profiles); on a miss it runs `epdmesh profile` with the
workers' own settings (seconds on the default model) and keeps the result. The workers then size their stage
budgets from it and the SLOs, and the router routes by it, as with a profile given by hand — the way vLLM
profiles memory before it serves.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

log = logging.getLogger("epdmesh")


def profiles_dir() -> Path:
    return Path(os.environ.get("EPDMESH_HOME", Path.home() / ".cache" / "epdmesh")) / "profiles"


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# the code whose speed a profile measures: a change to any of it measures again
ENGINE_SOURCES = (
    "kernels/*.py",
    "kernels/*.c",
    "common/model/*.py",
    "common/engine/model_runner.py",
    "common/paged_cache.py",
)


def engine_digest() -> str:
    root = Path(__file__).resolve().parent.parent
    digest = hashlib.sha256()
    for path in sorted(p for pattern in ENGINE_SOURCES for p in root.glob(pattern)):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def setup_key(model: str, dtype: str, device: str, threads: int, eager: bool) -> dict:
    """What a profile depends on: the checkpoint (its path and files' sizes and times), the numerics, the host, and
    the engine's compute code (`ENGINE_SOURCES`)."""
    model_dir = Path(model).resolve()
    files = sorted((p.name, p.stat().st_size, int(p.stat().st_mtime)) for p in model_dir.glob("*.safetensors"))
    import torch

    return dict(
        model=str(model_dir),
        files=files,
        dtype=dtype,
        device=device,
        threads=threads,
        eager=eager,
        cpu=_cpu_name(),
        cores=os.cpu_count(),
        torch=torch.__version__,
        engine=engine_digest(),
        format=1,
    )


def profile_path(key: dict) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return profiles_dir() / f"{Path(key['model']).name}-{key['dtype']}-{key['threads']}t-{digest}.json"


# a profile measured while other processes took more than this share of the host's CPU time is not kept: on the
# 2-core hosts here, one measured during a pip install priced an image's encode at 205 ms against 11 ms on a quiet host
BUSY_SHARE = 0.25


def _cpu_seconds() -> tuple[float, float, float] | None:
    """(wall, the host's busy CPU seconds, this process's children's CPU seconds), or None where /proc/stat is not
    there to read. Busy includes steal: time a VM's host gave to others."""
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    except (OSError, IndexError):
        return None
    ticks = [int(x) for x in fields[:8]]  # user nice system idle iowait irq softirq steal
    busy = sum(ticks) - ticks[3] - ticks[4]
    children = os.times()
    return time.monotonic(), busy / os.sysconf("SC_CLK_TCK"), children.children_user + children.children_system


def _others_share(before, after) -> float:
    """The share of the host's CPU time between two `_cpu_seconds()` that went to anything but this process's
    children (0 where it cannot be read)."""
    if before is None or after is None or after[0] <= before[0]:
        return 0.0
    wall, busy, mine = (a - b for a, b in zip(after, before))
    return max(0.0, busy - mine) / (wall * (os.cpu_count() or 1))


def wants_auto_profile(args) -> bool:
    """serve measures its own profile: asked to, on the real backend, with no profile or token budget given."""
    return (
        args.auto_profile
        and getattr(args, "backend", "torch") == "torch"
        and not args.latency_profile
        and args.token_budget is None
    )


def ensure_profile(args, threads: int) -> str:
    """The path of this setup's profile, measured now (in a child process, with `threads` threads) if not cached."""
    from common.engine.config import resolve_dtype

    dtype = resolve_dtype(args.dtype, args.device)
    key = setup_key(args.model, dtype, args.device, threads, bool(getattr(args, "enforce_eager", False)))
    path = profile_path(key)
    if path.is_file():
        log.info("latency profile of this setup: %s (cached)", path)
        return str(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(f".{os.getpid()}.partial")
    argv = [
        sys.executable,
        "-m",
        "epdmesh.cli",
        "profile",
        "--model",
        args.model,
        "--dtype",
        dtype,
        "--device",
        args.device,
        "--threads",
        str(threads),
        "--repeats",  # a median of 3 drops one slow sample; of 2 it is their mean (a prefill point of 16 tokens
        "3",  # once came out at 42 ms against 7, and the fit priced prefills 8-23 ms high); ~19 s either way
        "--out",
        str(partial),
    ]
    if key["eager"]:
        argv.append("--enforce-eager")
    log.info("measuring a latency profile of this setup (once; --latency-profile FILE or --no-auto-profile skip it)")
    before = _cpu_seconds()
    subprocess.run(argv, check=True)
    others = _others_share(before, _cpu_seconds())
    if others > BUSY_SHARE:
        busy = path.with_suffix(".busy.json")
        partial.replace(busy)
        log.warning(
            "other processes used %.0f%% of this host's CPU time while the latency profile was measured: it sizes "
            "this run's budgets (%s) but is not kept, and the next start measures again",
            others * 100,
            busy,
        )
        return str(busy)
    partial.replace(path)
    path.with_suffix(".busy.json").unlink(missing_ok=True)
    path.with_suffix(".key.json").write_text(json.dumps(key, indent=2) + "\n")
    log.info("latency profile written to %s", path)
    return str(path)
