"""Model benchmark: the GPT example (``examples/gpt.py``) trained with fused-kernels against plain torch.

Each point trains a fresh model for ``STEPS`` AdamW steps per backend ("ours": the fused backend; "torch":
``nn.LayerNorm``, ``nn.Dropout``, SDPA), eager and under ``torch.compile(fullgraph=True)``, dropout 0.1 and 0,
bf16 autocast, at three sizes: two GPU-bound ones (8 layers, d_model 1024, 16 heads, seq 1024, batch 8: head
dim 64; 8 layers, d_model 2048, 16 heads, seq 2048, batch 4: head dim 128) and the example's default
(4 layers, d_model 512, 8 heads, seq 256, batch 16). The two backends of a point train in ``ROUNDS``
alternating runs; ``ms`` is the median over runs of each run's median step time after ``WARMUP`` steps.

``TIMING`` (``FUSED_KERNELS_MODEL_TIMING``) picks how steps are timed (``examples.gpt.train``): "pipelined" (the
default) trains as a trainer that reads its losses later does, the host queueing the next step while the GPU runs
this one, and times each step by CUDA events at successive step starts; "synchronized" waits for the GPU before and
after each step and times it on the host, so every step pays the host's time to queue its first kernels and the
GPU's to finish its last ones on top of whichever of the two is longer. Each record's shape says which
(``step_timing``).

FLOPs (for TFLOP/s and the fraction of the matmul ceiling, i.e. model FLOPs utilisation): per token
``6 * parameters + 6 * layers * seq * d_model`` (the causal attention scores and P·V, forward and backward).
Extras per record: ``tokens_per_s``, and ``loss_last`` (mean loss of the last five steps of the last run:
under bf16 the trajectory is chaotic, so losses are compared as these means, never step by step).

Smoke mode (no GPU): a one-layer toy, eager only, a few steps.
"""

from __future__ import annotations

import os
import statistics

import pytest
import torch

from benchmarks._harness import SMOKE
from examples.gpt import GPT, GPTConfig, train
from kernels._mode import DEVICE

#: (layers, d_model, heads, seq, batch)
SIZES = [(1, 32, 2, 16, 2)] if SMOKE else [(8, 1024, 16, 1024, 8), (8, 2048, 16, 2048, 4), (4, 512, 8, 256, 16)]
STEPS = 4 if SMOKE else int(os.environ.get("FUSED_KERNELS_MODEL_STEPS", "30"))
WARMUP = 1 if SMOKE else 10  # compile, autotuning and allocator warm-up stay out of the median
ROUNDS = 1 if SMOKE else int(os.environ.get("FUSED_KERNELS_MODEL_ROUNDS", "2"))
LAST_STEPS = 5
TIMING = os.environ.get("FUSED_KERNELS_MODEL_TIMING", "pipelined")
if TIMING not in ("pipelined", "synchronized"):
    raise ValueError(f"FUSED_KERNELS_MODEL_TIMING must be 'pipelined' or 'synchronized', got {TIMING!r}")
BACKENDS = {"ours": "fused", "torch": "torch"}


def _flops_per_step(config: GPTConfig, batch: int) -> float:
    params = sum(p.numel() for p in GPT(config).parameters())
    per_token = 6 * params + 6 * config.n_layer * config.seq_len * config.d_model
    return per_token * batch * config.seq_len


@pytest.mark.parametrize("dropout", [0.1, 0.0])
@pytest.mark.parametrize("mode", ["eager"] if SMOKE else ["eager", "compile"])
@pytest.mark.parametrize(("layers", "d_model", "heads", "seq", "batch"), SIZES, ids=str)
def test_model(benchmark, recorder, layers, d_model, heads, seq, batch, mode, dropout):
    autocast = None if SMOKE else torch.bfloat16
    runs: dict[str, list] = {provider: [] for provider in BACKENDS}

    def train_all():
        for _ in range(ROUNDS):
            for provider, backend in BACKENDS.items():
                config = GPTConfig(seq_len=seq, n_layer=layers, n_head=heads, d_model=d_model, dropout=dropout,
                                   backend=backend)
                runs[provider].append(train(config, steps=STEPS, batch=batch, device=DEVICE, autocast_dtype=autocast,
                                            compile_model=mode == "compile",
                                            pipelined=TIMING == "pipelined"))

    benchmark.group = f"model {mode} dropout {dropout}"
    benchmark.pedantic(train_all, rounds=1, iterations=1)
    config = GPTConfig(seq_len=seq, n_layer=layers, n_head=heads, d_model=d_model, dropout=dropout)
    flops = _flops_per_step(config, batch)
    for provider, results in runs.items():
        ms = statistics.median(r.median_step_ms(WARMUP) for r in results)
        last = results[-1].losses[-LAST_STEPS:]
        record = recorder.add(
            family="model", provider=provider, direction="fwd+bwd", dtype=autocast or torch.float32,
            shape={"mode": mode, "layers": layers, "d_model": d_model, "heads": heads, "seq": seq, "batch": batch,
                   "dropout": dropout, "step_timing": TIMING},
            ms=ms, x_key="d_model", flops=flops,
            extra={"tokens_per_s": batch * seq / (ms * 1e-3), "loss_last": sum(last) / len(last)},
        )
        benchmark.extra_info[provider] = record
