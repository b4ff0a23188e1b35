"""Chat → prompt tokens and pixels, through the checkpoint's own transformers processor.

The prompt a request runs on is exactly what
`processor.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True, return_dict=True)`
builds: the checkpoint's chat template (or the server's `--chat-template`), tokenizer and image preprocessing, not a
re-implementation. A request's `chat_template_kwargs` reach the template as its variables (those it uses).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import re
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from common.model.config import LlavaConfig
from common.model.pixels import PixelScaling, finish
from common.request import IMAGE_DIGEST_KEY, ImageInput

log = logging.getLogger(__name__)


# what the processor itself passes to the template (the tokenizer's special tokens too): a request's
# chat_template_kwargs may not set them
RESERVED_TEMPLATE_VARIABLES = frozenset(
    {
        "messages",
        "tools",
        "documents",
        "add_generation_prompt",
        "continue_final_message",
        "chat_template",
        "tokenize",
        "return_dict",
        "bos_token",
        "eos_token",
        "unk_token",
        "pad_token",
        "sep_token",
        "cls_token",
        "mask_token",
        "additional_special_tokens",
    }
)


@contextlib.contextmanager
def _template_refusals():
    """The chat template refusing the chat (its `raise_exception(...)`, e.g. "roles must alternate") or failing on
    it: a ValueError with the template's words, which the gateway answers as the client's 400."""
    from jinja2 import TemplateError

    try:
        yield
    except TemplateError as e:
        raise ValueError(f"the chat template refused the chat: {e}") from None


class TemplateArgumentError(ValueError):
    pass


def image_digests(conversation: list[dict]) -> list[str]:
    """The digests of the chat's images in prompt order ('' for one decoded without a digest)."""
    return [
        part["image"].info.get(IMAGE_DIGEST_KEY, "") if hasattr(part.get("image"), "info") else ""
        for message in conversation
        if isinstance(message.get("content"), list)
        for part in message["content"]
        if isinstance(part, dict) and part.get("type") == "image"
    ]


