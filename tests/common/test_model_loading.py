"""The tiny checkpoint is a real HF llava-1.5 directory; our loader reads both naming schemes and shards."""

import hashlib
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from common.engine.config import EngineConfig
from common.engine.engine import Engine
from common.model.config import LlavaConfig, UnsupportedModelError
from common.model.loader import load_model, our_name
from common.model.tiny import TinySpec, make_tiny_model
from common.request import Request
from common.sampling import SamplingParams

PROMPT = [1, 354, 29, 405, 77, 1290, 33, 358, 29]


def digest(path):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.iterdir())}


def greedy(model_dir, model=None, n=12):
    engine = Engine(EngineConfig(model=str(model_dir), kv_cache_gib=0.01), model=model)
    return engine.generate([Request("r", PROMPT, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))])[
        "r"
    ].output_token_ids


def test_checkpoint_is_deterministic_in_its_seed(tmp_path, tiny_dir):
    again = make_tiny_model(tmp_path / "again", TinySpec("tiny", seed=0))
    other = make_tiny_model(tmp_path / "other", TinySpec("tiny", seed=1))
    assert digest(again) == digest(tiny_dir)
    assert digest(other)["model.safetensors"] != digest(tiny_dir)["model.safetensors"]


def test_checkpoint_has_clear_margins_and_varied_greedy_output(tiny_dir):
    model = load_model(tiny_dir)
    engine = Engine(EngineConfig(model=str(tiny_dir), kv_cache_gib=0.01), model=model)
    engine.generate(
        [Request("r", PROMPT, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))], capture_logits=True
    )
    logits = torch.stack(engine.captured_logits["r"])
    top2 = logits.topk(2, dim=-1).values
    margins = top2[:, 0] - top2[:, 1]
    assert margins.median() > 0.5 and logits.std(dim=-1).mean() > 4
    tokens = logits.argmax(-1).tolist()
    assert len(set(tokens)) >= 10


def test_config_of_a_real_llava_7b_directory_parses():
    """llava-hf/llava-1.5-7b-hf's config.json as published (defaults omitted, as on the hub)."""
    from transformers import LlavaConfig as HFConfig

    hf = HFConfig.from_dict(
        {
            "architectures": ["LlavaForConditionalGeneration"],
            "ignore_index": -100,
            "image_token_index": 32000,
            "model_type": "llava",
            "pad_token_id": 32001,
            "projector_hidden_act": "gelu",
            "text_config": {
                "architectures": ["LlamaForCausalLM"],
                "max_position_embeddings": 4096,
                "model_type": "llama",
                "rms_norm_eps": 1e-05,
                "torch_dtype": "float16",
                "vocab_size": 32064,
            },
            "tie_word_embeddings": False,
            "torch_dtype": "float16",
            "vision_config": {
                "hidden_size": 1024,
                "image_size": 336,
                "intermediate_size": 4096,
                "model_type": "clip_vision_model",
                "num_attention_heads": 16,
                "num_hidden_layers": 24,
                "patch_size": 14,
                "projection_dim": 768,
                "vocab_size": 32000,
            },
            "vision_feature_layer": -2,
            "vision_feature_select_strategy": "default",
            "vocab_size": 32064,
        }
    )
    cfg = LlavaConfig.from_hf(hf, (2,))
    assert (cfg.text.hidden_size, cfg.text.num_layers, cfg.text.num_heads, cfg.text.num_kv_heads) == (4096, 32, 32, 32)
    assert (cfg.text.intermediate_size, cfg.text.head_dim, cfg.text.rope_theta) == (11008, 128, 10000.0)
    assert cfg.image_tokens_per_image == 576 and cfg.vision_layers_to_run == 23
    assert cfg.image_token_id == 32000 and cfg.vision.hidden_act == "quick_gelu"


def test_unsupported_models_are_refused_clearly(tiny_dir, tmp_path):
    config = json.loads((tiny_dir / "config.json").read_text())
    config["vision_feature_select_strategy"] = "full"
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="CLS dropped"):
        LlavaConfig.from_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError, match="config.json"):
        LlavaConfig.from_pretrained(tmp_path / "missing")


@pytest.mark.parametrize(
    "name,ours",
    [
        ("language_model.model.layers.3.self_attn.k_proj.weight", "text.layers.3.qkv_proj.weight#k"),
        ("model.language_model.layers.3.mlp.up_proj.weight", "text.layers.3.gate_up_proj.weight#up"),
        ("language_model.lm_head.weight", "text.lm_head.weight"),
        ("lm_head.weight", "text.lm_head.weight"),
        ("vision_tower.vision_model.encoder.layers.0.self_attn.q_proj.bias", "vision.layers.0.qkv.bias#q"),
        ("model.vision_tower.encoder.layers.0.mlp.fc2.weight", "vision.layers.0.fc2.weight"),
        ("model.multi_modal_projector.linear_2.bias", "projector.linear_2.bias"),
        ("vision_tower.vision_model.post_layernorm.weight", None),
    ],
)
def test_both_naming_schemes_map_onto_ours(name, ours):
    assert our_name(name) == ours


