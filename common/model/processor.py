"""Chat → prompt tokens and pixels, through the checkpoint's own transformers processor.

The prompt a request runs on is exactly what
`processor.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True, return_dict=True)`
builds: the checkpoint's chat template, tokenizer and image preprocessing, not a re-implementation.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import torch

from common.model.config import LlavaConfig
from common.request import ImageInput


class ChatProcessor:
    def __init__(self, model_dir: str | Path, config: LlavaConfig | None = None):
        from transformers import AutoProcessor
        from transformers.utils import logging as hf_logging

        hf_logging.get_logger("transformers.image_processing_utils").setLevel(logging.ERROR)
        verbosity = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()  # the torchvision → PIL image processor fallback notice
        try:
            self.processor = AutoProcessor.from_pretrained(str(model_dir))
        finally:
            hf_logging.set_verbosity(verbosity)
        self.tokenizer = self.processor.tokenizer
        self.config = config or LlavaConfig.from_pretrained(model_dir)

    def apply(self, conversation: list[dict]) -> tuple[list[int], list[ImageInput]]:
        """HF-format conversation (image parts as {'type': 'image', 'image': PIL.Image}) → token ids, images."""
        batch = self.processor.apply_chat_template(
            conversation, add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt"
        )
        ids = batch["input_ids"][0].tolist()
        images = []
        if "pixel_values" in batch:
            for pixels in batch["pixel_values"]:
                pixels = pixels.to(torch.float32).contiguous()
                digest = hashlib.blake2b(pixels.numpy().tobytes(), digest_size=16).hexdigest()
                images.append(ImageInput(pixels, self.config.image_tokens_per_image, digest))
        return ids, images

    def count_prompt_tokens(self, conversation: list[dict]) -> int:
        """The prompt's length without preprocessing any image (a fraction of `apply`'s time, so a route can
        be asked for while the pixels are made): the chat template's text tokenized as `apply` does, each
        image placeholder counted as the tokens it expands to. `apply` gives the ids themselves."""
        text = self.processor.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
        bos = self.tokenizer.bos_token
        ids = self.tokenizer(text, add_special_tokens=not (bos is not None and text.startswith(bos)))["input_ids"]
        image_token = self.config.image_token_id
        return len(ids) + sum(1 for t in ids if t == image_token) * (self.config.image_tokens_per_image - 1)

    def detokenize(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)
