"""The dropout family's Philox (``kernels/_common/philox.py``) compiled as Gluon, for the Hopper kernels that draw
dropout masks themselves (the attention backward, the norms' wide backward).

The Triton functions are scalar and element-wise arithmetic only (no layouts), so ``gluon.jit`` takes their source as
it is: one source, and so the same words, in both languages. Limits: what ``philox.py`` states; Gluon kernels run
only on a GPU (no interpreter).
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from kernels._common import philox

philox4x32 = gluon.jit(philox.philox4x32.fn)
philox_key = gluon.jit(philox.philox_key.fn)
LANE_STRIDE: gl.constexpr = gl.constexpr(philox.LANE_STRIDE.value)
