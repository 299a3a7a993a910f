"""One behaviour per input on every path.

A call gives the same outcome, the same numbers (to rounding, with NaN and Inf in the same places) or the same
error type, whichever path runs it: this mode's device path (the CUDA kernels, or the Triton interpreter on CPU
tensors) and the reference twin that CPU tensors run without the interpreter. The inputs are the awkward ones:
NaN and Inf, rows of no element, sequences of no token, lengths and page numbers out of range, gradients asked of
the inference-only op. On CUDA the index tensors are checked on request (``FUSED_KERNELS_CHECK_INDICES=1``), which
this file sets for its device path; CPU calls always check them.
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch

from kernels._common import cpu_runs_reference
from kernels._common.validate import CHECK_INDICES_ENV
from kernels._mode import DEVICE
from kernels.attention import flash_attention, flash_attention_varlen, flash_attention_with_kvcache
from kernels.dropout import dropout
from kernels.layernorm import add_dropout_norm, layer_norm, rms_norm

NAN, INF = float("nan"), float("inf")
_ON: list[str] = [DEVICE]  # the device the cases build their tensors on (set per path by the test)


def _randn(*shape, seed=0, grad=False, bad=None):
    """Seeded normal numbers on the path's device; ``bad = (index, value)`` writes one value first."""
    t = torch.randn(*shape, generator=torch.Generator().manual_seed(seed))
    if bad is not None:
        t[bad[0]] = bad[1]
    return t.to(_ON[0]).requires_grad_(grad)


def _ints(values):
    return torch.tensor(values, dtype=torch.int32, device=_ON[0])


def _with_grads(out, *inputs):
    """``out`` and the gradients of ``out.sum()`` (NaN-safe: a NaN output row gives NaN gradients, as in torch)."""
    outs = out if isinstance(out, tuple) else (out,)
    grads = torch.autograd.grad(outs[0], inputs, torch.ones_like(outs[0]))
    return (*outs, *grads)


def _attention(bad_tensor: int | None = None, value=NAN, causal=False, sk=9):
    shapes = ((1, 2, 7, 16), (1, 1, sk, 16), (1, 1, sk, 16))
    tensors = [_randn(*shape, seed=i, grad=True,
                      bad=((0, 0, 3, 5), value) if i == bad_tensor else None) for i, shape in enumerate(shapes)]
    o, lse = flash_attention(*tensors, causal=causal, return_lse=True)
    return _with_grads((o, lse), *tensors)


def _varlen(cu_q, cu_k, max_q, max_k, total_q=8, total_k=11):
    q = _randn(total_q, 4, 16, grad=True)
    k, v = _randn(total_k, 2, 16, seed=1, grad=True), _randn(total_k, 2, 16, seed=2, grad=True)
    o = flash_attention_varlen(q, k, v, _ints(cu_q), _ints(cu_k), max_q, max_k, causal=True)
    return _with_grads(o, q, k, v)


def _norm(kind, *shape, n, bad=None):
    x = _randn(*shape, grad=True, bad=bad)
    w, b = _randn(n, seed=1, grad=True), _randn(n, seed=2, grad=True)
    if kind == "layer":
        return _with_grads(layer_norm(x, n, w, b), x, w, b)
    return _with_grads(rms_norm(x, n, w), x, w)


def _add_dropout_norm(bad=None, rows=5, n=24):
    x, r = _randn(rows, n, grad=True), _randn(rows, n, seed=1, grad=True, bad=bad)
    w, b = _randn(n, seed=2, grad=True), _randn(n, seed=3, grad=True)
    y, residual_out = add_dropout_norm(x, r, w, b, dropout_p=0.25, seed=3)
    grads = torch.autograd.grad((y, residual_out), (x, r, w, b), (torch.ones_like(y), torch.ones_like(y)))
    return (y, residual_out, *grads)


def _dropout(bad=None):
    x = _randn(300, grad=True, bad=bad)
    return _with_grads(dropout(x, 0.3, seed=9), x)


