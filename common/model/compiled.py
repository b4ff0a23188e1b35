"""The model's dense path compiled by inductor (torch.compile), attention and the paged cache left eager.

What is compiled: a decoder layer's two halves around attention (`DecoderLayer.qkv`: norm, projection, rotary;
`DecoderLayer.finish`: output projection, residuals, norm, SwiGLU) and a vision layer. Inductor fuses their
elementwise work (norms, rotary, activations, residual adds: most of a CPU prefill's time outside the GEMMs) into
vectorised C++ loops; the GEMMs stay oneDNN's (`packed_linear`). The token count becomes dynamic at its second
size, so one graph per half serves every batch (1 token has a graph of its own). Paged reads and writes stay out.

The model is not changed: an engine holds a `CompiledModel` and passes its functions to the forward, so an eager
engine and a compiled one can share one model. Compiled code is C++ built by the host's compiler on first use; its
cache is the user's (`$EPDMESH_HOME/inductor`, default ~/.cache/epdmesh/inductor), never the repository.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import torch

from common.model.clip import VisionLayer
from common.model.llama import DecoderLayer
from common.model.llava import LlavaModel

log = logging.getLogger(__name__)


def cache_dir() -> Path:
    return Path(os.environ.get("EPDMESH_HOME", Path.home() / ".cache" / "epdmesh")) / "inductor"


class CompiledModel:
    """torch.compile'd forms of the model's dense halves; `warm_up` compiles them before the first request."""

    def __init__(self, model: LlavaModel):
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir

        if os.environ.get("TORCHINDUCTOR_CACHE_DIR") in (None, default_cache_dir()):  # unless the user chose one
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir())  # (inductor writes its default back)
        self.model = model
        # dynamo keeps compiled code on the function's code object: every engine's wrappers share it
        self.text = (torch.compile(DecoderLayer.qkv), torch.compile(DecoderLayer.finish))
        self.vision_layer = torch.compile(VisionLayer.forward)

    @torch.inference_mode()
    def warm_up(self, text: bool = True, vision: bool = True) -> float:
        """Compile every graph a server meets (1 token and several; 1 image and several) on dummy inputs; returns
        the seconds it took (from a warm cache, a few)."""
        start = time.perf_counter()
        model = self.model
        like = dict(dtype=model.text.embed_tokens.weight.dtype, device=model.text.embed_tokens.weight.device)
        if text:
            cfg, layer = model.text.cfg, model.text.layers[0]
            qkv, finish = self.text
            for n in (1, 2):
                x = torch.zeros(n, cfg.hidden_size, **like)
                cos = torch.ones(n, cfg.head_dim, **like)
                q, _, _ = qkv(layer, x, cos, torch.zeros_like(cos))
                finish(layer, x, q)
        if vision:
            vcfg = model.cfg.vision
            for images in (1, 2):
                self.vision_layer(
                    model.vision.layers[0], torch.zeros(images, vcfg.num_patches + 1, vcfg.hidden_size, **like)
                )
        seconds = time.perf_counter() - start
        log.info("compiled model warmed up in %.1f s (cache %s)", seconds, os.environ["TORCHINDUCTOR_CACHE_DIR"])
        return seconds
