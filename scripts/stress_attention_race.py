"""Hunt the intermittent dV error of (B=2, H=4, Sq=Sk=1, D=80, causal, fp16): run forward and backward many
times on fixed inputs and report which output ever differs from the first run, bit for bit."""
import argparse

import torch

from kernels.attention import ops


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="2,4,4,1,1,80")
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--causal", type=int, default=1)
    ap.add_argument("--dtype", default="float16")
    args = ap.parse_args()
    b, hq, hkv, sq, sk, d = (int(x) for x in args.shape.split(","))
    dtype = getattr(torch, args.dtype)
    g = torch.Generator().manual_seed(b * 1000 + sq * 10 + sk)
    q = torch.randn(b, hq, sq, d, generator=g).to("cuda", dtype)
    k = torch.randn(b, hkv, sk, d, generator=g).to("cuda", dtype)
    v = torch.randn(b, hkv, sk, d, generator=g).to("cuda", dtype)
    do = torch.randn_like(q)
    left, right = (-1, 0) if args.causal else (-1, -1)
    scale = d ** -0.5
    o0, lse0 = ops._fwd_impl(q, k, v, left, right, scale)
    grads0 = ops._bwd_impl(do, q, k, v, o0, lse0, left, right, scale)
    ref_lse = (q.float() @ k.float().transpose(-1, -2) * scale).logsumexp(-1)
    print("lse0 vs fp32 max err", (lse0 - ref_lse).abs().max().item(),
          "dv0 vs do err", (grads0[2] - do).abs().max().item())
    bad = {"o": 0, "lse": 0, "dq": 0, "dk": 0, "dv_fixed_lse": 0}
    examples = []
    for it in range(args.iters):
        # garbage in fresh allocations, so that a read of unwritten memory shows
        junk = torch.full((1 << 20,), float("nan"), device="cuda", dtype=torch.float32)
        del junk
        o, lse = ops._fwd_impl(q, k, v, left, right, scale)
        if not torch.equal(o, o0):
            bad["o"] += 1
        if not torch.equal(lse, lse0):
            bad["lse"] += 1
            if len(examples) < 5:
                examples.append(("lse", it, (lse - lse0).abs().max().item(), lse.flatten()[:8].tolist()))
        dq, dk, dv = ops._bwd_impl(do, q, k, v, o0, lse0, left, right, scale)
        for name, t, t0 in (("dq", dq, grads0[0]), ("dk", dk, grads0[1]), ("dv_fixed_lse", dv, grads0[2])):
            if not torch.equal(t, t0):
                bad[name] += 1
                if len(examples) < 10:
                    examples.append((name, it, (t.float() - t0.float()).abs().max().item()))
    torch.cuda.synchronize()
    print("shape", args.shape, "causal", args.causal, args.dtype, "iters", args.iters, "mismatches", bad)
    for e in examples:
        print("  ", e)


if __name__ == "__main__":
    main()
