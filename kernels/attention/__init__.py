"""FlashAttention-2 forward and backward (``flash_attention``); ``flash_attention_varlen`` comes with the
attention-extras issue. See ``ops.py`` for the GPU-verification guard."""

from kernels.attention.ops import flash_attention, flash_attention_varlen

__all__ = ["flash_attention", "flash_attention_varlen"]
