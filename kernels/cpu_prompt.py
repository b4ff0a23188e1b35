"""Prompt attention on the CPU in C (`cpu_prompt.c`), built on first use by the host's compiler (`cbuild`).

Every query row of a prompt (or its last n rows) against the prompt's own K/V: causal, aligned bottom-right, for
the text model's prompts, or not, for the vision tower. `prompt_attention` takes a batch of equal-length sequences
in tensors (`causal_attention` of `kernels/torch_ref.py`, the compiled prefill graph, the vision tower);
`paged_prompt_attention` a step's prompt chunks at once, their K/V read in place from the paged cache (the torch
backend's prefill rows). torch's fused CPU SDPA runs ~50–110 GFLOP/s on these shapes, where the cores do ~500 a
core (bench/README.md, "Prompt attention in C"); the kernel packs each kv head's keys once in the order the
dot-product instruction reads them and keeps 16 rows' scores and sums in registers. Its arithmetic is SDPA's
(fp32 scores, fp32 softmax, bf16 probabilities against bf16 values); only the order of the fp32 sums differs.

AVX-512 hosts (bf16 also needs AVX512_BF16), head_dim a multiple of 16 up to 256; `supports` says where it runs.
`attend` is what the model calls: on the CPU the op `epdmesh::prompt_attention`, which is the kernel where it runs
and SDPA (`sdpa`, the reference) elsewhere; on other devices SDPA. `ENABLED = False` keeps SDPA everywhere
(`serve --no-prompt-kernel`, `bench/engine.py --without prompt-attention`; set before the first compile: the
compiled graphs guard on it).
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch
import torch.nn.functional as F

from kernels import cbuild
from kernels.ops import define
from kernels.scratch import scratch as kept_scratch

SOURCE = Path(__file__).with_name("cpu_prompt.c")
ENABLED = True
TILES = True  # bf16 products on the AMX tiles where the host has them (`use_tiles`)


_Shape = cbuild.shape_struct(
    "_Shape",
    "num_seqs num_heads num_kv_heads head_dim causal block_size table_width threads q_tok q_head o_tok o_head "
    "k_block k_token k_head v_block v_token v_head",
)


@functools.cache
def _library() -> ctypes.CDLL | None:
    lib = cbuild.load(SOURCE, "CPU prompt attention stays torch's SDPA")
    if lib is None:
        return None
    for name in ("prompt_bf16", "prompt_f32", "prompt_supports", "prompt_tiles"):
        getattr(lib, f"epdmesh_{name}").restype = ctypes.c_int
    lib.epdmesh_prompt_scratch.restype = ctypes.c_int64
    lib.epdmesh_prompt_tiles(int(TILES))
    return lib


def use_tiles(want: bool) -> bool:
    """bf16 prompts on the AMX tiles where the host has them (the default) or on the vector units; returns whether
    they now run on the tiles. For A/B runs (`bench/prompt_attention.py`, `bench/engine.py --without prompt-tiles`)."""
    global TILES
    TILES = want
    lib = _library()
    return lib is not None and bool(lib.epdmesh_prompt_tiles(int(want)))


@functools.cache
def _runs(bf16: bool, head_dim: int) -> bool:
    lib = _library()
    return lib is not None and bool(lib.epdmesh_prompt_supports(int(bf16), head_dim))


def supports(q: torch.Tensor) -> bool:
    """Whether the kernel computes attention for q [..., head_dim] on this host: CPU, bf16 (with AVX512_BF16) or
    fp32 (AVX-512), head_dim a multiple of 16 up to 256."""
    return (
        q.device.type == "cpu"
        and q.dtype in (torch.bfloat16, torch.float32)
        and _runs(q.dtype == torch.bfloat16, q.shape[-1])
    )


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool, whole: bool | None = None
) -> torch.Tensor:
    """q [batch, n, heads, head_dim]; k, v [batch, len, kv_heads, head_dim], n ≤ len; `causal`: row i sees keys up
    to len − n + i → out [batch, n, heads, head_dim]. `whole`: n == len is known (SDPA's causal flag in a compiled
    graph, where the sizes are symbols)."""
    if q.device.type == "cpu" and ENABLED:
        return prompt_attention(q, k, v, scale, causal)
    return sdpa(q, k, v, scale, causal, whole)


def sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool, whole: bool | None = None
) -> torch.Tensor:
    """`attend` through torch's SDPA: the reference, and what runs where the kernel does not."""
    # heads first, with a batch dimension: SDPA takes its fused CPU kernel (3-D inputs fall back to the math path)
    qh, kh, vh = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    gqa = kh.shape[1] != qh.shape[1]
    n, length = q.shape[1], k.shape[1]
    if not causal or (whole if whole is not None else n == length):
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=causal, scale=scale, enable_gqa=gqa)
    else:
        rows = torch.arange(length - n, length, device=q.device)[:, None]
        mask = torch.arange(length, device=q.device)[None, :] <= rows
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=gqa)
    return out.transpose(1, 2)


