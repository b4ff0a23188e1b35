"""A decode step's bf16 products on the vector units of a host with AVX512-BF16 and no AMX (`cpu_amx.linear` there),
against oneDNN's, and where a model uses them."""

import pytest
import torch
from torch import nn

from common.model import packed_linear as pl
from kernels import cpu_amx

pytestmark = pytest.mark.skipif(not cpu_amx.vector_available(), reason="needs AVX512-BF16 without AMX")


def onednn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, torch.ops.mkldnn._reorder_linear_weight(w), None, "none", [], "")


@pytest.mark.parametrize("n,k", [(1536, 512), (512, 1408), (8192, 512), (48, 64)])  # 48: a pass of 3 column blocks
@pytest.mark.parametrize("rows", [1, 2, 5, 8, 16])  # 5: a pass of one row after four
def test_its_sums_are_onednns_bit_for_bit(rows, n, k):
    g = torch.Generator().manual_seed(rows * n + k)
    w = (torch.randn(n, k, generator=g) * 0.05).bfloat16()
    x = torch.randn(rows, k, generator=g).bfloat16()
    tiles = cpu_amx.pack(w)
    out = cpu_amx.linear(x, tiles)
    assert out.shape == (rows, n) and out.dtype == torch.bfloat16
    assert_onednns(out, onednn(x, w), rows)
    exact = x.double() @ w.double().T
    assert ((out.double() - exact).abs() <= exact.abs() * 2**-7 + 2**-20 * k).all()
    wide = torch.randn(rows, k + 32, generator=g).bfloat16()  # strided rows
    assert torch.equal(cpu_amx.linear(wide[:, :k], tiles), cpu_amx.linear(wide[:, :k].contiguous(), tiles))
    assert_onednns(cpu_amx.linear(wide[:, :k], tiles), onednn(wide[:, :k].contiguous(), w), rows)


def assert_onednns(out: torch.Tensor, theirs: torch.Tensor, rows: int) -> None:
    """VDPBF16PS over K in order into one fp32 sum per output, rounded once: what oneDNN's product computes up to 8
    rows; from 9 rows it blocks K otherwise at some shapes (1 of 6,144 outputs at 12 × 1,408 on a Zen 4), which
    moves a sum lying on a bf16 rounding boundary one step."""
    if rows <= 8:
        assert torch.equal(out, theirs)
    else:
        assert ((out.float() - theirs.float()).abs() <= theirs.float().abs() * 2**-7).all()
        assert (out != theirs).sum() <= max(2, out.numel() // 1_000)


def test_a_models_decode_products_take_it_and_its_prompts_stay_onednns(monkeypatch):
    model = nn.Sequential()
    model.text = nn.Sequential(nn.Linear(512, 1536, bias=False)).bfloat16()
    assert pl.pack_linears(model) == 1
    linear = model.text[0]
    assert isinstance(linear, pl.PackedLinear) and linear.tiles is not None
    assert not cpu_amx.gemm_supports(linear.tiles) and not linear.amx  # AMX's prompt and SwiGLU kernels: not here
    assert linear.mlp(torch.randn(2, 512).bfloat16(), linear) is None
    calls = []
    kernel = cpu_amx.linear
    monkeypatch.setattr(cpu_amx, "linear", lambda *a: calls.append(a[0].shape[0]) or kernel(*a))
    w = model.text[0].tiles.permute(0, 3, 1, 2, 4).reshape(1536, 512)  # the weight back from its tiles
    for rows in (1, cpu_amx.VECTOR_ROWS, cpu_amx.VECTOR_ROWS + 1, 100):
        x = torch.randn(rows, 512).bfloat16()
        assert_onednns(linear(x), onednn(x, w), rows if rows <= cpu_amx.VECTOR_ROWS else 0)
    assert calls == [1, cpu_amx.VECTOR_ROWS]  # more rows: oneDNN's blocked product
