"""Pick a worker's transfer backend by configuration, falling back to the gRPC stream with a clear log line."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

from common.paged_cache import PagedBuffer, PagePayload
from common.transfer.channels import ChannelPool
from common.transfer.grpc_stream import GrpcStreamPuller
from common.transfer.handle import PageHandle
from common.transfer.puller import PagePuller

log = logging.getLogger(__name__)
BACKENDS = ("auto", "nixl", "grpc")


class DispatchingPuller:
    """Pulls each handle with the backend its source offers, when this worker has it; else over gRPC."""

    name = "dispatch"

    def __init__(self, pullers: dict[str, PagePuller], fallback: PagePuller):
        self.pullers = pullers
        self.fallback = fallback

    def _for(self, handle: PageHandle) -> PagePuller:
        return self.pullers.get(handle.backend, self.fallback)

    async def pull(self, handle: PageHandle) -> PagePayload:
        return await self._for(handle).pull(handle)

    async def pull_into(self, handle: PageHandle, cache: PagedBuffer, block_ids: list[int]) -> None:
        await self._for(handle).pull_into(handle, cache, block_ids)

    async def release(self, handle: PageHandle) -> bool:
        return await self._for(handle).release(handle)

    async def close(self) -> None:
        for puller in {id(p): p for p in [*self.pullers.values(), self.fallback]}.values():
            await puller.close()


@dataclasses.dataclass(slots=True)
class Transfer:
    puller: PagePuller
    offer: str  # the backend this worker's handles name
    backend_info: bytes = b""
    serving: Callable[[int], None] | None = None  # told how many of this worker's page sets are leased out
    # the cache memory `offer` serves pages from, by kind ("kv", "image") → data pointer; empty: any (it reads
    # the cache a lease names when pulled). Pages in other memory (a cache allocated later) go by gRPC.
    registered: dict[str, int] = dataclasses.field(default_factory=dict)

    async def close(self) -> None:
        await self.puller.close()


def make_transfer(backend: str, engine, channels: ChannelPool, worker_id: str) -> Transfer:
    """`auto`: NIXL/UCX where it starts, else the gRPC stream — and the gRPC stream only over mutual TLS
    (`channels.tls`): UCX moves the pages unencrypted, so a mesh secured by configuration keeps them on gRPC
    unless `nixl` is asked for by name."""
    if backend not in BACKENDS:
        raise ValueError(f"transfer backend {backend!r} is not one of {BACKENDS}")
    grpc_puller = GrpcStreamPuller(channels)
    if channels.tls is not None and backend == "auto":
        log.info("mutual TLS: pages move over the (encrypted) gRPC stream; --transfer nixl moves them over UCX")
        backend = "grpc"
    elif channels.tls is not None and backend == "nixl":
        log.warning("--transfer nixl with mutual TLS: pages move over UCX unencrypted; control calls use TLS")
    if backend in ("auto", "nixl"):
        try:
            from common.transfer.nixl_backend import NixlTransfer
        except ImportError as e:
            if backend == "nixl":
                raise RuntimeError(
                    f"transfer backend nixl asked for but unavailable: {e}; pip install 'epdmesh[ucx]'"
                ) from None
            log.info("UCX transfer unavailable (%s); pages move over the gRPC stream fallback", e)
        else:
            try:
                nixl = NixlTransfer(worker_id, engine, channels)
            except Exception as e:  # UCX could not start here
                if backend == "nixl":
                    raise RuntimeError(f"transfer backend nixl asked for but it failed to start: {e}") from e
                log.warning(
                    "NIXL/UCX failed to start (%s: %s); pages move over the gRPC stream fallback", type(e).__name__, e
                )
            else:
                return Transfer(
                    DispatchingPuller({"nixl": nixl, "grpc": grpc_puller}, grpc_puller),
                    "nixl",
                    nixl.metadata,
                    nixl.serving,
                    {kind: tensor.data_ptr() for kind, tensor in nixl.tensors.items()},
                )
    return Transfer(DispatchingPuller({"grpc": grpc_puller}, grpc_puller), "grpc")