def _kvcache(seqlens, *, new=0, paged=False, table=None, grad=None, bad_cache=None, causal=True):
    """Two sequences of Hq 4 / Hkv 2, D 16, a cache of 12 positions (or three pages of 4 of a 7-page pool)."""
    with torch.no_grad() if grad is None else torch.enable_grad():
        q = _randn(2, 4, 2, 16, grad=grad == "q")
        shape = (7, 2, 4, 16) if paged else (2, 2, 12, 16)
        k_cache = _randn(*shape, seed=1, grad=grad == "k_cache", bad=bad_cache)
        v_cache = _randn(*shape, seed=2)
        k, v = (_randn(2, 2, new, 16, seed=s) for s in (3, 4)) if new else (None, None)
        block_table = _ints(table if table is not None else [[6, 1, 3], [0, 5, 2]]) if paged else None
        o, lse = flash_attention_with_kvcache(q, k_cache, v_cache, _ints(seqlens), k=k, v=v, block_table=block_table,
                                              causal=causal, return_lse=True)
        return o, lse, k_cache.detach(), v_cache


EDGE_CASES = {
    # NaN and Inf: a NaN score or value makes the rows that see it NaN, and nothing else
    "attention NaN in q": lambda: _attention(0),
    "attention NaN in k, causal": lambda: _attention(1, causal=True),
    "attention NaN in k": lambda: _attention(1),
    "attention Inf in v": lambda: _attention(2, INF),
    "attention -Inf in q, causal": lambda: _attention(0, -INF, causal=True),
    "attention no key": lambda: _attention(sk=0),
    "layer_norm NaN in a row": lambda: _norm("layer", 4, 7, n=7, bad=((2, 3), NAN)),
    "rms_norm Inf in a row": lambda: _norm("rms", 4, 7, n=7, bad=((1, 0), INF)),
    "dropout NaN and Inf": lambda: _dropout(((slice(0, 300, 7)), NAN)),
    "add_dropout_norm NaN in the residual": lambda: _add_dropout_norm(((1, 4), NAN)),
    "kvcache NaN in the cache": lambda: _kvcache([5, 9], bad_cache=((1, 0, 3, 2), NAN)),
    # rows of no element, sequences of no token
    "layer_norm rows of 0": lambda: _norm("layer", 4, 0, n=0),
    "rms_norm rows of 0": lambda: _norm("rms", 3, 0, n=0),
    "layer_norm no row": lambda: _norm("layer", 0, 5, n=5),
    "add_dropout_norm no row": lambda: _add_dropout_norm(rows=0),
    "varlen sequences of 0 tokens": lambda: _varlen([0, 3, 3, 8], [0, 4, 4, 11], 5, 7),
    "varlen no key for a sequence": lambda: _varlen([0, 3, 8], [0, 0, 11], 5, 11),
    "kvcache empty caches": lambda: _kvcache([0, 0]),
    "kvcache empty caches, appended": lambda: _kvcache([0, 0], new=3),
    "kvcache paged, appended across pages": lambda: _kvcache([3, 6], new=3, paged=True),
    # lengths and page numbers out of range: a clear error on every path (CUDA: when indices are checked)
    "kvcache length past the cache": lambda: _kvcache([5, 13]),
    "kvcache append past the cache": lambda: _kvcache([5, 10], new=3),
    "kvcache negative length": lambda: _kvcache([-1, 4]),
    "kvcache page past the pool": lambda: _kvcache([3, 6], paged=True, table=[[6, 7, 3], [0, 5, 2]]),
    "kvcache negative page": lambda: _kvcache([9, 6], paged=True, table=[[6, 1, -1], [0, 5, 2]]),
    "kvcache unused page entries are not read": lambda: _kvcache([3, 4], paged=True, table=[[6, 99, -5], [0, 7, 8]]),
    "varlen cu_seqlens past the end": lambda: _varlen([0, 3, 9], [0, 4, 11], 6, 7),
    "varlen cu_seqlens short of q": lambda: _varlen([0, 3, 7], [0, 4, 11], 5, 7),
    "varlen cu_seqlens_k past k": lambda: _varlen([0, 3, 8], [0, 4, 12], 5, 8),
    "varlen cu_seqlens decreasing": lambda: _varlen([0, 5, 3, 8], [0, 4, 6, 11], 5, 5),
    "varlen cu_seqlens not from 0": lambda: _varlen([1, 3, 8], [0, 4, 11], 5, 7),
    "varlen max_seqlen_q short": lambda: _varlen([0, 3, 8], [0, 4, 11], 4, 7),
    "varlen max_seqlen_k short": lambda: _varlen([0, 3, 8], [0, 4, 11], 5, 6),
    # gradients of the inference-only op
    "kvcache q requires grad": lambda: _kvcache([5, 9], grad="q"),
    "kvcache k_cache requires grad": lambda: _kvcache([5, 9], grad="k_cache"),
}


