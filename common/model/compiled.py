"""The model's dense path compiled by inductor (torch.compile), attention and the paged cache left eager.

What is compiled: a decoder layer's two halves around attention (`DecoderLayer.qkv`: norm, projection, rotary;
`DecoderLayer.finish`: output projection, residuals, norm, SwiGLU) and a vision layer. Inductor fuses their
elementwise work (norms, rotary, activations, residual adds: most of a CPU prefill's time outside the GEMMs) into
vectorised C++ loops; the GEMMs stay oneDNN's (`packed_linear`). The token count becomes dynamic at its second
size, so one graph per half serves every batch (1 token has a graph of its own). Paged reads and writes stay out.

A step of decodes only on the CPU (most steps of a server) runs as one compiled graph instead
(`decode_step`): the embedding, every layer with its K/V write and attention (`kernels/cpu_paged.py`'s C kernel,
one op per layer that mutates the cache in place), the last norm and the logits. One graph per step keeps Python
and dynamo's guards out of the gaps between oneDNN's products, whose threads otherwise go cold between them. A
step of one whole prompt alone runs as another (`prefill_step`; not where bf16 prompts run on the AMX tiles, whose
prompts graph computes it as fast: `LONE_PROMPT_GRAPH`), and a step of other prompt chunks only (several prompts, or
chunks after a cached prefix) as a third (`prompts_step`, attention through the C prompt kernel over the cache);
steps of prompt chunks beside decodes take the halves.

The model is not changed: an engine holds a `CompiledModel` and passes its functions to the forward, so an eager
engine and a compiled one can share one model. Compiled code is C++ built by the host's compiler on first use; its
cache is the user's (`$EPDMESH_HOME/inductor`, default ~/.cache/epdmesh/inductor), never the repository.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import torch
from torch._dynamo.decorators import mark_unbacked

from common.model.clip import VisionLayer
from common.model.layers import rms_norm
from common.model.llama import DecoderLayer, LlamaDecoder
from common.model.llava import LlavaModel
from common.model.packed_linear import _packed_linear as packed_linear_impl
from kernels import cpu_amx, cpu_paged, cpu_prompt
from kernels.metadata import write_slots
from kernels.ops import define
from kernels.torch_ref import causal_attention

log = logging.getLogger(__name__)

WARM_TOKENS = 128  # the token count the warm-up compiles the dynamic text graphs at (their size hint)
# Whether this host's C kernel applies RoPE and writes K/V in one pass (`cpu_paged.rotary_kv`, bf16 on AVX-512): set
# when a CompiledModel is made; `prompts_step` reads it (a host's property, the same for every engine); False for
# A/B runs (`bench/engine.py --without rotary-kv`).
ROTARY_KV = False
# Whether a step of one whole prompt alone gets a graph of its own (`prefill_step`). None: by host — not where bf16
# prompts run on the AMX tiles, whose prompts graph (its qkv product with RoPE in one pass, attention on the tiles)
# computes a lone prompt as fast (bench/README.md, "Prompt attention in C") and the graph would only add its compile
# to a cold start; True / False for A/B runs.
LONE_PROMPT_GRAPH: bool | None = None


def cache_dir() -> Path:
    return Path(os.environ.get("EPDMESH_HOME", Path.home() / ".cache" / "epdmesh")) / "inductor"


class CompiledModel:
    """torch.compile'd forms of the model's dense halves; `warm_up` compiles them before the first request."""

    def __init__(self, model: LlavaModel):
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir

        if os.environ.get("TORCHINDUCTOR_CACHE_DIR") in (None, default_cache_dir()):  # unless the user chose one
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir())  # (inductor writes its default back)
        self.model = model
        # dynamo keeps compiled code on the function's code object: every engine's wrappers share it
        self.text = (torch.compile(DecoderLayer.qkv), torch.compile(DecoderLayer.finish))
        self.vision_layer = torch.compile(VisionLayer.forward)
        weight = model.text.embed_tokens.weight
        self.decode = None  # a step of decodes only, as one graph (CPU, where the C attention kernel is built)
        self.prefill = None  # a step of one whole prompt and nothing else, as one graph (same hosts)
        self.prompts = None  # a step of prompt chunks only, several or with a cached prefix (the C prompt kernel's)
        if weight.device.type == "cpu" and weight.dtype in (torch.bfloat16, torch.float32):
            if model.text.cfg.head_dim <= cpu_paged.MAX_HEAD_DIM and cpu_paged.available():
                self.decode = torch.compile(decode_step, dynamic=True)
                # only the token count dynamic (marked at the warm-up): SDPA takes its GQA flag as a plain bool
                self.prefill = torch.compile(prefill_step)
                model.text.rotary_for(weight)  # (made inside the graph, it would be a guard that fails once)
            probe = torch.empty(1, model.text.cfg.head_dim, dtype=weight.dtype)
            if cpu_prompt.ENABLED and cpu_prompt.supports(probe):
                global ROTARY_KV
                ROTARY_KV = ROTARY_KV or cpu_paged.rotary_kv_host()
                self.prompts = torch.compile(prompts_step, dynamic=True)
                model.text.rotary_for(weight)
            lone = LONE_PROMPT_GRAPH
            if lone is None:
                lone = not (self.prompts is not None and weight.dtype == torch.bfloat16 and cpu_amx.available())
            if not lone:
                self.prefill = None  # a lone prompt runs through the prompts graph

    @torch.inference_mode()
    def warm_up(self, text: bool = True, vision: bool = True) -> float:
        """Compile every graph a server meets (1 token and several; 1 image and several) on dummy inputs; returns
        the seconds it took (from a warm cache, a few)."""
        start = time.perf_counter()
        model = self.model
        like = dict(dtype=model.text.embed_tokens.weight.dtype, device=model.text.embed_tokens.weight.device)
        if text:
            cfg, layer = model.text.cfg, model.text.layers[0]
            qkv, finish = self.text
            # the second size is the dynamic graph's size hint, from which inductor decides which loops run on
            # every thread: at 2, a rotary of 8 heads looked too small to split and ran on one (~0.5 ms a layer at
            # 1,024 tokens); WARM_TOKENS is a prompt's order of size
            for n in (1, WARM_TOKENS):
                x = torch.zeros(n, cfg.hidden_size, **like)
                cos = torch.ones(n, cfg.head_dim, **like)
                q, _, _ = qkv(layer, x, cos, torch.zeros_like(cos))
                finish(layer, x, q)
            if self.decode is not None:
                cache = torch.zeros(9, cfg.num_layers, 2, 16, cfg.num_kv_heads, cfg.head_dim, **like)
                # sizes unbacked at the first call: one graph for every count of sequences and blocks, 1 included
                # (the calls after it find that graph; dynamo would otherwise specialise on 1s)
                for n, width in ((3, 3), (1, 1), (1, 2), (2, 1)):
                    tables = torch.arange(n * width, dtype=torch.int32).view(n, width)
                    lens = torch.full((n,), 16 * (width - 1) + 1, dtype=torch.int32)
                    slots = torch.tensor(tables[:, -1].tolist()), torch.zeros(n, dtype=torch.long)
                    ids, positions = torch.zeros(n, dtype=torch.long), lens.long() - 1
                    if n == 3:
                        for t in (ids, positions, lens, tables, *slots):
                            mark_unbacked(t, 0)
                        mark_unbacked(tables, 1)
                    self.decode(model.text, ids, positions, cache, tables, lens, *slots)
            if self.prefill is not None:
                self._warm_lone_prompt(like)
            if self.prompts is not None:
                self._warm_prompts(like)
        if vision:
            vcfg = model.cfg.vision
            for images in (1, 2):
                self.vision_layer(
                    model.vision.layers[0], torch.zeros(images, vcfg.num_patches + 1, vcfg.hidden_size, **like)
                )
        seconds = time.perf_counter() - start
        log.info("compiled model warmed up in %.1f s (cache %s)", seconds, os.environ["TORCHINDUCTOR_CACHE_DIR"])
        return seconds

    def _warm_lone_prompt(self, like: dict) -> None:
        """The lone-prompt graph: one graph for every length from 2 (the first call's length dynamic; a 1-token
        prompt takes the halves: its own graph would cost ~8 s of cold compile)."""
        cfg, text = self.model.text.cfg, self.model.text
        # the cache made as the engine makes its own (outside inference mode: another dispatch key set)
        with torch.inference_mode(False):
            cache = torch.zeros(WARM_TOKENS // 16 + 1, cfg.num_layers, 2, 16, cfg.num_kv_heads, cfg.head_dim, **like)
        for n in (WARM_TOKENS, 2):  # (the first, dynamic, size the hint, as above)
            embeds = torch.zeros(n, cfg.hidden_size, **like)
            positions = torch.arange(n)
            slots = torch.arange(n) // 16, torch.arange(n) % 16
            if n == WARM_TOKENS:
                for t in (embeds, positions, *slots):
                    torch._dynamo.mark_dynamic(t, 0)
                torch._dynamo.mark_dynamic(cache, 0)  # any number of blocks
            self.prefill(text, embeds, positions, cache, *slots)

    def _warm_prompts(self, like: dict) -> None:
        """The prompts graph at three sequences (one after a cached block), every size unbacked at that first call:
        one graph for every count of sequences, rows, blocks and sampled rows, 1 included; then at one sequence."""
        cfg = self.model.text.cfg
        with torch.inference_mode(False):  # (the cache as the engine makes its own)
            cache = torch.zeros(9, cfg.num_layers, 2, 16, cfg.num_kv_heads, cfg.head_dim, **like)
        for query_lens, seq_lens, tables in (([5, 3, 4], [5, 19, 4], [[0, 8], [1, 2], [3, 8]]), ([2], [2], [[4]])):
            rows = sum(query_lens)
            starts = torch.tensor([0, *query_lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
            positions = torch.cat([torch.arange(s - q, s) for q, s in zip(query_lens, seq_lens)])
            slots = [(tables[i][p // 16], p % 16) for i, (q, s) in enumerate(zip(query_lens, seq_lens))
                     for p in range(s - q, s)]  # fmt: skip
            args = (
                torch.zeros(rows, cfg.hidden_size, **like),
                positions,
                cache,
                torch.tensor(tables, dtype=torch.int32),
                starts,
                torch.tensor(seq_lens, dtype=torch.int32),
                torch.tensor([b for b, _ in slots]),
                torch.tensor([o for _, o in slots]),
                starts[1:].long() - 1,
            )
            if len(query_lens) == 3:
                for t in (*args[:2], *args[4:]):
                    mark_unbacked(t, 0)
                mark_unbacked(args[3], 0)
                mark_unbacked(args[3], 1)
                torch._dynamo.mark_dynamic(cache, 0)
            self.prompts(self.model.text, *args)


def decode_step(
    text: LlamaDecoder,
    ids: torch.Tensor,
    positions: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    slot_blocks: torch.Tensor,
    slot_offsets: torch.Tensor,
) -> torch.Tensor:
    """One token per sequence → its logits [sequences, vocab] (float32): the decoder's forward and `logits`, with
    each layer's attention through `paged_decode_layer` on the engine's whole KV cache (`PagedKVCache.data`)."""
    x = text.embed_tokens(ids)
    cos, sin = text.rotary.cos_sin(positions, x.dtype)
    scale = text.cfg.head_dim**-0.5
    for i, layer in enumerate(text.layers):
        q, k, v = DecoderLayer.qkv(layer, x, cos, sin)
        attention = torch.ops.epdmesh.paged_decode_layer(
            q, k, v, cache, i, slot_blocks, slot_offsets, block_tables, seq_lens, scale
        )
        x = DecoderLayer.finish(layer, x, attention)
    return text.logits(x)


def prefill_step(
    text: LlamaDecoder,
    embeds: torch.Tensor,
    positions: torch.Tensor,
    cache: torch.Tensor,
    slot_blocks: torch.Tensor,
    slot_offsets: torch.Tensor,
) -> torch.Tensor:
    """One prompt from its first token, nothing cached before it (embeds [tokens, hidden], images already in) → the
    logits of its last position [1, vocab] (float32). Each layer's K/V go into the whole cache in place; attention
    is causal over the prompt's own K/V, which is what the eager path reads back from the cache. The last layer
    computes its K/V for every position and the rest for the last one only: nothing reads the other positions'
    outputs (a 128-token prompt's last layer is then ~1/8 of its products fewer)."""
    cos, sin = text.rotary.cos_sin(positions, embeds.dtype)
    scale = text.cfg.head_dim**-0.5
    x, last = embeds, len(text.layers) - 1
    for i, layer in enumerate(text.layers):
        q, k, v = DecoderLayer.qkv(layer, x, cos, sin)
        torch.ops.epdmesh.write_kv_layer(cache, i, k, v, slot_blocks, slot_offsets)
        if i == last:
            x = DecoderLayer.finish(layer, x[-1:], causal_attention(q[-1:], k, v, scale))
        else:
            x = DecoderLayer.finish(layer, x, causal_attention(q, k, v, scale, whole=True))
    return text.logits(x)


def prompts_step(
    text: LlamaDecoder,
    embeds: torch.Tensor,
    positions: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_starts: torch.Tensor,
    seq_lens: torch.Tensor,
    slot_blocks: torch.Tensor,
    slot_offsets: torch.Tensor,
    sample_rows: torch.Tensor,
) -> torch.Tensor:
    """Prompt chunks and nothing else (embeds [tokens, hidden], images already in; sequence i's rows [query_starts[i],
    query_starts[i + 1]), the last of its seq_lens[i] positions, earlier ones already in the cache) → the logits of
    `sample_rows` [rows, vocab] (float32). What the eager path computes with the C prompt kernel, as one graph: each
    layer's K/V into the whole cache in place, then the step's attention in one call over the cache
    (`cpu_prompt.paged_prompt_attention`); the last layer past its attention at the sampled rows only. In bf16 on
    hosts where `ROTARY_KV`, each layer's RoPE and K/V write are one C pass over its qkv projection — on AMX hosts
    part of the projection's own product (`qkv_rotary_kv_layer`)."""
    cos, sin = text.rotary.cos_sin(positions, embeds.dtype)
    scale = text.cfg.head_dim**-0.5
    x, last = embeds, len(text.layers) - 1
    fused = ROTARY_KV and cache.dtype == torch.bfloat16 and text.cfg.head_dim % 32 == 0
    for i, layer in enumerate(text.layers):
        proj = layer.qkv_proj
        if fused and getattr(proj, "amx", False):  # the product, RoPE and K/V write in one pass where it runs
            h = rms_norm(x, layer.input_layernorm, layer.cfg.rms_norm_eps)
            q = torch.ops.epdmesh.qkv_rotary_kv_layer(
                h, proj.packed_weight, proj.tiles, cos, sin, cache, i, slot_blocks, slot_offsets
            )
        elif fused:  # RoPE and the K/V write in one C pass (`cpu_paged.rotary_kv`)
            q = torch.ops.epdmesh.rotary_kv_layer(
                DecoderLayer.project(layer, x), cos, sin, cache, i, slot_blocks, slot_offsets
            )
        else:
            q, k, v = DecoderLayer.qkv(layer, x, cos, sin)
            torch.ops.epdmesh.write_kv_layer(cache, i, k, v, slot_blocks, slot_offsets)
        kv = cache.select(1, i)
        attn = torch.ops.epdmesh.paged_prompt_attention(
            q, kv.select(1, 0), kv.select(1, 1), block_tables, query_starts, seq_lens, scale
        )
        if i == last:
            x, attn = x[sample_rows], attn[sample_rows]
        x = DecoderLayer.finish(layer, x, attn)
    return text.logits(x)


def _write_kv_layer(
    cache: torch.Tensor,
    layer: int,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_blocks: torch.Tensor,
    slot_offsets: torch.Tensor,
) -> None:
    """K/V [tokens, kv_heads, head_dim] into their slots of one layer of the whole cache ([blocks, layers, 2,
    block_size, kv_heads, head_dim]), in place: as an index_put in the graph, functionalisation would copy the
    layer's whole cache."""
    layer_cache = cache.select(1, layer)
    write_slots(k, v, layer_cache.select(1, 0), layer_cache.select(1, 1), slot_blocks, slot_offsets)


def _rotary_kv_layer(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    cache: torch.Tensor,
    layer: int,
    slot_blocks: torch.Tensor,
    slot_offsets: torch.Tensor,
) -> torch.Tensor:
    """`cpu_paged.rotary_kv` on one layer of the whole cache: q [tokens, heads, head_dim] returned, K and V written
    in place."""
    layer_cache = cache.select(1, layer)
    kv_heads, dim = cache.shape[-2], cache.shape[-1]
    heads = qkv.shape[-1] // dim - 2 * kv_heads
    return cpu_paged.rotary_kv(
        qkv, cos, sin, layer_cache.select(1, 0), layer_cache.select(1, 1), slot_blocks, slot_offsets, heads, kv_heads
    )


def _rotary_kv_fake(qkv, cos, sin, cache, layer, slot_blocks, slot_offsets):
    kv_heads, dim = cache.shape[-2], cache.shape[-1]
    return qkv.new_empty(qkv.shape[0], qkv.shape[-1] // dim - 2 * kv_heads, dim)


def _qkv_rotary_kv_layer(
    h: torch.Tensor,
    weight: torch.Tensor,
    tiles: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    cache: torch.Tensor,
    layer: int,
    slot_blocks: torch.Tensor,
    slot_offsets: torch.Tensor,
) -> torch.Tensor:
    """A layer's qkv projection of the normed rows h ([tokens, hidden]; a `PackedLinear`'s weight and AMX tiles),
    RoPE and K/V write into the whole cache: q [tokens, heads, head_dim] returned. A prompt's rows (above
    `cpu_amx.MAX_ROWS`) in one pass, `cpu_amx.qkv_rope` (the product's blocks rotated and written as they finish);
    fewer rows, or where it does not run, the product then `_rotary_kv_layer` — the same bits either way."""
    kv_heads, dim = cache.shape[-2], cache.shape[-1]
    n = tiles.shape[0] * 16
    heads = n // dim - 2 * kv_heads
    fused = cpu_amx.QKV_ROPE and cpu_amx.GEMM and cpu_amx.qkv_rope_supports(tiles, dim, heads, kv_heads)
    if h.shape[0] > cpu_amx.MAX_ROWS and fused:
        layer_cache = cache.select(1, layer)
        return cpu_amx.qkv_rope(
            h, tiles, cos, sin, layer_cache.select(1, 0), layer_cache.select(1, 1), slot_blocks, slot_offsets,
            heads, kv_heads,
        )  # fmt: skip
    qkv = packed_linear_impl(h, weight, tiles, None, n)
    return _rotary_kv_layer(qkv, cos, sin, cache, layer, slot_blocks, slot_offsets)


def _qkv_rotary_kv_fake(h, weight, tiles, cos, sin, cache, layer, slot_blocks, slot_offsets):
    kv_heads, dim = cache.shape[-2], cache.shape[-1]
    return h.new_empty(h.shape[0], tiles.shape[0] * 16 // dim - 2 * kv_heads, dim)


qkv_rotary_kv_layer = define(
    "qkv_rotary_kv_layer(Tensor h, Tensor weight, Tensor tiles, Tensor cos, Tensor sin, Tensor(a!) cache, int layer,"
    " Tensor slot_blocks, Tensor slot_offsets) -> Tensor",
    _qkv_rotary_kv_layer,
    _qkv_rotary_kv_fake,
)

rotary_kv_layer = define(
    "rotary_kv_layer(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) cache, int layer, Tensor slot_blocks,"
    " Tensor slot_offsets) -> Tensor",
    _rotary_kv_layer,
    _rotary_kv_fake,
)

write_kv_layer = define(
    "write_kv_layer(Tensor(a!) cache, int layer, Tensor k, Tensor v, Tensor slot_blocks, Tensor slot_offsets) -> ()",
    _write_kv_layer,
    lambda *_: None,
)
