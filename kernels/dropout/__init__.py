"""Seeded Philox dropout that stores no mask: ``dropout``, ``Dropout``.

``philox4x32`` is the in-kernel RNG (a ``@triton.jit`` function in ``kernels._common.philox``, shared with
attention's dropout); ``keep_threshold`` and ``LANE_STRIDE`` are the keep rule and the element-to-word layout,
both defined by the twin ``reference.dropout``.
"""

from kernels._common.philox import philox4x32
from kernels.dropout.modules import Dropout
from kernels.dropout.ops import dropout
from reference.dropout import LANE_STRIDE, keep_threshold

__all__ = ["LANE_STRIDE", "Dropout", "dropout", "keep_threshold", "philox4x32"]
