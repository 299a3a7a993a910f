"""Fused LayerNorm and RMSNorm: forward, and a backward whose dW/dB partial sums go through
lock-guarded fp32 buffers (or, with ``deterministic=True``, one buffer per program and a fixed-order
sum)."""

from kernels.layernorm.modules import LayerNorm, RMSNorm
from kernels.layernorm.ops import layer_norm, rms_norm

__all__ = ["LayerNorm", "RMSNorm", "layer_norm", "rms_norm"]
