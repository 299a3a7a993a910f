"""Which forward launch configs give a wrong log-sum-exp on a fixed input, and how often (race hunt)."""
import itertools
import sys

import torch

from kernels.attention import ops


def count_bad(q, k, v, left, right, cfg, iters):
    scale = q.shape[-1] ** -0.5
    ref = (q.float() @ k.float().transpose(-1, -2) * scale)
    sq, sk = q.shape[2], k.shape[2]
    if right == 0:
        i = torch.arange(sq, device=q.device)[:, None]
        j = torch.arange(sk, device=q.device)[None, :]
        ref = ref.masked_fill(j > i + sk - sq, float("-inf"))
    ref = ref.logsumexp(-1)
    bad = 0
    for _ in range(iters):
        o = torch.empty_like(q)
        lse = torch.empty(q.shape[:3], device=q.device, dtype=torch.float32)
        ops._launch_fwd(q, k, v, o, lse, left, right, scale, cfg)
        if not torch.allclose(lse, ref, atol=1e-3, rtol=1e-3):
            bad += 1
    return bad


def main():
    shape = [int(x) for x in (sys.argv[1] if len(sys.argv) > 1 else "2,4,4,1,1,80").split(",")]
    iters = int(sys.argv[2]) if len(sys.argv) > 2 else 200
    b, hq, hkv, sq, sk, d = shape
    g = torch.Generator().manual_seed(b * 1000 + sq * 10 + sk)
    q = torch.randn(b, hq, sq, d, generator=g).to("cuda", torch.float16)
    k = torch.randn(b, hkv, sk, d, generator=g).to("cuda", torch.float16)
    v = torch.randn(b, hkv, sk, d, generator=g).to("cuda", torch.float16)
    base = ops._config("fwd", d, torch.float16)
    for causal in (1, 0):
        right = 0 if causal else -1
        for bm, bn, w, s in itertools.product((128, 64), (64, 32), (8, 4), (3, 2, 1)):
            cfg = dict(base, BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=s)
            print(f"causal={causal} BLOCK_M={bm} BLOCK_N={bn} warps={w} stages={s}: "
                  f"{count_bad(q, k, v, -1, right, cfg, iters)}/{iters} wrong", flush=True)


if __name__ == "__main__":
    main()
