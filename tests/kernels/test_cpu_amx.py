"""bf16 products on AMX tiles (a decode step's few rows, a prompt's many) against oneDNN's, and where a model uses
them."""

import pytest
import torch
from torch import nn

from common.model import packed_linear as pl
from kernels import cpu_amx

pytestmark = pytest.mark.skipif(not cpu_amx.available(), reason="no AMX on this host (or no C compiler)")


@pytest.mark.parametrize("n,k", [(1536, 512), (80, 96), (48, 1408), (16, 32)])
@pytest.mark.parametrize("rows", [1, 3, 8, 16, 17, 24, 32])
def test_the_tiles_give_onednn_bits(rows, n, k):
    """The tile unit's arithmetic, as oneDNN runs it: bit-identical up to 32 rows — one slab of rows, or two with
    the second one short or whole — N in whole groups of four (two) column blocks or not."""
    g = torch.Generator().manual_seed(rows * n + k)
    w = torch.randn(n, k, generator=g).bfloat16()
    x = torch.randn(rows, k, generator=g).bfloat16()
    onednn = torch.ops.mkldnn._linear_pointwise(x, torch.ops.mkldnn._reorder_linear_weight(w), None, "none", [], "")
    out = cpu_amx.linear(x, cpu_amx.pack(w))
    assert out.shape == (rows, n) and torch.equal(out, onednn)


@pytest.mark.parametrize("rows", [33, 40, 48, 49, 63, 64, 100])
def test_more_rows_are_the_fp32_sum_rounded_once(rows):
    """Beyond 32 rows oneDNN splits its sums otherwise; the tiles' output is still each fp32 sum along K rounded
    once to bf16 — an odd last slab alone, an even one short of 16 rows, whole slabs — as close to the exact
    product as oneDNN's is."""
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(1552, 1408, generator=g).bfloat16()  # 97 column blocks: the last one alone
    x = torch.randn(rows, 1408, generator=g).bfloat16()
    exact = x.double() @ w.double().t()
    out = cpu_amx.linear(x, cpu_amx.pack(w))
    onednn = torch.ops.mkldnn._linear_pointwise(x, torch.ops.mkldnn._reorder_linear_weight(w), None, "none", [], "")
    ulp = exact.abs().clamp_min(1.0) * 2**-8  # one bf16 step, and the fp32 sums' drift below
    assert out.shape == (rows, 1552)
    assert ((out.double() - exact).abs() <= ulp).all()
    assert ((out.double() - onednn.double()).abs() <= 2 * ulp).all()


def test_any_leading_shape_and_strided_rows():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 64, generator=g).bfloat16()
    wide = torch.randn(2, 3, 128, generator=g).bfloat16()
    x = wide[..., :64]  # rows 128 apart
    tiles = cpu_amx.pack(w)
    assert torch.equal(cpu_amx.linear(x, tiles), nn.functional.linear(x, w))
    many = torch.randn(5, 6, 128, generator=g).bfloat16()[..., 64:]  # 30 rows, in slabs
    assert torch.equal(cpu_amx.linear(many, tiles), nn.functional.linear(many, w))
    transposed = torch.randn(64, 4, generator=g).bfloat16().t()  # columns not contiguous: copied first
    assert torch.equal(cpu_amx.linear(transposed, tiles), nn.functional.linear(transposed, w))


def test_shapes_it_does_not_take():
    w = torch.randn(64, 64).bfloat16()
    with pytest.raises(ValueError, match="0 rows"):
        cpu_amx.linear(torch.randn(0, 64).bfloat16(), cpu_amx.pack(w))
    assert not cpu_amx.supports(torch.randn(64, 48).bfloat16())  # K not a multiple of 32
    assert not cpu_amx.supports(torch.randn(40, 64).bfloat16())  # N not a multiple of 16
    assert not cpu_amx.supports(torch.randn(64, 64))  # fp32


