"""The CPU decode-attention kernel in C against the torch reference it replaces, and how it is built."""

import ctypes
import os
import shutil
import subprocess
import sys

import pytest
import torch

from kernels import AttentionMetadata, cpu_paged
from kernels.torch_ref import TorchPagedAttention
from tests.kernels.test_attention import build_case

pytestmark = pytest.mark.skipif(not cpu_paged.available(), reason="no C compiler on this host")


def decode_case(dtype, num_seqs, heads, kv_heads, dim, seq_lens, block_size=16, seed=0):
    """Decodes only: random K/V in a 2-layer cache laid out as the engine's, blocks scattered over the cache."""
    g = torch.Generator().manual_seed(seed)
    widths = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(widths) + 3
    cache = torch.randn(num_blocks, 2, 2, block_size, kv_heads, dim, generator=g).to(dtype)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, taken = [], 0
    for w in widths:
        tables.append(perm[taken : taken + w] + [0] * (max(widths) + 1 - w))  # padded past the longest, as may be
        taken += w
    meta = AttentionMetadata(
        num_decodes=num_seqs,
        query_lens=[1] * num_seqs,
        seq_lens=list(seq_lens),
        block_tables=torch.tensor(tables, dtype=torch.int32),
        seq_lens_t=torch.tensor(seq_lens, dtype=torch.int32),
        query_start_loc=torch.arange(num_seqs + 1, dtype=torch.int32),
        slot_blocks=torch.zeros(num_seqs, dtype=torch.long),
        slot_offsets=torch.zeros(num_seqs, dtype=torch.long),
    )
    q = torch.randn(num_seqs, heads, dim, generator=g).to(dtype)
    return q, cache[:, 1, 0], cache[:, 1, 1], meta


SHAPES = [  # (sequences, heads, kv heads, head_dim, context lengths)
    (1, 8, 8, 64, [1]),
    (3, 8, 2, 32, [5, 40, 17]),
    (8, 8, 8, 64, [147, 16, 17, 300, 1, 64, 65, 100]),
    (2, 32, 32, 128, [600, 33]),
    (5, 12, 4, 80, [9, 31, 32, 33, 250]),
    (2, 4, 2, 24, [7, 70]),  # a head_dim that is not a multiple of 16: the portable loops in any build
]
BUILDS = [False, True]  # the host's build (AVX-512 lanes where it has them), the portable loops alone


def kernel(q, k, v, meta, scale, scalar):
    return cpu_paged._decode(q, k, v, meta.block_tables, meta.seq_lens_t, scale, scalar=scalar)


