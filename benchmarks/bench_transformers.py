"""transformers benchmark: real model families trained and run with ``kernels.transformers`` against their own SDPA.

Providers per point: ``sdpa`` (the model as transformers builds it, ``attn_implementation="sdpa"``),
``fused-kernels`` (the same model after ``kernels.transformers.apply``: our attention and norms, and torch's
one-kernel tanh-GELU for a chain of eager ops), ``sdpa+liger`` (Liger's RMSNorm patch,
``apply_liger_kernel_to_llama(rms_norm=True)`` with its other patches off, on the models Liger has a patch for; left
out when Liger is not installed) and ``sdpa+gelu-tanh`` (``apply``'s activation swap alone, on the models it changes:
GPT-2; what of ``fused-kernels``' speed is not our kernels'). Every provider of a point starts from the same weights,
in bf16 parameters. ``fused-kernels`` runs its eager calls on the Python path (the compiled eager tier turned
off); eager points add ``fused-kernels-native``: the same model with the tier on (``kernels/_native``, the default),
where its extension builds.

Points (record keys ``model``, ``mode`` (eager / compile: ``torch.compile(model)``), ``task`` (train / generate),
``padding`` (the fraction of pad tokens in the batch)):
- ``llama``: ``LlamaConfig`` hidden 2048, 8 layers, 16 heads, 4 key/value heads, intermediate 5632, batch 4 x 2048
  tokens; a train step is forward, the causal-LM loss, backward and a fused AdamW step;
- ``gpt2``: ``GPT2Config`` 1024 wide, 24 layers, 16 heads (head dim 64, ~350M parameters), dropout 0.1, batch 8 x
  1024;
- ``bert``: ``BertForMaskedLM`` hidden 1024, 12 layers, 16 heads, batch 64 x 512 with 30% right padding (lengths
  spread evenly from 40% to 100% of 512), the masked-LM loss on 15% of the tokens;
- generation on the Llama: 256 new tokens (greedy) after a 2048-token prompt, batch 1 and 16, eager.

A train point times ``STEPS`` steps after ``WARMUP`` per provider, in ``ROUNDS`` interleaved rounds (every provider
once per round); ``ms`` is the median over rounds of each round's median step (CUDA events at step starts, the host
pipelining as a trainer does). A generation point times whole ``generate`` calls, prompt included, synchronised.
``tokens_per_s`` counts every position of the batch (pads too) per step, or the new tokens of a generation;
``peak_mib`` is the most memory allocated during the timed steps beyond what was allocated before them (the
weights, gradients and optimizer states of every provider stay resident).

Select points with pytest's ``-k`` (``-k "llama and eager"``, ``-k generate``). Smoke mode (no GPU): tiny
configurations, eager, a few steps.
"""

from __future__ import annotations

import copy
import os
import statistics
import time

import pytest
import torch

import kernels._native as native_tier
from benchmarks._harness import SMOKE
from kernels._mode import DEVICE

transformers = pytest.importorskip("transformers")

import kernels.transformers as fused  # noqa: E402  (needs transformers)

STEPS = 3 if SMOKE else int(os.environ.get("FUSED_KERNELS_HF_STEPS", "10"))
WARMUP = 1 if SMOKE else 3  # compile, autotuning and allocator warm-up stay out of the median
ROUNDS = 1 if SMOKE else int(os.environ.get("FUSED_KERNELS_HF_ROUNDS", "3"))
DTYPE = torch.float32 if SMOKE else torch.bfloat16
NEW_TOKENS = 4 if SMOKE else 256


def _models() -> dict[str, dict]:
    """name -> config, batch, seq, padding fraction (the smoke mode's tiny versions without a GPU)."""
    if SMOKE:
        tiny = {"vocab_size": 97}
        llama = transformers.LlamaConfig(**tiny, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2)
        gpt2 = transformers.GPT2Config(**tiny, n_embd=64, n_layer=1, n_head=4, n_positions=32)
        bert = transformers.BertConfig(**tiny, hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                                       intermediate_size=96, max_position_embeddings=32)
        return {"llama": {"config": llama, "batch": 2, "seq": 16, "padding": 0.0},
                "gpt2": {"config": gpt2, "batch": 2, "seq": 16, "padding": 0.0},
                "bert": {"config": bert, "batch": 4, "seq": 16, "padding": 0.3}}
    return {
        "llama": {"config": transformers.LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=8,
                                                     num_attention_heads=16, num_key_value_heads=4,
                                                     max_position_embeddings=4096),
                  "batch": 4, "seq": 2048, "padding": 0.0},
        "gpt2": {"config": transformers.GPT2Config(n_embd=1024, n_layer=24, n_head=16, n_positions=1024,
                                                   resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1),
                 "batch": 8, "seq": 1024, "padding": 0.0},
        "bert": {"config": transformers.BertConfig(hidden_size=1024, num_hidden_layers=12, num_attention_heads=16,
                                                   intermediate_size=4096, max_position_embeddings=512),
                 "batch": 64, "seq": 512, "padding": 0.3},
    }


