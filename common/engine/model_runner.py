"""Build tensors from a `SchedulerOutput` and run the model: the only place the engine touches torch.

One `run()` does the step's encodes (vision tower → image cache pages), then one forward
over every decode token and prefill chunk flattened together, and returns the logits of
the positions that sample: each decode, and each chunk that completes its prompt.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from common.model.cuda_graphs import DecodeGraphs
from common.model.llava import LlavaModel
from common.paged_cache import PagedImageCache, PagedKVCache
from common.request import Request
from common.scheduler import SchedulerOutput
from kernels import AttentionMetadata
from kernels.torch_ref import TorchPagedAttention

if TYPE_CHECKING:  # (compiled imports torch._dynamo, ~1.3 s: only an engine that compiles needs it)
    from common.model.compiled import CompiledModel

log = logging.getLogger(__name__)


class ModelRunner:
    def __init__(
        self,
        model: LlavaModel,
        kv_cache: PagedKVCache,
        image_cache: PagedImageCache,
        attention,
        compiled: CompiledModel | None = None,
    ):
        self.model = model
        self.compiled = compiled  # the dense path compiled (None: eager)
        self.kv_cache = kv_cache
        self.image_cache = image_cache
        self.attention = attention
        self.device = kv_cache.data.device
        self.image_token_id = model.cfg.image_token_id
        # a step of decodes only runs as one compiled graph where attention is the CPU's C kernel
        graphs = compiled is not None and isinstance(attention, TorchPagedAttention) and attention.use_c
        self.decode_graph = compiled.decode if graphs else None
        self.prefill_graph = compiled.prefill if graphs else None  # a step of one whole prompt, as one graph
        self.prompts_graph = compiled.prompts if graphs else None  # a step of other prompt chunks only, as one graph
        self.decode_graphs: DecodeGraphs | None = None  # CUDA: decode steps as captured graphs (capture_graphs)

    def capture_graphs(self, max_seqs: int, max_model_len: int) -> float | None:
        """Capture the decode steps' CUDA graphs (before any request); returns the seconds it took, or None when the
        capture failed (logged with its reason: the decode steps then run eagerly)."""
        graphs = DecodeGraphs(
            self.model.text, self.kv_cache.layers, self.kv_cache.layout.block_size, max_seqs, max_model_len
        )
        try:
            seconds = graphs.capture()
        except RuntimeError as e:
            log.warning("decode CUDA graphs not captured (%s): decode steps run eagerly", e, exc_info=True)
            return None
        self.decode_graphs = graphs
        return seconds

    @torch.inference_mode()
    def run(self, plan: SchedulerOutput) -> tuple[list[Request], torch.Tensor | None]:
        """Execute the plan; returns the requests that sample and their logits rows [len, vocab] (float32)."""
        if plan.encodes:
            self._encode(plan)
        if not (plan.decodes or plan.prefills):
            return [], None
        ids, positions, meta, sample_rows, sampling = self._prepare(plan)
        if self.decode_graphs is not None and not plan.prefills:
            args = (meta.block_tables, meta.seq_lens_t, meta.slot_blocks, meta.slot_offsets)
            logits = self.decode_graphs.run(ids, positions, *args)
            if logits is not None:  # (else no bucket holds the step: it runs eagerly)
                return sampling, logits
        if self.decode_graph is not None and not plan.prefills:  # every row samples, in order
            args = (meta.block_tables, meta.seq_lens_t, meta.slot_blocks, meta.slot_offsets)
            return sampling, self.decode_graph(self.model.text, ids, positions, self.kv_cache.data, *args)
        embeds = self.model.embed(ids)
        self._insert_image_embeddings(plan, ids, embeds, len(plan.decodes))
        if self.prefill_graph is not None and self._whole_prompt_alone(plan):
            args = (self.kv_cache.data, meta.slot_blocks, meta.slot_offsets)
            return sampling, self.prefill_graph(self.model.text, embeds, positions, *args)
        if self.prompts_graph is not None and not plan.decodes and len(sample_rows):  # (its graph samples ≥ 1 row)
            args = (meta.block_tables, meta.query_start_loc, meta.seq_lens_t, meta.slot_blocks, meta.slot_offsets)
            return sampling, self.prompts_graph(
                self.model.text, embeds, positions, self.kv_cache.data, *args, sample_rows
            )
        dense = self.compiled.text if self.compiled else None
        rows = None if len(sample_rows) == len(ids) else sample_rows  # (every row samples: none to pick)
        hidden = self.model.text(embeds, positions, self.kv_cache.layers, meta, self.attention, dense, rows)
        return sampling, self.model.text.logits(hidden)

    @staticmethod
    def _whole_prompt_alone(plan: SchedulerOutput) -> bool:
        """One prompt of ≥ 2 tokens computed whole from its first (no cached prefix, not chunked), no decodes beside
        it: what the prefill graph runs (a server's step at low load)."""
        if plan.decodes or len(plan.prefills) != 1:
            return False
        chunk = plan.prefills[0]
        return chunk.start == 0 and chunk.completes_prefill and chunk.num_tokens >= 2

    def _encode(self, plan: SchedulerOutput) -> None:
        pixels = [
            w.request.images[i].pixel_values
            for w in plan.encodes
            for i in range(w.first_image, w.first_image + w.num_images)
        ]
        features = self.model.encode_images(
            torch.stack(pixels).to(self.device), self.compiled.vision_layer if self.compiled else None
        )
        rows, block_size = [], self.image_cache.layout.block_size
        for work in plan.encodes:
            images = work.request.images
            first = sum(img.num_tokens for img in images[: work.first_image])
            count = sum(img.num_tokens for img in images[work.first_image : work.first_image + work.num_images])
            table = work.request.image_block_table
            rows.extend(table[k // block_size] * block_size + k % block_size for k in range(first, first + count))
        self.image_cache.flat[torch.tensor(rows, device=self.device)] = features.flatten(0, 1).to(
            self.image_cache.data.dtype
        )

    def _prepare(self, plan: SchedulerOutput):
        block_size = self.kv_cache.layout.block_size
        ids: list[int] = []
        positions: list[int] = []
        query_lens, seq_lens, tables = [], [], []
        sample_rows, sampling = [], []
        for request in plan.decodes:
            pos = request.num_tokens - 1
            ids.append(request.output_token_ids[-1] if request.output_token_ids else request.prompt_token_ids[-1])
            positions.append(pos)
            query_lens.append(1)
            seq_lens.append(pos + 1)
            tables.append(request.block_table)
            sample_rows.append(len(ids) - 1)
            sampling.append(request)
        for chunk in plan.prefills:
            end = chunk.start + chunk.num_tokens
            ids.extend(chunk.request.token_ids(chunk.start, end))  # a preempted request's output too
            positions.extend(range(chunk.start, end))
            query_lens.append(chunk.num_tokens)
            seq_lens.append(end)
            tables.append(chunk.request.block_table)
            if chunk.completes_prefill:
                sample_rows.append(len(ids) - 1)
                sampling.append(chunk.request)
        width = max(-(-s // block_size) for s in seq_lens)
        padded = [t[:width] + [0] * (width - len(t[:width])) for t in tables]
        slot_blocks, slot_offsets = [], []
        for table, qlen, slen in zip(tables, query_lens, seq_lens):
            for p in range(slen - qlen, slen):
                slot_blocks.append(table[p // block_size])
                slot_offsets.append(p % block_size)
        dev = self.device
        meta = AttentionMetadata(
            num_decodes=len(plan.decodes),
            query_lens=query_lens,
            seq_lens=seq_lens,
            block_tables=torch.tensor(padded, dtype=torch.int32, device=dev),
            seq_lens_t=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            query_start_loc=torch.tensor([0] + query_lens, dtype=torch.int32, device=dev).cumsum(0, dtype=torch.int32),
            slot_blocks=torch.tensor(slot_blocks, dtype=torch.long, device=dev),
            slot_offsets=torch.tensor(slot_offsets, dtype=torch.long, device=dev),
        )
        return (
            torch.tensor(ids, dtype=torch.long, device=dev),
            torch.tensor(positions, dtype=torch.long, device=dev),
            meta,
            torch.tensor(sample_rows, dtype=torch.long, device=dev),
            sampling,
        )

    def _insert_image_embeddings(
        self, plan: SchedulerOutput, ids: torch.Tensor, embeds: torch.Tensor, offset: int
    ) -> None:
        block_size = self.image_cache.layout.block_size
        rows_out, rows_in = [], []
        row = offset
        for chunk in plan.prefills:
            prompt = chunk.request.prompt_token_ids
            seen = prompt[: chunk.start].count(self.image_token_id)
            table = chunk.request.image_block_table
            for i, token in enumerate(prompt[chunk.start : chunk.start + chunk.num_tokens]):
                if token == self.image_token_id:
                    rows_out.append(row + i)
                    rows_in.append(table[seen // block_size] * block_size + seen % block_size)
                    seen += 1
            row += chunk.num_tokens
        if rows_out:
            gathered = self.image_cache.flat[torch.tensor(rows_in, device=self.device)]
            embeds[torch.tensor(rows_out, device=self.device)] = gathered.to(embeds.dtype)
