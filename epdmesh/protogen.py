"""Regenerate the Python stubs of proto/ (`make proto`); the tests check the committed ones are current."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTOS = ["epdmesh/v1/mesh.proto"]


def generate(out_dir: Path) -> list[Path]:
    """Write the stubs for every proto under `out_dir` (a package root); returns the files written.

    protoc runs in its own process: its bundled libprotobuf must not meet the native libraries other
    packages have loaded into ours (seen: a segfault importing it after NIXL)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    args = [
        sys.executable,
        "-m",
        "grpc_tools.protoc",
        f"-I{ROOT / 'proto'}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
    ]
    done = subprocess.run(args + [str(ROOT / "proto" / p) for p in PROTOS], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"protoc failed: {done.stderr.strip()}")
    stems = [out_dir / p.removesuffix(".proto") for p in PROTOS]
    return [stem.with_name(stem.name + suffix) for stem in stems for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")]


if __name__ == "__main__":
    for path in generate(ROOT):
        print(path.relative_to(ROOT), file=sys.stderr)
