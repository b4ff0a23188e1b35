"""LLaVA-1.5: CLIP vision tower → 2-layer projector → Llama decoder.

The three pieces are separate entry points because the engine runs them as separate
stages: `encode_images` (encode), `embed` + `decoder` (prefill and decode).
"""

from __future__ import annotations

import torch
from torch import nn

from common.model.clip import VisionTower
from common.model.config import LlavaConfig
from common.model.layers import activation
from common.model.llama import LlamaDecoder


class Projector(nn.Module):
    def __init__(self, cfg: LlavaConfig):
        super().__init__()
        self.linear_1 = nn.Linear(cfg.vision.hidden_size, cfg.text.hidden_size)
        self.linear_2 = nn.Linear(cfg.text.hidden_size, cfg.text.hidden_size)
        self.act = activation(cfg.projector_hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class LlavaModel(nn.Module):
    def __init__(self, cfg: LlavaConfig):
        super().__init__()
        self.cfg = cfg
        self.vision = VisionTower(cfg.vision, cfg.vision_layers_to_run)
        self.projector = Projector(cfg)
        self.text = LlamaDecoder(cfg.text)

    @torch.inference_mode()
    def encode_images(self, pixel_values: torch.Tensor, vision_layer=None) -> torch.Tensor:
        """[images, 3, H, W] → projected embeddings [images, tokens_per_image, text_hidden]; `vision_layer`: a
        compiled `VisionLayer.forward` (None: eager)."""
        return self.projector(self.vision(pixel_values, *([vision_layer] if vision_layer else [])))

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.text.embed_tokens(token_ids)
