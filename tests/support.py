"""Shared builders for the tests: mixed chat workloads and the transformers reference."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
from PIL import Image

from common.engine.engine import Engine
from common.model.processor import ChatProcessor
from common.request import Request, Stage
from common.sampling import SamplingParams

WORDS = "the man holding a red cup sits near the window of a small kitchen while two dogs look at the street".split()


def image(seed: int, width: int, height: int) -> Image.Image:
    return Image.fromarray((np.random.RandomState(seed).rand(height, width, 3) * 255).astype("uint8"))


def text_of(num_words: int, seed: int) -> str:
    rng = np.random.RandomState(seed)
    return " ".join(WORDS[i] for i in rng.randint(0, len(WORDS), num_words))


@dataclasses.dataclass
class Case:
    name: str
    conversation: list[dict] | None  # None: raw prompt tokens
    max_tokens: int
    raw_ids: list[int] | None = None


def mixed_cases() -> list[Case]:
    """Ten concurrent requests: with and without images, prompts from 5 to 600+ tokens, varied max_tokens."""
    user = lambda *parts: [{"role": "user", "content": list(parts)}]  # noqa: E731
    txt = lambda s: {"type": "text", "text": s}  # noqa: E731
    img = lambda seed, w, h: {"type": "image", "image": image(seed, w, h)}  # noqa: E731
    return [
        Case("raw-5", None, 12, raw_ids=[1, 405, 77, 1290, 33]),
        Case("hi", user(txt("Hi")), 9),
        Case("img-short", user(img(1, 320, 240), txt("What is in the picture?")), 24),
        Case("img-tall", user(img(2, 200, 400), txt(text_of(40, 2))), 17),
        Case("text-200", user(txt(text_of(180, 3))), 30),
        Case("text-650", user(txt(text_of(560, 4))), 20),
        Case("img-long", user(img(5, 500, 300), txt(text_of(300, 5))), 11),
        Case("system", [{"role": "system", "content": [txt("Answer briefly.")]}] + user(txt(text_of(25, 6))), 40),
        Case(
            "multi-turn",
            user(txt("Describe the scene."))
            + [{"role": "assistant", "content": [txt(text_of(12, 7))]}]
            + user(img(8, 256, 256), txt("And now?")),
            15,
        ),
        Case("two-images", user(img(9, 300, 300), img(10, 180, 240), txt("Compare them.")), 13),
    ]


def build_requests(processor: ChatProcessor, cases: list[Case], **overrides) -> list[Request]:
    requests = []
    for case in cases:
        if case.conversation is None:
            ids, images = list(case.raw_ids), []
        else:
            ids, images = processor.apply(case.conversation)
        sampling = SamplingParams(max_tokens=case.max_tokens, temperature=0.0)
        requests.append(Request(case.name, ids, sampling, images, **overrides))
    return requests


@dataclasses.dataclass
class Reference:
    prompt_ids: list[int]
    tokens: list[int]
    logits: list[torch.Tensor]  # per generated token, float32 [vocab]

    def margin(self, step: int) -> float:
        top = self.logits[step].topk(2).values
        return float(top[0] - top[1])


def hf_reference(
    model_dir,
    processor: ChatProcessor,
    cases: list[Case],
    dtype: torch.dtype,
    presence_penalty: float = 0.0,
    frequency_penalty: float = 0.0,
    **generate,
) -> dict[str, Reference]:
    """transformers' own LlavaForConditionalGeneration.generate, greedy, one request at a time. `generate`:
    more of its arguments (e.g. repetition_penalty); the OpenAI penalties, which transformers lacks, are a
    logits processor written from OpenAI's definition (`OpenAIPenalties`)."""
    from transformers import LlavaForConditionalGeneration, LogitsProcessorList

    model = LlavaForConditionalGeneration.from_pretrained(str(model_dir), dtype=dtype).eval()
    refs = {}
    for case in cases:
        if case.conversation is None:
            inputs = {
                "input_ids": torch.tensor([case.raw_ids]),
                "attention_mask": torch.ones(1, len(case.raw_ids), dtype=torch.long),
            }
        else:
            inputs = processor.processor.apply_chat_template(
                case.conversation, add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt"
            )
            if "pixel_values" in inputs:
                inputs["pixel_values"] = inputs["pixel_values"].to(dtype)
        n = inputs["input_ids"].shape[1]
        processors = LogitsProcessorList(
            [OpenAIPenalties(n, presence_penalty, frequency_penalty)] if presence_penalty or frequency_penalty else []
        )
        with torch.inference_mode():
            out = model.generate(
                **inputs,
                do_sample=False,
                max_new_tokens=case.max_tokens,
                logits_processor=processors,
                output_logits=True,
                return_dict_in_generate=True,
                **generate,
            )
        refs[case.name] = Reference(
            inputs["input_ids"][0].tolist(), out.sequences[0, n:].tolist(), [step[0].float() for step in out.logits]
        )
    return refs