def _liger_patch(name: str):
    """Liger's norm patch for model ``name`` (a function of the model), or None: no patch for this family, Liger
    not installed, or smoke mode (Liger's kernels need a GPU)."""
    if SMOKE or name != "llama":
        return None
    try:
        from liger_kernel.transformers.monkey_patch import apply_liger_kernel_to_llama
    except ImportError:
        return None
    from transformers.models.llama import modeling_llama

    def patch(model):
        cls = modeling_llama.LlamaRMSNorm
        try:  # it also swaps the module's class for models built later: undone, so it touches this model only
            apply_liger_kernel_to_llama(rope=False, cross_entropy=False, fused_linear_cross_entropy=False,
                                        swiglu=False, rms_norm=True, model=model)
        finally:
            modeling_llama.LlamaRMSNorm = cls
        return model

    return patch


#: the provider that takes only the activation swap of ``kernels.transformers.apply`` (torch's one-kernel tanh-GELU
#: for a chain of eager ops): what of ``fused-kernels``' speed is not our kernels'
GELU_PROVIDER = "sdpa+gelu-tanh"

#: the provider that runs the ``fused-kernels`` model with the compiled eager tier on
NATIVE_PROVIDER = "fused-kernels-native"


def _with_tier(fn, on: bool):
    """``fn`` run with the compiled eager tier turned on or off, whatever the environment says."""

    def run(*args, **kwargs):
        with native_tier.switched(on):
            return fn(*args, **kwargs)

    return run


def _native_variant(fn):
    """``fn`` run with the compiled eager tier on, or None where its extension cannot be built (and in smoke mode,
    which runs the interpreter)."""
    if SMOKE or native_tier.module() is None:
        return None
    return _with_tier(fn, True)


def _build(name: str, config) -> torch.nn.Module:
    torch.manual_seed(0)
    cls = transformers.BertForMaskedLM if name == "bert" else transformers.AutoModelForCausalLM
    with torch.device(DEVICE):
        model = (cls(config) if name == "bert" else cls.from_config(config, attn_implementation="sdpa"))
    model.set_attn_implementation("sdpa")
    return model.to(DTYPE)


def _providers(name: str, config) -> dict[str, torch.nn.Module]:
    base = _build(name, config)
    models = {"sdpa": base, "fused-kernels": copy.deepcopy(base)}
    fused.apply(models["fused-kernels"])
    liger = _liger_patch(name)
    if liger is not None:
        models["sdpa+liger"] = liger(copy.deepcopy(base))
    activations_only = copy.deepcopy(base)
    if fused.apply(activations_only, attention=False, norms=False):  # the model has a tanh-GELU chain
        models[GELU_PROVIDER] = activations_only
    return models


def _batch(name: str, point: dict) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    batch, seq, vocab = point["batch"], point["seq"], point["config"].vocab_size
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    if name != "bert":
        return {"input_ids": ids.to(DEVICE), "labels": ids.to(DEVICE)}
    # right padding: lengths evenly from 40% to 100% of seq, in random order: 30% of the positions are padding
    lengths = torch.linspace(0.4 * seq, seq, batch).round().long()[torch.randperm(batch, generator=g)]
    mask = (torch.arange(seq)[None] < lengths[:, None]).long()
    chosen = (torch.rand(batch, seq, generator=g) < 0.15) & mask.bool()
    labels = torch.where(chosen, ids, torch.full_like(ids, -100))
    return {"input_ids": ids.to(DEVICE), "attention_mask": mask.to(DEVICE), "labels": labels.to(DEVICE)}


def _train_run(model, step_fn, steps: int) -> tuple[float, float]:
    """Median step ms of ``steps`` timed steps after ``WARMUP``, and the peak MiB allocated beyond the start."""
    for _ in range(WARMUP):
        step_fn()
    if SMOKE:
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            step_fn()
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times), 0.0
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    events = [torch.cuda.Event(enable_timing=True) for _ in range(steps + 1)]
    for i in range(steps):
        events[i].record()
        step_fn()
    events[-1].record()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - before) / 2**20
    return statistics.median(events[i].elapsed_time(events[i + 1]) for i in range(steps)), peak


