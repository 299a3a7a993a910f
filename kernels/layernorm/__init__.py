"""Fused LayerNorm and RMSNorm: forward, and a backward whose dW/dB partial sums go through
lock-guarded fp32 buffers (or, with ``deterministic=True``, one buffer per program and a fixed-order
sum); and the pre-norm block's residual + dropout + norm fused into one kernel each way
(``add_dropout_norm``, ``AddDropoutNorm``)."""

from kernels.layernorm.modules import AddDropoutNorm, LayerNorm, RMSNorm
from kernels.layernorm.ops import add_dropout_norm, layer_norm, rms_norm

__all__ = ["AddDropoutNorm", "LayerNorm", "RMSNorm", "add_dropout_norm", "layer_norm", "rms_norm"]
