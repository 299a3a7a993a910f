"""Pure-PyTorch twin of the LayerNorm/RMSNorm kernels: forward, the backward written out by hand, and
the grouped reduction of dW/dB that the kernel's lock scheme performs.

Read this beside ``kernels/layernorm/_kernels.py``. Everything is computed in float32 (float64 if the
input is float64), as the kernels do, and cast back to the input dtype at the end.

**Forward.** For a row ``x`` of length ``N``: ``mean = sum(x) / N``, ``var = sum((x - mean)^2) / N``
(biased, as torch), ``rstd = 1 / sqrt(var + eps)``, ``xhat = (x - mean) * rstd``,
``y = xhat * w + b``. RMSNorm drops the mean: ``rstd = 1 / sqrt(sum(x^2) / N + eps)``, ``xhat = x * rstd``,
``y = xhat * w``.

**Backward** (see :func:`layer_norm_backward` for the derivation). With ``g = dy * w``:
``dx = rstd * (g - mean(g) - xhat * mean(g * xhat))``, ``dw = sum over rows of dy * xhat``,
``db = sum over rows of dy``. RMSNorm: ``dx = rstd * (g - xhat * mean(g * xhat))``.

**Residual + dropout + norm** (:func:`add_dropout_norm`), the pre-norm block's
``r = dropout(x) + residual; y = norm(r)``: the dropout mask is the dropout family's
(``reference.dropout.dropout`` with the same seed), ``r`` is returned too (the next block's residual), and
the backward (:func:`add_dropout_norm_backward`) adds the gradient that reaches ``r`` through the residual
stream to the norm's ``dx``; that sum is ``residual``'s gradient, and the same mask again gives ``x``'s.

Dependency rule: this file imports torch and ``reference.dropout`` only.
"""

from __future__ import annotations

import torch

import reference.dropout as dropout_twin


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _rows(x: torch.Tensor, normalized_shape) -> tuple[torch.Tensor, int]:
    shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    n = 1
    for s in shape:
        n *= s
    return as_rows(x, n), n


def as_rows(x: torch.Tensor, n: int) -> torch.Tensor:
    """``x`` as (M, n) rows; rows of no element (``n == 0``) as an empty (0, 0) tensor, which torch's ``reshape``
    cannot infer (``reshape(-1, 0)`` is ambiguous)."""
    return x.reshape(-1, n) if n else x.reshape(0, 0)


def rms_norm_eps(eps: float | None, dtype: torch.dtype) -> float:
    """The ``eps`` RMSNorm adds, with torch's rule for ``eps=None``: the machine epsilon of the type torch
    *computes* in, float32 for fp16, bf16 and fp32 inputs (``torch.finfo(torch.float32).eps``, 1.19e-7),
    float64 for float64. Not ``torch.finfo(x.dtype).eps``: in fp16 that is 9.8e-4, which changes the output
    of rows with an RMS near 0.03 by several percent."""
    if eps is not None:
        return eps
    return torch.finfo(torch.promote_types(dtype, torch.float32)).eps


def layer_norm_forward(x2d: torch.Tensor, weight=None, bias=None, eps: float = 1e-5):
    """Rows of ``x2d`` (M, N) -> ``(y, mean, rstd)``; ``mean``/``rstd`` (M,) are float32 (float64 for float64
    rows)."""
    xf = x2d.to(_compute_dtype(x2d))
    mean = xf.mean(dim=1)
    xc = xf - mean[:, None]
    rstd = torch.rsqrt((xc * xc).mean(dim=1) + eps)
    y = xc * rstd[:, None]
    if weight is not None:
        y = y * weight.to(y.dtype)
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y.to(x2d.dtype), mean, rstd


def rms_norm_forward(x2d: torch.Tensor, weight=None, eps: float | None = None):
    """Rows of ``x2d`` (M, N) -> ``(y, rstd)``."""
    xf = x2d.to(_compute_dtype(x2d))
    rstd = torch.rsqrt((xf * xf).mean(dim=1) + rms_norm_eps(eps, x2d.dtype))
    y = xf * rstd[:, None]
    if weight is not None:
        y = y * weight.to(y.dtype)
    return y.to(x2d.dtype), rstd


def layer_norm(x: torch.Tensor, normalized_shape, weight=None, bias=None, eps: float = 1e-5) -> torch.Tensor:
    """LayerNorm over the trailing ``normalized_shape`` dims (same contract as ``F.layer_norm``)."""
    x2d, _ = _rows(x, normalized_shape)
    w = None if weight is None else weight.reshape(-1)
    b = None if bias is None else bias.reshape(-1)
    return layer_norm_forward(x2d, w, b, eps)[0].reshape(x.shape)


