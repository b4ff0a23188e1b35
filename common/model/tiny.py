"""`epdmesh make-tiny-model DIR`: a small random LLaVA-1.5 checkpoint in Hugging Face format.

No weights can be downloaded here, so tests and the default demo run on a checkpoint we
generate: `config.json`, `model.safetensors` (hub naming, as llava-hf/llava-1.5-7b-hf ships),
a byte-level BPE tokenizer trained on a fixed corpus, a CLIP image processor and a
llava-1.5-style chat template. Everything is a pure function of (preset, seed).

Random init gives near-flat logits, where greedy argmax flips on rounding. We shape the
init so the parity check is meaningful: unit-scale embeddings and residual branches, and
an lm_head whose logits have a standard deviation of `logit_scale` (top-1/top-2 margins
of order 1, far above fp32 rounding), so greedy outputs are stable and varied.
"""

from __future__ import annotations

import dataclasses
import math
import random
from pathlib import Path

PRESETS: dict[str, dict] = {
    # The default serving model: grouped-query attention (8 query heads share 2 KV heads).
    "tiny": dict(
        text=dict(hidden=256, layers=6, heads=8, kv_heads=2, intermediate=768, rope_theta=10000.0, eps=1e-5),
        vision=dict(hidden=192, layers=4, heads=6, intermediate=768, image=224, patch=14),
        vocab=4096,
    ),
    # A second shape for parity: multi-head attention, other head_dim, fewer image tokens.
    "tiny-mha": dict(
        text=dict(hidden=192, layers=4, heads=4, kv_heads=4, intermediate=512, rope_theta=500000.0, eps=1e-6),
        vision=dict(hidden=128, layers=3, heads=4, intermediate=512, image=112, patch=16),
        vocab=3072,
    ),
    # Roughly the 62M-parameter shape used to measure a peer engine on these machines.
    "small": dict(
        text=dict(hidden=512, layers=8, heads=8, kv_heads=8, intermediate=1408, rope_theta=10000.0, eps=1e-5),
        vision=dict(hidden=256, layers=4, heads=4, intermediate=1024, image=336, patch=14),
        vocab=8192,
    ),
    # LLaVA-1.5-7B's shapes (Llama-2-7B decoder, CLIP ViT-L/14 at 336 px: 576 image tokens) for the emulated
    # backend: written config-only (`config_only`), as no 7B weights can exist here.
    "llava-1.5-7b": dict(
        text=dict(hidden=4096, layers=32, heads=32, kv_heads=32, intermediate=11008, rope_theta=10000.0, eps=1e-5),
        vision=dict(hidden=1024, layers=24, heads=16, intermediate=4096, image=336, patch=14),
        vocab=32064,
    ),
    # The encode-heavy shape the emulated backend's `H20:qwen2-vl-7b-1344` profile times (common/latency/roofline.py):
    # Qwen2-7B's decoder and 2,304 image tokens an image, in the LLaVA layout this package reads (a 672 px, patch-14
    # tower gives that count; Qwen2-VL's is 1344 px, patch 14, 2×2 patches merged into a token).
    "qwen2-vl-7b-1344": dict(
        text=dict(hidden=3584, layers=28, heads=28, kv_heads=4, intermediate=18944, rope_theta=1e6, eps=1e-6),
        vision=dict(hidden=1280, layers=32, heads=16, intermediate=5120, image=672, patch=14),
        vocab=32064,
        max_positions=32768,
    ),
}
CONFIG_ONLY_PRESETS = {"llava-1.5-7b", "qwen2-vl-7b-1344"}  # too big to write random weights for

CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['content'] is string -%}{%- set parts = [{'type': 'text', 'text': message['content']}] -%}"
    "{%- else -%}{%- set parts = message['content'] -%}{%- endif -%}"
    "{%- if message['role'] == 'system' -%}"
    "{%- for part in parts if part['type'] == 'text' -%}{{ part['text'] }}{%- endfor -%}{{ '\n' }}"
    "{%- else -%}"
    "{{ message['role'] | upper }}{{ ': ' }}"
    "{%- for part in parts if part['type'] == 'image' -%}{{ '<image>\n' }}{%- endfor -%}"
    "{%- for part in parts if part['type'] == 'text' -%}{{ part['text'] + ' ' }}{%- endfor -%}"
    "{%- if message['role'] == 'assistant' -%}{{ eos_token }}{%- endif -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ 'ASSISTANT:' }}{%- endif -%}"
)

