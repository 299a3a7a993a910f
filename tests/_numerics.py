"""The accuracy rule shared by the family tests (the one FlashAttention uses).

A low-precision result passes when its error against a float64 reference is at most twice PyTorch's own
error in the same dtype, plus a small absolute slack: the kernel may round differently from torch, but
not worse.
"""

from __future__ import annotations

import torch


def max_abs_error(value: torch.Tensor, reference: torch.Tensor) -> float:
    return (value.double() - reference.double()).abs().max().item() if value.numel() else 0.0


def assert_no_worse_than_torch(name: str, ours: torch.Tensor, torch_same_dtype: torch.Tensor,
                               reference_fp64: torch.Tensor, *, atol: float) -> None:
    assert ours.shape == reference_fp64.shape, f"{name}: shape {tuple(ours.shape)} != {tuple(reference_fp64.shape)}"
    assert torch.isfinite(ours).all() or not torch.isfinite(reference_fp64).all(), f"{name}: non-finite values"
    ours_err = max_abs_error(ours, reference_fp64)
    torch_err = max_abs_error(torch_same_dtype, reference_fp64)
    assert ours_err <= 2 * torch_err + atol, (
        f"{name}: max error {ours_err:.3e} against float64, torch's own {torch_err:.3e} (allowed "
        f"2x + {atol:.1e})"
    )
