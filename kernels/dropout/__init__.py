"""Seeded Philox dropout that stores no mask: ``dropout``, ``Dropout``.

``philox4x32`` is the in-kernel RNG helper (a ``@triton.jit`` function) that other families' kernels
reuse; ``keep_threshold`` is the integer keep rule.
"""

from kernels.dropout._kernels import LANE_STRIDE_ELEMENTS as LANE_STRIDE
from kernels.dropout._kernels import philox4x32
from kernels.dropout.modules import Dropout
from kernels.dropout.ops import dropout, keep_threshold

__all__ = ["LANE_STRIDE", "Dropout", "dropout", "keep_threshold", "philox4x32"]