def _step(model, optimizer, batch: dict, compiled):
    def step():
        compiled(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


@pytest.mark.parametrize("mode", ["eager"] if SMOKE else ["eager", "compile"])
@pytest.mark.parametrize("name", ["llama", "gpt2", "bert"])
def test_train(benchmark, recorder, name, mode):
    point = _models()[name]
    models = _providers(name, point["config"])
    batch = _batch(name, point)
    steps = {}
    for provider, model in models.items():
        model.train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=not SMOKE)
        steps[provider] = _step(model, optimizer, batch, torch.compile(model) if mode == "compile" else model)
    native = _native_variant(steps["fused-kernels"]) if mode == "eager" else None
    steps["fused-kernels"] = _with_tier(steps["fused-kernels"], False)
    if native is not None:  # the same model and optimizer, trained in turn with the tier on
        steps[NATIVE_PROVIDER] = native
    runs: dict[str, list[tuple[float, float]]] = {provider: [] for provider in steps}

    def train_all():
        for _ in range(ROUNDS):
            for provider, step in steps.items():
                runs[provider].append(_train_run(models.get(provider), step, STEPS))

    benchmark.group = f"transformers train {name} {mode}"
    benchmark.pedantic(train_all, rounds=1, iterations=1)
    tokens = point["batch"] * point["seq"]
    padding = 0.0 if "attention_mask" not in batch else round(1 - batch["attention_mask"].float().mean().item(), 3)
    for provider, results in runs.items():
        ms = statistics.median(r[0] for r in results)
        record = recorder.add(
            family="transformers", provider=provider, direction="fwd+bwd", dtype=DTYPE,
            shape={"model": name, "mode": mode, "task": "train", "padding": padding, "batch": point["batch"],
                   "seq": point["seq"]},
            ms=ms, x_key="batch", tokens=tokens, extra={"peak_mib": max(r[1] for r in results)},
        )
        benchmark.extra_info[provider] = record


@pytest.mark.parametrize("batch", [1, 2] if SMOKE else [1, 16])
def test_generate(benchmark, recorder, batch):
    point = _models()["llama"]
    prompt = 8 if SMOKE else 2048
    models = _providers("llama", point["config"])
    ids = torch.randint(0, point["config"].vocab_size, (batch, prompt), generator=torch.Generator().manual_seed(2))
    ids = ids.to(DEVICE)
    kwargs = {"attention_mask": torch.ones_like(ids), "max_new_tokens": NEW_TOKENS, "min_new_tokens": NEW_TOKENS,
              "do_sample": False, "pad_token_id": 0}
    calls = {provider: model.generate for provider, model in models.items()}
    native = _native_variant(models["fused-kernels"].generate)
    calls["fused-kernels"] = _with_tier(calls["fused-kernels"], False)
    if native is not None:
        calls[NATIVE_PROVIDER] = native
    runs: dict[str, list[float]] = {provider: [] for provider in calls}
    outputs = {}

    def generate(provider):
        if not SMOKE:
            torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.no_grad():
            outputs[provider] = calls[provider](ids, **kwargs)
        if not SMOKE:
            torch.cuda.synchronize()
        return (time.perf_counter() - start) * 1e3

    def generate_all():
        for model in models.values():
            model.eval()
            model.generation_config.eos_token_id = None  # every call makes NEW_TOKENS tokens
        for provider in calls:
            generate(provider)  # warm-up: kernels compiled, caches allocated
        for _ in range(ROUNDS):
            for provider in calls:
                runs[provider].append(generate(provider))

    benchmark.group = f"transformers generate batch {batch}"
    benchmark.pedantic(generate_all, rounds=1, iterations=1)
    for provider, times in runs.items():
        assert outputs[provider].shape == (batch, prompt + NEW_TOKENS)
        record = recorder.add(
            family="transformers", provider=provider, direction="fwd", dtype=DTYPE,
            shape={"model": "llama", "mode": "eager", "task": "generate", "padding": 0.0, "batch": batch,
                   "seq": prompt},
            ms=statistics.median(times), x_key="batch", tokens=batch * NEW_TOKENS,
        )
        benchmark.extra_info[provider] = record