def rms_norm(x: torch.Tensor, normalized_shape, weight=None, eps: float | None = None) -> torch.Tensor:
    """RMSNorm over the trailing ``normalized_shape`` dims (same contract as ``F.rms_norm``, ``eps=None``
    included: see :func:`rms_norm_eps`)."""
    x2d, _ = _rows(x, normalized_shape)
    w = None if weight is None else weight.reshape(-1)
    return rms_norm_forward(x2d, w, eps)[0].reshape(x.shape)


def layer_norm_backward(dy, x, weight, mean, rstd):
    """``(dx, dw, db)`` of LayerNorm for rows ``x`` (M, N), written out by hand.

    Derivation for one row. Let ``xhat_j = (x_j - mean) * rstd`` and ``g_j = dy_j * w_j`` (the gradient
    reaching ``xhat``). Since ``d mean / d x_i = 1/N`` and
    ``d rstd / d x_i = -rstd^3 * (x_i - mean) / N = -rstd^2 * xhat_i / N``,

        d xhat_j / d x_i = rstd * (delta_ij - 1/N) - xhat_j * xhat_i * rstd / N

    so ``dx_i = sum_j g_j * d xhat_j / d x_i = rstd * (g_i - mean_j(g_j) - xhat_i * mean_j(g_j * xhat_j))``.
    The weight and bias gradients are sums over rows: ``dw = sum_rows dy * xhat``, ``db = sum_rows dy``.
    ``weight=None`` means ``w = 1``; ``dw`` is then None.
    """
    ct = _compute_dtype(x)
    xf, dyf = x.to(ct), dy.to(ct)
    xhat = (xf - mean.to(ct)[:, None]) * rstd.to(ct)[:, None]
    g = dyf if weight is None else dyf * weight.to(ct)
    dx = rstd.to(ct)[:, None] * (g - g.mean(dim=1, keepdim=True) - xhat * (g * xhat).mean(dim=1, keepdim=True))
    dw = None if weight is None else (dyf * xhat).sum(dim=0)
    db = dyf.sum(dim=0)
    return dx.to(x.dtype), dw, db


def rms_norm_backward(dy, x, weight, rstd):
    """``(dx, dw)`` of RMSNorm: the LayerNorm derivation without the mean terms,
    ``dx = rstd * (g - xhat * mean(g * xhat))`` with ``xhat = x * rstd``."""
    ct = _compute_dtype(x)
    xf, dyf = x.to(ct), dy.to(ct)
    xhat = xf * rstd.to(ct)[:, None]
    g = dyf if weight is None else dyf * weight.to(ct)
    dx = rstd.to(ct)[:, None] * (g - xhat * (g * xhat).mean(dim=1, keepdim=True))
    dw = None if weight is None else (dyf * xhat).sum(dim=0)
    return dx.to(x.dtype), dw