class OpenAIPenalties:
    """OpenAI's presence and frequency penalties as a transformers logits processor, from their definition:
    logit[t] -= presence · [t was generated] + frequency · (times t was generated) — generated tokens only."""

    def __init__(self, prompt_len: int, presence: float, frequency: float):
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        scores = scores.clone()
        for row in range(scores.shape[0]):
            for token in set(input_ids[row, self.prompt_len :].tolist()):
                count = int((input_ids[row, self.prompt_len :] == token).sum())
                scores[row, token] -= self.presence + self.frequency * count
        return scores


def run_disaggregated(
    encoder: Engine, prefiller: Engine, decoder: Engine, requests: list[Request]
) -> dict[str, list[int]]:
    """Drive requests encode → (image page bytes) → prefill → (KV page bytes) → decode across three engines."""
    finals: dict[str, list[int]] = {}
    for r in requests:
        stage = Stage.ENCODE if r.images else Stage.PREFILL
        target = encoder if r.images else prefiller
        target.add_request(
            Request(
                r.request_id,
                r.prompt_token_ids,
                r.sampling,
                r.images,
                first_stage=stage,
                last_stage=Stage.ENCODE if r.images else Stage.PREFILL,
            ),
            capture_logits=True,
        )
    while encoder.has_unfinished or prefiller.has_unfinished or decoder.has_unfinished:
        for out in encoder.step():
            r = encoder.pages.handed_off[out.request_id]
            assert out.pages == ("image", r.image_block_table, r.num_image_tokens)  # what a worker leases
            pages = encoder.pages.export_image_pages(out.request_id)
            encoder.pages.release(out.request_id)
            prefiller.add_request(
                Request(
                    r.request_id,
                    r.prompt_token_ids,
                    r.sampling,
                    r.images,
                    first_stage=Stage.PREFILL,
                    last_stage=Stage.PREFILL,
                ),
                image_pages=_through_bytes(pages),
                capture_logits=True,
            )
        for out in prefiller.step():
            if out.finished:
                finals[out.request_id] = out.output_token_ids
                continue
            r = prefiller.pages.handed_off[out.request_id]
            assert out.pages == ("kv", r.block_table[: len(out.pages[1])], r.num_prompt_tokens) and out.pages[1]
            pages = prefiller.pages.export_kv_pages(out.request_id)
            prefiller.pages.release(out.request_id)
            decoder.add_request(
                Request(
                    r.request_id,
                    r.prompt_token_ids,
                    r.sampling,
                    r.images,
                    first_stage=Stage.DECODE,
                    output_token_ids=list(out.output_token_ids),
                ),
                kv_pages=_through_bytes(pages),
            )
        for out in decoder.step():
            if out.finished:
                finals[out.request_id] = out.output_token_ids
    return finals


def _through_bytes(pages):
    """Rebuild the payload from a fresh copy of its bytes, as a receiving process would."""
    from common.paged_cache import PagePayload

    return PagePayload(pages.layout, pages.num_tokens, bytes(bytearray(pages.data)))


def assert_pools_full(*engines: Engine) -> None:
    for engine in engines:
        stats = engine.stats()
        assert stats.kv_blocks_free == stats.kv_blocks_total, stats
        assert stats.image_blocks_free == stats.image_blocks_total, stats
        assert not engine.requests and not engine.pages.handed_off


class IdleRuntime:
    """What a worker's heartbeat (`Registration`) reads of its runtime, idle: no load, nothing admitted; `freed` set
    asks for a beat at once."""

    def __init__(self):
        import asyncio

        self.freed = asyncio.Event()

    def load(self):
        from common.workers import WorkerLoad

        return WorkerLoad()

    def take_admitted(self):
        return []
