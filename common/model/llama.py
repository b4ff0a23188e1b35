"""Llama decoder over a paged KV cache: RMSNorm, RoPE, grouped-query attention, SwiGLU.

Tokens of all sequences in a step are flattened into one [tokens, hidden] batch; attention
reads and writes K/V through the block tables in `AttentionMetadata`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from common.model.config import TextConfig
from common.model.layers import RotaryEmbedding, activation, apply_rotary, rms_norm
from kernels import AttentionMetadata, write_kv


class DecoderLayer(nn.Module):
    def __init__(self, cfg: TextConfig):
        super().__init__()
        self.cfg = cfg
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.split = (q_size, kv_size, kv_size)
        self.input_layernorm = nn.Parameter(torch.empty(cfg.hidden_size))
        self.post_attention_layernorm = nn.Parameter(torch.empty(cfg.hidden_size))
        self.qkv_proj = nn.Linear(cfg.hidden_size, sum(self.split), bias=False)
        self.o_proj = nn.Linear(q_size, cfg.hidden_size, bias=False)
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.act = activation(cfg.hidden_act)

    def forward(
        self, x, cos, sin, k_cache, v_cache, meta: AttentionMetadata, attention, dense=None, rows=None
    ) -> torch.Tensor:
        """`dense`: this class's two dense halves, compiled (`common/model/compiled.py`); None runs them eagerly.
        `rows` (an index tensor): K/V written for every position, the output computed for these positions only."""
        qkv, finish = dense or (DecoderLayer.qkv, DecoderLayer.finish)
        q, k, v = qkv(self, x, cos, sin)
        write_kv(k, v, k_cache, v_cache, meta)
        attn = attention.forward(q, k_cache, v_cache, meta, self.cfg.head_dim**-0.5)
        if rows is not None:
            if len(rows) == 0:  # nothing samples: the layer's K/V were all that was needed
                return x[:0]
            x, attn = x[rows], attn[rows]
        return finish(self, x, attn)

    def project(self, x) -> torch.Tensor:
        """The norm and the qkv projection: [n, (heads + 2·kv_heads)·D], q's columns, then k's, then v's."""
        return self.qkv_proj(rms_norm(x, self.input_layernorm, self.cfg.rms_norm_eps))

    def qkv(self, x, cos, sin) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Everything before attention: norm, projection, rotary → q [n, heads, D], k and v [n, kv_heads, D]."""
        cfg, n = self.cfg, x.shape[0]
        q, k, v = DecoderLayer.project(self, x).split(self.split, dim=-1)
        q = apply_rotary(q.view(n, cfg.num_heads, cfg.head_dim), cos, sin)
        k = apply_rotary(k.view(n, cfg.num_kv_heads, cfg.head_dim), cos, sin)
        return q, k, v.view(n, cfg.num_kv_heads, cfg.head_dim)

    def finish(self, x, attn) -> torch.Tensor:
        """Everything after attention: output projection, residual, norm, SwiGLU MLP, residual."""
        x = x + self.o_proj(attn.reshape(x.shape[0], -1))
        h = rms_norm(x, self.post_attention_layernorm, self.cfg.rms_norm_eps)
        fused = getattr(self.gate_up_proj, "mlp", None)  # bf16 CPU linears with AMX tiles: the MLP in one op
        out = fused(h, self.down_proj) if fused is not None and self.act is F.silu else None
        if out is None:
            gate, up = self.gate_up_proj(h).chunk(2, dim=-1)
            out = self.down_proj(self.act(gate) * up)
        return x + out


class LlamaDecoder(nn.Module):
    def __init__(self, cfg: TextConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = nn.Parameter(torch.empty(cfg.hidden_size))
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary: RotaryEmbedding | None = None

    def forward(
        self, embeds, positions, kv_layers, meta: AttentionMetadata, attention, dense=None, rows=None
    ) -> torch.Tensor:
        """embeds [tokens, hidden], positions [tokens] → final hidden states (before the last norm). `dense`: the
        layers' two halves compiled (`common.model.compiled.CompiledModel.text`); None: eager. `rows` (an index
        tensor): the positions whose hidden states are wanted (those that sample), in that order; the last layer
        computes its K/V at every position and the rest at these only — nothing reads the others' outputs, and a
        prompt's last layer is then mostly skipped. None: every position."""
        cos, sin = self.rotary_for(embeds).cos_sin(positions, embeds.dtype)
        x, last = embeds, len(self.layers) - 1
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(self.layers, kv_layers)):
            x = layer(x, cos, sin, k_cache, v_cache, meta, attention, dense, rows if i == last else None)
        return x

    def rotary_for(self, like: torch.Tensor) -> RotaryEmbedding:
        """The decoder's RoPE, made at its first use with the table of every position in `like`'s dtype and device
        (the engine's: a compiled graph that finds it there gathers instead of evaluating cos and sin)."""
        if self.rotary is None:
            cfg = self.cfg
            self.rotary = RotaryEmbedding(
                cfg.head_dim, cfg.rope_theta, like.device, like.dtype, cfg.max_position_embeddings
            )
        return self.rotary

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(rms_norm(hidden, self.norm, self.cfg.rms_norm_eps)).float()
