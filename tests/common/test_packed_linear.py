"""Packed bf16 linears give `F.linear`'s bits exactly; a model's linears are packed only where oneDNN computes bf16."""

import pytest
import torch
from torch import nn

from common.model.loader import load_model
from common.model.packed_linear import PackedLinear, can_pack, pack_linears, row_bucket

needs_bf16 = pytest.mark.skipif(
    not can_pack(torch.bfloat16, torch.device("cpu")),
    reason="this CPU has no native bf16 (AMX / AVX512-BF16) for oneDNN",
)


@needs_bf16
@pytest.mark.parametrize("tiles", [False, True], ids=["onednn", "amx-tiles"])  # (tiles: where the host has AMX)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [(0,), (1,), (7,), (2, 16), (3, 64)], ids=["empty", "one", "seven", "2x16", "3x64"])
def test_packed_linear_is_bitwise_f_linear_at_a_bucket_row_count(bias, rows, tiles):
    torch.manual_seed(0)
    linear = nn.Linear(96, 160, bias=bias).to(torch.bfloat16)
    x = torch.randn(*rows, 96, dtype=torch.bfloat16)
    packed = PackedLinear(linear, tiles=tiles)
    assert packed(x).shape == (*rows, 160)
    assert torch.equal(packed(x), linear(x))


@needs_bf16
@pytest.mark.parametrize("rows", [(33,), (3, 50), (595,), (1179,)], ids=["33", "3x50", "595", "1179"])
def test_other_row_counts_run_padded_to_their_bucket(rows):
    """The product of the rows zero-padded to the bucket, sliced back: within bf16's rounding of F.linear."""
    torch.manual_seed(0)
    linear = nn.Linear(512, 1536, bias=False).to(torch.bfloat16)
    x = torch.randn(*rows, 512, dtype=torch.bfloat16)
    n = x.numel() // 512
    padded = torch.cat([x.reshape(n, 512), x.new_zeros(row_bucket(n) - n, 512)])
    out = PackedLinear(linear)(x)
    assert out.shape == (*rows, 1536) and out.is_contiguous()
    assert torch.equal(out.reshape(n, 1536), linear(padded)[:n])
    torch.testing.assert_close(out, linear(x), atol=1e-5, rtol=2**-7)  # (atol: sums that cancel)


def test_row_buckets_are_few_and_pad_little():
    assert [row_bucket(n) for n in (0, 1, 32, 33, 64, 65, 512, 513, 1000, 1025, 2049)] == [
        0, 1, 32, 64, 64, 96, 512, 576, 1024, 1152, 2304,
    ]  # fmt: skip
    assert len({row_bucket(n) for n in range(1, 8193)}) == 32 + 15 + 8 + 8 + 24
    assert all(row_bucket(n) >= n and (n <= 512 or row_bucket(n) <= n * 1.125) for n in range(1, 8193))


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
