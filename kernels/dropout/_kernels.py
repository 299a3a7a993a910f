"""Seeded dropout in Triton: Philox4x32-10 regenerated in-kernel, no mask ever stored.

Implements ``_dropout_fwd_kernel``, which computes ``y = x * (word >= threshold ? 1/(1-p) : 0)`` with
the Philox4x32-10 words of ``kernels._common.philox`` (shared with attention's dropout). Dropout is linear
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

from kernels._common.philox import LANE_STRIDE, chunk_words, philox_key, scaled_where_kept


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
        w0, w1, w2, w3 = chunk_words(chunk, k0, k1)
        tl.store(y_ptr + offs0, scaled_where_kept(x0, w0, thr, scale).to(out_ty), mask=offs0 < n)
        tl.store(y_ptr + offs1, scaled_where_kept(x1, w1, thr, scale).to(out_ty), mask=offs1 < n)
        tl.store(y_ptr + offs2, scaled_where_kept(x2, w2, thr, scale).to(out_ty), mask=offs2 < n)
        tl.store(y_ptr + offs3, scaled_where_kept(x3, w3, thr, scale).to(out_ty), mask=offs3 < n)
