"""FlashAttention-2 forward and backward: ``flash_attention`` for (B, H, S, D) batches and
``flash_attention_varlen`` for packed variable-length ones; causal, sliding windows, GQA and dropout."""

from kernels.attention.ops import flash_attention, flash_attention_varlen

__all__ = ["flash_attention", "flash_attention_varlen"]
