"""Prompt attention on the CPU in C (`cpu_prompt.c`), built on first use by the host's compiler (`cbuild`).

Every query row of a prompt (or its last n rows) against the prompt's own K/V: causal, aligned bottom-right, for
the text model's prompts (`kernels/torch_ref.py` `causal_attention`, the compiled prefill graph), or not, for the
vision tower. torch's fused CPU SDPA runs ~50–110 GFLOP/s on these shapes, where the cores do ~500 a core (bench/
README.md, "Prompt attention"); the kernel packs each kv head's keys once in the order the dot-product instruction
reads them and keeps 16 rows' scores and sums in registers. Its arithmetic is SDPA's (fp32 scores, fp32 softmax,
bf16 probabilities against bf16 values); only the order of the fp32 sums differs.

AVX-512 hosts (bf16 also needs AVX512_BF16), head_dim a multiple of 16 up to 256; `supports` says where it runs.
`attend` is what the model calls: on the CPU the op `epdmesh::prompt_attention`, which is the kernel where it runs
and SDPA (`sdpa`, the reference) elsewhere; on other devices SDPA. `ENABLED = False` keeps SDPA everywhere
(`bench/engine.py --without prompt-attention`; set it before the first compile: the compiled graphs guard on it).
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch
import torch.nn.functional as F

from kernels import cbuild
from kernels.ops import define

SOURCE = Path(__file__).with_name("cpu_prompt.c")
ENABLED = True


class _Shape(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_int64)
        for name in (
            "batch n len num_heads num_kv_heads head_dim causal q_batch q_tok q_head k_batch k_tok k_head "
            "v_batch v_tok v_head o_batch o_tok o_head"
        ).split()
    ] + [("scale", ctypes.c_float)]


@functools.cache
def _library() -> ctypes.CDLL | None:
    lib = cbuild.load(SOURCE, "CPU prompt attention stays torch's SDPA")
    if lib is None:
        return None
    for name in ("prompt_bf16", "prompt_f32", "prompt_supports"):
        getattr(lib, f"epdmesh_{name}").restype = ctypes.c_int
    lib.epdmesh_prompt_scratch.restype = ctypes.c_int64
    return lib


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
    if not supports(q):
        return sdpa(q, k, v, scale, causal).contiguous()
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    batch, n, heads, dim = q.shape
    length, kv_heads = k.shape[1], k.shape[2]
    if not (k.shape == v.shape and k.shape[0] == batch and k.shape[3] == dim and n <= length and heads % kv_heads == 0):
        raise ValueError(f"prompt_attention: q {tuple(q.shape)} against k {tuple(k.shape)}, v {tuple(v.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"prompt_attention: dtypes {q.dtype}, {k.dtype}, {v.dtype}")
    out = torch.empty(batch, n, heads, dim, dtype=q.dtype)
    if n == 0:
        return out
    shape = _Shape(
        batch, n, length, heads, kv_heads, dim, int(causal),
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *out.stride()[:3],
        scale,
    )  # fmt: skip
    lib = _library()
    bf16 = q.dtype == torch.bfloat16
    scratch = torch.empty(lib.epdmesh_prompt_scratch(ctypes.byref(shape), int(bf16)), dtype=torch.uint8)
    fn = lib.epdmesh_prompt_bf16 if bf16 else lib.epdmesh_prompt_f32
    ptr = ctypes.c_void_p
    if fn(ctypes.byref(shape), *(ptr(t.data_ptr()) for t in (q, k, v, out, scratch))) != 0:
        raise ValueError(f"prompt_attention: {q.dtype} with head_dim {dim} is not computed on this host")
    return out


def _like(q, *_):
    return q.new_empty(q.shape)


prompt_attention = define(
    "prompt_attention(Tensor q, Tensor k, Tensor v, float scale, bool causal) -> Tensor", _prompt_attention, _like
)
