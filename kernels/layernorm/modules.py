"""``torch.nn.Module`` drop-ins for LayerNorm and RMSNorm: same constructor arguments, parameters and
``state_dict`` keys as ``torch.nn.LayerNorm`` / ``torch.nn.RMSNorm``, so a torch model's weights load
unchanged."""

from __future__ import annotations

import numbers

import torch

from kernels.layernorm.ops import layer_norm, rms_norm


def _as_shape(normalized_shape) -> tuple[int, ...]:
    if isinstance(normalized_shape, numbers.Integral):
        return (int(normalized_shape),)
    return tuple(normalized_shape)


class LayerNorm(torch.nn.Module):
    """Drop-in for ``torch.nn.LayerNorm(normalized_shape, eps, elementwise_affine, bias, device, dtype)``.

    ``deterministic=True`` (keyword only) makes the weight and bias gradients bitwise reproducible.
    """

    def __init__(self, normalized_shape, eps: float = 1e-5, elementwise_affine: bool = True, bias: bool = True,
                 device=None, dtype=None, *, deterministic: bool = False) -> None:
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        self.normalized_shape = _as_shape(normalized_shape)
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        self.deterministic = deterministic
        if elementwise_affine:
            self.weight = torch.nn.Parameter(torch.empty(self.normalized_shape, **factory))
            if bias:
                self.bias = torch.nn.Parameter(torch.empty(self.normalized_shape, **factory))
            else:
                self.register_parameter("bias", None)
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.weight is not None:
            torch.nn.init.ones_(self.weight)
        if self.bias is not None:
            torch.nn.init.zeros_(self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps,
                          deterministic=self.deterministic)

    def extra_repr(self) -> str:
        return (f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}, "
                f"bias={self.bias is not None}")


class RMSNorm(torch.nn.Module):
    """Drop-in for ``torch.nn.RMSNorm(normalized_shape, eps=None, elementwise_affine, device, dtype)``;
    ``eps=None`` uses ``torch.finfo(x.dtype).eps`` as torch does."""

    def __init__(self, normalized_shape, eps: float | None = None, elementwise_affine: bool = True, device=None,
                 dtype=None, *, deterministic: bool = False) -> None:
        super().__init__()
        self.normalized_shape = _as_shape(normalized_shape)
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        self.deterministic = deterministic
        if elementwise_affine:
            self.weight = torch.nn.Parameter(torch.empty(self.normalized_shape, device=device, dtype=dtype))
        else:
            self.register_parameter("weight", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.weight is not None:
            torch.nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.normalized_shape, self.weight, self.eps, deterministic=self.deterministic)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}"