WORDS = (
    "the a an of to in and is are was were be it this that what which who where when why how "
    "image picture photo shows show see look color red green blue yellow black white orange "
    "man woman child dog cat bird car bus train street road sign tree sky water table chair "
    "person people sitting standing holding wearing next left right top bottom front behind "
    "text read says written number one two three four five many some there here "
    "describe detail answer question please briefly word single yes no not can you "
    "large small big little old new open closed on under over near with without at by from "
    "building window door wall floor room kitchen food plate cup bottle phone screen book "
    "paper letter label brand name time clock day night light dark shadow background scene"
).split()


@dataclasses.dataclass(frozen=True, slots=True)
class TinySpec:
    preset: str = "tiny"
    seed: int = 0
    logit_scale: float = 8.0
    config_only: bool = False  # tokenizer, processor and config, no weights (for the emulated backend)

    def __post_init__(self) -> None:
        if self.preset not in PRESETS:
            raise ValueError(f"unknown preset {self.preset!r}; choose one of {sorted(PRESETS)}")


def make_tiny_model(out_dir: str | Path, spec: TinySpec = TinySpec(), progress=None) -> Path:
    """Write the checkpoint to `out_dir` (created) and return its path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    steps = [("tokenizer", _write_tokenizer_and_processor), ("config", _write_config)]
    if not spec.config_only:
        if spec.preset in CONFIG_ONLY_PRESETS:
            raise ValueError(f"preset {spec.preset!r} is written config-only (for the emulated backend)")
        steps.append(("weights", _write_weights))
    state: dict = {}
    for name, step in steps:
        step(out, spec, state)
        if progress is not None:
            progress(name)
    return out


def _corpus(seed: int) -> list[str]:
    rng = random.Random(seed)
    lines = []
    for _ in range(4000):
        words = [rng.choice(WORDS) for _ in range(rng.randint(4, 14))]
        if rng.random() < 0.3:
            words.insert(rng.randrange(len(words)), str(rng.randint(0, 2026)))
        sentence = " ".join(words)
        lines.append(sentence[0].upper() + sentence[1:] + rng.choice([".", "?", "!", ",", ":"]))
    # Chat-shaped lines so the template's role markers are single tokens, as in real tokenizers.
    return lines + [f"USER: {lines[i]} ASSISTANT: {lines[i + 1]}" for i in range(0, 1000, 2)]


def _write_tokenizer_and_processor(out: Path, spec: TinySpec, state: dict) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import CLIPImageProcessor, LlavaProcessor, PreTrainedTokenizerFast

    preset = PRESETS[spec.preset]
    specials = ["<unk>", "<s>", "</s>", "<pad>"]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=preset["vocab"] - 64,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(spec.seed), trainer)
    tok.add_special_tokens(["<image>"])
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
    )
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        model_max_length=preset.get("max_positions", 4096),
        padding_side="left",
    )
    vision = preset["vision"]
    image_processor = CLIPImageProcessor(
        size={"shortest_edge": vision["image"]},
        crop_size={"height": vision["image"], "width": vision["image"]},
    )
    processor = LlavaProcessor(
        image_processor=image_processor,
        tokenizer=hf_tok,
        patch_size=vision["patch"],
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        chat_template=CHAT_TEMPLATE,
    )
    processor.save_pretrained(str(out))
    state["image_token_id"] = tok.token_to_id("<image>")
    state["pad_token_id"] = tok.token_to_id("<pad>")
    state["tokenizer_size"] = tok.get_vocab_size()  # the BPE stops short of the vocabulary on this small corpus
    # byte tokens that are part of a UTF-8 character: alone they decode to U+FFFD
    state["partial_ids"] = [i for i in range(state["tokenizer_size"]) if "\ufffd" in tok.decode([i])]


def _write_config(out: Path, spec: TinySpec, state: dict) -> None:
    from transformers import CLIPVisionConfig, GenerationConfig, LlamaConfig, LlavaConfig

    preset = PRESETS[spec.preset]
    t, v = preset["text"], preset["vision"]
    text = LlamaConfig(
        vocab_size=preset["vocab"],
        hidden_size=t["hidden"],
        intermediate_size=t["intermediate"],
        num_hidden_layers=t["layers"],
        num_attention_heads=t["heads"],
        num_key_value_heads=t["kv_heads"],
        rms_norm_eps=t["eps"],
        rope_theta=t["rope_theta"],
        max_position_embeddings=preset.get("max_positions", 4096),
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=state["pad_token_id"],
        tie_word_embeddings=False,
    )
    vision = CLIPVisionConfig(
        hidden_size=v["hidden"],
        intermediate_size=v["intermediate"],
        num_hidden_layers=v["layers"],
        num_attention_heads=v["heads"],
        image_size=v["image"],
        patch_size=v["patch"],
        projection_dim=v["hidden"],
        hidden_act="quick_gelu",
    )
    config = LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=state["image_token_id"],
        projector_hidden_act="gelu",
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
        tie_word_embeddings=False,
    )
    config.save_pretrained(str(out))
    GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=state["pad_token_id"]).save_pretrained(str(out))


def _write_weights(out: Path, spec: TinySpec, state: dict) -> None:
    import torch
    from safetensors.torch import save_file

    preset = PRESETS[spec.preset]
    t, v = preset["text"], preset["vision"]
    gen = torch.Generator().manual_seed(spec.seed)
    tensors: dict[str, torch.Tensor] = {}

    def normal(name: str, shape: tuple[int, ...], std: float) -> None:
        tensors[name] = torch.randn(shape, generator=gen) * std

    def const(name: str, shape: tuple[int, ...], value: float) -> None:
        tensors[name] = torch.full(shape, value)

    def linear(name: str, fan_in: int, fan_out: int, bias: bool, gain: float = 1.0) -> None:
        normal(f"{name}.weight", (fan_out, fan_in), gain / math.sqrt(fan_in))
        if bias:
            normal(f"{name}.bias", (fan_out,), 0.02)

    vp = "vision_tower.vision_model"
    vh = v["hidden"]
    normal(f"{vp}.embeddings.class_embedding", (vh,), 1.0)
    normal(
        f"{vp}.embeddings.patch_embedding.weight", (vh, 3, v["patch"], v["patch"]), 1.0 / math.sqrt(3 * v["patch"] ** 2)
    )
    normal(f"{vp}.embeddings.position_embedding.weight", ((v["image"] // v["patch"]) ** 2 + 1, vh), 0.5)
    for ln in ("pre_layrnorm", "post_layernorm"):
        const(f"{vp}.{ln}.weight", (vh,), 1.0)
        const(f"{vp}.{ln}.bias", (vh,), 0.0)
    for i in range(v["layers"]):
        p = f"{vp}.encoder.layers.{i}"
        for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
            linear(f"{p}.self_attn.{proj}", vh, vh, bias=True)
        linear(f"{p}.mlp.fc1", vh, v["intermediate"], bias=True)
        linear(f"{p}.mlp.fc2", v["intermediate"], vh, bias=True)
        for ln in ("layer_norm1", "layer_norm2"):
            const(f"{p}.{ln}.weight", (vh,), 1.0)
            const(f"{p}.{ln}.bias", (vh,), 0.0)

    th = t["hidden"]
    linear("multi_modal_projector.linear_1", vh, th, bias=True)
    linear("multi_modal_projector.linear_2", th, th, bias=True)

    lp = "language_model.model"
    head_dim = th // t["heads"]
    normal(f"{lp}.embed_tokens.weight", (preset["vocab"], th), 1.0)
    for i in range(t["layers"]):
        p = f"{lp}.layers.{i}"
        # Unit gain: a sharper attention (gain 2) made the net chaotic, bf16 rounding then moved logits by ~2.
        linear(f"{p}.self_attn.q_proj", th, t["heads"] * head_dim, bias=False)
        linear(f"{p}.self_attn.k_proj", th, t["kv_heads"] * head_dim, bias=False)
        linear(f"{p}.self_attn.v_proj", th, t["kv_heads"] * head_dim, bias=False)
        linear(f"{p}.self_attn.o_proj", t["heads"] * head_dim, th, bias=False)
        linear(f"{p}.mlp.gate_proj", th, t["intermediate"], bias=False)
        linear(f"{p}.mlp.up_proj", th, t["intermediate"], bias=False)
        linear(f"{p}.mlp.down_proj", t["intermediate"], th, bias=False)
        const(f"{p}.input_layernorm.weight", (th,), 1.0)
        const(f"{p}.post_attention_layernorm.weight", (th,), 1.0)
    const(f"{lp}.norm.weight", (th,), 1.0)
    linear("language_model.lm_head", th, preset["vocab"], bias=False, gain=spec.logit_scale)
    # Ids the tokenizer never makes (past its end, and <image>) and lone UTF-8 continuation bytes get a zero logit
    # row, so they are (almost) never the argmax: random rows made them 30 of a 40-token demo answer, which decoded
    # to nothing or to U+FFFD.
    head = tensors["language_model.lm_head.weight"]
    head[state["tokenizer_size"] :] = 0.0
    head[[state["image_token_id"], *state["partial_ids"]]] = 0.0
    save_file(
        {k: t.contiguous() for k, t in tensors.items()}, str(out / "model.safetensors"), metadata={"format": "pt"}
    )
