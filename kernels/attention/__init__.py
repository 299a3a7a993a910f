"""FlashAttention-2 forward and backward.

Not implemented yet: the public names exist so the API contract is importable; they raise
``NotImplementedError`` until the attention family lands (issue 5).
"""

from __future__ import annotations

_MESSAGE = "kernels.attention.{} is not implemented yet (the attention family, issue 5)"


def flash_attention(q, k, v, *, causal=False, softmax_scale=None, dropout_p=0.0, seed=None,
                    window_size=(-1, -1), return_lse=False, deterministic=False):
    """FlashAttention-2 on (B, H, S, D) tensors (not implemented yet)."""
    raise NotImplementedError(_MESSAGE.format("flash_attention"))


def flash_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, **kwargs):
    """FlashAttention-2 on packed variable-length batches (not implemented yet)."""
    raise NotImplementedError(_MESSAGE.format("flash_attention_varlen"))


__all__ = ["flash_attention", "flash_attention_varlen"]
