"""``torch.nn.Module`` drop-ins for LayerNorm and RMSNorm, and ``AddDropoutNorm`` (residual + dropout + norm).

Each subclasses torch's module and overrides only ``forward``: the constructor, the parameters, the
``state_dict`` keys, ``reset_parameters``, ``extra_repr`` and ``isinstance`` checks are torch's, so a
model's weights load unchanged in either direction, code that finds norms by type still finds these, and
``kernels.replace_modules`` can turn a torch module into one of these in place.
"""

from __future__ import annotations

import torch

from kernels.layernorm.ops import add_dropout_norm, layer_norm, rms_norm


class LayerNorm(torch.nn.LayerNorm):
    """``torch.nn.LayerNorm(normalized_shape, eps=1e-5, elementwise_affine=True, bias=True, device, dtype)``
    computed by the fused kernels.

    ``deterministic=True`` (keyword only) makes the weight and bias gradients bitwise reproducible.
    """

    #: a class default, so a torch module switched to this class in place has it too
    deterministic: bool = False

    def __init__(self, normalized_shape, eps: float = 1e-5, elementwise_affine: bool = True, bias: bool = True,
                 device=None, dtype=None, *, deterministic: bool = False) -> None:
        super().__init__(normalized_shape, eps=eps, elementwise_affine=elementwise_affine, bias=bias,
                         device=device, dtype=dtype)
        if deterministic:
            self.deterministic = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps,
                          deterministic=self.deterministic)


class RMSNorm(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm(normalized_shape, eps=None, elementwise_affine=True, device, dtype)`` computed by the
    fused kernels; ``eps=None`` follows torch's rule (see :func:`kernels.layernorm.rms_norm`).

    ``deterministic=True`` (keyword only) makes the weight gradient bitwise reproducible.
    """

    deterministic: bool = False

    def __init__(self, normalized_shape, eps: float | None = None, elementwise_affine: bool = True, device=None,
                 dtype=None, *, deterministic: bool = False) -> None:
        super().__init__(normalized_shape, eps=eps, elementwise_affine=elementwise_affine, device=device,
                         dtype=dtype)
        if deterministic:
            self.deterministic = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.normalized_shape, self.weight, self.eps, deterministic=self.deterministic)


class AddDropoutNorm(torch.nn.Module):
    """The pre-norm block's residual step as one module: ``forward(x, residual=None) -> (y, residual_out)``
    with ``residual_out = dropout(x, p) + residual`` and ``y = norm(residual_out)``
    (:func:`kernels.layernorm.add_dropout_norm`: one kernel forward, one backward, the dropout family's mask).

    ``normalized_shape`` is the last dim (an int, or a one-element sequence); ``kind`` ``"layer"``
    (LayerNorm: weight and, with ``bias=True``, bias) or ``"rms"`` (RMSNorm: weight only); ``eps`` defaults to
    1e-5 for LayerNorm and to torch's rule (``None``) for RMSNorm; ``residual_dtype=torch.float32`` keeps the
    residual stream in fp32, ``out_dtype`` sets ``y``'s dtype (see the function). Dropout follows
    ``self.training``; each call draws its seed from torch's generator, so ``torch.manual_seed`` governs the masks.
    """

    def __init__(self, normalized_shape, kind: str = "layer", p: float = 0.0, eps: float | None = None,
                 residual_dtype: torch.dtype | None = None, elementwise_affine: bool = True, bias: bool = True,
                 device=None, dtype=None, *, out_dtype: torch.dtype | None = None,
                 deterministic: bool = False) -> None:
        super().__init__()
        if kind not in ("layer", "rms"):
            raise ValueError(f"kind must be 'layer' or 'rms', got {kind!r}")
        shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
        if len(shape) != 1 or not isinstance(shape[0], int) or shape[0] < 1:
            raise ValueError(f"normalized_shape must be one positive int (the last dim), got {normalized_shape!r}")
        if not 0.0 <= p < 1.0:
            raise ValueError(f"p must be in [0, 1), got {p}")
        self.normalized_shape, self.kind, self.p = shape, kind, p
        self.eps = (1e-5 if kind == "layer" else None) if eps is None else eps
        self.residual_dtype, self.out_dtype, self.deterministic = residual_dtype, out_dtype, deterministic
        factory = {"device": device, "dtype": dtype}
        self.weight = torch.nn.Parameter(torch.ones(shape, **factory)) if elementwise_affine else None
        has_bias = elementwise_affine and bias and kind == "layer"
        self.bias = torch.nn.Parameter(torch.zeros(shape, **factory)) if has_bias else None

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return add_dropout_norm(x, residual, self.weight, self.bias, kind=self.kind, eps=self.eps, dropout_p=self.p,
                                training=self.training, residual_dtype=self.residual_dtype,
                                out_dtype=self.out_dtype, deterministic=self.deterministic)

    def extra_repr(self) -> str:
        return (f"{self.normalized_shape}, kind={self.kind!r}, p={self.p}, eps={self.eps}, "
                f"residual_dtype={self.residual_dtype}"
                + ("" if self.out_dtype is None else f", out_dtype={self.out_dtype}"))
