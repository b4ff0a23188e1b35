"""Packed bf16 linears give `F.linear`'s bits exactly; a model's linears are packed only where oneDNN computes bf16."""

import pytest
import torch
from torch import nn

from common.model.loader import load_model
from common.model.packed_linear import PackedLinear, can_pack, pack_linears

needs_bf16 = pytest.mark.skipif(
    not can_pack(torch.bfloat16, torch.device("cpu")),
    reason="this CPU has no native bf16 (AMX / AVX512-BF16) for oneDNN",
)


@needs_bf16
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [(0,), (1,), (7,), (3, 50)], ids=["empty", "one", "seven", "3x50"])
def test_packed_linear_is_bitwise_f_linear(bias, rows):
    torch.manual_seed(0)
    linear = nn.Linear(96, 160, bias=bias).to(torch.bfloat16)
    x = torch.randn(*rows, 96, dtype=torch.bfloat16)
    packed = PackedLinear(linear)
    assert packed(x).shape == (*rows, 160)
    assert torch.equal(packed(x), linear(x))


@needs_bf16
def test_a_bf16_model_is_packed_once_and_answers_as_before(tiny_dir):
    eager = load_model(tiny_dir, torch.bfloat16)
    model = load_model(tiny_dir, torch.bfloat16)
    linears = sum(type(m) is nn.Linear for m in model.modules())
    assert pack_linears(model) == linears > 0
    assert pack_linears(model) == 0 and not any(type(m) is nn.Linear for m in model.modules())
    pixels = torch.randn(1, 3, model.cfg.vision.image_size, model.cfg.vision.image_size)
    assert torch.equal(model.encode_images(pixels), eager.encode_images(pixels))


def test_fp32_and_non_cpu_linears_are_left_alone(tiny_dir):
    assert not can_pack(torch.float32, torch.device("cpu"))
    assert not can_pack(torch.bfloat16, torch.device("meta"))
    model = load_model(tiny_dir, torch.float32)
    assert pack_linears(model) == 0