@pytest.mark.parametrize("scalar", BUILDS, ids=["host", "portable"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}seq-{s[1]}h-{s[2]}kv-d{s[3]}")
def test_bf16_is_the_reference_to_the_bit_but_for_sum_order(shape, scalar):
    """The same roundings as the reference (scores and probabilities to bf16, fp32 sums): only the order of the
    fp32 sums differs, so outputs agree to one bf16 step and almost all to the bit."""
    q, k, v, meta = decode_case(torch.bfloat16, *shape)
    scale = shape[3] ** -0.5
    ref = TorchPagedAttention._decode(q, k, v, meta, scale)
    out = kernel(q, k, v, meta, scale, scalar)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    diff = (out.float() - ref.float()).abs()
    # one bf16 ulp, about, of the value or of an eighth of its head's largest: where the sum nearly cancels, a score
    # that rounds to the other bf16 neighbour (its fp32 sum in another order: AMX and AVX512-BF16 products differ)
    # moves the output by a share of the terms, not of the small result
    magnitude = ref.float().abs()
    step = torch.maximum(magnitude, magnitude.amax(-1, keepdim=True) / 8).clamp_min(2**-20) * 2**-7
    assert (diff <= step * 1.01).all(), f"max diff {diff.max().item()}"
    assert (diff == 0).float().mean() >= 0.9


@pytest.mark.parametrize("scalar", BUILDS, ids=["host", "portable"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}seq-{s[1]}h-{s[2]}kv-d{s[3]}")
def test_fp32_matches_the_reference(shape, scalar):
    q, k, v, meta = decode_case(torch.float32, *shape)
    scale = shape[3] ** -0.5
    ref = TorchPagedAttention._decode(q, k, v, meta, scale)
    out = kernel(q, k, v, meta, scale, scalar)
    torch.testing.assert_close(out, ref, atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_layer_writes_its_new_rows_as_index_put_does_then_decodes_over_them(dtype):
    """`paged_decode_layer` writes the step's K/V rows into their slots in the kernel's call: the cache ends as two
    index_puts leave it, the output is the decode over that cache, and k/v may be strided views (a fused qkv)."""
    g = torch.Generator().manual_seed(3)
    blocks, layers, bs, kv, dim, lens = 12, 3, 16, 2, 32, [5, 17, 33]
    cache = torch.randn(blocks, layers, 2, bs, kv, dim, generator=g).to(dtype)
    tables = torch.tensor([[4, 0, 0], [7, 2, 0], [1, 9, 11]], dtype=torch.int32)
    slot_blocks = torch.tensor([4, 2, 11])  # each sequence's last position
    slot_offsets = torch.tensor([4, 0, 0])
    fused = torch.randn(3, 3 * kv * dim, generator=g).to(dtype)  # q, k and v of 3 tokens side by side
    q, k, v = (fused[:, i * kv * dim : (i + 1) * kv * dim].view(3, kv, dim) for i in range(3))
    assert k.stride(0) == 3 * kv * dim  # not contiguous
    expected = cache.clone()
    expected[:, 1, 0][slot_blocks, slot_offsets] = k
    expected[:, 1, 1][slot_blocks, slot_offsets] = v
    lens_t = torch.tensor(lens, dtype=torch.int32)
    want = cpu_paged.paged_decode(q, expected[:, 1, 0], expected[:, 1, 1], tables, lens_t, 0.2)
    got = torch.ops.epdmesh.paged_decode_layer(q, k, v, cache, 1, slot_blocks, slot_offsets, tables, lens_t, 0.2)
    assert torch.equal(cache, expected) and torch.equal(got, want)

    before = cache.clone()
    with pytest.raises(IndexError, match="outside the cache"):
        torch.ops.epdmesh.paged_decode_layer(
            q, k, v, cache, 1, torch.tensor([4, 2, 12]), slot_offsets, tables, lens_t, 0.2
        )
    assert torch.equal(cache, before)  # nothing written


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n, kv, dim", [(37, 2, 32), (300, 4, 64)], ids=["one-thread", "threads"])
def test_a_prompts_rows_are_written_by_memcpy_as_index_put_writes_them(dtype, n, kv, dim):
    """`write_rows` (what a prefill's K/V writes go through on the CPU): the cache ends bit for bit as index_put
    leaves it, from strided k/v (a fused qkv) into scattered blocks of a whole cache's layer — on the calling
    thread, and over OpenMP's threads from 64 KiB of rows up; a slot outside the cache writes nothing and raises;
    fewer than 16 rows, or two caches of different shapes, are left to the caller (False, nothing written)."""
    g = torch.Generator().manual_seed(5)
    blocks, layers, bs = -(-n // 16) + 6, 2, 16
    cache = torch.randn(blocks, layers, 2, bs, kv, dim, generator=g).to(dtype)
    table = torch.randperm(blocks - 1, generator=g)[: -(-n // 16)] + 1  # scattered, block 0 unused
    slot_blocks, slot_offsets = table[torch.arange(n) // bs], torch.arange(n) % bs
    fused = torch.randn(n, 3 * kv * dim, generator=g).to(dtype)
    k, v = (fused[:, i * kv * dim : (i + 1) * kv * dim].view(n, kv, dim) for i in (1, 2))
    expected = cache.clone()
    expected[:, 1, 0][slot_blocks, slot_offsets] = k
    expected[:, 1, 1][slot_blocks, slot_offsets] = v
    assert cpu_paged.write_rows(k, v, cache[:, 1, 0], cache[:, 1, 1], slot_blocks, slot_offsets)
    assert torch.equal(cache, expected)

    before = cache.clone()
    with pytest.raises(IndexError, match="outside the cache"):
        cpu_paged.write_rows(k, v, cache[:, 0, 0], cache[:, 0, 1], slot_blocks + (blocks - table.max()), slot_offsets)
    assert torch.equal(cache, before)
    assert not cpu_paged.write_rows(k[:15], v[:15], cache[:, 0, 0], cache[:, 0, 1], slot_blocks[:15], slot_offsets[:15])
    assert not cpu_paged.write_rows(k, v, cache[:, 0, 0], cache[:-1, 0, 1], slot_blocks, slot_offsets)
    assert torch.equal(cache, before)


@pytest.mark.skipif(not cpu_paged.rotary_kv_supported(torch.bfloat16, 32), reason="needs the AVX-512 build")
@pytest.mark.parametrize("heads,kv,dim,n", [(8, 2, 32, 300), (4, 4, 64, 17), (8, 8, 128, 1)])
def test_a_prompts_rope_and_kv_write_in_one_pass_are_apply_rotary_and_write_slots(heads, kv, dim, n):
    """`rotary_kv`: q with RoPE as `apply_rotary` computes it compiled (fp32, rounded once) — bit for bit — and K
    with RoPE, V as they are, in their slots; every other slot untouched."""
    from common.model.layers import apply_rotary

    g = torch.Generator().manual_seed(n * dim + kv)
    width = (heads + 2 * kv) * dim
    qkv = torch.randn(n, width + 64, generator=g).bfloat16()[:, :width]  # rows apart: a view of a wider output
    cos, sin = (torch.randn(n, dim, generator=g).bfloat16() for _ in range(2))
    k_cache = torch.randn(40, 16, kv, dim, generator=g).bfloat16()
    v_cache, before = torch.randn_like(k_cache), k_cache.clone()
    slots = torch.randperm(40 * 16, generator=g)[:n]
    blocks, offsets = slots // 16, slots % 16
    v_before = v_cache.clone()
    q = cpu_paged.rotary_kv(qkv, cos, sin, k_cache, v_cache, blocks, offsets, heads, kv)
    q_rows, k_rows, v_rows = qkv.float().split([heads * dim, kv * dim, kv * dim], dim=-1)
    assert torch.equal(q, apply_rotary(q_rows.view(n, heads, dim), cos.float(), sin.float()).bfloat16())
    assert torch.equal(
        k_cache[blocks, offsets], apply_rotary(k_rows.view(n, kv, dim), cos.float(), sin.float()).bfloat16()
    )
    assert torch.equal(v_cache[blocks, offsets], v_rows.bfloat16().view(n, kv, dim))
    untouched = torch.ones(40, 16, dtype=torch.bool)
    untouched[blocks, offsets] = False
    assert torch.equal(k_cache[untouched], before[untouched]) and torch.equal(v_cache[untouched], v_before[untouched])
    with pytest.raises(IndexError, match="outside the cache"):
        cpu_paged.rotary_kv(qkv, cos, sin, k_cache, v_cache, blocks + 40, offsets, heads, kv)
    assert torch.equal(v_cache[untouched], v_before[untouched])
    assert not cpu_paged.rotary_kv_supported(torch.float32, 32) and not cpu_paged.rotary_kv_supported(
        torch.bfloat16, 48
    )


def test_the_backend_decodes_through_it_and_matches_dense_attention_with_prefills_beside():
    q, k_cache, v_cache, meta, expected = build_case("cpu", torch.float32)
    with_c = TorchPagedAttention().forward(q, k_cache, v_cache, meta, 32**-0.5)
    without = TorchPagedAttention(use_c=False).forward(q, k_cache, v_cache, meta, 32**-0.5)
    torch.testing.assert_close(with_c, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(with_c, without, atol=2e-6, rtol=2e-6)


def test_a_head_dim_beyond_the_kernel_stays_in_torch():
    q, k, v, meta = decode_case(torch.float32, 2, 2, 1, 288, [20, 3])
    assert not cpu_paged.supports(q, k)
    out = TorchPagedAttention().forward(q, k, v, meta, 288**-0.5)
    torch.testing.assert_close(out, TorchPagedAttention._decode(q, k, v, meta, 288**-0.5))
    with pytest.raises(ValueError, match="head_dim 288"):
        cpu_paged.paged_decode(q, k, v, meta.block_tables, meta.seq_lens_t, 288**-0.5)


def test_it_runs_inside_a_compiled_graph():
    q, k, v, meta = decode_case(torch.bfloat16, 4, 8, 2, 64, [10, 50, 3, 33])

    def step(q, k, v, tables, lens):
        return torch.ops.epdmesh.paged_decode(q * 2, k, v, tables, lens, 0.125) + 1

    compiled = torch.compile(step, dynamic=True)
    expected = step(q, k, v, meta.block_tables, meta.seq_lens_t)
    torch.testing.assert_close(compiled(q, k, v, meta.block_tables, meta.seq_lens_t), expected, atol=0, rtol=0)


def test_built_once_into_the_users_cache_and_refused_without_a_compiler(tmp_path):
    """A fresh cache builds the library; a second process reuses it; with no working compiler attention stays the
    torch reference, with a warning."""
    probe = (
        "import logging, sys; logging.basicConfig(level=logging.WARNING)\n"
        "from kernels import cbuild, cpu_paged\n"
        "print(cpu_paged.available(), sorted(p.name for p in cbuild.cache_dir().glob('cpu_paged-*.so')))\n"
    )
    env = dict(os.environ, EPDMESH_HOME=str(tmp_path))
    runs = [subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True) for _ in range(2)]
    assert [r.returncode for r in runs] == [0, 0], runs[0].stderr
    first, second = (r.stdout.split(" ", 1) for r in runs)
    assert first[0] == second[0] == "True" and first[1] == second[1] and ".so" in first[1]
    broken = subprocess.run(
        [sys.executable, "-c", probe],
        env=dict(env, CC="/bin/false", EPDMESH_HOME=str(tmp_path / "other")),
        capture_output=True,
        text=True,
    )
    assert broken.returncode == 0 and broken.stdout.startswith("False")
    assert "building cpu_paged.c failed (CPU decode attention stays the torch reference)" in broken.stderr


def test_a_changed_header_is_a_new_build(tmp_path, monkeypatch):
    """The build is keyed by the headers of ours a source includes: a kernel whose shared header changed is built
    again, not taken from the cache."""
    from kernels import cbuild

    monkeypatch.setenv("EPDMESH_HOME", str(tmp_path))
    (tmp_path / "k.h").write_text("#define VALUE 1\n")
    source = tmp_path / "k.c"
    source.write_text('#include "k.h"\nint value(void) { return VALUE; }\n')
    assert cbuild.included(source.read_bytes()) == ["k.h"]
    compiler = os.environ.get("CC") or shutil.which("cc") or "gcc"
    first = cbuild.build(source, compiler)
    (tmp_path / "k.h").write_text("#define VALUE 2\n")
    second = cbuild.build(source, compiler)
    assert first != second and first.is_file() and second.is_file()
    assert ctypes.CDLL(str(first)).value() == 1 and ctypes.CDLL(str(second)).value() == 2


def test_every_header_a_kernel_includes_is_installed_with_it():
    """`pip install .` (the Docker image) ships only the files pyproject.toml's package data names: a kernel whose
    header stays behind fails to build there and its caller falls back."""
    import fnmatch
    import tomllib
    from pathlib import Path

    from kernels import cbuild

    root = Path(cbuild.__file__).parent
    shipped = tomllib.loads((root.parent / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    patterns = shipped["kernels"]
    sources = sorted(root.glob("*.c"))
    headers = {h for s in sources for h in cbuild.included(s.read_bytes())}
    assert sources and {"cpu_vec.h", "cpu_tiles.h"} <= headers
    for name in [s.name for s in sources] + sorted(headers):
        assert any(fnmatch.fnmatch(name, p) for p in patterns), f"{name} is not in the package data {patterns}"