@pytest.mark.parametrize(
    "n,k", [(1536, 512), (512, 1408), (32, 32), (64, 4096)]
)  # K in one pass; in two passes (sums kept in fp32 between); one chunk; blocks of two pairs of rows
@pytest.mark.parametrize("rows", [1, 17, 33, 49, 100, 600, 1100])
def test_a_prompts_products_are_the_tiles_sums(rows, n, k):
    """`gemm` (a prompt's products) computes what `linear` does — each fp32 sum along K in chunks of 32, in order,
    rounded once — bit for bit, whatever the rows (a short last pair, several blocks of rows) and K (in passes),
    and within bf16's rounding of the exact product."""
    g = torch.Generator().manual_seed(rows * n + k)
    w = torch.randn(n, k, generator=g).bfloat16()
    x = torch.randn(rows, k, generator=g).bfloat16()
    tiles = cpu_amx.pack(w)
    out = cpu_amx.gemm(x, tiles)
    assert out.shape == (rows, n) and torch.equal(out, cpu_amx.linear(x, tiles))
    exact = x.double() @ w.double().t()
    assert ((out.double() - exact).abs() <= exact.abs().clamp_min(1.0) * 2**-8).all()


def test_a_prompts_products_take_any_leading_shape_and_strided_rows_and_refuse_odd_blocks():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(96, 64, generator=g).bfloat16()
    tiles = cpu_amx.pack(w)
    x = torch.randn(7, 11, 128, generator=g).bfloat16()[..., 32:96]  # 77 rows, 128 apart
    out = cpu_amx.gemm(x, tiles)
    assert out.shape == (7, 11, 96) and torch.equal(out, cpu_amx.linear(x, tiles))
    odd = cpu_amx.pack(torch.randn(80, 64).bfloat16())  # five column blocks: not in pairs
    assert cpu_amx.gemm_supports(tiles) and not cpu_amx.gemm_supports(odd)
    with pytest.raises(ValueError, match="N % 32"):
        cpu_amx.gemm(torch.randn(64, 64).bfloat16(), odd)


def test_a_packed_linear_takes_its_tiles_for_decode_and_prompts_and_onednn_where_they_do_not_fit(monkeypatch):
    calls = []
    for name in ("linear", "gemm"):
        kernel = getattr(cpu_amx, name)
        monkeypatch.setattr(
            cpu_amx, name, lambda x, t, name=name, kernel=kernel: calls.append((name, len(x))) or kernel(x, t)
        )
    linear = nn.Linear(64, 96, bias=False).bfloat16()
    packed = pl.PackedLinear(linear, tiles=True)
    for rows in (1, 16, 17, 40, 48, 49, 130):
        x = torch.randn(rows, 64).bfloat16()
        torch.testing.assert_close(packed(x), linear(x), atol=1e-5, rtol=2**-7)
    assert calls == [("linear", r) for r in (1, 16, 17, 40, 48)] + [("gemm", 49), ("gemm", 130)]
    calls.clear()
    monkeypatch.setattr(cpu_amx, "GEMM", False)  # bench/engine.py --without prefill-tiles
    packed(torch.randn(130, 64).bfloat16())
    monkeypatch.setattr(cpu_amx, "GEMM", True)
    odd = nn.Linear(64, 80, bias=False).bfloat16()  # N = 80: five column blocks, not in pairs
    torch.testing.assert_close(pl.PackedLinear(odd, tiles=True)(x), odd(x), atol=1e-5, rtol=2**-7)
    assert calls == []  # both oneDNN's
    assert pl.PackedLinear(nn.Linear(64, 96).bfloat16(), tiles=True).tiles is None  # a bias: oneDNN adds it


