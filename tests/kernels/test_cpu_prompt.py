"""The CPU prompt-attention kernel in C against torch's SDPA (the reference it replaces), and where it runs."""

import threading

import pytest
import torch

from kernels import cpu_prompt
from kernels.scratch import scratch
from kernels.torch_ref import TorchPagedAttention, causal_attention

pytestmark = pytest.mark.skipif(
    not cpu_prompt.supports(torch.empty(1, 64)), reason="no AVX-512 on this host (or no C compiler)"
)
BF16 = cpu_prompt.supports(torch.empty(1, 64, dtype=torch.bfloat16))
TILES = BF16 and cpu_prompt.use_tiles(True)  # bf16 on the AMX tiles (head_dim % 32 == 0)


@pytest.fixture(params=["tiles", "vectors"])
def units(request):
    """bf16's products on the AMX tiles, then on the vector units (where the host has no AMX, only the latter)."""
    tiles = request.param == "tiles"
    if tiles and not TILES:
        pytest.skip("no AMX on this host")
    assert cpu_prompt.use_tiles(tiles) == tiles
    yield request.param
    cpu_prompt.use_tiles(True)


SHAPES = [  # (batch, query rows, keys, heads, kv heads, head_dim, causal)
    (1, 128, 128, 8, 8, 64, True),  # a whole prompt
    (1, 5, 37, 8, 2, 64, True),  # the last rows of a prompt whose first ones are cached; GQA
    (3, 17, 17, 2, 1, 16, True),  # a row past a block of 16; keys not a multiple of 16
    (1, 1, 300, 4, 4, 128, True),  # one row
    (1, 100, 700, 4, 4, 32, True),
    (2, 50, 50, 6, 6, 48, False),  # the vision tower: every row sees every key, several images
    (1, 257, 257, 4, 4, 64, False),
    (2, 33, 45, 4, 2, 96, True),  # two tiles of rows' worth of keys past a cached prefix; dims in 64 + 32
]


def case(shape, dtype, seed=0):
    """q, k, v as the model makes them: views of one projection's output [batch, tokens, 3, heads, dim] (strided
    across tokens); for GQA, k and v from a separate [batch, keys, 2, kv_heads, dim]."""
    batch, n, length, heads, kv_heads, dim, _ = shape
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, n, 3, heads, dim, generator=g).to(dtype)[:, :, 1]
    kv = torch.randn(batch, length, 2, kv_heads, dim, generator=g).to(dtype)
    return q, kv[:, :, 0], kv[:, :, 1]


def scale_of(shape):
    return shape[5] ** -0.5


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_fp32_is_sdpa_but_for_the_order_of_its_sums(shape):
    q, k, v = case(shape, torch.float32)
    causal = shape[-1]
    out = cpu_prompt.prompt_attention(q, k, v, scale_of(shape), causal)
    torch.testing.assert_close(out, cpu_prompt.sdpa(q, k, v, scale_of(shape), causal), atol=2e-6, rtol=1e-5)
    assert out.is_contiguous() and out.shape == q.shape


@pytest.mark.skipif(not BF16, reason="no AVX512_BF16 on this host")
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_bf16_is_as_close_to_exact_as_sdpa(shape, units):
    """Both round the probabilities to bf16 before their product with V and the output once: against attention
    computed in fp32 from the same bf16 inputs, the kernel's error is SDPA's, and the two differ by a rounding."""
    q, k, v = case(shape, torch.bfloat16, seed=1)
    causal, scale = shape[-1], scale_of(shape)
    out = cpu_prompt.prompt_attention(q, k, v, scale, causal).float()
    ref = cpu_prompt.sdpa(q, k, v, scale, causal).float()
    exact = cpu_prompt.sdpa(q.float(), k.float(), v.float(), scale, causal)
    assert (out - exact).abs().max() <= 1.25 * (ref - exact).abs().max() + 1e-4
    torch.testing.assert_close(out, ref, atol=2e-3, rtol=2 * 2**-8)


