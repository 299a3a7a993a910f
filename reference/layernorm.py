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

Dependency rule: this file imports torch only.
"""

from __future__ import annotations

import torch


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _rows(x: torch.Tensor, normalized_shape) -> tuple[torch.Tensor, int]:
    shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    n = 1
    for s in shape:
        n *= s
    return x.reshape(-1, n), n


def rms_norm_eps(eps: float | None, dtype: torch.dtype) -> float:
    """The ``eps`` RMSNorm adds, with torch's rule for ``eps=None``: the machine epsilon of the type torch
    *computes* in, float32 for fp16, bf16 and fp32 inputs (``torch.finfo(torch.float32).eps``, 1.19e-7),
    float64 for float64. Not ``torch.finfo(x.dtype).eps``: in fp16 that is 9.8e-4, which changes the output
    of rows with an RMS near 0.03 by several percent."""
    if eps is not None:
        return eps
    return torch.finfo(torch.promote_types(dtype, torch.float32)).eps


def layer_norm_forward(x2d: torch.Tensor, weight=None, bias=None, eps: float = 1e-5):
    """Rows of ``x2d`` (M, N) -> ``(y, mean, rstd)``; ``mean``/``rstd`` are float32 (M,)."""
    xf = x2d.to(_compute_dtype(x2d))
    mean = xf.mean(dim=1)
    xc = xf - mean[:, None]
    rstd = torch.rsqrt((xc * xc).mean(dim=1) + eps)
    y = xc * rstd[:, None]
    if weight is not None:
        y = y * weight.to(y.dtype)
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y.to(x2d.dtype), mean.float(), rstd.float()


def rms_norm_forward(x2d: torch.Tensor, weight=None, eps: float | None = None):
    """Rows of ``x2d`` (M, N) -> ``(y, rstd)``."""
    xf = x2d.to(_compute_dtype(x2d))
    rstd = torch.rsqrt((xf * xf).mean(dim=1) + rms_norm_eps(eps, x2d.dtype))
    y = xf * rstd[:, None]
    if weight is not None:
        y = y * weight.to(y.dtype)
    return y.to(x2d.dtype), rstd.float()


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
