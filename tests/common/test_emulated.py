"""The emulated backend: the real engine around a latency profile instead of the model."""

import pytest

from common.engine.config import EngineConfig, parse_roles
from common.engine.emulated import EmulatedEngine, light_detokenizer, word_token_pool
from common.latency import iteration_ms, transfer_ms
from common.latency.roofline import analytic_profile
from common.model.config import LlavaConfig
from common.request import ImageInput, Request
from common.sampling import SamplingParams
from common.scheduler import SchedulerConfig
from tests.support import assert_pools_full, run_disaggregated

PROFILE = analytic_profile("H20")


@pytest.fixture(scope="module")
def cfg(emulated_dir):
    return LlavaConfig.from_pretrained(emulated_dir)


def make(emulated_dir, cfg, roles="epd", **config):
    engine_config = EngineConfig(
        model=str(emulated_dir),
        roles=parse_roles(roles),
        kv_cache_gib=config.pop("kv_cache_gib", 8.0),
        image_cache_gib=0.05,
        **config,
    )
    return EmulatedEngine(
        engine_config, PROFILE, light_detokenizer(emulated_dir), word_token_pool(emulated_dir), model_config=cfg
    )


def requests(cfg, max_tokens=6):
    image = ImageInput(None, cfg.image_tokens_per_image, "img-a")
    other = ImageInput(None, cfg.image_tokens_per_image, "img-b")
    placeholders = [cfg.image_token_id] * cfg.image_tokens_per_image
    text = [1, 319, 320, 321]
    return [
        Request("img", [1, *placeholders, 319, 400, 401], SamplingParams(max_tokens=max_tokens), images=[image]),
        Request("img2", [1, *placeholders, 319, 400, 401], SamplingParams(max_tokens=max_tokens), images=[other]),
        Request("txt", text * 30, SamplingParams(max_tokens=max_tokens + 3)),
        Request("short", text, SamplingParams(max_tokens=1)),
    ]


def test_the_7b_shape_is_the_real_models(cfg):
    assert cfg.image_tokens_per_image == 576 and cfg.text.vocab_size == 32064
    assert (cfg.text.num_layers, cfg.text.num_kv_heads, cfg.text.head_dim) == (32, 32, 128)


def test_the_encode_heavy_shape_matches_its_profile(tmp_path):
    """The config-only checkpoint of `H20:qwen2-vl-7b-1344` expands an image to the profile's 2,304 tokens and
    sizes the KV cache by Qwen2-7B's decoder (28 layers, 4 KV heads of 128)."""
    from common.latency.roofline import QWEN2_VL_7B_1344, load_profile
    from common.model.tiny import TinySpec, make_tiny_model

    out = make_tiny_model(tmp_path / "qwen", TinySpec(preset=QWEN2_VL_7B_1344.name, config_only=True))
    qwen = LlavaConfig.from_pretrained(out)
    assert qwen.image_tokens_per_image == load_profile("H20:qwen2-vl-7b-1344").image_tokens == 2304
    assert (qwen.text.num_layers, qwen.text.num_kv_heads, qwen.text.head_dim) == (28, 4, 128)
    assert qwen.text.max_position_embeddings == 32768
    assert not (out / "model.safetensors").exists()


def test_tokens_are_deterministic_depend_on_the_prompt_and_images_and_survive_disaggregation(emulated_dir, cfg):
    colocated = make(emulated_dir, cfg)
    together = {k: v.output_token_ids for k, v in colocated.generate(requests(cfg)).items()}
    assert [len(together[k]) for k in ("img", "img2", "txt", "short")] == [6, 6, 9, 1]
    assert together["img"] != together["img2"]  # same prompt, other image: the image pages feed the tokens
    assert len(set(together["txt"])) > 3 and set(together["txt"]) <= set(colocated.token_pool)
    again = make(emulated_dir, cfg)
    assert {k: v.output_token_ids for k, v in again.generate(requests(cfg)).items()} == together
    e, p, d = (make(emulated_dir, cfg, roles) for roles in ("e", "p", "d"))
    assert run_disaggregated(e, p, d, requests(cfg)) == together  # image and KV pages went through bytes
    assert_pools_full(colocated, again, e, p, d)


