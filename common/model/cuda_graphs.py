"""Steps of decodes only, replayed as CUDA graphs: one graph per (batch bucket, context-width bucket), as vLLM does
for decode batches.

A decode step of a small model on a GPU is launch-bound: a few hundred kernels of microseconds each, every one
launched from Python. Captured once, the whole step (embedding, each layer's projections, K/V write, paged
attention, MLP, the last norm and the logits) replays with one launch. A graph has fixed shapes and addresses,
so each bucket owns static inputs (slices of buffers shared by all graphs) and one output; a step of n sequences
whose longest context spans w blocks runs the smallest captured bucket (B ≥ n, W ≥ w):
- rows n..B repeat row 0 (its token, position, blocks and slot): they compute what row 0 computes and write the
  same K/V into the same slot, and their logits are dropped;
- table columns past a sequence's own are masked by its length (`kernels.torch_ref.paged_decode`), whatever
  valid block ids they hold.
The arithmetic is the eager torch path's (`TorchPagedAttention`), so parity with transformers holds unchanged.
Attention gathers each sequence's W blocks, so buckets whose gathered K/V per layer would exceed
`gather_limit_bytes` are not captured; their steps run eagerly.
"""

from __future__ import annotations

import logging
import time

import torch

from common.model.llama import DecoderLayer, LlamaDecoder
from kernels.torch_ref import paged_decode

log = logging.getLogger(__name__)

GATHER_LIMIT_BYTES = 256 * 2**20  # a bucket's gathered K and V of one layer, at most
# what the captured graphs' memory pool can come to (the gathered K/V, their heads-first copies, the scores and the
# rest of one layer's intermediates): kept out of a KV cache sized from the GPU's memory
GRAPH_MEMORY_BYTES = 3 * GATHER_LIMIT_BYTES


def batch_buckets(max_seqs: int) -> list[int]:
    """1, 2, 4, 8, 16, 32, then every 32, up to max_seqs (itself the last)."""
    sizes = [b for b in (1, 2, 4, 8, 16) if b < max_seqs] + list(range(32, max_seqs, 32))
    return sizes + [max_seqs]


def width_buckets(max_blocks: int, smallest: int = 4) -> list[int]:
    """Powers of two from `smallest` blocks, up to max_blocks (itself the last)."""
    widths, w = [], smallest
    while w < max_blocks:
        widths.append(w)
        w *= 2
    return widths + [max_blocks]


def decode_step(
    text: LlamaDecoder,
    kv_layers,
    ids: torch.Tensor,
    positions: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    slot_blocks: torch.Tensor,
    slot_offsets: torch.Tensor,
) -> torch.Tensor:
    """One token per sequence → logits [sequences, vocab] (float32), eager torch with no host reads: each layer
    writes its K/V in place and attends over `block_tables`' blocks (`paged_decode`)."""
    x = text.embed_tokens(ids)
    cos, sin = text.rotary.cos_sin(positions, x.dtype)
    scale = text.cfg.head_dim**-0.5
    for layer, (k_cache, v_cache) in zip(text.layers, kv_layers):
        q, k, v = DecoderLayer.qkv(layer, x, cos, sin)
        k_cache[slot_blocks, slot_offsets] = k
        v_cache[slot_blocks, slot_offsets] = v
        x = DecoderLayer.finish(layer, x, paged_decode(q, k_cache, v_cache, block_tables, seq_lens, scale))
    return text.logits(x)