@pytest.mark.skipif(not TILES, reason="no AMX on this host")
def test_tiles_and_vectors_differ_in_few_outputs_by_a_rounding():
    """The same arithmetic on either unit (fp32 scores and sums, bf16 probabilities): only the order of the fp32
    sums differs, which flips a probability's or an output's bf16 rounding now and then — in a few outputs, by a
    rounding's worth — and shows that the tiles did run."""
    q, k, v = case((1, 200, 200, 4, 4, 64, True), torch.bfloat16, seed=2)
    outs = []
    for tiles in (True, False):
        cpu_prompt.use_tiles(tiles)
        outs.append(cpu_prompt.prompt_attention(q, k, v, 0.125, True).float())
    cpu_prompt.use_tiles(True)
    differ = (outs[0] != outs[1]).float().mean()
    assert 0 < differ < 0.01
    torch.testing.assert_close(outs[0], outs[1], atol=1e-3, rtol=2**-7)


def test_causal_rows_see_no_later_key():
    """A later key changed to anything leaves every earlier row's output as it was."""
    q, k, v = case((1, 40, 40, 2, 2, 32, True), torch.float32)
    before = cpu_prompt.prompt_attention(q, k, v, 0.2, True)
    k2, v2 = k.clone(), v.clone()
    k2[:, 30:], v2[:, 30:] = 1e4, -1e4
    after = cpu_prompt.prompt_attention(q, k2, v2, 0.2, True)
    assert torch.equal(after[:, :30], before[:, :30]) and not torch.equal(after[:, 30:], before[:, 30:])


def test_causal_attention_runs_the_kernel_and_falls_back_to_sdpa(monkeypatch):
    """On the CPU `causal_attention` is the kernel; with `ENABLED` off, or a dtype it does not compute, SDPA's own
    result; a bad shape is a clear error."""
    q, k, v = case((1, 9, 20, 4, 2, 32, True), torch.float32)
    qt, kt, vt = q[0], k[0], v[0]
    ours = causal_attention(qt, kt, vt, 0.3)
    sdpa = cpu_prompt.sdpa(q, k, v, 0.3, True)[0]
    assert torch.equal(ours, cpu_prompt.prompt_attention(q, k, v, 0.3, True)[0]) and not torch.equal(ours, sdpa)
    monkeypatch.setattr(cpu_prompt, "ENABLED", False)
    assert torch.equal(causal_attention(qt, kt, vt, 0.3), sdpa)
    half = [t.half() for t in (q, k, v)]
    assert torch.equal(cpu_prompt.prompt_attention(*half, 0.3, True), cpu_prompt.sdpa(*half, 0.3, True))
    with pytest.raises(ValueError, match="prompt_attention"):
        cpu_prompt.prompt_attention(q, k[:, :5], v[:, :5], 0.3, True)  # more query rows than keys
    with pytest.raises(ValueError, match="contiguous int32"):  # the paged call's index tensors as given
        tables = torch.arange(20)[None]  # int64
        cpu_prompt.paged_prompt_attention(qt, kt[:, None], vt[:, None], tables, *int32([0, 9], [20]), 0.3)
    assert cpu_prompt.prompt_attention(q[:, :0], k, v, 0.3, True).shape == (1, 0, 4, 32)  # no rows: nothing to do
    # the kernel takes a row's largest score before scaling it: a scale not above 0 is SDPA's, or an error in place
    assert torch.equal(cpu_prompt.prompt_attention(q, k, v, -0.3, True), cpu_prompt.sdpa(q, k, v, -0.3, True))
    paged = (kt[:, None], vt[:, None], torch.arange(20, dtype=torch.int32)[None])
    with pytest.raises(ValueError, match="more query rows than keys"):
        cpu_prompt.paged_prompt_attention(qt, *paged, *int32([0, 9], [5]), 0.3)
    with pytest.raises(ValueError, match="one more than sequences"):
        cpu_prompt.paged_prompt_attention(qt, *paged, *int32([0, 4, 9], [20]), 0.3)
    with pytest.raises(ValueError, match="scale must be positive"):
        cpu_prompt.paged_prompt_attention(qt, *paged, *int32([0, 9], [20]), 0.0)
    strided = qt.transpose(1, 2).contiguous().transpose(1, 2)  # head_dim not contiguous: copied, not misread
    expected = cpu_prompt.paged_prompt_attention(qt, *paged, *int32([0, 9], [20]), 0.3)
    assert torch.equal(cpu_prompt.paged_prompt_attention(strided, *paged, *int32([0, 9], [20]), 0.3), expected)


