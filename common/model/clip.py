"""CLIP ViT vision tower, run up to the LLaVA feature layer (the last layers are never computed)."""

from __future__ import annotations

import torch
from torch import nn

from common.model.config import VisionConfig
from common.model.layers import activation
from kernels.cpu_prompt import attend


class VisionLayer(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        h = cfg.hidden_size
        self.layer_norm1 = nn.LayerNorm(h, eps=cfg.layer_norm_eps)
        self.layer_norm2 = nn.LayerNorm(h, eps=cfg.layer_norm_eps)
        self.qkv = nn.Linear(h, 3 * h)
        self.out_proj = nn.Linear(h, h)
        self.fc1 = nn.Linear(h, cfg.intermediate_size)
        self.fc2 = nn.Linear(cfg.intermediate_size, h)
        self.act = activation(cfg.hidden_act)
        self.num_heads = cfg.num_heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, h = x.shape
        dim = h // self.num_heads
        q, k, v = self.qkv(self.layer_norm1(x)).view(b, n, 3, self.num_heads, dim).unbind(2)  # [b, n, heads, dim]
        attn = attend(q, k, v, dim**-0.5, causal=False)
        x = x + self.out_proj(attn.reshape(b, n, h))
        return x + self.fc2(self.act(self.fc1(self.layer_norm2(x))))


class VisionTower(nn.Module):
    def __init__(self, cfg: VisionConfig, num_layers_to_run: int):
        super().__init__()
        h = cfg.hidden_size
        self.patch_size = cfg.patch_size
        self.class_embedding = nn.Parameter(torch.empty(h))
        self.patch_embedding = nn.Conv2d(cfg.num_channels, h, cfg.patch_size, cfg.patch_size, bias=False)
        self.position_embedding = nn.Embedding(cfg.num_patches + 1, h)
        self.pre_layrnorm = nn.LayerNorm(h, eps=cfg.layer_norm_eps)
        self.layers = nn.ModuleList(VisionLayer(cfg) for _ in range(num_layers_to_run))

    def forward(self, pixel_values: torch.Tensor, layer_forward=VisionLayer.forward) -> torch.Tensor:
        """pixel_values [images, 3, H, W] → features of the feature layer, CLS dropped: [images, patches, hidden].
        `layer_forward`: `VisionLayer.forward`, or it compiled (`common.model.compiled`)."""
        dtype = self.patch_embedding.weight.dtype
        patches = self.patch_embedding(pixel_values.to(dtype)).flatten(2).transpose(1, 2)
        cls = self.class_embedding.expand(patches.shape[0], 1, -1)
        x = torch.cat([cls, patches], dim=1) + self.position_embedding.weight[None]
        x = self.pre_layrnorm(x)
        for layer in self.layers:
            x = layer_forward(layer, x)
        return x[:, 1:]
