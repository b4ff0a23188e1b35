"""Every available paged-attention backend against a dense, unpaged attention computed from scratch."""

import pytest
import torch
import torch.nn.functional as F

from kernels import AttentionMetadata, available_backends, make_attention_backend, write_kv
from kernels.torch_ref import TorchPagedAttention, causal_attention

CUDA = torch.cuda.is_available()


def dense_reference(q, k, v, query_lens, seq_lens, scale):
    out, start, kv_start = [], 0, 0
    for qlen, slen in zip(query_lens, seq_lens):
        qi, ki, vi = q[start : start + qlen], k[kv_start : kv_start + slen], v[kv_start : kv_start + slen]
        groups = qi.shape[1] // ki.shape[1]
        ki, vi = ki.repeat_interleave(groups, 1), vi.repeat_interleave(groups, 1)
        scores = torch.einsum("qhd,khd->hqk", qi.float(), ki.float()) * scale
        allowed = torch.arange(slen)[None, :] <= torch.arange(slen - qlen, slen)[:, None]
        scores = scores.masked_fill(~allowed, float("-inf"))
        out.append(torch.einsum("hqk,khd->qhd", F.softmax(scores, -1), vi.float()))
        start, kv_start = start + qlen, kv_start + slen
    return torch.cat(out)


