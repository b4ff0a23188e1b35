"""One read-only copy of a model's weights for every worker process on a host (CPU only; opt-in).

Life of a shared copy:
  1. the first worker to load a checkpoint writes its parameters, as the engine holds them, into one file in
     /dev/shm named after the checkpoint's files, the dtype and the parameters' layout (under a lock, so two
     workers starting together write it once);
  2. every worker maps that file read-only and shared, and its parameters become views of it: one physical copy,
     so the steps of one worker keep the weights warm in the caches for the others (each holding its own copy,
     the prefill worker's forward ran 0.6-0.9 ms slower than the same forward in one process: bench/README.md);
  3. each worker holds a shared lock on a companion file while it lives; the last one to close removes both
     (creating, mapping and removing happen under one more lock, so none of them races another).
Where /dev/shm lacks room (a container's 64 MB default) the weights stay private, and the log says so.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import hashlib
import logging
import mmap
import os
import shutil
import warnings
from pathlib import Path

import torch

log = logging.getLogger(__name__)
ALIGN = 64
SHM_DIR = "/dev/shm"


class SharedWeights:
    """The mapping a model's parameters are views of; `close()` (or the process's exit) lets the file go."""

    def __init__(self, path: Path, region: mmap.mmap, users_fd: int):
        self.path = path
        self._region = region
        self._users_fd = users_fd

    def close(self) -> None:
        """Drop our hold; the last holder removes the file (the parameters' views stay valid while mapped)."""
        if self._users_fd < 0:
            return
        with _creating(self.path) as _:
            try:
                fcntl.flock(self._users_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # nobody else holds it: we are the last
            except BlockingIOError:
                pass
            else:
                for p in (self.path, _users(self.path)):
                    p.unlink(missing_ok=True)
            os.close(self._users_fd)
            self._users_fd = -1


def share(model: torch.nn.Module, model_dir: str, dtype: torch.dtype, directory: str = SHM_DIR) -> SharedWeights | None:
    """Make `model`'s (CPU) parameters views of the host's shared copy; None, and the parameters untouched, where
    that cannot be done."""
    params = list(model.parameters())
    if not params or any(p.device.type != "cpu" for p in params):
        return None
    sizes = [_aligned(p.numel() * p.element_size()) for p in params]
    total = sum(sizes)
    path = Path(directory) / f"epdmesh-weights-{_key(model_dir, dtype, params)}"
    try:
        if not path.exists() and shutil.disk_usage(directory).free < total + (64 << 20):
            log.info("weights stay private: %s has no room for %.0f MB", directory, total / 2**20)
            return None
        with _creating(path):
            if not path.exists() or path.stat().st_size != total:
                _write(path, params, sizes)
            fd = os.open(path, os.O_RDONLY)
            try:
                region = mmap.mmap(fd, total, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
            finally:
                os.close(fd)
            users_fd = os.open(_users(path), os.O_RDWR | os.O_CREAT, 0o600)
            fcntl.flock(users_fd, fcntl.LOCK_SH)  # held while we live: the last to let go removes the file
    except OSError as e:
        log.info("weights stay private: %s", e)
        return None
    with warnings.catch_warnings():  # read-only on purpose: a write to a weight would be a bug, and now a crash
        warnings.simplefilter("ignore", UserWarning)
        buffer = torch.frombuffer(region, dtype=torch.uint8)
    offset = 0
    for p, size in zip(params, sizes):
        view = buffer[offset : offset + p.numel() * p.element_size()].view(p.dtype).view(p.shape)
        if not torch.equal(view, p.data):  # the file is not this checkpoint's (a stale or torn one): stay private
            log.warning("weights stay private: %s does not hold this checkpoint's parameters", path)
            SharedWeights(path, region, users_fd).close()
            return None
        offset += size
    offset = 0
    for p, size in zip(params, sizes):
        p.data = buffer[offset : offset + p.numel() * p.element_size()].view(p.dtype).view(p.shape)
        offset += size
    log.info("weights shared: %s (%.0f MB)", path, total / 2**20)
    shared = SharedWeights(path, region, users_fd)
    atexit.register(shared.close)
    return shared


@contextlib.contextmanager
def _creating(path: Path):
    """The lock under which the file is made, mapped, or removed (one process at a time)."""
    fd = os.open(path.with_name(path.name + ".lock"), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # and with it the lock


def _users(path: Path) -> Path:
    return path.with_name(path.name + ".users")


def _write(path: Path, params: list[torch.Tensor], sizes: list[int]) -> None:
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        for p, size in zip(params, sizes):
            data = p.detach().contiguous().view(torch.uint8).reshape(-1).numpy().tobytes()
            f.write(data + bytes(size - len(data)))
    os.replace(tmp, path)


def _key(model_dir: str, dtype: torch.dtype, params: list[torch.Tensor]) -> str:
    """The checkpoint's files (path, size, mtime), the dtype and the parameters' shapes."""
    digest = hashlib.blake2b(digest_size=10)
    root = Path(model_dir).resolve()
    for f in sorted(root.glob("*.safetensors")):
        stat = f.stat()
        digest.update(f"{f}:{stat.st_size}:{stat.st_mtime_ns};".encode())
    digest.update(str(dtype).encode())
    for p in params:
        digest.update(f"{tuple(p.shape)}:{p.dtype};".encode())
    return digest.hexdigest()


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN
