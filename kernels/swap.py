"""``replace_modules``: swap torch's normalization and dropout modules for the fused ones, in place."""

from __future__ import annotations

import torch

from kernels.dropout import Dropout
from kernels.layernorm import LayerNorm, RMSNorm


def _layer_norm_like(old: torch.nn.LayerNorm) -> LayerNorm:
    param = old.weight if old.weight is not None else None
    new = LayerNorm(old.normalized_shape, eps=old.eps, elementwise_affine=old.elementwise_affine,
                    bias=old.bias is not None, device=param.device if param is not None else None,
                    dtype=param.dtype if param is not None else None)
    new.load_state_dict(old.state_dict())
    return new


def _rms_norm_like(old: torch.nn.RMSNorm) -> RMSNorm:
    param = old.weight
    new = RMSNorm(old.normalized_shape, eps=old.eps, elementwise_affine=old.elementwise_affine,
                  device=param.device if param is not None else None, dtype=param.dtype if param is not None else None)
    new.load_state_dict(old.state_dict())
    return new


def replace_modules(model: torch.nn.Module, *, layer_norm: bool = True, rms_norm: bool = True,
                    dropout: bool = True) -> torch.nn.Module:
    """Replace every ``nn.LayerNorm``, ``nn.RMSNorm`` and ``nn.Dropout`` inside ``model`` (in place) with
    ``kernels.layernorm.LayerNorm`` / ``RMSNorm`` and ``kernels.dropout.Dropout``, keeping weights, device,
    dtype and train/eval mode. Subclasses of torch's modules are left alone (they may override
    ``forward``). Returns ``model``; if ``model`` itself is one of those modules, returns its replacement.
    Attention has no module form here: call ``kernels.attention.flash_attention`` in the model's code.
    """
    swaps = []
    if layer_norm:
        swaps.append((torch.nn.LayerNorm, _layer_norm_like))
    if rms_norm:
        swaps.append((torch.nn.RMSNorm, _rms_norm_like))
    if dropout:
        swaps.append((torch.nn.Dropout, lambda old: Dropout(old.p, inplace=old.inplace)))

    def replacement(module):
        for cls, make in swaps:
            if type(module) is cls:
                new = make(module)
                new.train(module.training)
                return new
        return None

    root = replacement(model)
    if root is not None:
        return root
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            new = replacement(child)
            if new is not None:
                setattr(parent, name, new)
    return model
