"""Rotary position embedding (RoPE) in one pass: ``_rotary_kernel``.

Implements ``reference.attention.apply_rotary`` (read beside it): with ``x = (x1, x2)`` split at ``D / 2`` and the
cosine and sine rows of the token's position split the same way, ``out1 = x1 c1 - x2 s1`` and
``out2 = x2 c2 + x1 s2`` (transformers' ``x * cos + rotate_half(x) * sin``). One program per (block of positions,
batch * head): it reads each element of x once, the cosine and sine rows of its positions, and writes the output
once, in fp32 arithmetic rounded once. The backward is the same kernel (``BACKWARD``): the rotation's transpose,
``dx1 = g1 c1 + g2 s2`` and ``dx2 = g2 c2 - g1 s1``, is the forward with the sine halves swapped and negated.

Limits: even head dims, up to the family's largest; cos and sin (B or 1, S, D) in any strides (a batch stride of 0
broadcasts one table); x (B, H, S, D) in any strides. The trade-off: the eager composition it replaces reads and writes
x five times (negation, concatenation, two products, the sum) and rounds after each; this reads it once, at the cost
of a launch per tensor.
"""

import triton
import triton.language as tl


@triton.jit
def _rotary_kernel(
    x_ptr, cos_ptr, sin_ptr, out_ptr,
    stride_xb, stride_xh, stride_xs, stride_xd,
    stride_cb, stride_cs, stride_cd,  # cos's and sin's (they share their strides)
    stride_ob, stride_oh, stride_os, stride_od,
    H, S, HALF,
    BACKWARD: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    pid_s = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    offs_s = pid_s * BLOCK_S + tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_HALF)
    mask = (offs_s < S)[:, None] & (offs_d < HALF)[None, :]
    rows = offs_s[:, None].to(tl.int64)
    b64 = b.to(tl.int64)
    h64 = h.to(tl.int64)
    x1_ptrs = x_ptr + b64 * stride_xb + h64 * stride_xh + rows * stride_xs + offs_d[None, :] * stride_xd
    table = b64 * stride_cb + rows * stride_cs + offs_d[None, :] * stride_cd
    c1_ptrs = cos_ptr + table
    s1_ptrs = sin_ptr + table
    x1 = tl.load(x1_ptrs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x1_ptrs + HALF * stride_xd, mask=mask, other=0.0).to(tl.float32)
    c1 = tl.load(c1_ptrs, mask=mask, other=0.0).to(tl.float32)
    c2 = tl.load(c1_ptrs + HALF * stride_cd, mask=mask, other=0.0).to(tl.float32)
    if BACKWARD:  # the transpose: the sine halves swapped and negated
        s1 = -tl.load(s1_ptrs + HALF * stride_cd, mask=mask, other=0.0).to(tl.float32)
        s2 = -tl.load(s1_ptrs, mask=mask, other=0.0).to(tl.float32)
    else:
        s1 = tl.load(s1_ptrs, mask=mask, other=0.0).to(tl.float32)
        s2 = tl.load(s1_ptrs + HALF * stride_cd, mask=mask, other=0.0).to(tl.float32)
    out1 = x1 * c1 - x2 * s1
    out2 = x2 * c2 + x1 * s2
    o_ptrs = out_ptr + b64 * stride_ob + h64 * stride_oh + rows * stride_os + offs_d[None, :] * stride_od
    tl.store(o_ptrs, out1.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(o_ptrs + HALF * stride_od, out2.to(out_ptr.dtype.element_ty), mask=mask)
