"""What a stage hands the next one instead of pages: where they are and how to read them."""

from __future__ import annotations

import dataclasses

from common.paged_cache import PageLayout


@dataclasses.dataclass(frozen=True, slots=True)
class PageHandle:
    worker_id: str
    address: str  # gRPC address of the source worker (for pulls over gRPC and for the ack)
    lease_id: str
    block_ids: tuple[int, ...]  # in token order
    num_tokens: int  # valid tokens; the last block may be partly filled
    layout: PageLayout
    lease_expiry: float  # unix time (s) after which the source frees the pages
    backend: str = "grpc"  # transfer backend the source offers
    backend_info: bytes = b""  # what that backend needs (e.g. NIXL agent metadata)

    def __post_init__(self) -> None:
        if self.layout.kind not in ("kv", "image"):
            raise ValueError(f"unknown cache kind {self.layout.kind!r}")
        needed = -(-self.num_tokens // self.layout.block_size)
        if self.num_tokens < 1 or needed != len(self.block_ids):
            raise ValueError(
                f"{len(self.block_ids)} block ids for {self.num_tokens} tokens of block size {self.layout.block_size}"
            )

    @property
    def kind(self) -> str:
        return self.layout.kind

    @property
    def num_bytes(self) -> int:
        return len(self.block_ids) * self.layout.bytes_per_block
