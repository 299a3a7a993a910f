"""Host cost per call of the LayerNorm path, layer by layer, beside torch's, on the GPU.

    python3 -m scripts.host_overhead [--m 4096] [--n 1024,4096,16384] [--dtype bfloat16]

At M = 4096 a LayerNorm moves 8-130 MB: 2-30 us of memory time, the same order as a Python launch. This
times each layer of our path with the GPU kept busy elsewhere out of the picture: ``calls`` back-to-back
calls without synchronising, wall time per call (host-bound when the kernels are short), and the device
time of the same work replayed from a CUDA graph (no host at all). Layers: the public function, the
implementation below autograd (``_norm_fwd_impl`` / ``_norm_bwd_impl``), one launch with its arguments
prepared through Triton's ``kernel[grid]`` and through our ``FastLauncher``, torch's ``F.layer_norm`` and
its ATen backward; and ``.backward()`` through autograd, ours and torch's, as the benchmark times it.
"""

from __future__ import annotations

import kernels._mode  # noqa: F401  (picks CUDA or the interpreter before triton is imported)

# isort: split

import argparse

import torch
import torch.nn.functional as F

import kernels.layernorm.ops as ops
from benchmarks._harness import graph_us, host_us
from kernels.layernorm import configs, layer_norm


def report(m: int, n: int, dtype: torch.dtype) -> None:
    x = torch.randn(m, n, device="cuda", dtype=dtype)
    w = torch.rand(n, device="cuda", dtype=dtype) + 0.5
    b = torch.randn(n, device="cuda", dtype=dtype)
    dy = torch.randn_like(x)
    xg, wg, bg = (t.clone().requires_grad_(True) for t in (x, w, b))
    y_ours = layer_norm(xg, n, wg, bg)
    y_torch = F.layer_norm(xg, (n,), wg, bg)
    _, mean, rstd = ops._norm_fwd_impl(x, w, b, 1e-5, False)
    _, t_mean, t_rstd = torch.ops.aten.native_layer_norm(x, (n,), w, b, 1e-5)
    cfg = configs.forward(n)
    y = torch.empty_like(x)
    grid = (ops.cdiv(m, cfg["BLOCK_M"]),)

    def plain_triton_fwd():  # Triton's own launch path: kernel[grid](...)
        ops._layer_norm_fwd_kernel[grid](x, y, w, b, mean, rstd, m, n, x.stride(0), y.stride(0), 1e-5,
                                         IS_RMS=False, HAS_WEIGHT=True, HAS_BIAS=True, **cfg)

    fast = ops.kernel_for(ops._layer_norm_fwd_kernel, traceable=False)

    def fast_fwd():  # kernels._common.FastLauncher, what the eager path uses
        fast[grid](x, y, w, b, mean, rstd, m, n, x.stride(0), y.stride(0), 1e-5,
                   IS_RMS=False, HAS_WEIGHT=True, HAS_BIAS=True, **cfg)

    def backward(out):
        def run():
            for t in (xg, wg, bg):
                t.grad = None
            out.backward(dy, retain_graph=True)
        return run

    rows = [
        ("fwd  layer_norm (no grad)", lambda: layer_norm(x, n, w, b)),
        ("fwd  _norm_fwd_impl", lambda: ops._norm_fwd_impl(x, w, b, 1e-5, False)),
        ("fwd  Triton kernel[grid]", plain_triton_fwd),
        ("fwd  FastLauncher", fast_fwd),
        ("fwd  torch F.layer_norm", lambda: F.layer_norm(x, (n,), w, b)),
        ("bwd  _norm_bwd_impl", lambda: ops._norm_bwd_impl(dy, x, w, mean, rstd, False, True, False)),
        ("bwd  torch native_layer_norm_backward", lambda: torch.ops.aten.native_layer_norm_backward(
            dy, x, (n,), t_mean, t_rstd, w, b, [True, True, True])),
    ]
    # Host only: capturing autograd's backward in a CUDA graph fails and leaves the RNG state unusable.
    # .backward() with the grads reset is what the benchmark times.
    host_only = [
        ("fwd  layer_norm (requires grad)", lambda: layer_norm(xg, n, wg, bg)),
        ("fwd  torch F.layer_norm (requires grad)", lambda: F.layer_norm(xg, (n,), wg, bg)),
        ("bwd  .backward ours", backward(y_ours)),
        ("bwd  .backward torch", backward(y_torch)),
    ]
    print(f"\nM={m} N={n}: host us/call (back-to-back, no sync) | device us (CUDA graph replay)")
    for name, fn in rows:
        print(f"  {name:40s} {host_us(fn):7.1f} | {graph_us(fn):7.1f}", flush=True)
    for name, fn in host_only:
        print(f"  {name:40s} {host_us(fn):7.1f} |     n/a", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--m", type=int, default=4096)
    parser.add_argument("--n", default="1024,4096,16384")
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    print(torch.cuda.get_device_name(), "torch", torch.__version__, args.dtype)
    for n in (int(v) for v in args.n.split(",")):
        report(args.m, n, getattr(torch, args.dtype))


if __name__ == "__main__":
    main()
