# ruff: noqa: B023  (each lambda is timed immediately, inside the iteration that defines it)
"""Does loading K/V (and Q) through Hopper tensor descriptors (TMA) speed up the forward at the points
where it ties FlexAttention (S = 1024, non-causal)? Issue 6's remaining lead, measured before wiring it in.

    PYTHONPATH=$PWD python3 scripts/probe_attention_tma_fwd.py [--rounds 5] [--dtype float16]

A minimal copy of the forward's unmasked loop (non-causal, no dropout, D = BLOCK_D, S a multiple of the
blocks: the benchmark's points) in three variants: pointer loads (as the library kernel), tensor
descriptors made in the kernel (``tl.make_tensor_descriptor``, TMA), and descriptors with a
warp-specialised loop (``tl.range(..., warp_specialize=True)``). Timed in interleaved rounds beside the
library's ``flash_attention``, the library's forward kernel launched directly with the same configs
(``lib``), and the benchmark's compiled FlexAttention. The warp-specialised loop is tried with 8 warps only:
with 4 warps Triton 3.6 produced NaN outputs and then an illegal memory access on the H200.
"""

from __future__ import annotations

import argparse
import math

import torch
import triton
import triton.language as tl

import kernels.attention.ops as ops
from benchmarks._harness import interleaved_medians
from benchmarks.bench_attention import _flex
from kernels.attention import flash_attention


@triton.jit
def _probe_fwd_kernel(q_ptr, k_ptr, v_ptr, o_ptr, S, scale_log2, H: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, D: tl.constexpr, MODE: tl.constexpr, STAGES: tl.constexpr):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    base = bh.to(tl.int64) * S * D
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    if MODE == 0:
        q = tl.load(q_ptr + base + offs_m[:, None] * D + offs_d[None, :])
    else:
        q_desc = tl.make_tensor_descriptor(q_ptr + base, shape=[S, D], strides=[D, 1], block_shape=[BLOCK_M, D])
        k_desc = tl.make_tensor_descriptor(k_ptr + base, shape=[S, D], strides=[D, 1], block_shape=[BLOCK_N, D])
        v_desc = tl.make_tensor_descriptor(v_ptr + base, shape=[S, D], strides=[D, 1], block_shape=[BLOCK_N, D])
        q = q_desc.load([pid_m * BLOCK_M, 0])
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    for start_n in tl.range(0, S, BLOCK_N, num_stages=STAGES, warp_specialize=MODE == 2):
        if MODE == 0:
            k = tl.load(k_ptr + base + (start_n + offs_n)[:, None] * D + offs_d[None, :])
        else:
            k = k_desc.load([start_n, 0])
        s = tl.dot(q, tl.trans(k)) * scale_log2
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if MODE == 0:
            v = tl.load(v_ptr + base + (start_n + offs_n)[:, None] * D + offs_d[None, :])
        else:
            v = v_desc.load([start_n, 0])
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    o = acc / l_i[:, None]
    tl.store(o_ptr + base + offs_m[:, None] * D + offs_d[None, :], o.to(o_ptr.dtype.element_ty))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dtype", default="float16")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, args.dtype,
          "non-causal forward, TFLOP/s (median of interleaved rounds)")
    configs = {64: [(64, 64, 4, 3), (128, 64, 8, 3), (128, 64, 4, 3)], 128: [(64, 64, 4, 3), (128, 64, 8, 3)]}
    for s in (1024, 4096):
        for d in (64, 128):
            b, h = 16 * 1024 // s, 2048 // d
            q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=dtype) for _ in range(3))
            o = torch.empty_like(q)
            o_lib, lse = torch.empty_like(q), torch.empty(b, h, s, device="cuda", dtype=torch.float32)
            scale_log2 = 1 / math.sqrt(d) * 1.4426950408889634
            ref = flash_attention(q, k, v)
            flex = _flex(s, False)
            runs = {"library": lambda: flash_attention(q, k, v), "flex": lambda: flex(q, k, v)}
            for bm, bn, warps, stages in configs[d]:
                cfg = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_D": d, "EVEN_D": True, "num_warps": warps,
                       "num_stages": stages}
                runs[f"lib{(bm, bn, warps, stages)}"] = lambda cfg=cfg: ops._launch_fwd(
                    q, k, v, o_lib, lse, -1, -1, 1 / math.sqrt(d), cfg)
                for mode, label in ((0, "ptr"), (1, "tma"), (2, "tma+ws")):
                    if mode == 2 and warps < 8:
                        continue
                    def launch(bm=bm, bn=bn, warps=warps, stages=stages, mode=mode):
                        _probe_fwd_kernel[(s // bm, b * h)](q, k, v, o, s, scale_log2, H=h, BLOCK_M=bm, BLOCK_N=bn,
                                                            D=d, MODE=mode, STAGES=stages, num_warps=warps)
                    runs[f"{label}{(bm, bn, warps, stages)}"] = launch

            def check(name):
                if name not in ("library", "flex"):
                    out = o_lib if name.startswith("lib(") else o
                    err = (out.float() - ref.float()).abs().max().item()
                    assert err < 2e-2, f"wrong output (max error {err})"

            medians = interleaved_medians(runs, args.rounds, check=check, label=f"S={s} D={d} ")
            flops = 4 * b * h * s * s * d
            ranked = sorted(medians.items(), key=lambda kv: kv[1])
            print(f"S={s:5} D={d:3} " + "  ".join(f"{n}: {flops / t / 1e9:4.0f}" for n, t in ranked), flush=True)


if __name__ == "__main__":
    main()