def int32(*lists):
    return [torch.tensor(x, dtype=torch.int32) for x in lists]


def test_the_op_in_a_compiled_graph_is_the_kernel():
    q, k, v = case((2, 33, 33, 4, 4, 32, False), torch.float32)
    compiled = torch.compile(lambda q, k, v: cpu_prompt.attend(q, k, v, 0.25, False) * 2, fullgraph=True)
    assert torch.equal(compiled(q, k, v), cpu_prompt.prompt_attention(q, k, v, 0.25, False) * 2)


def test_a_vision_layer_attends_through_the_kernel(monkeypatch):
    """CLIP's attention (every patch sees every patch) is the kernel's on the CPU: counted calls, and its output
    matches SDPA's layer within fp32 sums."""
    from common.model.clip import VisionLayer
    from common.model.config import VisionConfig

    cfg = VisionConfig(64, 128, 1, 4, 56, 14, 3, 1e-5, "quick_gelu")
    torch.manual_seed(0)
    layer = VisionLayer(cfg).eval()
    x = torch.randn(2, 17, 64)
    calls, library = [], cpu_prompt._library

    class Counting:
        def __getattr__(self, name):
            calls.append(name)
            return getattr(library(), name)

    monkeypatch.setattr(cpu_prompt, "_library", Counting)
    with torch.inference_mode():
        ours = layer(x)
        assert calls.count("epdmesh_prompt_f32") == 1
        monkeypatch.setattr(cpu_prompt, "ENABLED", False)
        sdpa = layer(x)
    assert calls.count("epdmesh_prompt_f32") == 1
    torch.testing.assert_close(ours, sdpa, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "dtype", [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.skipif(not BF16, reason="no AVX512_BF16"))]
)
@pytest.mark.parametrize("heads, kv_heads, dim, block_size", [(8, 2, 32, 16), (4, 4, 64, 32), (6, 3, 16, 8)])
@pytest.mark.parametrize("enabled", [True, False], ids=["kernel", "sdpa"])
def test_a_steps_prompt_chunks_in_one_call_read_the_paged_cache_in_place(
    dtype, heads, kv_heads, dim, block_size, enabled, monkeypatch, units
):
    """Decodes, then two chunks (one after a cached prefix), blocks scattered: the torch backend's prompt rows are the
    kernel's paged call — one per layer — and match attention computed densely from scratch; with `ENABLED` off,
    SDPA per chunk on gathered copies does."""
    from tests.kernels.test_attention import build_case

    q, k_cache, v_cache, meta, expected = build_case("cpu", dtype, heads, kv_heads, dim, block_size)
    calls = []
    paged = cpu_prompt.paged_prompt_attention

    def counted(*args):
        calls.append(args[0].shape[0])
        return paged(*args)

    monkeypatch.setattr(cpu_prompt, "paged_prompt_attention", counted)
    monkeypatch.setattr(cpu_prompt, "ENABLED", enabled)
    out = TorchPagedAttention().forward(q, k_cache, v_cache, meta, dim**-0.5)
    assert calls == ([sum(meta.query_lens[meta.num_decodes :])] if enabled else [])
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(out.float(), expected, **tol)


def test_the_scratch_is_kept_per_thread_and_grows():
    """One buffer a thread, shared by the prompt kernel and the prompts' products (`kernels.scratch`)."""
    first = scratch(1000)
    assert scratch(500).data_ptr() == first.data_ptr()
    assert scratch(10**6).numel() >= 10**6 and scratch(10).numel() >= 10**6
    other = []
    thread = threading.Thread(target=lambda: other.append(scratch(10).numel()))
    thread.start(), thread.join()
    assert other == [10]
