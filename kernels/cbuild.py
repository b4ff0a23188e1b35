"""Our C kernels, built on first use by the host's compiler into the user's cache, as inductor builds its own.

`load(source, what)`: `$CC` (else `cc`, else `gcc`) with `-O3 -march=native -fopenmp` into
`$EPDMESH_HOME/kernels` (default ~/.cache/epdmesh/kernels), keyed by the source, the headers of ours it includes
(`#include "…"`, beside it), the compiler, the CPU and the defines; one build per host (a file lock), the other
processes wait and reuse it. OpenMP is the runtime torch has loaded (the same soname), so a kernel's parallel
regions run on torch's intra-op threads. Where no compiler works, None and a warning that says what stays in its
place.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import logging
import os
import platform
import re
import shutil
import subprocess
from pathlib import Path

log = logging.getLogger(__name__)


def cache_dir() -> Path:
    return Path(os.environ.get("EPDMESH_HOME", Path.home() / ".cache" / "epdmesh")) / "kernels"


def _cpu_id() -> str:
    """What -march=native compiles for: the model name and flags of the first CPU."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    return "\n".join(line for line in text.split("\n\n", 1)[0].splitlines() if line.startswith(("model name", "flags")))


def included(text: bytes) -> list[str]:
    """The headers of ours a C source includes (`#include "name.h"`: beside it)."""
    return [name.decode() for name in re.findall(rb'^\s*#\s*include\s+"([^"]+)"', text, re.MULTILINE)]


def build(source: Path, compiler: str, defines: tuple[str, ...] = ()) -> Path:
    """The shared library of `source` for this host (built once), its path."""
    text = source.read_bytes()
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    flags = [f"-D{d}" for d in defines]
    headers = [source.with_name(name).read_bytes() for name in included(text)]
    parts = [text, *headers, version.encode(), _cpu_id().encode(), " ".join(flags).encode()]
    key = hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]
    target = cache_dir() / f"{source.stem}-{key}.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.with_suffix(".lock"), "w") as lock:  # one build per host; the others wait and reuse it
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not target.is_file():
            partial = target.with_suffix(f".{os.getpid()}.partial")
            flags = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11", *flags]
            subprocess.run([compiler, *flags, str(source), "-o", str(partial), "-lm"], check=True, capture_output=True)
            partial.rename(target)
    return target


def load(source: Path, what: str, defines: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """`source` built and loaded; None (with a warning naming `what`: what stays instead) where that fails."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        log.warning("no C compiler (set CC): %s", what)
        return None
    try:
        return ctypes.CDLL(str(build(source, compiler, defines)))
    except (OSError, subprocess.CalledProcessError) as e:
        detail = getattr(e, "stderr", None) or e
        detail = detail.decode(errors="replace")[-500:] if isinstance(detail, bytes) else detail
        log.warning("building %s failed (%s): %s", source.name, what, detail)
        return None


def shape_struct(name: str, fields: str) -> type[ctypes.Structure]:
    """The ctypes twin of a kernel's shape struct: `fields` (space-separated) as int64s, then a float `scale`."""
    return type(
        name,
        (ctypes.Structure,),
        {"_fields_": [(f, ctypes.c_int64) for f in fields.split()] + [("scale", ctypes.c_float)]},
    )
