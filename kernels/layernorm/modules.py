"""``torch.nn.Module`` drop-ins for LayerNorm and RMSNorm.

Each subclasses torch's module and overrides only ``forward``: the constructor, the parameters, the
``state_dict`` keys, ``reset_parameters``, ``extra_repr`` and ``isinstance`` checks are torch's, so a
model's weights load unchanged in either direction, code that finds norms by type still finds these, and
``kernels.replace_modules`` can turn a torch module into one of these in place.
"""

from __future__ import annotations

import torch

from kernels.layernorm.ops import layer_norm, rms_norm


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
