"""Opaque ops: ``torch.ops.fused_kernels.<name>`` entries that torch.compile calls as they are, without tracing
into them.

A registered ``triton_op`` is traced into the compiled graph, and so is whatever its implementation calls. That is
what the Triton kernels want, but not the twin (``reference/``), which CPU tensors without the interpreter and
float64 tensors run: its loops read tensor values on the host (which blocks a mask skips, each sequence's length,
the dropout seed), which a trace cannot do, and its Philox in integer torch ops takes inductor minutes to lower.
So a family's implementation, once it knows that a traced call takes the twin, calls an opaque op instead, whose
implementation runs the twin eagerly when the compiled graph runs. The same holds for ops that must run eagerly on
any device (the KV-cache append and attention, whose lengths live on the device).

The ops are defined with ``torch.library.Library`` (not ``custom_op``, whose Python wrappers cost ~100 us of host
time per call), with a fake implementation for shape propagation and no autograd formula: they run inside the
registered ops' forward and backward, which carry the autograd.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

_LIBRARY = torch.library.Library("fused_kernels", "FRAGMENT")


def opaque_op(name: str, schema: str, fake: Callable):
    """Decorator: register the decorated function as ``torch.ops.fused_kernels.<name>`` with ``schema`` (the
    arguments and results, without the name; arguments it writes marked ``Tensor(a!)``, which torch.compile then
    functionalizes) and ``fake`` as its shape function; returns the op's overload."""

    def register(implementation: Callable):
        _LIBRARY.define(name + schema)
        _LIBRARY.impl(name, implementation, "CompositeExplicitAutograd")
        torch.library.register_fake(f"fused_kernels::{name}", fake, lib=_LIBRARY)
        return getattr(torch.ops.fused_kernels, name).default

    return register