class DecodeGraphs:
    """The captured decode steps of one engine (its model and KV cache). `capture()` records them (at start, before
    any request: the warm-up runs write K/V into block 0); `run(...)` replays the bucket a step fits, or returns
    None when none does. On the CPU nothing is captured and `run` computes the same padded step eagerly (tests)."""

    def __init__(
        self,
        text: LlamaDecoder,
        kv_layers,
        block_size: int,
        max_seqs: int,
        max_model_len: int,
        gather_limit_bytes: int = GATHER_LIMIT_BYTES,
    ):
        self.text, self.kv_layers, self.block_size = text, kv_layers, block_size
        weight = text.embed_tokens.weight
        self.device = weight.device
        text.rotary_for(weight)
        k_cache = kv_layers[0][0]
        token_bytes = 2 * k_cache[0, 0].numel() * k_cache.element_size()  # one token's K and V, one layer
        self.batches = batch_buckets(max_seqs)
        widths = width_buckets(-(-max_model_len // block_size))
        self.buckets = [
            (b, w) for b in self.batches for w in widths if b * w * block_size * token_bytes <= gather_limit_bytes
        ]
        self.widths = sorted({w for _, w in self.buckets})
        most_b, most_w = self.batches[-1], max(self.widths, default=1)
        like = dict(device=self.device)
        with torch.inference_mode():
            self.ids = torch.zeros(most_b, dtype=torch.long, **like)
            self.positions = torch.zeros(most_b, dtype=torch.long, **like)
            self.seq_lens = torch.ones(most_b, dtype=torch.int32, **like)
            self.tables = torch.zeros(most_b, most_w, dtype=torch.int32, **like)
            self.slot_blocks = torch.zeros(most_b, dtype=torch.long, **like)
            self.slot_offsets = torch.zeros(most_b, dtype=torch.long, **like)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph | None, torch.Tensor | None]] = {}
        self.replays = 0  # steps run through a bucket (tests, the bench's report)
        self._buckets: dict[tuple[int, int], tuple[int, int] | None] = {}  # step shape → its bucket (`bucket`)

    def _step(self, b: int, w: int) -> torch.Tensor:
        return decode_step(
            self.text,
            self.kv_layers,
            self.ids[:b],
            self.positions[:b],
            self.tables[:b, :w],
            self.seq_lens[:b],
            self.slot_blocks[:b],
            self.slot_offsets[:b],
        )

    @torch.inference_mode()
    def capture(self) -> float:
        """Record every bucket's graph, largest first (one memory pool: the smaller reuse its blocks); returns the
        seconds it took. On the CPU it only notes the buckets."""
        start = time.perf_counter()
        if self.device.type != "cuda":
            self.graphs = {key: (None, None) for key in self.buckets}
            self._buckets.clear()
            return 0.0
        before = torch.cuda.memory_reserved(self.device)
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        for b, w in sorted(self.buckets, reverse=True):
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):  # warm-up off the capture (cuBLAS picks its kernels, allocates)
                self._step(b, w)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = self._step(b, w)
            self.graphs[(b, w)] = graph, logits
        self._buckets.clear()  # (what was looked up before this capture saw fewer graphs)
        torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - start
        log.info(
            "decode CUDA graphs: %d captured (batches %s, widths %s blocks) in %.1f s, %.0f MiB",
            len(self.graphs),
            self.batches,
            self.widths,
            seconds,
            (torch.cuda.memory_reserved(self.device) - before) / 2**20,
        )
        return seconds

    def bucket(self, num_seqs: int, width: int) -> tuple[int, int] | None:
        """The smallest captured (batch, width) that holds a step, or None (looked up once per step shape: every
        decode step asks)."""
        key = (num_seqs, width)
        if key not in self._buckets:
            fits = [(b, w) for b, w in self.graphs if b >= num_seqs and w >= width]
            self._buckets[key] = min(fits, key=lambda bw: bw[0] * bw[1], default=None)
        return self._buckets[key]

    @torch.inference_mode()
    def run(self, ids, positions, block_tables, seq_lens, slot_blocks, slot_offsets) -> torch.Tensor | None:
        """A step of decodes (the runner's tensors, on the device) → their logits [n, vocab] (a copy: the graph's
        output is overwritten by its next replay), or None when no bucket holds it."""
        n, width = ids.shape[0], block_tables.shape[1]
        key = self.bucket(n, width)
        if key is None:
            return None
        b, w = key
        for static, value in (
            (self.ids, ids),
            (self.positions, positions),
            (self.seq_lens, seq_lens),
            (self.slot_blocks, slot_blocks),
            (self.slot_offsets, slot_offsets),
        ):
            static[:n].copy_(value)
            static[n:b].copy_(value[:1].expand(b - n))
        self.tables[:n, :width].copy_(block_tables)
        self.tables[n:b, :width].copy_(block_tables[:1].expand(b - n, width))
        graph, logits = self.graphs[key]
        if graph is None:  # CPU: the same padded step, eagerly
            logits = self._step(b, w)
        else:
            graph.replay()
        self.replays += 1
        return logits[:n].clone()
