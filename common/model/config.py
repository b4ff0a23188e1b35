"""Model configuration: the fields of a Hugging Face llava-1.5 `config.json` that our compute needs.

transformers parses the file (it knows every default a real checkpoint omits); we copy the
values into small frozen dataclasses so the rest of the engine never touches HF objects.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path


class UnsupportedModelError(ValueError):
    """The checkpoint is not a LLaVA-1.5-style model this engine can run."""


@dataclasses.dataclass(frozen=True, slots=True)
class VisionConfig:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    image_size: int
    patch_size: int
    num_channels: int
    layer_norm_eps: float
    hidden_act: str

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2


@dataclasses.dataclass(frozen=True, slots=True)
class TextConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    hidden_act: str
    tie_word_embeddings: bool

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModelError(
                f"num_attention_heads={self.num_heads} is not a multiple of num_key_value_heads={self.num_kv_heads}"
            )


@dataclasses.dataclass(frozen=True, slots=True)
class LlavaConfig:
    vision: VisionConfig
    text: TextConfig
    image_token_id: int
    vision_feature_layer: int
    projector_hidden_act: str
    eos_token_ids: tuple[int, ...]

    @property
    def image_tokens_per_image(self) -> int:
        """Placeholder tokens one image expands to: patches, CLS dropped (feature select 'default')."""
        return self.vision.num_patches

    @property
    def vision_layers_to_run(self) -> int:
        """Encoder layers whose output we need: hidden_states[feature_layer] counts the embeddings as 0."""
        return (
            self.vision.num_layers + 1 + self.vision_feature_layer
            if self.vision_feature_layer < 0
            else self.vision_feature_layer
        )

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> "LlavaConfig":
        from transformers import AutoConfig

        path = Path(model_dir)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path} has no config.json; pass a Hugging Face llava-1.5 model directory")
        hf = AutoConfig.from_pretrained(str(path))
        return cls.from_hf(hf, _generation_eos(path))

    @classmethod
    def from_hf(cls, hf, generation_eos: tuple[int, ...] = ()) -> "LlavaConfig":
        if getattr(hf, "model_type", None) != "llava":
            raise UnsupportedModelError(f"model_type {getattr(hf, 'model_type', None)!r} is not 'llava'")
        if getattr(hf, "vision_feature_select_strategy", "default") != "default":
            raise UnsupportedModelError("only vision_feature_select_strategy='default' (CLS dropped) is supported")
        if not isinstance(hf.vision_feature_layer, int):
            raise UnsupportedModelError("a list of vision feature layers is not supported")
        v, t = hf.vision_config, hf.text_config
        if getattr(t, "model_type", "llama") != "llama":
            raise UnsupportedModelError(f"text model {t.model_type!r} is not llama")
        rope = getattr(t, "rope_parameters", None) or {}
        if rope.get("rope_type", "default") != "default":
            raise UnsupportedModelError(f"rope_type {rope.get('rope_type')!r} is not supported")
        rope_theta = rope.get("rope_theta", getattr(t, "rope_theta", 10000.0))
        text = TextConfig(
            vocab_size=t.vocab_size,
            hidden_size=t.hidden_size,
            intermediate_size=t.intermediate_size,
            num_layers=t.num_hidden_layers,
            num_heads=t.num_attention_heads,
            num_kv_heads=t.num_key_value_heads or t.num_attention_heads,
            head_dim=getattr(t, "head_dim", None) or t.hidden_size // t.num_attention_heads,
            rms_norm_eps=t.rms_norm_eps,
            rope_theta=float(rope_theta),
            max_position_embeddings=t.max_position_embeddings,
            hidden_act=t.hidden_act,
            tie_word_embeddings=bool(
                getattr(t, "tie_word_embeddings", False) or getattr(hf, "tie_word_embeddings", False)
            ),
        )
        vision = VisionConfig(
            hidden_size=v.hidden_size,
            intermediate_size=v.intermediate_size,
            num_layers=v.num_hidden_layers,
            num_heads=v.num_attention_heads,
            image_size=v.image_size,
            patch_size=v.patch_size,
            num_channels=v.num_channels,
            layer_norm_eps=v.layer_norm_eps,
            hidden_act=v.hidden_act,
        )
        eos = generation_eos or _as_tuple(getattr(t, "eos_token_id", None))
        return cls(
            vision=vision,
            text=text,
            image_token_id=hf.image_token_id,
            vision_feature_layer=hf.vision_feature_layer,
            projector_hidden_act=hf.projector_hidden_act,
            eos_token_ids=eos,
        )


def _as_tuple(value) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, (list, tuple)) else (int(value),)


def _generation_eos(path: Path) -> tuple[int, ...]:
    gen = path / "generation_config.json"
    if not gen.is_file():
        return ()
    return _as_tuple(json.loads(gen.read_text()).get("eos_token_id"))