def test_the_decoders_linears_get_tiles_while_the_copy_is_a_small_share_of_memory(tiny_dir, monkeypatch):
    from common.model.loader import load_model

    model = load_model(tiny_dir, torch.bfloat16)
    pl.pack_linears(model)
    packed = {n: m for n, m in model.named_modules() if isinstance(m, pl.PackedLinear)}
    with_tiles = {n for n, m in packed.items() if m.tiles is not None}
    assert with_tiles and all(n.startswith("text.") for n in with_tiles)
    assert not any(n.startswith("vision.") for n in with_tiles) and len(with_tiles) < len(packed)

    unasked = load_model(tiny_dir, torch.bfloat16)
    pl.pack_linears(unasked, tiles=False)  # --no-amx-tiles
    assert not any(m.tiles is not None for m in unasked.modules() if isinstance(m, pl.PackedLinear))

    monkeypatch.setattr(pl, "_host_memory", lambda: 1 << 20)  # a host where the copy would be > 10%
    small = load_model(tiny_dir, torch.bfloat16)
    pl.pack_linears(small)
    assert not any(m.tiles is not None for m in small.modules() if isinstance(m, pl.PackedLinear))


@pytest.mark.parametrize("i,k", [(1408, 512), (16, 32), (48, 1408)])  # 48: an odd number of 32-column pairs
@pytest.mark.parametrize("rows", [1, 8, 48, 49, 100, 1100])
def test_swiglu_is_silu_of_the_rounded_gate_times_the_up_rounded_once(rows, i, k):
    """A SwiGLU's gate and up products and silu(gate) · up in one call: the products rounded to bf16 as a product's
    output, the rest in fp32 as torch's silu (and inductor's fused code) computes it, rounded once — the decode
    path (≤ 16 rows: `swiglu_rows`, one call; ≤ 48: `linear`, then `silu_mul`) and a prompt's (`gemm`, applied as its
    blocks finish) alike; whole lines (N % 32 == 0) and half lines, an odd last column block."""
    g = torch.Generator().manual_seed(rows * i + k)
    w = (torch.randn(2 * i, k, generator=g) * 0.1).bfloat16()
    x = torch.randn(rows, k, generator=g).bfloat16()
    tiles = cpu_amx.pack(w)
    both = cpu_amx.linear(x, tiles).float()
    expected = (nn.functional.silu(both[:, :i]) * both[:, i:]).bfloat16()
    for out in (
        cpu_amx.gemm(x, tiles, swiglu=True) if rows > cpu_amx.MAX_ROWS else cpu_amx.silu_mul(cpu_amx.linear(x, tiles)),
        *([cpu_amx.swiglu_rows(x, tiles)] if rows <= cpu_amx.SWIGLU_ROWS else []),
    ):
        assert_swiglu(out, expected, rows, i)
    if rows <= cpu_amx.SWIGLU_ROWS:  # one call, and the same as the product then silu_mul
        assert torch.equal(cpu_amx.swiglu_rows(x, tiles), cpu_amx.silu_mul(cpu_amx.linear(x, tiles)))


