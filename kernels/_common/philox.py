"""Philox4x32-10 in Triton: the counter-based generator behind every dropout mask in this package.

Implements ``philox4x32`` (four 32-bit words from a 128-bit counter and a 64-bit key), ``philox_key``
(the key from two run-time ints, or from a seed on the device), and the element-wise dropout layout:
``chunk_words`` (the four words of one chunk of ``4 * LANE_STRIDE`` elements) and ``scaled_where_kept``.
The element-wise dropout kernel, the fused residual + dropout + norm and attention's dropout all draw
from it; what counter each element uses is stated in the twins (``reference/dropout.py``,
``reference/attention.py``).

Derived from: Salmon, Moraes, Dror and Shaw, "Parallel random numbers: as easy as 1, 2, 3" (SC 2011). The
round constants are the twin's (``reference.dropout.PHILOX_*``), imported here so the two cannot drift.
They are module-level constexprs, not default arguments or attribute reads inside the jit code: under
torch.compile inductor copies the jit source into its own module, where only constexpr globals survive.

Trade-off: a round is two 32x32->64 multiplies; done as one wide multiply each (rather than separate
high and low halves), ten rounds cost about 40 integer instructions for four words.
"""

import triton
import triton.language as tl

import reference.dropout as twin

_M0 = tl.constexpr(twin.PHILOX_M0)
_M1 = tl.constexpr(twin.PHILOX_M1)
_W0 = tl.constexpr(twin.PHILOX_W0)
_W1 = tl.constexpr(twin.PHILOX_W1)
_ROUNDS = tl.constexpr(twin.PHILOX_ROUNDS)
LANE_STRIDE = tl.constexpr(twin.LANE_STRIDE)


@triton.jit
def philox4x32(c0, c1, c2, c3, k0, k1):
    """Philox4x32-10 on uint32 counter words ``c0..c3`` (tensors) with uint32 key ``k0, k1``.

    Each round: the 64-bit products ``M0*c0`` and ``M1*c2`` (one wide multiply each) are split into high
    and low halves and mixed with the other words and the key; the key gets the Weyl increments.
    """
    for _ in tl.static_range(_ROUNDS):
        prod0 = c0.to(tl.uint64) * _M0
        prod1 = c2.to(tl.uint64) * _M1
        hi0 = (prod0 >> 32).to(tl.uint32)
        lo0 = prod0.to(tl.uint32)
        hi1 = (prod1 >> 32).to(tl.uint32)
        lo1 = prod1.to(tl.uint32)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0 = k0 + _W0
        k1 = k1 + _W1
    return c0, c1, c2, c3


@triton.jit
def philox_key(seed_lo, seed_hi, seed_ptr, seed_in_memory):
    """The Philox key words ``(k0, k1)`` as uint32: the run-time arguments ``seed_lo``/``seed_hi``, or, when
    ``seed_in_memory`` is non-zero, the low and high halves of the int64 at ``seed_ptr`` (the int words are
    then 0). The second form keys the kernel with a seed drawn on the device (under torch.compile or CUDA
    graph capture) without a host sync.

    ``seed_in_memory`` is a run-time flag, not a constexpr, so both forms run one compiled kernel: a graph
    captured after an eager warm-up finds its kernel compiled (compiling during capture is not allowed)."""
    from_memory = tl.load(seed_ptr, mask=seed_in_memory != 0, other=0).to(tl.int64)
    # tl.cast, not .to: torch.compile's mutation analysis passes runtime scalars in as Python ints.
    k0 = tl.cast(seed_lo, tl.uint32) ^ (from_memory & 0xFFFFFFFF).to(tl.uint32)
    k1 = tl.cast(seed_hi, tl.uint32) ^ ((from_memory >> 32) & 0xFFFFFFFF).to(tl.uint32)
    return k0, k1


@triton.jit
def chunk_words(chunk, k0, k1):
    """The four Philox words of chunk ``chunk`` (int64) of the element-wise dropout layout
    (``reference/dropout.py``): word ``w`` decides elements ``chunk * 4 * LANE_STRIDE + w * LANE_STRIDE + j``
    for ``j`` in ``0 .. LANE_STRIDE - 1`` (each word a ``LANE_STRIDE`` tensor)."""
    lane = tl.arange(0, LANE_STRIDE)
    group = (chunk * LANE_STRIDE + lane).to(tl.uint64)
    zero = tl.zeros_like(lane).to(tl.uint32)
    return philox4x32(group.to(tl.uint32), (group >> 32).to(tl.uint32), zero, zero, k0, k1)


@triton.jit
def scaled_where_kept(x, word, threshold, scale):
    """``x * scale`` where the word clears the threshold, ``x * 0`` elsewhere (NaN stays NaN, as torch), fp32."""
    factor = tl.where(word >= threshold, scale, 0.0)
    return x.to(tl.float32) * factor
