"""One gRPC channel per peer address, shared by every call to it."""

from __future__ import annotations

import grpc

from common.tls import MeshTls
from common.tls import channel as channel_to

# pages move in messages of up to a few MiB; leave headroom over the chunk size
MAX_MESSAGE_BYTES = 64 * 2**20
# HTTP/2 flow control: grpc's default stream window (64 KiB, grown by its bandwidth probe) makes a large
# message wait for window updates on the way; an 8 MiB window lets a request carrying an image's pixels
# (600 KB) or a page chunk go out at once. Measured across two processes on loopback: a 600 KB request's
# round trip 2.3-2.5 ms -> 1.4 ms (bench/README, "gRPC window").
STREAM_WINDOW_BYTES = 8 * 2**20
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.http2.lookahead_bytes", STREAM_WINDOW_BYTES),
]


class ChannelPool:
    def __init__(self, tls: MeshTls | None = None):
        """`tls`: every channel over mutual TLS (common/tls.py); None: plaintext."""
        self.tls = tls
        self._channels: dict[str, grpc.aio.Channel] = {}

    def get(self, address: str) -> grpc.aio.Channel:
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = channel_to(address, self.tls, CHANNEL_OPTIONS)
        return channel

    async def close(self) -> None:
        channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            await channel.close()
