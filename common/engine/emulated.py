"""The emulated backend: the real engine with the model replaced by a latency profile.

Everything but the model is the real code: scheduler and budgets, block managers, paged caches,
handoffs, and — above the engine — the worker, the transfer path, gRPC, the toggle and the gateway.
Each iteration waits what the profile predicts for its batch (`iteration_ms`: images encoded,
decodes and their context, prefill chunks), then emits deterministic tokens.

Pages are real bytes in real paged caches, but `kv_bytes_per_token` / `image_bytes_per_token`
each (default 256 / 64) instead of the model's (LLaVA-1.5-7B: 512 KiB / 8 KiB), so dozens of
instances fit one host; they move between workers by the real transfer path, and each import also
waits what the profile predicts for the model's real page bytes (`transfer_delay_s`). Cache
capacity is counted in the real model's bytes (16-bit, as served on the profiled GPU), so a worker
holds as many tokens as that GPU's cache would.

Tokens: the prefill stamps the request's first KV page with a digest of its prompt (a continuation's: of the original
prompt) and of the stamp the encoder wrote into its first image page; every token is a function of the stamp read back
from the KV page and of its position in the output (a continuation's counts the tokens sent before it), so a migrated
request goes on with the tokens it would have had. A page lost or garbled in a transfer changes the tokens, so
comparing topologies checks the bytes moved, as the real model's parity does.
"""

from __future__ import annotations

import array
import time
import zlib
from collections.abc import Callable
from pathlib import Path

import torch

from common.engine.config import EngineConfig
from common.engine.engine import Engine
from common.latency.model import LatencyProfile, iteration_ms, transfer_ms
from common.model.config import LlavaConfig
from common.request import Request
from common.scheduler import SchedulerOutput

REAL_BYTES_PER_VALUE = 2  # the emulated model is served in bf16/fp16, as on the profiled GPU
STAMP_MASK = (1 << 20) - 1  # stamps stay exact in float32


class EmulatedEngine(Engine):
    computes_logprobs = False  # it waits out predicted times and emits deterministic tokens: there are no logits

    def __init__(
        self,
        config: EngineConfig,
        profile: LatencyProfile,
        detokenize: Callable[[list[int]], str] | None = None,
        token_pool: list[int] | None = None,
        kv_bytes_per_token: int = 256,
        image_bytes_per_token: int = 64,
        model_config: LlavaConfig | None = None,
    ):
        if config.kv_cache_gib is None:
            raise ValueError("the emulated engine's KV cache needs a size (kv_cache_gib): it has no GPU to measure")
        if kv_bytes_per_token < 8 or image_bytes_per_token < 4:
            raise ValueError("emulated pages need at least 8 KV bytes and 4 image bytes per token")
        model_config = model_config or LlavaConfig.from_pretrained(config.model)
        text = model_config.text
        real_kv = 2 * text.num_layers * text.num_kv_heads * text.head_dim * REAL_BYTES_PER_VALUE
        real_image = text.hidden_size * REAL_BYTES_PER_VALUE
        self.real_bytes_per_token = {"kv": real_kv, "image": real_image}

        def setup(c: EngineConfig, reuse=None) -> None:
            self._build(
                c,
                model_config,
                (1, 1, kv_bytes_per_token // 8),
                image_bytes_per_token // 4,
                torch.float32,
                torch.device("cpu"),
                detokenize,
                count_as=(real_kv * c.block_size, real_image * c.image_block_size),
                reuse=reuse,
            )

        self._setup = setup
        setup(config)
        self.model = self.compiled = None
        self.profile = profile
        excluded = {model_config.image_token_id, *model_config.eos_token_ids}
        pool = [
            t
            for t in (token_pool or range(10, min(text.vocab_size, 1000)))
            if t not in excluded and 0 <= t < text.vocab_size
        ]
        if not pool:
            raise ValueError("the emulated engine has no token ids to emit")
        self.token_pool = pool
        self.predicted_ms = 0.0  # of the last iteration
        self.sleeps = True  # an iteration takes its predicted time; False: the caller keeps time (the simulator)

    def transfer_delay_s(self, kind: str, num_tokens: int) -> float:
        return transfer_ms(self.profile, self.real_bytes_per_token[kind] * num_tokens) / 1e3

    def _execute(self, plan: SchedulerOutput) -> tuple[list[Request], list[int]]:
        start = time.perf_counter()
        self.predicted_ms = iteration_ms(
            self.profile,
            plan.num_images,
            len(plan.decodes),
            sum(r.num_tokens for r in plan.decodes),
            [(c.num_tokens, c.start) for c in plan.prefills],
        )
        for work in plan.encodes:
            request = work.request
            if work.first_image + work.num_images == len(request.images):
                self._write_stamp(self.image_cache.data, request.image_block_table[0], _images_digest(request))
        sampling, tokens = [], []
        for request in plan.decodes:
            sampling.append(request)
            tokens.append(self._token(self._read_stamp(self.kv_cache.data, self._stamp_block(request)), request))
        for chunk in plan.prefills:
            if not chunk.completes_prefill:
                continue
            request = chunk.request
            original = request.prompt_token_ids[: request.num_prompt_tokens - request.num_continued_tokens]
            seed = array.array("q", original).tobytes()  # a continuation's tokens go on from the original's
            if request.images:  # from the encoder's pages; with none (the prefix cache held its images' KV), the same
                digest = (
                    self._read_stamp(self.image_cache.data, request.image_block_table[0])
                    if request.image_block_table
                    else _images_digest(request) & STAMP_MASK
                )
                seed += digest.to_bytes(4, "little")
            stamp = zlib.crc32(seed)
            self._write_stamp(self.kv_cache.data, self._stamp_block(request), stamp)
            sampling.append(request)
            tokens.append(self._token(stamp & STAMP_MASK, request))
        remaining = start + self.predicted_ms / 1e3 - time.perf_counter()
        if remaining > 0 and self.sleeps:
            time.sleep(remaining)
        return sampling, tokens

    def _stamp_block(self, request: Request) -> int:
        """The KV block the prefill's stamp goes in: the one of the last prompt token, which no other request shares
        (a cached prefix never includes it) and which goes with the prompt's KV pages to the decoder."""
        return request.block_table[(request.num_prompt_tokens - 1) // self.config.block_size]

    def _token(self, stamp: int, request: Request) -> int:
        return self.token_pool[(stamp * 2654435761 + 7919 * len(request.generated_token_ids)) % len(self.token_pool)]

    @staticmethod
    def _write_stamp(data: torch.Tensor, block: int, stamp: int) -> None:
        data[block].view(-1)[0] = float(stamp & STAMP_MASK)

    @staticmethod
    def _read_stamp(data: torch.Tensor, block: int) -> int:
        return int(data[block].view(-1)[0].item())


def _images_digest(request: Request) -> int:
    return zlib.crc32("".join(img.content_hash for img in request.images).encode())


def word_token_pool(model_dir: str | Path) -> list[int] | None:
    """Ids of single-token words of the checkpoint's tokenizer (readable emulated text), None without one."""
    from common.model.tiny import WORDS

    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        return None
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(path))
    pool = []
    for word in WORDS:
        ids = tokenizer.encode(" " + word, add_special_tokens=False).ids
        if len(ids) == 1:
            pool.append(ids[0])
    return sorted(set(pool)) or None


def light_detokenizer(model_dir: str | Path) -> Callable[[list[int]], str] | None:
    """The checkpoint's tokenizer decode without loading transformers (emulated workers stay small)."""
    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        return None
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(path))
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)
