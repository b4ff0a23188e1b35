"""Regenerate the Python stubs of proto/ (`make proto`); the tests check the committed ones are current."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTOS = ["epdmesh/v1/mesh.proto"]


def generate(out_dir: Path) -> list[Path]:
    """Write the stubs for every proto under `out_dir` (a package root); returns the files written."""
    from grpc_tools import protoc

    out_dir.mkdir(parents=True, exist_ok=True)
    args = ["protoc", f"-I{ROOT / 'proto'}", f"--python_out={out_dir}", f"--pyi_out={out_dir}", f"--grpc_python_out={out_dir}"]
    if protoc.main(args + [str(ROOT / "proto" / p) for p in PROTOS]) != 0:
        raise RuntimeError("protoc failed")
    stems = [out_dir / p.removesuffix(".proto") for p in PROTOS]
    return [stem.with_name(stem.name + suffix) for stem in stems for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")]


if __name__ == "__main__":
    for path in generate(ROOT):
        print(path.relative_to(ROOT), file=sys.stderr)
