"""Argument checks and constants shared by every attention entry point: ``flash_attention`` and its packed form
(``ops.py``), ``flash_attention_with_kvcache`` (``kvcache.py``) and ``context_parallel_attention``."""

from __future__ import annotations

import math
import operator

import torch

from kernels._common import check_finite_number
from kernels.attention import configs

#: log2(e): the kernels run the softmax in base 2, so launchers pass ``softmax_scale * LOG2E``
LOG2E = 1.4426950408889634


def dot_precision(dtype: torch.dtype) -> str:
    """The ``tl.dot`` input precision of a call: IEEE for fp32 inputs (no tf32 rounding), tf32 otherwise (unused by
    16-bit products)."""
    return "ieee" if dtype == torch.float32 else "tf32"


def resolve_scale(softmax_scale, head_dim: int) -> float:
    """The score scale: ``softmax_scale`` (a finite number) or ``1 / sqrt(head_dim)``."""
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim)
    return check_finite_number("softmax_scale", softmax_scale)


def window_edges(window_size, causal: bool) -> tuple[int, int]:
    """``(left, right)`` of the visible band, causal folded in (``right = 0``); -1 is unbounded."""
    try:
        left, right = window_size
        if isinstance(left, bool) or isinstance(right, bool):
            raise TypeError
        # operator.index takes ints (numpy's too) and refuses floats: 2.7 must not become 2.
        left, right = operator.index(left), operator.index(right)
    except (TypeError, ValueError):
        raise TypeError(f"window_size must be a pair of ints (left, right), got {window_size!r}") from None
    if left < -1 or right < -1:
        raise ValueError(f"window_size entries must be >= 0, or -1 for unbounded; got {(left, right)}")
    if causal:
        right = 0
    return left, right


def check_heads(heads: int, kv_heads: int, d: int, d_k: int, *, k_name: str = "k", empty_ok: bool = True) -> None:
    """One head dim for queries and keys (``k_name``: the key tensor's name in the message), within the family's
    range, and query heads a multiple of the key/value heads (GQA/MQA); ``empty_ok``: no heads at all passes."""
    if d != d_k:
        raise ValueError(f"q and {k_name} must have the same head dim, got {d} and {d_k}")
    if (kv_heads == 0 and (heads != 0 or not empty_ok)) or (kv_heads != 0 and heads % kv_heads != 0):
        raise ValueError(f"the number of query heads ({heads}) must be a multiple of the number of "
                         f"key/value heads ({kv_heads})")
    if not 1 <= d <= configs.MAX_HEAD_DIM:
        raise ValueError(f"head dim must be between 1 and {configs.MAX_HEAD_DIM}, got {d}")