def test_transformers_saved_and_sharded_checkpoints_load_to_the_same_outputs(tiny_dir, tmp_path):
    from transformers import LlavaForConditionalGeneration

    expected = greedy(tiny_dir)
    resaved = tmp_path / "resaved"
    hf = LlavaForConditionalGeneration.from_pretrained(str(tiny_dir))
    hf.save_pretrained(str(resaved))  # transformers writes the hub naming back
    assert greedy(resaved) == expected
    save_file({k: v.contiguous() for k, v in hf.state_dict().items()}, str(resaved / "model.safetensors"))
    assert any(k.startswith("model.language_model.") for k in load_file(str(resaved / "model.safetensors")))
    assert greedy(resaved) == expected  # transformers 5's in-memory naming

    sharded = tmp_path / "sharded"
    sharded.mkdir()
    for f in ("config.json", "generation_config.json"):
        (sharded / f).write_bytes((tiny_dir / f).read_bytes())
    tensors = load_file(str(tiny_dir / "model.safetensors"))
    names = sorted(tensors)
    weight_map = {}
    for i, part in enumerate((names[: len(names) // 2], names[len(names) // 2 :])):
        shard = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({k: tensors[k] for k in part}, str(sharded / shard))
        weight_map.update(dict.fromkeys(part, shard))
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    assert greedy(sharded) == expected
    (sharded / "model-00002-of-00002.safetensors").unlink()
    save_file({k: tensors[k] for k in names[len(names) // 2 : -1]}, str(sharded / "model-00002-of-00002.safetensors"))
    with pytest.raises(ValueError, match="lacks 1 tensors"):
        load_model(sharded)


@pytest.mark.parametrize("preset", ["tiny", "tiny-mha"])
def test_prompt_length_counted_without_pixels_is_the_processors(processors, preset):
    """The gateway routes an image request on this count while the pixels are made: it must be exact."""
    from tests.support import mixed_cases

    processor = processors[preset]
    cases = [case for case in mixed_cases() if case.conversation is not None]
    assert any(sum(p["type"] == "image" for m in c.conversation for p in m["content"]) == 2 for c in cases)
    for case in cases:
        ids, images = processor.apply(case.conversation)
        assert processor.prompt_ids(case.conversation) == ids, case.name  # what routing hashes, the ids themselves
        assert processor.count_prompt_tokens(case.conversation) == len(ids), case.name


def test_a_transformers_models_state_builds_the_same_model_as_its_checkpoint(tiny_dir):
    """`model_from_state` (bench/engine.py's full-size shapes with random weights) matches `load_model`, and shares
    the tensors it need not fuse."""
    import transformers

    from common.model.loader import model_from_state

    hf = transformers.LlavaForConditionalGeneration.from_pretrained(str(tiny_dir), dtype=torch.float32)
    ours = model_from_state(tiny_dir, hf.state_dict(), torch.float32, "cpu")
    loaded = dict(load_model(tiny_dir, torch.float32).named_parameters())
    for name, param in ours.named_parameters():
        assert torch.equal(param, loaded[name]), name
    embed = hf.state_dict()["model.language_model.embed_tokens.weight"]
    assert ours.text.embed_tokens.weight.data_ptr() == embed.data_ptr()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_rotary_table_holds_what_each_call_would_compute(dtype):
    """Every position's cos and sin in the table equal what a call computes for it, whether that call's positions
    are a whole prompt's or one decode's; a dtype other than the table's is computed as before."""
    from common.model.layers import RotaryEmbedding

    rotary = RotaryEmbedding(128, 10000.0, torch.device("cpu"), dtype, 1000)  # 1000: the last slice is partial
    everything = torch.arange(1000)
    for positions in (everything, everything[:37], everything[999:], torch.tensor([5, 5, 998, 0])):
        for got, want in zip(rotary.cos_sin(positions, dtype), rotary.computed(positions, dtype)):
            assert got.dtype == dtype and torch.equal(got, want)
    other = torch.float32 if dtype != torch.float32 else torch.bfloat16
    assert torch.equal(rotary.cos_sin(everything[:9], other)[0], rotary.computed(everything[:9], other)[0])
    with pytest.raises(IndexError):
        rotary.cos_sin(torch.tensor([1000]), dtype)


@pytest.mark.parametrize("table", [False, True], ids=["computed", "table"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rotary_is_transformers_to_the_bit(dtype, table):
    """Our RoPE (cos/sin from integer positions, each half of the rotation written out; or gathered from the table
    of every position the engine's decoder makes) against transformers' Llama rotary embedding and
    `apply_rotary_pos_emb`, eager: the same values bit for bit."""
    from transformers import LlamaConfig
    from transformers.models.llama import modeling_llama as hf

    from common.model.layers import RotaryEmbedding, apply_rotary

    config = LlamaConfig(hidden_size=256, num_attention_heads=4, rope_theta=10000.0, max_position_embeddings=4096)
    positions = torch.tensor([0, 1, 2, 17, 500, 3000, 4095])
    x = torch.randn(len(positions), 4, 64, generator=torch.Generator().manual_seed(0)).to(dtype)
    rotary = RotaryEmbedding(64, 10000.0, torch.device("cpu"), *((dtype, 4096) if table else ()))
    assert (rotary.table is not None) == table
    cos, sin = rotary.cos_sin(positions, dtype)
    hf_cos, hf_sin = hf.LlamaRotaryEmbedding(config)(x, positions[None])
    assert torch.equal(cos, hf_cos[0]) and torch.equal(sin, hf_sin[0])
    heads_first = x.transpose(0, 1)[None]  # [1, heads, tokens, dim], as transformers holds q and k
    q, _ = hf.apply_rotary_pos_emb(heads_first, heads_first, hf_cos, hf_sin)
    assert torch.equal(apply_rotary(x, cos, sin), q[0].transpose(0, 1))
