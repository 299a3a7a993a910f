"""``replace_modules``: turn torch's normalization and dropout modules into the fused ones, in place.

The fused modules subclass torch's and add nothing but ``forward`` (and a ``deterministic`` flag that
defaults to False on the class), so the swap changes each module's class and nothing else: the module
object, its ``Parameter`` objects (identity, ``requires_grad``, optimizer state, tying), its hooks, its
parametrizations, its training flag and every place that refers to it stay as they were. A module shared
by several parents is one object and is swapped once.
"""

from __future__ import annotations

import torch
from torch.nn.utils import parametrize

from kernels.dropout import Dropout
from kernels.layernorm import LayerNorm, RMSNorm

_FUSED = {torch.nn.LayerNorm: LayerNorm, torch.nn.RMSNorm: RMSNorm, torch.nn.Dropout: Dropout}


def _torch_class(module: torch.nn.Module) -> type | None:
    """The torch class ``module`` is an instance of exactly, seeing through the class that parametrization
    puts in between (``ParametrizedLayerNorm``, whose only base is ``nn.LayerNorm``); None for anything
    else, subclasses of torch's modules included (they may override ``forward``)."""
    cls = type(module)
    if parametrize.is_parametrized(module):
        cls = cls.__bases__[0]
    return cls if cls in _FUSED else None


def _swap_class(module: torch.nn.Module, fused: type) -> None:
    if parametrize.is_parametrized(module):
        # Parametrization keeps its properties on a class made for this one module: make the same class
        # over the fused module (so ``remove_parametrizations`` later restores the fused class).
        made = type(module)
        namespace = {k: v for k, v in vars(made).items() if k not in ("__dict__", "__weakref__")}
        module.__class__ = type(f"Parametrized{fused.__name__}", (fused,), namespace)
    else:
        module.__class__ = fused


def replace_modules(model: torch.nn.Module, *, layer_norm: bool = True, rms_norm: bool = True,
                    dropout: bool = True) -> dict[str, type]:
    """Make every ``nn.LayerNorm``, ``nn.RMSNorm`` and ``nn.Dropout`` inside ``model`` (``model`` itself
    included) compute with fused-kernels, in place.

    Each module keeps its identity and state: the same ``Parameter`` objects (an optimizer built before the
    call keeps working, frozen weights stay frozen, tied and shared modules stay tied), its hooks,
    parametrizations and train/eval mode; only its class changes, to ``kernels.layernorm.LayerNorm`` /
    ``RMSNorm`` or ``kernels.dropout.Dropout``, which subclass torch's, so ``isinstance`` checks, ``repr``
    and ``state_dict`` are unchanged and a saved ``state_dict`` loads into the torch model and back.
    Subclasses of torch's modules are left alone (they may override ``forward``). The keyword flags turn
    a kind off. Attention has no module form here: call ``kernels.attention.flash_attention`` in the
    model's code.

    Returns what was replaced: ``{qualified name: torch class it had}``, one entry per module (a module
    reachable under several names is listed under its first; ``""`` is ``model`` itself).
    """
    wanted = {torch.nn.LayerNorm: layer_norm, torch.nn.RMSNorm: rms_norm, torch.nn.Dropout: dropout}
    replaced: dict[str, type] = {}
    for name, module in model.named_modules():  # each module object once, however often it is reached
        cls = _torch_class(module)
        if cls is not None and wanted[cls]:
            _swap_class(module, _FUSED[cls])
            replaced[name] = cls
    return replaced
