"""``torch.nn.Module`` drop-in for seeded dropout: subclasses ``torch.nn.Dropout`` and overrides only
``forward``, so ``isinstance``, ``extra_repr`` and the constructor are torch's."""

from __future__ import annotations

import torch

from kernels._common import check_probability
from kernels.dropout.ops import dropout


class Dropout(torch.nn.Dropout):
    """``torch.nn.Dropout(p=0.5, inplace=False)`` computed by the seeded kernel: same train/eval behaviour.

    Each call in training mode draws a fresh seed from torch's generator (``torch.manual_seed`` governs
    it); the backward regenerates the mask from that seed instead of storing it.
    """

    def __init__(self, p: float = 0.5, inplace: bool = False) -> None:
        # torch's own check lets NaN through; ours names the argument and refuses it
        super().__init__(check_probability("p", p, allow_one=True), inplace)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dropout(x, self.p, self.training, inplace=self.inplace)