def _outcome(case: str, path: str, monkeypatch):
    """``("error", type)`` or ``("value", tensors on the CPU)`` of one case on one path."""
    if path == "reference":
        _ON[0], context = "cpu", cpu_runs_reference()
    else:
        _ON[0], context = DEVICE, contextlib.nullcontext()
        monkeypatch.setenv(CHECK_INDICES_ENV, "1")
    try:
        with context:
            result = EDGE_CASES[case]()
    except (ValueError, TypeError, RuntimeError) as error:
        return "error", type(error), str(error)
    finally:
        _ON[0] = DEVICE
        monkeypatch.delenv(CHECK_INDICES_ENV, raising=False)
    return "value", tuple(t.detach().cpu() for t in result), None


def _assert_same_numbers(ours: torch.Tensor, theirs: torch.Tensor, what: str) -> None:
    assert ours.shape == theirs.shape and ours.dtype == theirs.dtype, (what, ours.shape, theirs.shape)
    assert torch.equal(ours.isnan(), theirs.isnan()), f"{what}: NaN in other places"
    assert torch.equal(ours.isinf() & (ours > 0), theirs.isinf() & (theirs > 0)), f"{what}: +Inf in other places"
    assert torch.equal(ours.isinf() & (ours < 0), theirs.isinf() & (theirs < 0)), f"{what}: -Inf in other places"
    finite = torch.isfinite(theirs)
    torch.testing.assert_close(ours[finite], theirs[finite], rtol=1e-4, atol=1e-4, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("case", list(EDGE_CASES))
def test_every_path_gives_the_same_outcome(case, monkeypatch):
    device = _outcome(case, "device", monkeypatch)
    reference = _outcome(case, "reference", monkeypatch)
    assert device[0] == reference[0], f"device path: {device}; reference path: {reference}"
    if device[0] == "error":
        assert device[1] is reference[1] and device[1] is not RuntimeError, (device, reference)
        return
    assert len(device[1]) == len(reference[1])
    for i, (ours, theirs) in enumerate(zip(device[1], reference[1], strict=True)):
        _assert_same_numbers(ours, theirs, f"result {i}")


def test_the_edge_cases_mean_what_they_say(monkeypatch):
    """A few outcomes spelled out, so that both paths agreeing on a wrong answer fails too."""
    monkeypatch.setenv(CHECK_INDICES_ENV, "1")
    o, lse, *_ = EDGE_CASES["attention NaN in q"]()
    assert o[0, 0, 3].isnan().all() and lse[0, 0, 3].isnan() and not o[0, 0, :3].isnan().any()
    assert not o[0, 1].isnan().any()
    o, *_ = EDGE_CASES["attention NaN in k, causal"]()  # Sq 7, Sk 9: query i sees keys up to i + 2; key 3 from i = 1
    assert not o[0, :, 0].isnan().any() and o[0, :, 1:].isnan().all()
    o, lse, *_ = EDGE_CASES["attention no key"]()
    assert (o == 0).all() and (lse == -math.inf).all()
    o, lse, *_ = EDGE_CASES["kvcache empty caches"]()
    assert (o == 0).all() and (lse == -math.inf).all()
    y, dx, dw, db = EDGE_CASES["layer_norm rows of 0"]()
    assert y.shape == dx.shape == (4, 0) and dw.shape == db.shape == (0,)
    for case in ("kvcache length past the cache", "varlen cu_seqlens past the end", "kvcache q requires grad"):
        with pytest.raises(ValueError):
            EDGE_CASES[case]()

