"""Operators of our own (`torch.ops.epdmesh.*`), defined on a `torch.library.Library`.

Inductor calls such an op as it is, as an external kernel: our bf16 products (`common/model/packed_linear.py`), the
CPU decode attention (`kernels/cpu_paged.py`) and the K/V writes of a compiled step (`common/model/compiled.py`).
They are not `torch.library.custom_op`s: its Python wrapper costs ~14 µs a call more (37.6 against 23.7 µs for an
8×64 bf16 product, 2026-12-06), and a batch-8 decode step of the `small` preset calls 41 of them — 8.6 → ~7.2 ms a
step (bench/README.md, "Engine"). None has autograd: they serve inference only.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

_LIB = torch.library.Library("epdmesh", "FRAGMENT")


def define(schema: str, impl: Callable, fake: Callable) -> Callable:
    """`schema` as torch.library writes it (mutated tensors marked `Tensor(a!)`); `impl` runs it on every device;
    `fake` gives its output's shape and dtype to the compiler. Returns `torch.ops.epdmesh.<name>`."""
    name = schema.split("(", 1)[0]
    _LIB.define(schema)
    _LIB.impl(name, impl, "CompositeExplicitAutograd")
    torch.library.register_fake(f"epdmesh::{name}", fake, lib=_LIB)
    return getattr(torch.ops.epdmesh, name)