def assert_swiglu(out, expected, rows, i):
    assert out.shape == (rows, i)
    # torch's silu and ours (Cephes' exp, a division) may part in fp32's last bit, which moves a value lying on a
    # bf16 rounding boundary one step: at most that, and rarely (1 of 140,800 values at 100 × 1408)
    assert ((out.float() - expected.float()).abs() <= expected.float().abs() * 2**-7).all()
    assert (out != expected).sum() <= max(2, out.numel() // 10_000)


def test_a_decoder_layer_takes_the_fused_mlp_where_its_linears_have_tiles(monkeypatch):
    from common.model.config import TextConfig
    from common.model.layers import rms_norm
    from common.model.llama import DecoderLayer

    cfg = TextConfig(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=96,
        num_layers=1,
        num_heads=2,
        num_kv_heads=2,
        head_dim=32,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=128,
        hidden_act="silu",
        tie_word_embeddings=False,
    )
    layer = DecoderLayer(cfg).bfloat16()
    for p in layer.parameters():
        nn.init.normal_(p, std=0.2)
    x, attn = torch.randn(70, 64).bfloat16(), torch.randn(70, 64).bfloat16()
    plain = layer.finish(x, attn)
    calls = []
    for name in ("mlp", "gemm"):
        kernel = getattr(cpu_amx, name)
        monkeypatch.setattr(cpu_amx, name, lambda *a, n=name, k=kernel, **kw: calls.append(n) or k(*a, **kw))
    holder = nn.Module()
    holder.text = layer  # the decoder's linears get tiles (`pack_linears`' tiles_under)
    pl.pack_linears(holder)
    assert layer.gate_up_proj.tiles is not None and layer.down_proj.tiles is not None
    fused = layer.finish(x, attn)
    assert calls.count("mlp") == 1  # the MLP's two products and the activation in one op
    torch.testing.assert_close(fused, plain, atol=0.05, rtol=2**-6)
    # the same bits as the two products apart (the activation in the first's blocks, its output rows copied in)
    residual = x + layer.o_proj(attn)
    middle = cpu_amx.gemm(
        rms_norm(residual, layer.post_attention_layernorm, 1e-5), layer.gate_up_proj.tiles, swiglu=True
    )
    assert torch.equal(fused, residual + cpu_amx.gemm(middle, layer.down_proj.tiles))
    calls.clear()
    monkeypatch.setattr(cpu_amx, "GEMM", False)  # --without prefill-tiles: oneDNN's products, then the activation
    torch.testing.assert_close(layer.finish(x, attn), fused, atol=0.05, rtol=2**-6)
    assert calls == []
    monkeypatch.setattr(cpu_amx, "GEMM", True)
    calls.clear()
    layer.finish(x[:8], attn[:8])  # a decode step's rows: the SwiGLU in one call, then the down product
    assert calls == []


@pytest.mark.parametrize(
    "rows,heads,kv_heads,dim,k",
    [
        (1024, 8, 8, 64, 512),
        (77, 4, 2, 64, 96),
        (49, 2, 1, 128, 256),
        (130, 3, 1, 128, 64),
        (33, 1, 1, 64, 32),
        (100, 4, 2, 32, 64),
        (3000, 2, 2, 64, 512),  # several blocks of rows
        (200, 4, 4, 128, 1024),  # K in passes
    ],
)
def test_a_prompts_qkv_rope_is_the_product_then_rotary_kv_bit_for_bit(rows, heads, kv_heads, dim, k):
    """`qkv_rope` (the product's blocks through RoPE and into the slots as they finish) against `gemm` then
    `cpu_paged.rotary_kv` on its rows: the same q, the same cache, every other slot untouched; GQA, head_dim 32, 64
    and 128, row counts off the 32-row blocks, several blocks of rows, K in passes, slots in any order."""
    from kernels import cpu_paged

    g = torch.Generator().manual_seed(rows)
    n = (heads + 2 * kv_heads) * dim
    x = torch.randn(rows, k, generator=g).bfloat16()
    tiles = cpu_amx.pack((torch.randn(n, k, generator=g) * 0.1).bfloat16())
    angles = torch.randn(rows, dim // 2, generator=g) * 3
    cos, sin = (torch.cat([f(angles)] * 2, dim=-1).bfloat16() for f in (torch.cos, torch.sin))
    block_size, blocks = 16, -(-rows // 16) + 3
    slots = torch.randperm(blocks * block_size, generator=g)[:rows]
    slot_blocks, slot_offsets = slots // block_size, slots % block_size
    cache = torch.randn(2, blocks, block_size, kv_heads, dim, generator=g).bfloat16()
    caches = [cache, cache.clone()]
    q = cpu_amx.qkv_rope(x, tiles, cos, sin, caches[0][0], caches[0][1], slot_blocks, slot_offsets, heads, kv_heads)
    expected = cpu_paged.rotary_kv(
        cpu_amx.gemm(x, tiles), cos, sin, caches[1][0], caches[1][1], slot_blocks, slot_offsets, heads, kv_heads
    )
    assert torch.equal(q, expected) and torch.equal(caches[0], caches[1])
    with pytest.raises(IndexError, match="outside the cache"):
        cpu_amx.qkv_rope(
            x, tiles, cos, sin, caches[0][0], caches[0][1], slot_blocks + blocks, slot_offsets, heads, kv_heads
        )
    assert torch.equal(caches[0], caches[1])  # nothing written then
    assert cpu_amx.qkv_rope_supports(tiles, dim, heads, kv_heads)
    assert not cpu_amx.qkv_rope_supports(tiles, dim, heads + 1, kv_heads)
