"""Autocast: each public entry point follows the policy torch's autocast applies to its torch counterpart.

Our ops are Python functions over Triton kernels, so ``torch.autocast`` never sees them; without this a model
under ``torch.autocast("cuda", dtype=torch.bfloat16)`` would run our attention in fp32 (SDPA runs in bf16)
and our LayerNorm in bf16 (torch's runs in fp32). The policies, by torch's autocast op lists:

- attention (``scaled_dot_product_attention``): lower precision on CPU and CUDA, inputs cast to the
  autocast dtype;
- layer norm: fp32 on CUDA (inputs upcast, fp32 output), untouched on CPU;
- RMS norm: as layer norm (checked against ``F.rms_norm`` by ``tests/test_integration.py``);
- dropout: untouched (it is on no list: the output keeps the input's dtype).

As torch's autocast, it never casts a float64 tensor.
"""

from __future__ import annotations

import torch

_LOWER_PRECISION = {"attention": ("cpu", "cuda")}
_FP32 = {"layer_norm": ("cuda",), "rms_norm": ("cuda",)}


def autocast_dtype(op: str, device_type: str) -> torch.dtype | None:
    """The dtype autocast runs ``op`` in on ``device_type`` now, or None when it leaves the inputs alone."""
    if not torch.is_autocast_enabled(device_type):
        return None
    if device_type in _LOWER_PRECISION.get(op, ()):
        return torch.get_autocast_dtype(device_type)
    if device_type in _FP32.get(op, ()):
        return torch.float32
    return None


def autocast_cast(op: str, *tensors):
    """``tensors`` cast as autocast would cast the inputs of ``op`` (None and non-float tensors pass through)."""
    first = next(t for t in tensors if isinstance(t, torch.Tensor))
    dtype = autocast_dtype(op, first.device.type)
    if dtype is None:
        return tensors
    # the dtype check first: a no-op ``.to`` still costs a dispatch (about 1.3 us each on a CPU)
    return tuple(t.to(dtype) if isinstance(t, torch.Tensor) and t.dtype not in (dtype, torch.float64)
                 and t.is_floating_point() else t for t in tensors)