def test_with_prefix_caching_the_tokens_are_the_same_and_a_cached_image_is_not_encoded(emulated_dir, cfg):
    def longer():  # the image requests with a block or more of text after the image
        out = requests(cfg)
        for r in out[:2]:
            r.prompt_token_ids += [402, 403] * 10
        return out

    plain = {k: v.output_token_ids for k, v in make(emulated_dir, cfg).generate(longer()).items()}
    engine = make(emulated_dir, cfg, enable_prefix_caching=True)
    encoded = []
    execute = engine._execute
    engine._execute = lambda plan: (encoded.extend(w.request.request_id for w in plan.encodes), execute(plan))[1]
    for round_ in range(2):  # the second time every prompt's full blocks are cached, images' placeholders included
        encoded.clear()
        outs = engine.generate(longer())
        assert {k: v.output_token_ids for k, v in outs.items()} == plain
        assert (outs["img"].num_cached_tokens > 0) == (round_ == 1)
    assert encoded == [] and engine.scheduler.num_encodes_skipped == 2  # the second round: img and img2
    assert_pools_full(engine)


def test_a_continuation_goes_on_with_the_tokens_the_request_would_have_had(emulated_dir, cfg):
    """A request migrated or handed back mid-answer (prompt + the tokens sent) gets the rest of the same answer."""
    from services.gateway.mesh.migration import continuation

    whole = {k: v.output_token_ids for k, v in make(emulated_dir, cfg).generate(requests(cfg, max_tokens=9)).items()}
    for original in requests(cfg, max_tokens=9)[:3]:
        sent = whole[original.request_id][:4]
        rest = make(emulated_dir, cfg).generate([continuation(original, sent, attempt=2)])
        assert sent + rest[f"{original.request_id}-m2"].output_token_ids == whole[original.request_id]


def test_a_garbled_kv_page_changes_the_tokens(emulated_dir, cfg):
    engine = make(emulated_dir, cfg)
    prompt = [1, 319, 320, 321] * 10
    clean = engine.generate([Request("t", prompt, SamplingParams(max_tokens=4))])["t"].output_token_ids
    request = Request("t", prompt, SamplingParams(max_tokens=4))
    engine.add_request(request)
    first = engine.step()[0]  # prefill: the first token, the stamp written into the last prompt token's KV page
    engine.kv_cache.data[request.block_table[(len(prompt) - 1) // engine.config.block_size]].zero_()
    while engine.has_unfinished:
        engine.step()
    assert first.new_token_ids == clean[:1] and request.output_token_ids != clean
    assert_pools_full(engine)


def test_each_iteration_is_predicted_by_the_profile(emulated_dir, cfg):
    engine = make(emulated_dir, cfg, scheduler=SchedulerConfig(token_budget=4096, image_budget=4))
    img, img2, txt, short = requests(cfg)
    for r in (img, img2, txt):
        engine.add_request(r)
    engine.step()  # both images encoded, and all three prompts prefilled in the same step
    prompts = [(r.num_prompt_tokens, 0) for r in (img, img2, txt)]
    assert engine.predicted_ms == pytest.approx(iteration_ms(PROFILE, images=2, chunks=prompts))
    engine.step()  # their first decodes
    context = sum(r.num_prompt_tokens + 1 for r in (img, img2, txt))
    assert engine.predicted_ms == pytest.approx(iteration_ms(PROFILE, decodes=3, decode_context=context))
    while engine.has_unfinished:
        engine.step()
    assert_pools_full(engine)


def test_cache_capacity_and_transfer_time_are_the_real_models(emulated_dir, cfg):
    engine = make(emulated_dir, cfg, kv_cache_gib=2.0)
    real_kv_token = 2 * 32 * 32 * 128 * 2  # 512 KiB: K and V of 32 layers × 32 heads × 128 in 16-bit
    assert engine.stats().kv_blocks_total == (2 << 30) // (real_kv_token * 16)
    assert engine.kv_cache.layout.bytes_per_block == 16 * 256  # the bytes actually held and moved: 256 per token
    assert engine.transfer_delay_s("kv", 600) == pytest.approx(transfer_ms(PROFILE, 600 * real_kv_token) / 1e3)
    assert engine.transfer_delay_s("image", 576) == pytest.approx(transfer_ms(PROFILE, 576 * 4096 * 2) / 1e3)


def test_what_needs_logits_is_refused_with_a_reason(emulated_dir, cfg):
    """It runs no model: logprobs and structured output (a grammar masks the model's logits) are not there."""
    from common.engine.engine import RequestRejected

    engine = make(emulated_dir, cfg)
    for sampling, what in (
        (SamplingParams(max_tokens=4, logprobs=2), "logprobs"),
        (SamplingParams(max_tokens=4, grammar='{"grammars": []}'), "structured output"),
    ):
        with pytest.raises(RequestRejected, match=what):
            engine.add_request(Request(what, [1, 2, 3], sampling))
    assert not engine.requests
