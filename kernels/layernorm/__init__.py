"""Fused LayerNorm and RMSNorm (forward, and a backward with lock-guarded dW/dB buffers).

Not implemented yet: the public names exist so the API contract is importable; they raise
``NotImplementedError`` until the LayerNorm family lands (issue 4).
"""

from __future__ import annotations

_MESSAGE = "kernels.layernorm.{} is not implemented yet (the LayerNorm family, issue 4)"


def layer_norm(x, normalized_shape, weight=None, bias=None, eps=1e-5, *, deterministic=False):
    """Fused LayerNorm over the trailing ``normalized_shape`` dims (not implemented yet)."""
    raise NotImplementedError(_MESSAGE.format("layer_norm"))


def rms_norm(x, normalized_shape, weight=None, eps=1e-6, *, deterministic=False):
    """Fused RMSNorm over the trailing ``normalized_shape`` dims (not implemented yet)."""
    raise NotImplementedError(_MESSAGE.format("rms_norm"))


class LayerNorm:
    """Drop-in for ``torch.nn.LayerNorm`` (not implemented yet)."""

    def __init__(self, *args, **kwargs):
        raise NotImplementedError(_MESSAGE.format("LayerNorm"))


class RMSNorm:
    """Drop-in for ``torch.nn.RMSNorm`` (not implemented yet)."""

    def __init__(self, *args, **kwargs):
        raise NotImplementedError(_MESSAGE.format("RMSNorm"))


__all__ = ["LayerNorm", "RMSNorm", "layer_norm", "rms_norm"]