class ChatProcessor:
    def __init__(self, model_dir: str | Path, config: LlavaConfig | None = None, chat_template: str | None = None):
        """`chat_template`: a Jinja chat template to use instead of the checkpoint's (vLLM's `--chat-template`)."""
        from transformers import AutoProcessor
        from transformers.utils import logging as hf_logging

        hf_logging.get_logger("transformers.image_processing_utils").setLevel(logging.ERROR)
        verbosity = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()  # the torchvision → PIL image processor fallback notice
        try:
            self.processor = AutoProcessor.from_pretrained(str(model_dir))
        finally:
            hf_logging.set_verbosity(verbosity)
        if chat_template is not None:
            self.processor.chat_template = chat_template
        self.tokenizer = self.processor.tokenizer
        self.config = config or LlavaConfig.from_pretrained(model_dir)
        if chat_template is not None:  # a template that cannot render a plain chat fails here, not at each request
            try:
                self.count_prompt_tokens([{"role": "user", "content": [{"type": "text", "text": "Hello"}]}])
            except Exception as e:
                raise ValueError(
                    f"the chat template cannot render a one-message chat: {type(e).__name__}: {e}"
                ) from None

    def apply(
        self,
        conversation: list[dict],
        finish_pixels: bool = True,
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        template_kwargs: dict | None = None,
    ) -> tuple[list[int], list[ImageInput]]:
        """HF-format conversation (image parts as {'type': 'image', 'image': PIL.Image}) → token ids, images.
        `finish_pixels=False`: where that is exact (`deferred_scaling`), the images' pixels stop before the
        processor's rescale and normalize steps — uint8, for the worker that encodes to finish.
        `add_generation_prompt=False` (only to tokenize a chat, not to answer it): no assistant turn opened.
        `tools`: the request's tools, for a template that renders them (HF's `apply_chat_template(tools=...)`);
        `template_kwargs`: the request's `chat_template_kwargs` (`template_variables` says which the template reads)."""
        return self._apply(
            conversation,
            None if finish_pixels else self.deferred_scaling,
            add_generation_prompt,
            tools,
            template_kwargs,
        )

    def _apply(
        self,
        conversation: list[dict],
        scaling: PixelScaling | None,
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        template_kwargs: dict | None = None,
    ) -> tuple[list[int], list[ImageInput]]:
        kwargs = self._template_kwargs(tools, template_kwargs)
        if scaling is not None:
            kwargs["processor_kwargs"] = {"do_rescale": False, "do_normalize": False}
        with _template_refusals():
            batch = self.processor.apply_chat_template(
                self._calls_as_text(conversation),
                add_generation_prompt=add_generation_prompt,
                tokenize=True,
                return_dict=True,
                return_tensors="pt",
                **kwargs,
            )
        ids = batch["input_ids"][0].tolist()
        images = []
        if "pixel_values" in batch:
            sources = image_digests(conversation)  # the files' own digests, where the gateway took them
            for i, pixels in enumerate(batch["pixel_values"]):
                pixels = pixels.to(torch.float32 if scaling is None else torch.uint8).contiguous()
                # the same file gives the same pixels: its digest identifies them (cheaper than hashing the pixels)
                digest = (
                    sources[i]
                    if i < len(sources) and sources[i]
                    else hashlib.blake2b(pixels.numpy().tobytes(), digest_size=16).hexdigest()
                )
                images.append(ImageInput(pixels, self.config.image_tokens_per_image, digest, scaling))
        return ids, images

    @functools.cached_property
    def deferred_scaling(self) -> PixelScaling | None:
        """The image processor's rescale and normalize steps, when `common.model.pixels.finish` redoes them
        bit for bit (checked once, on probe images of several sizes); else None: pixels travel finished."""
        ip = getattr(self.processor, "image_processor", None)
        try:
            if not (ip.do_rescale and ip.do_normalize):
                return None
            mean, std = ([v] * 3 if isinstance(v, (int, float)) else list(v) for v in (ip.image_mean, ip.image_std))
            scaling = PixelScaling(float(ip.rescale_factor), tuple(map(float, mean)), tuple(map(float, std)))
            rng = np.random.default_rng(0)
            for height, width in ((240, 320), (47, 61), (500, 300)):
                probe = Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))
                chat = [{"role": "user", "content": [{"type": "image", "image": probe}, {"type": "text", "text": "?"}]}]
                (_, (full,)), (_, (raw,)) = self._apply(chat, None), self._apply(chat, scaling)
                if not torch.equal(
                    full.pixel_values.view(torch.int32), finish(raw.pixel_values, scaling).view(torch.int32)
                ):
                    log.info("image pixels travel finished: finishing them elsewhere would not be exact")
                    return None
        except Exception as e:  # an image processor unlike CLIP's: keep to its own output
            log.info("image pixels travel finished (%s: %s)", type(e).__name__, e)
            return None
        return scaling

    def encode_prompt(self, prompt: str | list[int]) -> tuple[list[int], list[ImageInput]]:
        """A text completion's prompt → token ids (text tokenized as it is, with the tokenizer's BOS, as vLLM does;
        token ids kept as given), and no images."""
        ids = self.tokenizer(prompt)["input_ids"] if isinstance(prompt, str) else list(prompt)
        if self.config.image_token_id in ids:
            raise ValueError(
                "the prompt holds the image placeholder token, and a text completion takes no images; "
                "send images to /v1/chat/completions"
            )
        return ids, []

    def _calls_as_text(self, conversation: list[dict]) -> list[dict]:
        """The chat, with the tool calls of earlier assistant turns written into their text when the template does not
        render `tool_calls` itself (LLaVA-1.5's): as the JSON a "required" answer is (`[{"name","parameters"}]`), so
        the model sees what it called before the tool's answer (a "tool" turn) instead of an empty turn."""
        if not any("tool_calls" in m for m in conversation) or "tool_calls" in (self.processor.chat_template or ""):
            return conversation
        out = []
        for m in conversation:
            if m.get("tool_calls"):
                calls = [
                    {"name": c["function"]["name"], "parameters": c["function"]["arguments"]} for c in m["tool_calls"]
                ]
                text = json.dumps(calls, ensure_ascii=False, separators=(",", ":"))
                m = {k: v for k, v in m.items() if k != "tool_calls"}
                m["content"] = [*m["content"], {"type": "text", "text": text}]
            out.append(m)
        return out

    @functools.cached_property
    def template_variables(self) -> frozenset[str]:
        """The variables the chat template reads, but for those the processor sets itself."""
        from jinja2 import meta
        from transformers.utils.chat_template_utils import _compile_jinja_template

        template = self.processor.chat_template
        if not isinstance(template, str):
            return frozenset()
        try:
            environment = _compile_jinja_template(template).environment
            return frozenset(meta.find_undeclared_variables(environment.parse(template))) - RESERVED_TEMPLATE_VARIABLES
        except Exception as e:  # a template this cannot read: it takes no request variables
            log.warning(
                "the chat template's variables could not be read (%s: %s): chat_template_kwargs are ignored",
                type(e).__name__,
                e,
            )
            return frozenset()

    def _template_kwargs(self, tools: list[dict] | None, given: dict | None) -> dict:
        """apply_chat_template's keyword arguments for the request's tools and chat_template_kwargs: a kwarg the
        processor sets itself is refused; one the template does not read is left out (it could change nothing)."""
        kwargs = {"tools": tools} if tools else {}
        reserved = sorted(set(given or ()) & RESERVED_TEMPLATE_VARIABLES)
        if reserved:
            raise TemplateArgumentError(f"chat_template_kwargs may not set {', '.join(reserved)}: the server sets it")
        kwargs.update({k: v for k, v in (given or {}).items() if k in self.template_variables})
        return kwargs

    def count_prompt_tokens(
        self, conversation: list[dict], tools: list[dict] | None = None, template_kwargs: dict | None = None
    ) -> int:
        """The prompt's length without preprocessing any image (a fraction of `apply`'s time, so a route can
        be asked for while the pixels are made)."""
        return len(self.prompt_ids(conversation, tools, template_kwargs))

    def prompt_ids(
        self, conversation: list[dict], tools: list[dict] | None = None, template_kwargs: dict | None = None
    ) -> list[int]:
        """The prompt's token ids without preprocessing any image: the chat template's text tokenized as `apply`
        does, each image placeholder expanded to the tokens it stands for — `apply`'s ids (a test keeps them so)."""
        with _template_refusals():
            text = self.processor.apply_chat_template(
                self._calls_as_text(conversation),
                add_generation_prompt=True,
                tokenize=False,
                **self._template_kwargs(tools, template_kwargs),
            )
        bos = self.tokenizer.bos_token
        ids = self.tokenizer(text, add_special_tokens=not (bos is not None and text.startswith(bos)))["input_ids"]
        image_token, per_image = self.config.image_token_id, self.config.image_tokens_per_image
        if image_token not in ids:
            return ids
        return [t for token in ids for t in ([token] * per_image if token == image_token else [token])]

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The most characters one token can stand for (its vocabulary string's length; a byte-level BPE string
        has one character per byte, so at least as many as the text it decodes to): with it, a text can be known
        too long for the model without tokenizing it."""
        return max(map(len, self.tokenizer.get_vocab()), default=1)

    def detokenize(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def token_text(self, token_id: int) -> tuple[str, bytes]:
        """One token's own text (special tokens included: what a logprobs entry names it by) and its bytes — the
        raw ones, which a token holding part of a UTF-8 character has though its text is only U+FFFD."""
        cache = self.__dict__.setdefault("_token_texts", {})
        entry = cache.get(token_id)
        if entry is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            entry = cache[token_id] = (text, self._token_bytes(token_id, text))
        return entry

    def _token_bytes(self, token_id: int, text: str) -> bytes:
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if not isinstance(piece, str) or token_id in self.tokenizer.all_special_ids:
            return text.encode()
        if (m := re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", piece)) is not None:  # SentencePiece byte fallback
            return bytes([int(m.group(1), 16)])
        if self._byte_level and all(c in _BYTE_OF_CHAR for c in piece):  # GPT-2-style byte-level BPE
            return bytes(_BYTE_OF_CHAR[c] for c in piece)
        return piece.replace("\u2581", " ").encode()  # SentencePiece: "▁" is a space

    @functools.cached_property
    def _byte_level(self) -> bool:
        try:
            decoder = json.loads(self.tokenizer.backend_tokenizer.to_str()).get("decoder") or {}
        except (AttributeError, ValueError):
            return False
        kinds = [decoder.get("type")] + [d.get("type") for d in decoder.get("decoders", [])]
        return "ByteLevel" in kinds


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE writes each byte as one printable character: the printable Latin-1 bytes as
    themselves, the other 68 as the characters from U+0100 on, in byte order. Character → byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[chr(byte)] = byte
        else:
            chars[chr(256 + extra)] = byte
            extra += 1
    return chars


_BYTE_OF_CHAR = _byte_level_alphabet()
