"""Load a Hugging Face llava-1.5 checkpoint (single or sharded safetensors) into `LlavaModel`.

Two naming schemes exist for the same tensors: the hub's (`language_model.model.*`,
`vision_tower.vision_model.*`, as llava-hf/llava-1.5-7b-hf ships) and the one transformers 5
writes (`model.language_model.*`, `model.vision_tower.*`, `lm_head.*`). Both map onto ours;
q/k/v and gate/up are fused into one matrix each on the way in.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from common.model.config import LlavaConfig
from common.model.llava import LlavaModel

_PREFIXES = [
    (re.compile(r"^(model\.)?vision_tower\.(vision_model\.)?"), "vision."),
    (re.compile(r"^(model\.)?multi_modal_projector\."), "projector."),
    (re.compile(r"^(language_model\.model\.|model\.language_model\.)"), "text."),
    (re.compile(r"^(language_model\.)?lm_head\."), "text.lm_head."),
]
_VISION = [
    (re.compile(r"^embeddings\.(class_embedding|patch_embedding\.weight)$"), r"\1"),
    (re.compile(r"^embeddings\.position_embedding\.weight$"), "position_embedding.weight"),
    (re.compile(r"^pre_layrnorm\.(weight|bias)$"), r"pre_layrnorm.\1"),
    (re.compile(r"^encoder\.layers\.(\d+)\.self_attn\.([qkv])_proj\.(weight|bias)$"), r"layers.\1.qkv.\3#\2"),
    (re.compile(r"^encoder\.layers\.(\d+)\.self_attn\.out_proj\.(.+)$"), r"layers.\1.out_proj.\2"),
    (re.compile(r"^encoder\.layers\.(\d+)\.mlp\.(fc1|fc2)\.(.+)$"), r"layers.\1.\2.\3"),
    (re.compile(r"^encoder\.layers\.(\d+)\.(layer_norm[12])\.(.+)$"), r"layers.\1.\2.\3"),
]
_TEXT = [
    (re.compile(r"^embed_tokens\.weight$"), "embed_tokens.weight"),
    (re.compile(r"^norm\.weight$"), "norm"),
    (re.compile(r"^lm_head\.weight$"), "lm_head.weight"),
    (re.compile(r"^layers\.(\d+)\.self_attn\.([qkv])_proj\.weight$"), r"layers.\1.qkv_proj.weight#\2"),
    (re.compile(r"^layers\.(\d+)\.self_attn\.o_proj\.weight$"), r"layers.\1.o_proj.weight"),
    (re.compile(r"^layers\.(\d+)\.mlp\.(gate|up)_proj\.weight$"), r"layers.\1.gate_up_proj.weight#\2"),
    (re.compile(r"^layers\.(\d+)\.mlp\.down_proj\.weight$"), r"layers.\1.down_proj.weight"),
    (re.compile(r"^layers\.(\d+)\.(input_layernorm|post_attention_layernorm)\.weight$"), r"layers.\1.\2"),
]
_FUSED_ORDER = {"q": 0, "k": 1, "v": 2, "gate": 0, "up": 1}


def our_name(checkpoint_name: str) -> str | None:
    """Our parameter name for a checkpoint tensor ('name#part' for a slice of a fused one); None = unused."""
    for pattern, prefix in _PREFIXES:
        match = pattern.match(checkpoint_name)
        if match:
            rest = checkpoint_name[match.end() :]
            rules = {"vision.": _VISION, "text.": _TEXT}.get(prefix)
            if prefix == "text.lm_head.":
                return "text.lm_head." + rest
            if rules is None:
                return prefix + rest
            for rule, repl in rules:
                if rule.match(rest):
                    return prefix + rule.sub(repl, rest)
            return None
    return None


def _checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / s for s in shards]
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {model_dir}")


def load_model(
    model_dir: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> LlavaModel:
    from safetensors import safe_open

    def tensors():
        for file in _checkpoint_files(Path(model_dir)):
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for key in f.keys():
                    yield key, lambda key=key, f=f: f.get_tensor(key)

    return _assemble(Path(model_dir), tensors(), dtype, device)


def model_from_state(
    model_dir: str | Path, state: dict[str, torch.Tensor], dtype: torch.dtype, device: str | torch.device
) -> LlavaModel:
    """Our model of the config in `model_dir` with the weights of a transformers LLaVA's `state_dict()` (a model made
    from a config only, with random weights: `bench/engine.py` on a full-size shape). Tensors already of `dtype` on
    `device` are shared, not copied (all but the fused q/k/v and gate/up)."""
    return _assemble(Path(model_dir), ((key, lambda t=t: t) for key, t in state.items()), dtype, device)


def _assemble(path: Path, tensors, dtype: torch.dtype, device) -> LlavaModel:
    """`tensors`: (checkpoint name, a function that reads the tensor) pairs, read only for the names we use."""
    cfg = LlavaConfig.from_pretrained(path)
    with torch.device("meta"):
        model = LlavaModel(cfg)
    params = dict(model.named_parameters())
    fused: dict[str, dict[str, torch.Tensor]] = {}
    loaded: dict[str, torch.Tensor] = {}
    for key, read in tensors:
        name = our_name(key)
        if name is None or name.split("#")[0] not in params:
            continue  # post_layernorm, layers past the feature layer, rotary buffers
        tensor = read().to(dtype)
        if "#" in name:
            base, part = name.split("#")
            fused.setdefault(base, {})[part] = tensor
        else:
            loaded[name] = tensor
    for base, parts in fused.items():
        loaded[base] = torch.cat([t for _, t in sorted(parts.items(), key=lambda kv: _FUSED_ORDER[kv[0]])])
    if cfg.text.tie_word_embeddings and "text.lm_head.weight" not in loaded:
        loaded["text.lm_head.weight"] = loaded["text.embed_tokens.weight"]
    missing = sorted(set(params) - set(loaded))
    if missing:
        raise ValueError(f"checkpoint {path} lacks {len(missing)} tensors, e.g. {missing[:3]}")
    for name, tensor in loaded.items():
        if tuple(tensor.shape) != tuple(params[name].shape):
            raise ValueError(
                f"{name}: checkpoint shape {tuple(tensor.shape)} != model shape {tuple(params[name].shape)}"
            )
    model.load_state_dict({k: v.to(device) for k, v in loaded.items()}, assign=True, strict=True)
    return model.eval().requires_grad_(False)
