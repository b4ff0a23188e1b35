"""What a NIXL puller needs to know about a source worker: its agent and where its page caches live.

`pack_metadata` puts a small JSON header (per cache kind: base address, bytes per block, block count,
memory type) in front of the agent's own NIXL metadata; every handle the worker leases carries it.
"""

from __future__ import annotations

import dataclasses
import json
import struct

MAGIC = b"EPDNIXL1"


@dataclasses.dataclass(frozen=True, slots=True)
class CacheRegion:
    addr: int  # address of block 0 in the owner's process
    block_bytes: int
    num_blocks: int
    mem: str = "DRAM"  # NIXL memory type
    dev: int = 0  # device id (0 for DRAM)


@dataclasses.dataclass(frozen=True, slots=True)
class PeerInfo:
    agent: str
    caches: dict[str, CacheRegion]
    agent_metadata: bytes


def pack_metadata(agent: str, caches: dict[str, CacheRegion], agent_metadata: bytes) -> bytes:
    header = json.dumps(
        {"v": 1, "agent": agent, "caches": {k: dataclasses.asdict(c) for k, c in caches.items()}}, separators=(",", ":")
    ).encode()
    return MAGIC + struct.pack("<I", len(header)) + header + agent_metadata


def parse_metadata(blob: bytes) -> PeerInfo:
    """The inverse of `pack_metadata`; ValueError if `blob` is not ours."""
    if not blob.startswith(MAGIC) or len(blob) < len(MAGIC) + 4:
        raise ValueError("not epdmesh NIXL metadata")
    (n,) = struct.unpack_from("<I", blob, len(MAGIC))
    start = len(MAGIC) + 4
    try:
        header = json.loads(blob[start : start + n])
        caches = {k: CacheRegion(**c) for k, c in header["caches"].items()}
        agent = header["agent"]
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"bad epdmesh NIXL metadata header: {e}") from None
    return PeerInfo(agent, caches, bytes(blob[start + n :]))
