"""Seeded dropout in Triton: Philox4x32-10 regenerated in-kernel, no mask ever stored.

Implements: ``philox4x32`` (the RNG) and ``philox_key`` (the key from run-time ints or from a seed on
the device), in-kernel helpers shared with the attention family, and ``_dropout_fwd_kernel``, which computes ``y = x * (word >= threshold ? 1/(1-p) : 0)``. Dropout is linear
in its input with a fixed mask, so the backward is the same kernel applied to ``dy`` with the same
seed: the mask is drawn again, not read.

Derived from: the Philox4x32 generator (Salmon et al., SC 2011); the index-to-counter scheme is this
project's and is stated, with the twin, in ``reference/dropout.py``.

Trade-off: one Philox call costs ~40 integer instructions for four words. Using all four words (one
call per four elements) rather than one word per element keeps the kernel bound by memory, not by the
integer pipes; the price is a fixed element-to-word layout (runs of ``LANE_STRIDE`` elements per word),
which the kernel matches with four contiguous loads so nothing is shuffled between threads.

Limits: contiguous input (the launcher makes a contiguous copy of a strided view); 64-bit offsets, so
any element count works.
"""

import triton
import triton.language as tl

# Elements per Philox-word run: part of the mask's definition. Keep in step with reference/dropout.py
# (the twin states the same constant; the tests compare the bits).
LANE_STRIDE_ELEMENTS = 1024
LANE_STRIDE = tl.constexpr(LANE_STRIDE_ELEMENTS)


@triton.jit
def philox4x32(c0, c1, c2, c3, k0, k1, ROUNDS: tl.constexpr = 10):
    """Philox4x32-ROUNDS on uint32 counter words ``c0..c3`` (tensors) with uint32 key ``k0, k1``.

    Each round: the 64-bit products ``M0*c0`` and ``M1*c2`` (one wide multiply each) are split into high
    and low halves and mixed with the other words and the key; the key gets the Weyl increments.
    """
    for _ in tl.static_range(ROUNDS):
        prod0 = c0.to(tl.uint64) * 0xD2511F53
        prod1 = c2.to(tl.uint64) * 0xCD9E8D57
        hi0 = (prod0 >> 32).to(tl.uint32)
        lo0 = prod0.to(tl.uint32)
        hi1 = (prod1 >> 32).to(tl.uint32)
        lo1 = prod1.to(tl.uint32)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0 = k0 + 0x9E3779B9
        k1 = k1 + 0xBB67AE85
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
def _scaled_where_kept(x, word, threshold, scale):
    """``x * scale`` where the word clears the threshold, ``x * 0`` elsewhere (NaN stays NaN, as torch)."""
    factor = tl.where(word >= threshold, scale, 0.0)
    return x.to(tl.float32) * factor


@triton.jit(do_not_specialize=["seed_lo", "seed_hi", "seed_in_memory", "threshold"])
def _dropout_fwd_kernel(
    x_ptr,  # (n,) contiguous input (dy in the backward)
    y_ptr,  # (n,) contiguous output, may alias x_ptr (in-place)
    n,  # element count
    seed_lo,  # low 32 bits of the seed (Philox key word 0)
    seed_hi,  # high 32 bits of the seed (Philox key word 1)
    seed_ptr,  # int64 seed on the device, read when seed_in_memory != 0 (see philox_key)
    seed_in_memory,
    threshold,  # keep iff word >= threshold, in [1, 2**32 - 1]
    scale,  # 1 / (1 - p), fp32
    CHUNKS: tl.constexpr,  # chunks of 4 * LANE_STRIDE elements per program
):
    k0, k1 = philox_key(seed_lo, seed_hi, seed_ptr, seed_in_memory)
    thr = tl.cast(threshold, tl.uint32)
    # Pin the scale to fp32 (what an eager launch passes): inductor's launcher may hand floats over wider,
    # and x * scale must round the same way in both.
    scale = tl.cast(scale, tl.float32)
    lane = tl.arange(0, LANE_STRIDE)
    out_ty = y_ptr.dtype.element_ty
    for step in tl.static_range(CHUNKS):
        chunk = tl.program_id(0).to(tl.int64) * CHUNKS + step
        base = chunk * (4 * LANE_STRIDE)
        # Issue the four loads before the Philox arithmetic so memory latency hides behind it.
        offs0 = base + lane
        offs1 = offs0 + LANE_STRIDE
        offs2 = offs1 + LANE_STRIDE
        offs3 = offs2 + LANE_STRIDE
        x0 = tl.load(x_ptr + offs0, mask=offs0 < n, eviction_policy="evict_first")
        x1 = tl.load(x_ptr + offs1, mask=offs1 < n, eviction_policy="evict_first")
        x2 = tl.load(x_ptr + offs2, mask=offs2 < n, eviction_policy="evict_first")
        x3 = tl.load(x_ptr + offs3, mask=offs3 < n, eviction_policy="evict_first")
        group = (chunk * LANE_STRIDE + lane).to(tl.uint64)
        zero = tl.zeros_like(lane).to(tl.uint32)
        w0, w1, w2, w3 = philox4x32(group.to(tl.uint32), (group >> 32).to(tl.uint32), zero, zero, k0, k1)
        tl.store(y_ptr + offs0, _scaled_where_kept(x0, w0, thr, scale).to(out_ty), mask=offs0 < n)
        tl.store(y_ptr + offs1, _scaled_where_kept(x1, w1, thr, scale).to(out_ty), mask=offs1 < n)
        tl.store(y_ptr + offs2, _scaled_where_kept(x2, w2, thr, scale).to(out_ty), mask=offs2 < n)
        tl.store(y_ptr + offs3, _scaled_where_kept(x3, w3, thr, scale).to(out_ty), mask=offs3 < n)
