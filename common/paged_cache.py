"""Paged tensors whose blocks are plain byte buffers addressable by block id.

`PagedKVCache` keeps all layers of one block contiguous — [blocks, layers, 2, block_size,
kv_heads, head_dim] — so one block is one byte range that can be moved between processes.
`PagedImageCache` holds projected image embeddings, [blocks, block_size, hidden].
`PagePayload` is what crosses a process boundary: the layout plus the blocks' bytes.
"""

from __future__ import annotations

import dataclasses
import math
import warnings

import torch

from common.memory import bytes_of, host_zeros


class PageLayoutMismatch(ValueError):
    """Pages produced by an engine with another model, dtype or block size."""


@dataclasses.dataclass(frozen=True, slots=True)
class PageLayout:
    kind: str  # "kv" or "image"
    dtype: str  # torch dtype name, e.g. "float32"
    block_size: int  # tokens per block
    block_shape: tuple[int, ...]  # shape of one block's tensor

    @property
    def bytes_per_block(self) -> int:
        return math.prod(self.block_shape) * torch.empty((), dtype=getattr(torch, self.dtype)).element_size()


@dataclasses.dataclass(frozen=True, slots=True)
class PagePayload:
    layout: PageLayout
    num_tokens: int  # valid tokens; the last block may be partly filled
    data: bytes  # the blocks' bytes, in token order

    def __post_init__(self) -> None:
        blocks = -(-self.num_tokens // self.layout.block_size)
        if len(self.data) != blocks * self.layout.bytes_per_block:
            raise ValueError(f"{len(self.data)} bytes do not hold {blocks} blocks of {self.layout.bytes_per_block}")

    @property
    def num_blocks(self) -> int:
        return len(self.data) // self.layout.bytes_per_block


class PagedBuffer:
    def __init__(self, kind: str, num_blocks: int, block_size: int, block_shape: tuple[int, ...], dtype, device):
        shape = (num_blocks, *block_shape)
        cpu = torch.device(device).type == "cpu"
        self.data = host_zeros(shape, dtype) if cpu else torch.zeros(shape, dtype=dtype, device=device)
        self.layout = PageLayout(kind, str(dtype).removeprefix("torch."), block_size, tuple(block_shape))

    @property
    def num_blocks(self) -> int:
        return self.data.shape[0]

    def block_bytes(self, block_id: int) -> memoryview:
        """Zero-copy view of one block's bytes (CPU caches)."""
        return memoryview(self.data[block_id].view(torch.uint8).reshape(-1).numpy())

    def gather_bytes(self, block_ids: list[int]) -> bytes:
        """The blocks' bytes, in the given order (copied out without holding the GIL where possible)."""
        index = torch.tensor(block_ids, dtype=torch.long, device=self.data.device)
        return bytes_of(self.data.index_select(0, index).cpu())

    def read_blocks(self, block_ids: list[int], num_tokens: int) -> PagePayload:
        return PagePayload(self.layout, num_tokens, self.gather_bytes(block_ids))

    def write_raw(self, block_ids: list[int], data) -> None:
        """Write whole blocks' bytes (any buffer; read only) into `block_ids`, in order."""
        if len(data) != len(block_ids) * self.layout.bytes_per_block:
            raise ValueError(f"{len(data)} bytes are not {len(block_ids)} blocks of {self.layout.bytes_per_block}")
        with warnings.catch_warnings():  # torch warns that a read-only buffer is not writable: we only read it
            warnings.simplefilter("ignore", UserWarning)
            src = torch.frombuffer(data, dtype=torch.uint8)
        index = torch.tensor(block_ids, dtype=torch.long, device=self.data.device)
        self.data[index] = src.view(self.data.dtype).view(len(block_ids), *self.layout.block_shape).to(self.data.device)

    def write_blocks(self, block_ids: list[int], payload: PagePayload) -> None:
        if payload.layout != self.layout:
            raise PageLayoutMismatch(f"pages have layout {payload.layout}, this cache {self.layout}")
        if len(block_ids) != payload.num_blocks:
            raise ValueError(f"{payload.num_blocks} blocks of data for {len(block_ids)} block ids")
        self.write_raw(block_ids, payload.data)


class PagedKVCache(PagedBuffer):
    def __init__(self, num_blocks, block_size, num_layers, num_kv_heads, head_dim, dtype, device):
        super().__init__(
            "kv", num_blocks, block_size, (num_layers, 2, block_size, num_kv_heads, head_dim), dtype, device
        )
        self.layers = [(self.data[:, i, 0], self.data[:, i, 1]) for i in range(num_layers)]

    @staticmethod
    def bytes_per_block(block_size, num_layers, num_kv_heads, head_dim, dtype) -> int:
        return block_size * num_layers * 2 * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


class PagedImageCache(PagedBuffer):
    def __init__(self, num_blocks, block_size, hidden_size, dtype, device):
        super().__init__("image", num_blocks, block_size, (block_size, hidden_size), dtype, device)
        self.flat = self.data.view(-1, hidden_size)

    @staticmethod
    def bytes_per_block(block_size, hidden_size, dtype) -> int:
        return block_size * hidden_size * torch.empty((), dtype=dtype).element_size()