def grouped_weight_grad(dy, xhat, *, rows_per_program: int, group_size_m: int):
    """The arithmetic of the kernel's dW reduction, without the locks.

    Program ``p`` owns rows ``[p * rows_per_program, (p + 1) * rows_per_program)`` and sums
    ``dy * xhat`` over them into a partial row (fp32). Partial rows are added into buffer
    ``p % group_size_m``: in the kernel, under that buffer's spin lock, in whatever order the programs
    arrive, the first arrival storing instead of adding. A second pass sums the buffers in order.
    With ``group_size_m`` equal to the number of programs every buffer has one writer, which is the
    ``deterministic=True`` layout: the result no longer depends on arrival order.
    Returns ``(dw, buffers)``.
    """
    m, n = dy.shape
    contrib = dy.float() * xhat.float()
    programs = max(1, -(-m // rows_per_program))
    buffers = torch.zeros(group_size_m, n, dtype=torch.float32, device=dy.device)
    for p in range(programs):
        partial = contrib[p * rows_per_program : (p + 1) * rows_per_program].sum(dim=0)
        buffers[p % group_size_m] += partial
    return buffers.sum(dim=0), buffers


def _residual_dtype(x: torch.Tensor, residual: torch.Tensor | None, residual_dtype) -> torch.dtype:
    if residual_dtype is not None:
        return residual_dtype
    return x.dtype if residual is None else residual.dtype


def _add_dropout_norm_eps(kind: str, eps: float | None, dtype: torch.dtype) -> float:
    """The norm's ``eps``: given, or by default LayerNorm's 1e-5 and RMSNorm's rule (:func:`rms_norm_eps`)."""
    if kind == "layer":
        return 1e-5 if eps is None else eps
    return rms_norm_eps(eps, dtype)


def _sum_dtype(*tensors) -> torch.dtype:
    """What the residual add and the norm compute in: float32, float64 when any of ``tensors`` is float64."""
    return torch.float64 if any(t is not None and t.dtype == torch.float64 for t in tensors) else torch.float32


def add_dropout_norm(x, residual=None, weight=None, bias=None, *, kind="layer", eps=None, dropout_p=0.0,
                     seed=None, training=True, residual_dtype=None, out_dtype=None):
    """``(y, residual_out)`` of the pre-norm block over the last dim of ``x``, as three torch ops would give:

    - ``dropped = dropout(x, dropout_p, seed=seed)`` in ``x``'s dtype (identity when not ``training`` or
      ``dropout_p == 0``); the mask is the dropout family's for ``x``'s logical shape;
    - ``residual_out = dropped + residual`` (or ``dropped`` alone) added in float32 and rounded once to
      ``residual_dtype``: default ``residual``'s dtype, or ``x``'s without a residual (``torch.float32``
      keeps the residual stream in fp32, as pre-norm trainers do);
    - ``y = norm(residual_out) * weight (+ bias)``, ``kind`` ``"layer"`` or ``"rms"`` (no bias), statistics in
      float32 from the rounded ``residual_out``, ``y`` in ``x``'s dtype, or ``out_dtype`` when given.

    ``eps=None``: 1e-5 for LayerNorm, torch's rule for RMSNorm (:func:`rms_norm_eps`). Where a tensor or a
    requested dtype is float64, float64 replaces float32 throughout.
    """
    if kind not in ("layer", "rms"):
        raise ValueError(f"kind must be 'layer' or 'rms', got {kind!r}")
    if kind == "rms" and bias is not None:
        raise ValueError("RMSNorm has no bias")
    apply_dropout = training and dropout_p > 0.0
    if apply_dropout and seed is None:
        raise ValueError("the twin needs an explicit seed to draw the dropout mask")
    dropped = dropout_twin.dropout(x, dropout_p, seed=seed) if apply_dropout else x
    out_dtype = out_dtype or x.dtype
    ct = _sum_dtype(x, residual, weight, bias, torch.empty(0, dtype=out_dtype),
                    torch.empty(0, dtype=residual_dtype or x.dtype))
    summed = dropped.to(ct) if residual is None else dropped.to(ct) + residual.to(ct)
    residual_out = summed.to(_residual_dtype(x, residual, residual_dtype))
    rows = as_rows(residual_out, x.shape[-1]).to(ct)
    eps = _add_dropout_norm_eps(kind, eps, x.dtype)
    if kind == "layer":
        y = layer_norm_forward(rows, weight, bias, eps)[0]
    else:
        y = rms_norm_forward(rows, weight, eps)[0]
    return y.to(out_dtype).reshape(x.shape), residual_out


def add_dropout_norm_backward(dy, dresidual_out, residual_out, weight, *, kind="layer", eps=None, dropout_p=0.0,
                              seed=None, training=True, x_dtype=None, residual_dtype=None):
    """``(dx, dresidual, dw, db)`` of :func:`add_dropout_norm`, written out by hand.

    ``dr = norm_backward(dy, residual_out) + dresidual_out`` in float32 (``dresidual_out``: the gradient that
    reaches ``residual_out`` from later blocks, may be None); ``dresidual = dr`` (rounded to
    ``residual_dtype``, default ``residual_out``'s); dropout is linear with a fixed mask, so
    ``dx = dropout(dr)`` with the forward's seed, applied to ``dr`` rounded to ``x_dtype`` (default ``dy``'s),
    as torch's dropout backward receives the gradient of its output in its output's dtype. ``db`` is None for
    RMSNorm, ``dw`` without a weight.
    """
    n = residual_out.shape[-1]
    ct = _sum_dtype(dy, residual_out, weight, torch.empty(0, dtype=x_dtype or dy.dtype))
    r = as_rows(residual_out, n).to(ct)
    g = as_rows(dy, n).to(ct)
    eps = _add_dropout_norm_eps(kind, eps, x_dtype or dy.dtype)
    if kind == "layer":
        _, mean, rstd = layer_norm_forward(r, weight, None, eps)
        dr, dw, db = layer_norm_backward(g, r, weight, mean, rstd)
    else:
        _, rstd = rms_norm_forward(r, weight, eps)
        (dr, dw), db = rms_norm_backward(g, r, weight, rstd), None
    dr = dr.reshape(residual_out.shape)
    if dresidual_out is not None:
        dr = dr + dresidual_out.to(ct)
    apply_dropout = training and dropout_p > 0.0
    dx = dr.to(x_dtype or dy.dtype)
    if apply_dropout:
        dx = dropout_twin.dropout(dx, dropout_p, seed=seed)
    return dx, dr.to(residual_dtype or residual_out.dtype), dw, db
