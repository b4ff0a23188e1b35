"""Pixels sent unfinished (uint8) and finished by the encoding worker are the processor's own, bit for bit."""

import numpy as np
import pytest
import torch
from PIL import Image

from common.model import processor as processor_module
from common.model.pixels import PixelScaling, finish, finish_elementwise
from common.model.processor import ChatProcessor
from common.request import Request, Stage
from common.sampling import SamplingParams
from services import wire


def _chat(image):
    return [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "what is it?"}]}]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


@pytest.mark.parametrize("size", [(320, 240), (224, 224), (31, 400), (1000, 90)])
def test_unfinished_pixels_cross_the_wire_in_a_quarter_of_the_bytes_and_come_out_exact(processors, size):
    processor = processors["tiny"]
    rng = np.random.default_rng(size[0])
    image = Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))
    ids, (finished,) = processor.apply(_chat(image))
    raw_ids, (raw,) = processor.apply(_chat(image), finish_pixels=False)
    assert raw_ids == ids and raw.pixel_values.dtype == torch.uint8 and raw.scaling == processor.deferred_scaling
    sent = {
        name: wire.spec_to_pb(Request("r", ids, SamplingParams(), [img]), with_pixels=True)
        for name, img in (("finished", finished), ("raw", raw))
    }
    assert len(sent["raw"].images[0].pixel_values) * 4 == len(sent["finished"].images[0].pixel_values)
    for msg in sent.values():
        got = wire.request_from_pb(msg, Stage.ENCODE, Stage.ENCODE).images[0]
        assert got.pixel_values.dtype == torch.float32 and got.scaling is None  # an engine gets finished pixels
        assert torch.equal(_bits(got.pixel_values), _bits(finished.pixel_values))


def test_pixels_travel_finished_when_finishing_elsewhere_would_not_be_exact(tiny_dir, monkeypatch):
    """The check is real: a finishing step that rounds differently (all float32) is caught, and then the
    processor's own float32 pixels are what `apply(finish_pixels=False)` gives."""

    def float32_only(raw: torch.Tensor, scaling: PixelScaling) -> torch.Tensor:
        mean = torch.tensor(scaling.mean, dtype=torch.float32).view(-1, 1, 1)
        std = torch.tensor(scaling.std, dtype=torch.float32).view(-1, 1, 1)
        return (raw.to(torch.float32) * np.float32(scaling.rescale) - mean) / std

    monkeypatch.setattr(processor_module, "finish", float32_only)
    processor = ChatProcessor(tiny_dir)
    assert processor.deferred_scaling is None
    image = Image.fromarray(np.random.default_rng(3).integers(0, 256, (240, 320, 3), dtype=np.uint8))
    (_, (img,)) = processor.apply(_chat(image), finish_pixels=False)
    assert img.pixel_values.dtype == torch.float32 and img.scaling is None


def test_finish_refuses_what_it_cannot_finish():
    scaling = PixelScaling(1 / 255, (0.5, 0.5, 0.5), (0.25, 0.25, 0.25))
    with pytest.raises(ValueError, match="uint8"):
        finish(torch.zeros(3, 4, 4), scaling)
    with pytest.raises(ValueError, match="3 means"):
        finish(torch.zeros(1, 4, 4, dtype=torch.uint8), scaling)
    assert finish(torch.full((3, 2, 2), 255, dtype=torch.uint8), scaling).eq(2.0).all()
    # what no image processor has (sent straight to a worker, they made NaN pixels the request was answered from)
    for odd in (
        PixelScaling(float("nan"), (0.5,) * 3, (0.25,) * 3),
        PixelScaling(1 / 255, (float("inf"),) * 3, (0.25,) * 3),
        PixelScaling(1 / 255, (0.5,) * 3, (0.25, 0.0, 0.25)),
    ):
        with pytest.raises(ValueError, match="finite"):
            finish(torch.zeros(3, 2, 2, dtype=torch.uint8), odd)


@pytest.mark.parametrize("shape", [(3, 1, 256), (3, 17, 5), (2, 3, 9, 4)])
def test_the_lookup_table_gives_the_elementwise_steps_bits_for_every_value(shape):
    """`finish` looks each uint8 value up in a per-channel table; every value of every channel, in one image
    and in a batch of images, comes out as the two steps done value by value."""
    scaling = PixelScaling(1 / 255, (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711))
    raw = torch.from_numpy(np.random.default_rng(sum(shape)).integers(0, 256, shape, dtype=np.uint8))
    if shape == (3, 1, 256):
        raw = torch.arange(256, dtype=torch.uint8).expand(3, 1, 256).contiguous()  # all 256 values per channel
    got, want = finish(raw, scaling), finish_elementwise(raw, scaling)
    assert got.shape == raw.shape and got.dtype == torch.float32 and got.is_contiguous()
    assert torch.equal(_bits(got), _bits(want))
    other = PixelScaling(1 / 255, (0.5, 0.5, 0.5), (0.5, 0.5, 0.5))  # a second processor's table is its own
    assert torch.equal(_bits(finish(raw, other)), _bits(finish_elementwise(raw, other)))
