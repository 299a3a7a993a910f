"""Philox4x32-10 in Triton: the counter-based generator behind every dropout mask in this package.

Implements ``philox4x32`` (four 32-bit words from a 128-bit counter and a 64-bit key), ``philox_key``
(the key from two run-time ints, or from a seed on the device), and the element-wise dropout layout:
``chunk_words`` (the four words of one chunk of ``4 * LANE_STRIDE`` elements), ``scaled_where_kept``, and
``tile_keep_factor`` (the mask of a 2-D tile of whole rows that covers whole chunks, one Philox call per
four elements, without walking the tile in flat chunks).
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
from kernels._common.runtime import INTERPRETER

_M0 = tl.constexpr(twin.PHILOX_M0)
_M1 = tl.constexpr(twin.PHILOX_M1)
_W0 = tl.constexpr(twin.PHILOX_W0)
_W1 = tl.constexpr(twin.PHILOX_W1)
_ROUNDS = tl.constexpr(twin.PHILOX_ROUNDS)
LANE_STRIDE = tl.constexpr(twin.LANE_STRIDE)
_COMPILED = tl.constexpr(not INTERPRETER)


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
def group_words(group, k0, k1):
    """The four Philox words of the element-wise layout's groups ``group`` (int64 tensor, any shape): word ``w``
    of group ``chunk * LANE_STRIDE + j`` decides element ``chunk * 4 * LANE_STRIDE + w * LANE_STRIDE + j``
    (``reference/dropout.py``). The group index is the Philox counter's low 64 bits."""
    group = group.to(tl.uint64)
    zero = tl.zeros(group.shape, tl.uint32)
    return philox4x32(group.to(tl.uint32), (group >> 32).to(tl.uint32), zero, zero, k0, k1)


@triton.jit
def chunk_words(chunk, k0, k1):
    """The four Philox words of chunk ``chunk`` (int64): word ``w`` decides elements
    ``chunk * 4 * LANE_STRIDE + w * LANE_STRIDE + j`` for ``j`` in ``0 .. LANE_STRIDE - 1`` (each word a
    ``LANE_STRIDE`` tensor)."""
    return group_words(chunk * LANE_STRIDE + tl.arange(0, LANE_STRIDE), k0, k1)


@triton.jit
def scaled_where_kept(x, word, threshold, scale, ROUNDED: tl.constexpr = False):
    """``x * scale`` where the word clears the threshold, ``x * 0`` elsewhere (NaN stays NaN, as torch), fp32.
    ``ROUNDED``: as :func:`times_factor`."""
    return times_factor(x, tl.where(word >= threshold, scale, 0.0), ROUNDED)


@triton.jit
def times_factor(x, factor, ROUNDED: tl.constexpr = False):
    """``x * factor`` in fp32. ``ROUNDED``: the product is rounded on its own even when an add follows. The
    compiler otherwise contracts ``x * scale + r`` into one FMA (one rounding instead of two), and an fp32
    ``dropout(x) + r`` would then differ in the last bit from the dropout kernel's output added to ``r``. A
    ``mul.rn`` is never contracted; the interpreter (NumPy) never contracts, so it multiplies plainly."""
    if ROUNDED and _COMPILED:
        return tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=f,f,f", [x.to(tl.float32), factor],
                                         dtype=tl.float32, is_pure=True, pack=1)
    return x.to(tl.float32) * factor


@triton.jit
def tile_keep_factor(row0, N, k0, k1, threshold, scale, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The dropout factors (``scale`` where kept, 0 where dropped, fp32) of the ``BLOCK_M x BLOCK_N`` tile of
    rows ``row0 ..`` of a contiguous ``(M, N)`` tensor, in the element-wise layout: the same mask as
    ``chunk_words`` over the flat elements. Requires ``N == BLOCK_N`` and ``BLOCK_M * BLOCK_N`` a multiple of
    ``4 * LANE_STRIDE`` (so that, with ``row0`` a multiple of ``BLOCK_M``, the tile is whole chunks)."""
    CHUNKS: tl.constexpr = BLOCK_M * BLOCK_N // (4 * LANE_STRIDE)
    chunk = (tl.cast(row0, tl.int64) * N) // (4 * LANE_STRIDE) + tl.arange(0, CHUNKS).to(tl.int64)
    return chunks_keep_factor(chunk, k0, k1, threshold, scale, BLOCK_M, BLOCK_N)


@triton.jit
def chunks_keep_factor(chunk, k0, k1, threshold, scale, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The dropout factors of whole chunks ``chunk`` (int64, ``BLOCK_M * BLOCK_N // (4 * LANE_STRIDE)`` of them,
    any indices) laid out one after the other as a ``BLOCK_M x BLOCK_N`` tile: a tile whose rows are whole
    chunks (``BLOCK_N == 4 * LANE_STRIDE``, e.g. one column block of several rows) or whose rows divide one.

    The tile's flat elements, viewed as ``(chunks, 4, LANE_STRIDE)``, are the chunks with their four runs:
    the words are drawn on ``(chunks, LANE_STRIDE)``, broadcast along the run axis and the view reshaped
    back to rows. Blocked layouts make the reshape free (no data moves); a thread then holds the four runs
    of its lanes, so each Philox call serves four elements, unless the warps of a program span more than
    ``LANE_STRIDE`` elements of one chunk (more than 4 warps of 8-element strips): then warps along the run
    axis draw the same words."""
    w0, w1, w2, w3 = group_words(chunk[:, None] * LANE_STRIDE + tl.arange(0, LANE_STRIDE)[None, :], k0, k1)
    run = tl.arange(0, 4)[None, :, None]
    word = tl.where(run == 0, w0[:, None, :],
                    tl.where(run == 1, w1[:, None, :], tl.where(run == 2, w2[:, None, :], w3[:, None, :])))
    return tl.reshape(tl.where(word >= threshold, scale, 0.0), [BLOCK_M, BLOCK_N])


@triton.jit
def element_keep_factor(index, k0, k1, threshold, scale):
    """The dropout factors of the elements at flat indices ``index`` (int64 tensor, any shape): each element
    draws its chunk's four words and keeps its run's (four times the Philox work of ``chunks_keep_factor``,
    for tiles that do not cover whole chunks)."""
    group = (index // (4 * LANE_STRIDE)) * LANE_STRIDE + index % LANE_STRIDE
    run = (index // LANE_STRIDE) % 4
    w0, w1, w2, w3 = group_words(group, k0, k1)
    word = tl.where(run == 0, w0, tl.where(run == 1, w1, tl.where(run == 2, w2, w3)))
    return tl.where(word >= threshold, scale, 0.0)
