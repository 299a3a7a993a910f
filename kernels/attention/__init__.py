"""FlashAttention-2 forward and backward: ``flash_attention`` for (B, H, S, D) batches and
``flash_attention_varlen`` for packed variable-length ones; causal, sliding windows, GQA and dropout.
``flash_attention_with_kvcache``: inference against a KV cache (contiguous or paged), split-KV decoding.
``apply_rotary``: the rotary position embedding of queries and keys in one pass each.
``context_parallel_attention``: ring attention of a sequence sharded over ``torch.distributed`` ranks
(``shard_sequence``/``unshard_sequence`` cut and gather it)."""

from kernels.attention.context_parallel import context_parallel_attention, shard_sequence, unshard_sequence
from kernels.attention.kvcache import flash_attention_with_kvcache
from kernels.attention.ops import flash_attention, flash_attention_varlen
from kernels.attention.rotary import apply_rotary

__all__ = [
    "apply_rotary",
    "context_parallel_attention",
    "flash_attention",
    "flash_attention_varlen",
    "flash_attention_with_kvcache",
    "shard_sequence",
    "unshard_sequence",
]
