"""Tests of kernels/_common: interpreter detection, the argument
checks and the seed source. They run in both modes and assert what each mode must do."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from kernels._common import (
    INTERPRETER,
    backend_for,
    check_float_dtype,
    check_probability,
    check_same_device,
    check_seed,
    draw_seed,
    interpreter_requested,
    splitmix64,
)
from kernels._mode import DEVICE
from kernels._mode import INTERPRETER as TEST_INTERPRETER


@pytest.mark.parametrize(
    ("value", "expected"),
    [("1", True), ("true", True), ("ON", True), (" yes ", True), ("0", False), ("", False), ("no", False)],
)
def test_interpreter_requested_parses_the_env_like_triton(value, expected):
    assert interpreter_requested({"TRITON_INTERPRET": value}) is expected


def test_interpreter_requested_defaults_to_off():
    assert interpreter_requested({}) is False


def test_library_and_tests_agree_on_the_mode():
    assert INTERPRETER is TEST_INTERPRETER


@triton.jit
def _copy_kernel(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=offs < n), mask=offs < n)


def test_jit_kernels_are_interpreted_exactly_in_interpreter_mode():
    from triton.runtime.interpreter import InterpretedFunction

    assert isinstance(_copy_kernel, InterpretedFunction) is INTERPRETER


def test_backend_dispatch_rule():
    assert backend_for(torch.empty(1)) == ("triton" if INTERPRETER else "reference")
    if torch.cuda.is_available():
        assert backend_for(torch.empty(1, device="cuda")) == "triton"
    with pytest.raises(ValueError, match="device meta"):
        backend_for(torch.empty(1, device="meta"))


def test_check_probability():
    assert check_probability("p", 0, allow_one=True) == 0.0
    assert check_probability("p", 1.0, allow_one=True) == 1.0
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match=r"p must be in \[0, 1\]"):
            check_probability("p", bad, allow_one=True)
    with pytest.raises(ValueError, match=r"dropout_p must be in \[0, 1\)"):
        check_probability("dropout_p", 1.0, allow_one=False)
    with pytest.raises(TypeError, match="p must be a float"):
        check_probability("p", "0.5", allow_one=True)


def test_check_float_dtype_and_devices():
    check_float_dtype("x", torch.empty(2, dtype=torch.bfloat16))
    check_float_dtype("x", torch.empty(2, dtype=torch.float64))  # the twin runs it
    with pytest.raises(TypeError, match=r"x must be a floating-point tensor with dtype in "
                                        r"\(float16, bfloat16, float32, float64\), got torch.int32"):
        check_float_dtype("x", torch.empty(2, dtype=torch.int32))
    with pytest.raises(TypeError, match=r"x must be a torch\.Tensor"):
        check_float_dtype("x", [1.0])
    check_same_device(a=torch.empty(1), b=None, c=torch.empty(1))
    with pytest.raises(ValueError, match="b is on meta but a is on cpu"):
        check_same_device(a=torch.empty(1), b=torch.empty(1, device="meta"))


def test_check_seed():
    assert check_seed("seed", None) is None
    assert check_seed("seed", 2**64 - 1) == 2**64 - 1
    assert check_seed("seed", torch.tensor(7)) == 7
    with pytest.raises(ValueError, match="seed must be in"):
        check_seed("seed", -1)
    with pytest.raises(TypeError, match="seed must be None or an int"):
        check_seed("seed", 1.5)


def test_splitmix64_matches_the_published_sequence():
    # SplitMix64 from state 0: the first two outputs of the reference generator.
    assert splitmix64(0) == 0xE220A8397B1DCDAF
    assert splitmix64(0x9E3779B97F4A7C15) == 0x6E789E6AA1B965F4


def test_draw_seed_follows_torch_manual_seed():
    torch.manual_seed(123)
    first = [draw_seed(torch.device(DEVICE)) for _ in range(3)]
    torch.manual_seed(123)
    again = [draw_seed(torch.device(DEVICE)) for _ in range(3)]
    assert first == again
    assert len(set(first)) == 3
    assert all(0 <= s < 2**64 for s in first)


def _run_python(code: str, **env_overrides) -> None:
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {**os.environ, **env_overrides}
    root = Path(__file__).resolve().parent.parent
    done = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


def test_reference_never_imports_kernels_or_triton():
    """The twins must not share code with the kernels: a twin that shares code with the kernel proves nothing."""
    _run_python(
        "import sys, reference\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('kernels', 'triton'))\n"
        "assert not bad, bad\n"
    )


def test_cpu_tensors_without_the_interpreter_run_the_twins():
    """CPU tensors run the reference twin unless TRITON_INTERPRET=1 was set before import."""
    _run_python(
        "import torch, torch.nn.functional as F\n"
        "import reference.dropout as twin\n"
        "from kernels.dropout import dropout\n"
        "from kernels.layernorm import layer_norm, rms_norm\n"
        "from kernels._common import INTERPRETER, backend_for\n"
        "x = torch.randn(3, 50)\n"
        "assert not INTERPRETER and backend_for(x) == 'reference'\n"
        "assert torch.equal(dropout(x, 0.3, seed=5), twin.dropout(x, 0.3, seed=5))\n"
        "xg = x.clone().requires_grad_(True)\n"
        "y = layer_norm(xg, 50)\n"
        "torch.testing.assert_close(y, F.layer_norm(x, (50,)))\n"
        "y.sum().backward()\n"
        "torch.testing.assert_close(rms_norm(x, 50), F.rms_norm(x, (50,)))\n",
        TRITON_INTERPRET="0",
    )


def test_concrete_scalar_passes_numbers_through_and_leaves_bools_alone():
    from kernels._common.validate import concrete_scalar

    assert concrete_scalar(0.25) == 0.25 and type(concrete_scalar(0.25)) is float
    assert concrete_scalar(2**64 - 1) == 2**64 - 1  # a full 64-bit seed is not squeezed into int64
    assert concrete_scalar(True) is True
    assert concrete_scalar(None) is None


def test_test_shards_split_round_robin_and_cover_everything(monkeypatch):
    from tests.conftest import _shard

    items = list(range(10))
    monkeypatch.setenv("FK_TEST_SHARD", "1/3")
    assert _shard(items) == [1, 4, 7]
    parts = []
    for index in range(3):
        monkeypatch.setenv("FK_TEST_SHARD", f"{index}/3")
        parts += _shard(items)
    assert sorted(parts) == items
    monkeypatch.setenv("FK_TEST_SHARD", "3/3")
    with pytest.raises(pytest.UsageError):
        _shard(items)
    monkeypatch.delenv("FK_TEST_SHARD")
    assert _shard(items) == items


def test_int_key_separates_what_triton_specialises_on():
    from kernels._common.launch import int_key

    assert int_key(1) != int_key(3)  # 1 becomes a constant
    assert int_key(32) != int_key(33)  # divisibility by 16
    assert int_key(2**31 - 16) != int_key(2**31)  # i32 -> i64
    assert int_key(2**63) != int_key(2**62)  # i64 -> u64
    assert int_key(-16) == int_key(48)


@triton.jit
def _scaled_copy_kernel(src_ptr, dst_ptr, n, stride, scale, bias_ptr, BLOCK: tl.constexpr, SHIFT: tl.constexpr = 0.0,
                        HAS_BIAS: tl.constexpr = False):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    x = tl.load(src_ptr + offsets * stride, mask=mask)
    y = x * scale + SHIFT
    if HAS_BIAS:
        y += tl.load(bias_ptr + offsets, mask=mask)
    tl.store(dst_ptr + offsets, y, mask=mask)


def test_eager_launches_take_the_plain_kernel_under_the_interpreter():
    from kernels._common import kernel_for
    from kernels._common.launch import FastLauncher

    launcher = kernel_for(_scaled_copy_kernel, traceable=False)
    assert (launcher is _scaled_copy_kernel) == INTERPRETER
    assert INTERPRETER or isinstance(launcher, FastLauncher)


@pytest.mark.cuda
def test_fast_launcher_matches_triton_for_every_specialisation():
    """Cached launches must use a kernel compiled for the same specialisation: misaligned views, ints equal
    to 1 or divisible by 16, constexpr defaults and overrides, an absent (None) pointer, after the first call
    of each. Run-time arguments by keyword take the plain launch (and are still right)."""
    from triton import knobs

    from kernels._common.launch import FastLauncher

    launcher = FastLauncher(_scaled_copy_kernel)
    base = torch.randn(4096 + 3, device="cuda", dtype=torch.float16)
    cases = [(base, 4096, 1, {}), (base[1:], 4095, 1, {}), (base[3:], 1, 1, {}), (base, 2048, 2, {}),
             (base[1:], 1365, 3, {"SHIFT": 1.5}), (base.float()[5:], 1000, 4, {"num_warps": 2}),
             (base, 512, 1, {"HAS_BIAS": True})]
    for _ in range(2):  # the second round takes the cached path
        for src, n, stride, extra in cases:
            dst = torch.full((n,), float("nan"), device="cuda", dtype=src.dtype)
            bias = base[7:] if extra.get("HAS_BIAS") else None  # None: an absent pointer
            launcher[(triton.cdiv(n, 128),)](src, dst, n, stride, 2.0, bias, BLOCK=128, **extra)
            expected = src[: n * stride : stride] * 2.0 + extra.get("SHIFT", 0.0)
            if bias is not None:
                expected = expected + bias[:n]
            torch.testing.assert_close(dst, expected)
    assert len(launcher._compiled) == len(cases)
    dst = torch.empty(512, device="cuda", dtype=base.dtype)
    launcher[(4,)](base, dst, 512, 1, scale=3.0, bias_ptr=None, BLOCK=128)  # run-time keywords: the plain launch
    torch.testing.assert_close(dst, base[:512] * 3.0)
    assert len(launcher._compiled) == len(cases)
    seen = []
    hook = lambda metadata: seen.append(metadata)
    knobs.runtime.launch_enter_hook.add(hook)
    try:
        dst = torch.empty(16, device="cuda", dtype=base.dtype)
        launcher[(1,)](base, dst, 16, 1, 1.0, None, BLOCK=128)
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert len(seen) == 1  # a profiler's hook sees the launch: the plain path ran
    torch.testing.assert_close(dst, base[:16])


@pytest.mark.cuda
def test_every_family_launch_takes_the_cached_path():
    """Each eager launch of the three families must be of the form FastLauncher caches (run-time arguments
    positional, constexprs by keyword): another form still runs, through Triton's slower plain launch, and
    nothing else would notice."""
    import kernels.attention.ops as attention_ops
    import kernels.dropout.ops as dropout_ops
    import kernels.layernorm.ops as layernorm_ops
    from kernels._common.launch import _fast_launcher
    from kernels.attention import flash_attention
    from kernels.dropout import dropout
    from kernels.layernorm import layer_norm, rms_norm

    x = torch.randn(64, 256, device="cuda", requires_grad=True)
    w = torch.ones(256, device="cuda", requires_grad=True)
    q, k, v = (torch.randn(1, 2, 128, 64, device="cuda", dtype=torch.float16, requires_grad=True) for _ in range(3))
    for _ in range(2):
        dropout(x, 0.5).sum().backward()
        layer_norm(x, 256, w, w).sum().backward()
        rms_norm(x, 256, w).sum().backward()
        for causal in (False, True):
            flash_attention(q, k, v, causal=causal, dropout_p=0.1).sum().backward()
    kernels = {obj for module in (attention_ops, dropout_ops, layernorm_ops) for obj in vars(module).values()
               if isinstance(obj, triton.runtime.jit.JITFunction)}
    launched = [kernel for kernel in kernels if any(cache[0] for cache in kernel.device_caches.values())]
    assert len(launched) >= 5
    missing = [kernel.__name__ for kernel in launched if not _fast_launcher(kernel)._compiled]
    assert not missing, f"launches that never take the cached path: {missing}"


def _gradients_of(run, inputs, seed: int):
    """Outputs and input gradients of ``run(*inputs)`` (a tensor or a tuple of them), its dropout seeded."""
    inputs = [t.detach().clone().requires_grad_(True) for t in inputs]
    outputs = run(*inputs, seed)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    torch.autograd.backward(outputs, [torch.ones_like(o) * 0.01 for o in outputs])
    return [o.detach() for o in outputs] + [t.grad for t in inputs]


def _replay_cases():
    from kernels.attention import flash_attention
    from kernels.layernorm import add_dropout_norm, layer_norm, rms_norm

    def qkv(b, hq, hkv, s, d, dtype=torch.bfloat16, bshd=False):
        shapes = [(b, hq, s, d), (b, hkv, s, d), (b, hkv, s, d)]
        if bshd:  # (B, S, H, D) storage viewed as (B, H, S, D)
            return [torch.randn(sh[0], sh[2], sh[1], sh[3], device="cuda", dtype=dtype).transpose(1, 2)
                    for sh in shapes]
        return [torch.randn(sh, device="cuda", dtype=dtype) for sh in shapes]

    x, r = (torch.randn(48, 768, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    w, b = (torch.randn(768, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    return {
        "attention causal p0.1": (lambda q, k, v, s: flash_attention(q, k, v, causal=True, dropout_p=0.1, seed=s),
                                  qkv(2, 4, 4, 200, 64)),
        "attention GQA window": (lambda q, k, v, s: flash_attention(q, k, v, window_size=(40, 8)),
                                 qkv(1, 8, 2, 130, 128, torch.float16)),
        "attention (B,S,H,D) views": (lambda q, k, v, s: flash_attention(q, k, v, causal=True), qkv(2, 4, 2, 96, 64,
                                                                                                    bshd=True)),
        "layer_norm": (lambda x, w, b, s: layer_norm(x, 768, w, b, deterministic=True), [x, w, b]),
        "rms_norm": (lambda x, w, s: rms_norm(x, 768, w, deterministic=True), [x, w]),
        "add_dropout_norm": (lambda x, r, w, b, s: add_dropout_norm(x, r, w, b, dropout_p=0.1, seed=s,
                                                                    deterministic=True), [x, r, w, b]),
        "add_dropout_norm rms fp32 residual": (
            lambda x, r, w, s: add_dropout_norm(x, r, w, kind="rms", dropout_p=0.2, seed=s, deterministic=True,
                                                residual_dtype=torch.float32), [x, r.float(), w]),
    }


@pytest.mark.cuda
@pytest.mark.parametrize("attention_path", ["auto", "hopper"])
def test_replayed_launches_equal_launches_built_anew(monkeypatch, attention_path):
    """An eager call records its launches and later calls of the same signature replay them with their own
    tensors and seed: the results must be bit for bit those of launches built anew, for every op that replays,
    and the replay must really happen (a signature whose recording failed builds its launches every time). On
    the ``hopper`` path the attention calls run the Gluon kernels, whose TMA arguments a replay makes anew."""
    import kernels._common.launch as launch
    import kernels.attention.ops as attention_ops
    import kernels.layernorm.ops as layernorm_ops
    from kernels.attention import configs

    if attention_path == "hopper" and not configs.is_hopper(torch.device("cuda")):
        pytest.skip("the hopper path needs an sm_90 GPU")
    monkeypatch.setenv(configs.PATH_ENV, attention_path)

    caches = [attention_ops._FORWARD_CALLS, attention_ops._BACKWARD_CALLS, layernorm_ops._NORM_FORWARD_CALLS,
              layernorm_ops._NORM_BACKWARD_CALLS, layernorm_ops._ADD_DROPOUT_NORM_CALLS]
    for name, (run, inputs) in _replay_cases().items():
        monkeypatch.setattr(launch, "PREPARED_LAUNCH", False)
        expected = [_gradients_of(run, inputs, seed) for seed in (11, 12)]
        monkeypatch.setattr(launch, "PREPARED_LAUNCH", True)
        launch.forget_recorded_launches()
        for round_ in range(2):  # the first call of each signature records, the others replay
            for seed, want in zip((11, 12), expected, strict=True):
                got = _gradients_of(run, inputs, seed)
                for g, e in zip(got, want, strict=True):
                    assert torch.equal(g, e), f"{name}, round {round_}, seed {seed}"
        recorded = [entry for cache in caches for entry in cache._entries.values()]
        assert recorded and all(isinstance(entry, launch.RecordedCall) for entry in recorded), name


@pytest.mark.cuda
@pytest.mark.parametrize("attention_path", ["auto", "hopper"])
def test_attention_calls_with_a_device_seed_replay_their_launches(monkeypatch, attention_path):
    """A seed on the device (how compiled graphs and CUDA graphs pass ``seed=None``) is one of a replay's tensors:
    the launches recorded with one seed tensor replay with another, bit for bit as launches built anew, forward
    and backward (on the ``hopper`` path the backward is the Gluon kernel's), and the replay really happens."""
    import kernels._common.launch as launch
    import kernels.attention.ops as attention_ops
    from kernels.attention import configs

    if attention_path == "hopper" and not configs.is_hopper(torch.device("cuda")):
        pytest.skip("the hopper path needs an sm_90 GPU")
    monkeypatch.setenv(configs.PATH_ENV, attention_path)
    q, k, v, do = (torch.randn(2, 4, 256, 64, device="cuda", dtype=torch.bfloat16) for _ in range(4))

    def run(seed):
        o, lse = attention_ops._fwd_impl(q, k, v, -1, 0, 0.125, 0.1, seed)
        return (o, lse, *attention_ops._bwd_impl(do, q, k, v, o, lse, -1, 0, 0.125, 0.1, seed))

    seeds = [torch.tensor(value, dtype=torch.int64, device="cuda") for value in (11, -12)]
    monkeypatch.setattr(launch, "PREPARED_LAUNCH", False)
    expected = [run(seed) for seed in seeds]
    assert not torch.equal(expected[0][0], expected[1][0]), "the two seeds must draw different masks"
    monkeypatch.setattr(launch, "PREPARED_LAUNCH", True)
    launch.forget_recorded_launches()
    for round_ in range(2):  # the first call records, the others replay
        for seed, want in zip(seeds, expected, strict=True):
            for got, e in zip(run(seed), want, strict=True):
                assert torch.equal(got, e), f"round {round_}, seed {seed.item()}"
    recorded = [entry for cache in (attention_ops._FORWARD_CALLS, attention_ops._BACKWARD_CALLS)
                for entry in cache._entries.values()]
    assert len(recorded) == 2 and all(isinstance(entry, launch.RecordedCall) for entry in recorded)


@pytest.mark.cuda
def test_a_replay_refuses_a_misaligned_tensor_and_builds_the_launch_anew():
    """The recorded kernel may assume 16-byte aligned pointers: a call with the same shapes and strides but a
    misaligned input must not replay it."""
    import kernels._common.launch as launch
    from kernels.attention import flash_attention

    launch.forget_recorded_launches()
    storage = torch.randn(3 * 2 * 64 * 64 + 8, device="cuda", dtype=torch.float16)
    aligned = [storage[i * 8192: i * 8192 + 8192].view(1, 2, 64, 64) for i in range(3)]
    shifted = [storage[i * 8192 + 1: i * 8192 + 8193].view(1, 2, 64, 64) for i in range(3)]
    flash_attention(*aligned, causal=True)  # records
    got = flash_attention(*shifted, causal=True)
    expected = flash_attention(*[t.clone() for t in shifted], causal=True)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def _plan_cases():
    """Calls of the ops that store checked plans (``kernels._common.eager``), small enough for the interpreter:
    name -> (run(*inputs, seed), inputs)."""
    from kernels.attention import flash_attention, flash_attention_varlen
    from kernels.dropout import dropout
    from kernels.layernorm import add_dropout_norm, layer_norm, rms_norm

    def randn(*shape):
        return torch.randn(*shape, device=DEVICE)

    cu = torch.tensor([0, 5, 24], dtype=torch.int32, device=DEVICE)

    return {
        "dropout": (lambda x, s: dropout(x, 0.25, seed=s), [randn(6, 32)]),
        "layer_norm": (lambda x, w, b, s: layer_norm(x, (32,), w, b), [randn(3, 2, 32), randn(32), randn(32)]),
        "rms_norm": (lambda x, w, s: rms_norm(x, 32, w), [randn(6, 32), randn(32)]),
        "add_dropout_norm": (lambda x, r, w, b, s: add_dropout_norm(x, r, w, b, dropout_p=0.25, seed=s),
                             [randn(6, 32), randn(6, 32), randn(32), randn(32)]),
        "add_dropout_norm rms": (lambda x, w, s: add_dropout_norm(x, None, w, kind="rms", eps=None, seed=s),
                                 [randn(3, 2, 32), randn(32)]),
        "flash_attention": (lambda q, k, v, s: flash_attention(q, k, v, causal=True, dropout_p=0.25, seed=s,
                                                               window_size=(8, 4)),
                            [randn(1, 2, 24, 16), randn(1, 1, 24, 16), randn(1, 1, 24, 16)]),
        "flash_attention_varlen": (lambda q, k, v, s: flash_attention_varlen(q, k, v, cu, cu, 19, 19, causal=True,
                                                                             dropout_p=0.25, seed=s,
                                                                             window_size=(8, 4)),
                                   [randn(24, 2, 16), randn(24, 1, 16), randn(24, 1, 16)]),
    }


def _plan_caches():
    import kernels.attention.ops as attention_ops
    import kernels.dropout.ops as dropout_ops
    import kernels.layernorm.ops as layernorm_ops

    return [attention_ops._PLANS, attention_ops._VARLEN_PLANS, layernorm_ops._ADD_DROPOUT_NORM_PLANS,
            layernorm_ops._NORM_PLANS, dropout_ops._DROPOUT_PLANS]


def test_checked_plans_give_what_the_checks_give(monkeypatch):
    """A call that takes a stored plan must give, bit for bit, what the same call gives after checking its arguments,
    forward and gradients, an explicit seed and a drawn one (``seed=None`` under ``torch.manual_seed``); and plans
    must really be stored and taken."""
    import kernels._common.eager as eager

    for name, (run, inputs) in _plan_cases().items():
        for seed in (5, None):
            for cache in _plan_caches():  # earlier tests leave plans behind
                cache.clear()
            monkeypatch.setattr(eager, "EAGER_PLANS", False)
            torch.manual_seed(1)
            expected = [_gradients_of(run, inputs, seed) for _ in range(2)]
            assert not any(cache._entries for cache in _plan_caches()), name
            monkeypatch.setattr(eager, "EAGER_PLANS", True)
            torch.manual_seed(1)
            got = [_gradients_of(run, inputs, seed) for _ in range(2)]  # the first call stores, the second takes
            for g_call, e_call in zip(got, expected, strict=True):
                for g, e in zip(g_call, e_call, strict=True):
                    assert torch.equal(g, e), f"{name}, seed {seed}"
            assert sum(len(cache._entries) for cache in _plan_caches()) == 1, name


def test_a_stored_plan_leaves_no_argument_unchecked():
    """Arguments equal as dict keys but refused by the checks (``True == 1``), seeds out of range and values a plan
    does not cover must still raise after a plan was stored for their look-alikes; grad mode and autocast are read
    anew."""
    from kernels.attention import flash_attention
    from kernels.layernorm import add_dropout_norm

    x, r, w = torch.randn(4, 32, device=DEVICE), torch.randn(4, 32, device=DEVICE), torch.randn(32, device=DEVICE)
    for _ in range(2):  # the second round takes the plans the first stored
        add_dropout_norm(x, r, w, eps=1, dropout_p=0)
        with pytest.raises(TypeError, match="eps"):
            add_dropout_norm(x, r, w, eps=True, dropout_p=0)
        with pytest.raises(TypeError, match="dropout_p"):
            add_dropout_norm(x, r, w, eps=1, dropout_p=False)
        for seed in (-1, 2**64):
            with pytest.raises(ValueError, match="seed"):
                add_dropout_norm(x, r, w, eps=1, dropout_p=0, seed=seed)
    q = torch.randn(1, 2, 16, 16, device=DEVICE)
    for _ in range(2):
        flash_attention(q, q, q, window_size=(1, 0), softmax_scale=1)
        with pytest.raises(TypeError, match="window_size"):
            flash_attention(q, q, q, window_size=(True, 0), softmax_scale=1)
        with pytest.raises(TypeError, match="softmax_scale"):
            flash_attention(q, q, q, window_size=(1, 0), softmax_scale=True)
        with pytest.raises(ValueError, match="seed"):
            flash_attention(q, q, q, window_size=(1, 0), softmax_scale=1, dropout_p=0.5, seed=-1)

    from kernels.attention import flash_attention_varlen

    packed = torch.randn(16, 2, 16, device=DEVICE)
    cu = torch.tensor([0, 7, 16], dtype=torch.int32, device=DEVICE)
    for _ in range(2):
        flash_attention_varlen(packed, packed, packed, cu, cu, 9, 9, causal=True)
        with pytest.raises(TypeError, match="max_seqlen_q"):
            flash_attention_varlen(packed, packed, packed, cu, cu, True, 9, causal=True)
        if DEVICE == "cpu":  # lengths are read back on every CPU call, plan or not
            with pytest.raises(ValueError, match="more than max_seqlen_q"):
                flash_attention_varlen(packed, packed, packed, cu, cu, 8, 9, causal=True)

    from kernels.dropout import dropout
    from kernels.layernorm import layer_norm, rms_norm

    for _ in range(2):
        layer_norm(x, 32, w, eps=1)
        rms_norm(x, [32], w)  # a list: no plan (not a dict key), checked every time
        dropout(x, 0.5, seed=3)
        with pytest.raises(TypeError, match="eps"):
            layer_norm(x, 32, w, eps=True)
        with pytest.raises(TypeError, match="normalized_shape"):
            layer_norm(x, 32.0, w, eps=1)
        with pytest.raises(ValueError, match="normalized_shape"):
            rms_norm(x, [16], w[:16])
        with pytest.raises(TypeError, match="p must"):
            dropout(x, True, seed=3)
        with pytest.raises(ValueError, match="seed"):
            dropout(x, 0.5, seed=-1)
        assert dropout(x, 0.5, training=False) is x and dropout(x, 0.0, seed=3) is x

    leaf = x.clone().requires_grad_(True)
    autocast_dtypes = []
    for _ in range(2):
        assert add_dropout_norm(leaf, r, w)[0].grad_fn is not None
        assert layer_norm(leaf, 32, w).grad_fn is not None and dropout(leaf, 0.5).grad_fn is not None
        with torch.no_grad():
            assert add_dropout_norm(leaf, r, w)[0].grad_fn is None
            assert layer_norm(leaf, 32, w).grad_fn is None and dropout(leaf, 0.5).grad_fn is None
        with torch.autocast(DEVICE, dtype=torch.bfloat16):  # CUDA: in fp32, as torch's norm; CPU: untouched
            autocast_dtypes.append(layer_norm(leaf.bfloat16(), 32, w.bfloat16()).dtype)
    assert autocast_dtypes == [torch.float32 if DEVICE == "cuda" else torch.bfloat16] * 2
    # flags that are not plain bools take the checks (bool() per call) and give what the bools give
    for _ in range(2):
        assert torch.equal(flash_attention(q, q, q, causal=1), flash_attention(q, q, q, causal=True))
    q32 = q.clone().requires_grad_(True)
    for _ in range(2):
        assert flash_attention(q32, q32, q32).dtype == torch.float32
        with torch.autocast(DEVICE, dtype=torch.bfloat16):
            assert flash_attention(q32, q32, q32).dtype == torch.bfloat16


def test_a_replay_with_tma_arguments_passes_what_tritons_wrapper_passes(monkeypatch):
    """A replayed launch with TMA arguments lays its arguments out for Triton's compiled launcher itself (each
    tensor map kept by address); it must pass exactly what Triton 3.6's wrapper would have passed."""
    from triton.backends.nvidia import driver

    from kernels._common import launch

    encoded = []

    def encode(arg, meta):  # stands in for the CUDA tensor-map encoder, which needs a GPU
        encoded.append(arg.base.data_ptr())
        return [("map", arg.base.data_ptr(), tuple(arg.block_shape), meta), *arg.shape, *arg.strides]

    monkeypatch.setattr(driver, "make_tensordesc_arg", encode)
    monkeypatch.setattr(launch, "_current_raw_stream", lambda device: 7)
    calls = []
    # kernel parameters: (x_desc, n, ptr, y_desc, seed) then one constexpr; TMA arguments at 0 and 3
    signature = {0: "tensordesc<bf16[1, 64, 32]>", 1: "i32", 2: "*bf16", 3: "tensordesc<bf16[1, 16, 32]>", 4: "i32",
                 5: "constexpr"}
    wrapped = driver.wrap_handle_tensordesc(lambda *args: calls.append(args), signature, ["meta-x", "meta-y"])
    leading = ("coop", "pdl", None, None, "packed", None, None, None)
    entry = (wrapped, "function", leading, ("BLOCK",))
    x, y, z = torch.zeros(4, 64, 32), torch.zeros(8, 16, 32), torch.zeros(3)
    prepared = launch.PreparedLaunch(entry, (5, 1, 1), [None, 96, None, None, None], [(2, 2)], [(4, 0)], 0,
                                     [(0, 0, (1, 64, 32), "layout-x"), (3, 1, (1, 16, 32), "layout-y")])
    assert prepared._expanded is not None

    def through_tritons_wrapper(tensors, ints):
        values = [launch.TmaTensor(tensors[0], (1, 64, 32), "layout-x"), 96, tensors[2].data_ptr(),
                  launch.TmaTensor(tensors[1], (1, 16, 32), "layout-y"), ints[0]]
        wrapped(5, 1, 1, 7, "function", *leading, *values, "BLOCK")

    # the signature fixes the shapes: between replays only the addresses and the ints change
    for tensors, ints in [((x, y, z), (11,)), ((x, y, z), (12,))]:
        prepared([t.data_ptr() for t in tensors], ints, tensors)
        through_tritons_wrapper(tensors, ints)
        assert calls[-2] == calls[-1]
    x2 = torch.zeros(4, 64, 32)  # a new address: its tensor map is encoded, the known ones are not
    before = len(encoded)
    prepared([x2.data_ptr(), y.data_ptr(), z.data_ptr()], (14,), (x2, y, z))
    assert encoded[before:] == [x2.data_ptr()]
    through_tritons_wrapper((x2, y, z), (14,))
    assert calls[-2] == calls[-1]