def _prompt_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool) -> torch.Tensor:
    """`attend` on the CPU: the kernel where it runs (head_dim contiguous, other strides any; out contiguous), else
    `sdpa`."""
    if not supports(q) or not scale > 0:  # (the kernel takes a row's largest score before scaling it)
        return sdpa(q, k, v, scale, causal).contiguous()
    batch, n, heads, dim = q.shape
    length, kv_heads = k.shape[1], k.shape[2]
    if not (k.shape == v.shape and k.shape[0] == batch and k.shape[3] == dim and n <= length and heads % kv_heads == 0):
        raise ValueError(f"prompt_attention: q {tuple(q.shape)} against k {tuple(k.shape)}, v {tuple(v.shape)}")
    if n == 0:
        return q.new_empty(q.shape)
    if q.stride(-1) != 1 or (batch > 1 and q.stride(0) != n * q.stride(1)):  # the kernel's q: rows one after another
        q = q.contiguous()
    k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (k, v))
    out = _call(q.flatten(0, 1), k, v, *_as_blocks(batch, n, length), length, scale, causal)
    return out.view(batch, n, heads, dim)


@functools.lru_cache(maxsize=64)
def _as_blocks(batch: int, n: int, length: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Equal sequences in tensors as a paged cache of one block a sequence (K/V [batch, length, kv_heads, dim]):
    their query starts, lengths and block tables (made once per shape: a call at 128 tokens takes ~60 µs)."""
    with torch.inference_mode(False):  # (kept across calls, in inference mode or not)
        starts = torch.arange(0, (batch + 1) * n, n, dtype=torch.int32)
        return starts, torch.full((batch,), length, dtype=torch.int32), torch.arange(batch, dtype=torch.int32)[:, None]


def _paged_prompt_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_starts: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """A step's prompt chunks at once, causal: q [tokens, heads, head_dim], sequence i's rows [query_starts[i],
    query_starts[i + 1]) counted from query_starts[0] (a step's offsets past its decodes serve as they are), the
    last of its seq_lens[i] keys, which lie in the caches ([blocks, block_size, kv_heads, head_dim], head_dim
    contiguous) at block_tables[i] (int32) → out like q. Read in place: no gathered copies."""
    assert supports(q) and k_cache.stride(-1) == v_cache.stride(-1) == 1
    if not query_starts.shape[0] == seq_lens.shape[0] + 1 == block_tables.shape[0] + 1:
        raise ValueError(
            f"paged_prompt_attention: {query_starts.shape[0]} query starts, {seq_lens.shape[0]} lengths and "
            f"{block_tables.shape[0]} block tables (starts: one more than sequences)"
        )
    q = q if q.stride(-1) == 1 else q.contiguous()
    return _call(q, k_cache, v_cache, query_starts, seq_lens, block_tables, k_cache.shape[1], scale, True)


def _call(q, k, v, starts, lens, tables, block_size: int, scale: float, causal: bool) -> torch.Tensor:
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"prompt_attention: dtypes {q.dtype}, {k.dtype}, {v.dtype}")
    for t in (starts, lens, tables):  # (checked, not converted: a conversion a call costs µs at 128 tokens)
        if t.dtype != torch.int32 or not t.is_contiguous():
            raise ValueError(
                f"prompt_attention: query starts, lengths and block tables in contiguous int32, not {t.dtype}"
            )
    out = torch.empty(q.shape, dtype=q.dtype)
    if q.shape[0] == 0:
        return out
    shape = _Shape(
        lens.shape[0], q.shape[1], k.shape[2], q.shape[2], int(causal), block_size, tables.shape[1], 0,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), *k.stride()[:3], *v.stride()[:3],
        scale,
    )  # fmt: skip
    lib = _library()
    bf16 = q.dtype == torch.bfloat16
    ptr = ctypes.c_void_p
    seqs = [ptr(t.data_ptr()) for t in (starts, lens, tables)]
    scratch = kept_scratch(lib.epdmesh_prompt_scratch(ctypes.byref(shape), seqs[1], int(bf16)))
    fn = lib.epdmesh_prompt_bf16 if bf16 else lib.epdmesh_prompt_f32
    rc = fn(ctypes.byref(shape), *seqs, *(ptr(t.data_ptr()) for t in (q, k, v, out, scratch)))
    if rc == -2:
        raise ValueError("prompt_attention: a sequence has more query rows than keys (or its rows out of order)")
    if rc == -3:
        raise ValueError(f"prompt_attention: the scale must be positive, not {scale}")
    if rc != 0:
        raise ValueError(f"prompt_attention: {q.dtype} with head_dim {q.shape[2]} is not computed on this host")
    return out


def _like(q, *_):
    return q.new_empty(q.shape)


prompt_attention = define(
    "prompt_attention(Tensor q, Tensor k, Tensor v, float scale, bool causal) -> Tensor", _prompt_attention, _like
)
paged_prompt_attention = define(
    "paged_prompt_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor query_starts,"
    " Tensor seq_lens, float scale) -> Tensor",
    _paged_prompt_attention,
    _like,
)
