"""Race hunt: the forward's log-sum-exp against fp32 torch over many small shapes, each launched many times,
with the default launch configs; optionally with Sq/Sk not specialised (`--no-specialize`)."""
import argparse

import torch
import triton

from kernels.attention import ops
from scripts.stress_attention_fwd_configs import count_bad


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dims", default="80")
    ap.add_argument("--seqs", default="1:1,1:2,2:1,2:2,1:17,17:1,3:3,17:17,65:65,1:200,200:1")
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument("--no-specialize", action="store_true")
    args = ap.parse_args()
    if args.no_specialize:
        ops._attn_fwd_kernel = triton.jit(do_not_specialize=["seed_lo", "seed_hi", "threshold", "Sq", "Sk"])(
            ops._attn_fwd_kernel.fn)
    for d in (int(x) for x in args.dims.split(",")):
        for pair in args.seqs.split(","):
            sq, sk = (int(x) for x in pair.split(":"))
            g = torch.Generator().manual_seed(sq * 10 + sk)
            q, k, v = (torch.randn(2, 4, s, d, generator=g).to("cuda", torch.float16) for s in (sq, sk, sk))
            for causal in (1, 0):
                cfg = ops._config("fwd", d, torch.float16)
                bad = count_bad(q, k, v, -1, 0 if causal else -1, cfg, args.iters)
                print(f"D={d} Sq={sq} Sk={sk} causal={causal}: {bad}/{args.iters} wrong", flush=True)


if __name__ == "__main__":
    main()
