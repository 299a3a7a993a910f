"""Merging a partial attention result into a running one through their log-sum-exps, in one pass (Triton).

Implements ``reference.attention.merge_partial`` (read beside it): the online softmax's merge at the granularity of
whole key sets, as context-parallel attention needs it (``kernels/attention/context_parallel.py``). A row that has
attended to two disjoint key sets, with outputs ``o_a``, ``o_b`` (each normalised over its own keys) and
log-sum-exps ``lse_a``, ``lse_b`` (natural log), has attended to their union with

    lse = log(exp(lse_a) + exp(lse_b)),   o = exp(lse_a - lse) o_a + exp(lse_b - lse) o_b,

computed from ``m = max(lse_a, lse_b)`` so nothing overflows; a row that has seen no key on either side (both
``-inf``) keeps a zero output and ``-inf``.

``_merge_kernel``: one program per (block of ``BLOCK_M`` rows, batch * head) reads the running output and
log-sum-exp at rows ``row0 ..`` of its tensors, the partial ones, and writes the merged output (into the running one
in place, or into a tensor of another dtype: the last merge writes the caller's dtype) and log-sum-exp. Any strides
but a contiguous head dim; the running output may be fp32 or the inputs' dtype (the math is fp32 either way).

Limits: dense (B, H, S, D) tensors, log-sum-exps (B, H, S) fp32 with stride 1 along the sequence. Trade-off: against
torch's eager merge (six passes over the rows and two temporaries) it reads each operand once and writes once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._common import cdiv, kernel_for


@triton.jit
def _merge_kernel(out_ptr, lse_ptr, part_ptr, part_lse_ptr, dst_ptr, row0, rows, H, D,
                  so_b, so_h, so_s, sp_b, sp_h, sp_s, sd_b, sd_h, sd_s, sl_b, sl_h, spl_b, spl_h,
                  BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    pid_m, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    r = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    c = tl.arange(0, BLOCK_D)
    row_ok = r < rows
    mask = row_ok[:, None] & (c < D)[None, :]
    lse_old = tl.load(lse_ptr + b * sl_b + h * sl_h + row0 + r, mask=row_ok, other=float("-inf"))
    lse_part = tl.load(part_lse_ptr + b * spl_b + h * spl_h + r, mask=row_ok, other=float("-inf"))
    m = tl.maximum(lse_old, lse_part)
    seen = m > float("-inf")
    m_safe = tl.where(seen, m, 0.0)
    w_old = tl.where(seen, tl.exp(lse_old - m_safe), 0.0)
    w_part = tl.where(seen, tl.exp(lse_part - m_safe), 0.0)
    total = w_old + w_part
    inv = tl.where(seen, 1.0 / tl.where(seen, total, 1.0), 0.0)
    o_old = tl.load(out_ptr + b * so_b + h * so_h + (row0 + r)[:, None] * so_s + c[None, :], mask=mask, other=0.0)
    o_part = tl.load(part_ptr + b * sp_b + h * sp_h + r[:, None] * sp_s + c[None, :], mask=mask, other=0.0)
    merged = (o_old.to(tl.float32) * (w_old * inv)[:, None] + o_part.to(tl.float32) * (w_part * inv)[:, None])
    tl.store(dst_ptr + b * sd_b + h * sd_h + (row0 + r)[:, None] * sd_s + c[None, :],
             merged.to(dst_ptr.dtype.element_ty), mask=mask)
    merged_lse = tl.where(seen, m_safe + tl.log(tl.where(seen, total, 1.0)), float("-inf"))
    tl.store(lse_ptr + b * sl_b + h * sl_h + row0 + r, merged_lse, mask=row_ok)


def merge_partial(out: torch.Tensor, lse: torch.Tensor, row0: int, part: torch.Tensor, part_lse: torch.Tensor,
                  dst: torch.Tensor | None = None) -> None:
    """Merge ``part`` (B, H, rows, D) with log-sum-exp ``part_lse`` (B, H, rows) into rows ``row0 ..`` of the running
    ``out`` (B, H, S, D) and ``lse`` (B, H, S) fp32: ``lse`` in place, the merged output into ``dst`` (``out``'s
    shape, any float dtype; ``out`` itself, in place, when None)."""
    dst = out if dst is None else dst
    b, h, rows, d = part.shape
    if b * h * rows == 0:
        return
    block_d = triton.next_power_of_2(d)
    block_m = max(1, min(64, 4096 // block_d))
    kernel_for(_merge_kernel, traceable=False)[(cdiv(rows, block_m), b * h)](
        out, lse, part, part_lse, dst, row0, rows, h, d, *out.stride()[:3], *part.stride()[:3], *dst.stride()[:3],
        *lse.stride()[:2], *part_lse.stride()[:2], BLOCK_M=block_m, BLOCK_D=block_d,
    )
