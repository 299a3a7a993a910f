"""``torch.nn.Module`` drop-in for seeded dropout."""

from __future__ import annotations

import torch

from kernels._common import check_probability
from kernels.dropout.ops import dropout


class Dropout(torch.nn.Module):
    """Drop-in for ``torch.nn.Dropout(p, inplace)``: same arguments, same train/eval behaviour.

    Each call in training mode draws a fresh seed from torch's generator (``torch.manual_seed`` governs
    it); the backward regenerates the mask from that seed instead of storing it.
    """

    def __init__(self, p: float = 0.5, inplace: bool = False) -> None:
        super().__init__()
        self.p = check_probability("p", p, allow_one=True)
        self.inplace = inplace

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dropout(x, self.p, self.training, inplace=self.inplace)

    def extra_repr(self) -> str:
        return f"p={self.p}, inplace={self.inplace}"