def build_case(device, dtype, heads=8, kv_heads=2, dim=32, block_size=16, seed=0):
    """Three decodes then two prefill chunks (one continuing a cached context), blocks scattered."""
    g = torch.Generator().manual_seed(seed)
    query_lens, seq_lens = [1, 1, 1, 37, 20], [5, 40, 17, 37, 50]
    num_blocks = 40
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, next_free = [], 0
    for slen in seq_lens:
        n = -(-slen // block_size)
        tables.append(perm[next_free : next_free + n])
        next_free += n
    k_all = torch.randn(sum(seq_lens), kv_heads, dim, generator=g)
    v_all = torch.randn(sum(seq_lens), kv_heads, dim, generator=g)
    q = torch.randn(sum(query_lens), heads, dim, generator=g)
    cache = torch.zeros(
        num_blocks, 3, 2, block_size, kv_heads, dim
    )  # [blocks, layers, k/v, ...] as the engine lays it out
    k_cache, v_cache = cache[:, 1, 0], cache[:, 1, 1]
    new_k, new_v, slot_b, slot_o, kv_start = [], [], [], [], 0
    for table, qlen, slen in zip(tables, query_lens, seq_lens):
        for p in range(slen):
            target = (table[p // block_size], p % block_size)
            if p >= slen - qlen:
                new_k.append(k_all[kv_start + p])
                new_v.append(v_all[kv_start + p])
                slot_b.append(target[0])
                slot_o.append(target[1])
            else:
                k_cache[target] = k_all[kv_start + p]
                v_cache[target] = v_all[kv_start + p]
        kv_start += slen
    width = max(len(t) for t in tables)
    meta = AttentionMetadata(
        num_decodes=3,
        query_lens=query_lens,
        seq_lens=seq_lens,
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=device),
        seq_lens_t=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        query_start_loc=torch.tensor([0] + query_lens, device=device).cumsum(0, dtype=torch.int32),
        slot_blocks=torch.tensor(slot_b, device=device),
        slot_offsets=torch.tensor(slot_o, device=device),
    )
    cache = cache.to(device, dtype)
    k_cache, v_cache = cache[:, 1, 0], cache[:, 1, 1]
    write_kv(torch.stack(new_k).to(device, dtype), torch.stack(new_v).to(device, dtype), k_cache, v_cache, meta)
    expected = dense_reference(q, k_all, v_all, query_lens, seq_lens, dim**-0.5)
    return q.to(device, dtype), k_cache, v_cache, meta, expected


def test_torch_reference_matches_dense_attention_on_scattered_blocks():
    q, k_cache, v_cache, meta, expected = build_case("cpu", torch.float32)
    out = make_attention_backend("torch", torch.device("cpu")).forward(q, k_cache, v_cache, meta, 32**-0.5)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_auto_picks_the_torch_reference_on_cpu_and_refuses_unavailable_backends():
    assert make_attention_backend("auto", torch.device("cpu")).name == "torch"
    assert available_backends(torch.device("cpu")) == ["torch"]
    with pytest.raises(ValueError, match="not available"):
        make_attention_backend("flash-attn", torch.device("cpu"))


def test_a_kernel_library_that_imports_but_cannot_run_is_reported_not_used(monkeypatch, caplog):
    """An xformers built for another torch imports, then fails at its first call: the probe says why, once."""
    import kernels

    class Broken:
        def forward(self, *args):
            raise NotImplementedError("No operator found for `memory_efficient_attention_forward`\nmore")

    monkeypatch.setattr(kernels, "_backend", lambda name: Broken() if name == "xformers" else TorchPagedAttention())
    probe = kernels._runs.__wrapped__
    assert probe("torch", "cpu") is None  # the tiny batch itself is valid
    assert probe("xformers", "cpu") == "NotImplementedError: No operator found for `memory_efficient_attention_forward`"
    assert "attention backend xformers is installed but does not run on cpu" in caplog.text


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("name", ["flash-attn", "xformers"])
@pytest.mark.parametrize("block_size", [16, 256])
def test_gpu_backend_matches_the_torch_reference(name, block_size):
    device = torch.device("cuda")
    if name not in available_backends(device):
        pytest.skip(f"{name} is not installed or does not run here")
    q, k_cache, v_cache, meta, expected = build_case(device, torch.bfloat16, block_size=block_size)
    ref = make_attention_backend("torch", device).forward(q, k_cache, v_cache, meta, 32**-0.5)
    out = make_attention_backend(name, device).forward(q, k_cache, v_cache, meta, 32**-0.5)
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(out.float().cpu(), expected, atol=3e-2, rtol=3e-2)


def varlen_reference(q, k, v, pack, scale):
    """The varlen kernel's contract on the CPU: each sequence's queries over its own packed context, causal from
    the bottom right (what FlashAttention-2 computes where a chunk is shorter than its context)."""
    out, cq, ck = torch.empty_like(q), pack.cu_q.tolist(), pack.cu_k.tolist()
    for i in range(len(cq) - 1):
        out[cq[i] : cq[i + 1]] = causal_attention(
            q[cq[i] : cq[i + 1]], k[ck[i] : ck[i + 1]], v[ck[i] : ck[i + 1]], scale
        )
    return out


def test_a_steps_prompt_chunks_pack_end_to_end_with_every_context_tokens_slot():
    q, k_cache, v_cache, meta, _ = build_case("cpu", torch.float32)
    pack = meta.packed(3, 16)
    assert meta.packed(3, 16) is pack  # built once a step
    assert (pack.first, pack.q_start, pack.max_q, pack.max_k) == (3, 3, 37, 50)
    assert pack.cu_q.tolist() == [0, 37, 57] and pack.cu_k.tolist() == [0, 37, 87]
    tables = meta.block_tables.tolist()
    want = [(tables[i][p // 16], p % 16) for i in (3, 4) for p in range(meta.seq_lens[i])]
    assert list(zip(pack.blocks.tolist(), pack.offsets.tolist())) == want
    whole = meta.packed(0, 16)
    assert whole.cu_q.tolist() == [0, 1, 2, 3, 40, 60] and whole.cu_k.tolist() == [0, 5, 45, 62, 99, 149]
    torch.testing.assert_close(whole.gather(k_cache)[62:], pack.gather(k_cache), rtol=0, atol=0)


def test_the_torch_reference_runs_a_steps_prompt_chunks_in_one_varlen_call_where_it_is_usable(monkeypatch):
    """The kernel is CUDA's; on the CPU its contract stands in for it: the packing, the rows each sequence's
    queries take and where their outputs land are what is tested."""
    from kernels import cpu_prompt, varlen

    q, k_cache, v_cache, meta, expected = build_case("cpu", torch.float32)
    calls = []
    monkeypatch.setattr(cpu_prompt, "ENABLED", False)  # (on the CPU the C prompt kernel takes these rows first)
    monkeypatch.setattr(varlen, "usable", lambda q, k_cache, tokens: tokens == 87)
    monkeypatch.setattr(varlen, "flash_varlen", lambda *a: calls.append(a[3]) or varlen_reference(*a))
    backend = TorchPagedAttention()
    for _ in range(2):  # two layers of one step: one pack
        out = backend.forward(q, k_cache, v_cache, meta, 32**-0.5)
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert len(calls) == 2 and calls[0] is calls[1] and calls[0].first == 3
    backend.varlen = False  # the per-chunk path, as `bench/engine.py --without prefill-varlen`
    torch.testing.assert_close(backend.forward(q, k_cache, v_cache, meta, 32**-0.5), expected, atol=1e-5, rtol=1e-5)
    assert len(calls) == 2


def test_the_varlen_kernel_is_probed_once_and_left_out_where_it_fails_or_differs(monkeypatch, caplog):
    from kernels import varlen

    probe = varlen._probe.__wrapped__
    assert probe("cpu", 4, 2, 64).startswith("NotImplementedError")  # torch's CPU build has no such kernel
    assert not varlen.usable(torch.zeros(1, 4, 64, dtype=torch.bfloat16), torch.zeros(1, 4, 2, 64), 1)
    monkeypatch.setattr(varlen, "flash_varlen", varlen_reference)
    assert probe("cpu", 4, 2, 64) is None and probe("cpu", 4, 4, 48) is None

    def top_left(q, k, v, pack, scale):  # causal from the top left: wrong for a chunk after a cached prefix
        out, cq, ck = torch.empty_like(q), pack.cu_q.tolist(), pack.cu_k.tolist()
        for i in range(len(cq) - 1):
            qh, kh, vh = (
                x.transpose(0, 1)[None] for x in (q[cq[i] : cq[i + 1]], k[ck[i] : ck[i + 1]], v[ck[i] : ck[i + 1]])
            )
            o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=True)
            out[cq[i] : cq[i + 1]] = o[0].transpose(0, 1)
        return out

    monkeypatch.setattr(varlen, "flash_varlen", top_left)
    assert probe("cpu", 4, 2, 64) == "ValueError: differs from plain attention"
    assert "varlen flash attention does not run on cpu with 4 heads (2 for K/V) of 64" in caplog.text


def test_the_flash_attn_backend_packs_every_context_for_its_varlen_call():
    """flash-attn's wheel is CUDA's; its varlen function's contract stands in for it (blocks of 16: every
    sequence, decodes included, goes through the packed call)."""
    from kernels.flash import FlashPagedAttention

    q, k_cache, v_cache, meta, expected = build_case("cpu", torch.float32)
    backend = object.__new__(FlashPagedAttention)

    def varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal):
        pack = meta.packed(0, 16)
        assert (cu_seqlens_q is pack.cu_q, cu_seqlens_k is pack.cu_k, max_seqlen_q, max_seqlen_k, causal) == (
            True,
            True,
            37,
            50,
            True,
        )
        return varlen_reference(q, k, v, pack, softmax_scale)

    backend._varlen = varlen_func
    torch.testing.assert_close(backend.forward(q, k_cache, v_cache, meta, 32**-0.5), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_on_a_gpu_the_varlen_kernel_runs_and_matches_one_call_per_chunk():
    from kernels import varlen

    device = torch.device("cuda")
    q, k_cache, v_cache, meta, expected = build_case(device, torch.bfloat16)
    assert varlen._probe(str(device), 8, 2, 32) is None
    assert varlen.usable(q, k_cache, 87) and not varlen.usable(q, k_cache, varlen.MAX_PACKED_TOKENS + 1)
    fast = TorchPagedAttention().forward(q, k_cache, v_cache, meta, 32**-0.5)
    slow = TorchPagedAttention(varlen=False).forward(q, k_cache, v_cache, meta, 32**-0.5)
    torch.testing.assert_close(fast.float(), slow.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(fast.float().cpu(), expected, atol=3e-2, rtol=3e-2)
