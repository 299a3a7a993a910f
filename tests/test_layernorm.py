"""LayerNorm / RMSNorm: kernel vs twin vs torch for y, dx, dW, dB; layouts, dtypes, the lock scheme and
the deterministic mode, modules and errors.

Accuracy rule: error against a float64 reference at most 2x torch's own error in the same dtype plus a
small atol (tests/_numerics.py).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import kernels.layernorm.ops as ops
import reference.dropout as reference_dropout
import reference.layernorm as twin
from kernels._mode import DEVICE, FLOAT_DTYPES, INTERPRETER, by_mode
from kernels.dropout import dropout
from kernels.layernorm import LayerNorm, RMSNorm, layer_norm, rms_norm
from tests._numerics import assert_no_worse_than_torch

WIDTHS = by_mode(interpreter=[1, 2, 7, 64, 1000, 4097, 20000],
                 cuda=[1, 2, 7, 64, 1000, 4097, 8192, 16384, 65536, 100000])
HEIGHTS = by_mode(interpreter=[1, 3, 17], cuda=[1, 3, 4096, 65536])
MAX_ELEMENTS = by_mode(interpreter=60_000, cuda=1 << 27)
ATOL = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float32: 2e-5}


def _shapes():
    return [(m, n) for m in HEIGHTS for n in WIDTHS if m * n <= MAX_ELEMENTS]


def _run(fn, x, params, dy):
    """Forward and backward of ``fn(x, *params)``: returns (y, dx, *dparams)."""
    x = x.detach().requires_grad_(True)
    params = [p.detach().requires_grad_(True) if p is not None else None for p in params]
    y = fn(x, *params)
    grads = torch.autograd.grad(y, [x] + [p for p in params if p is not None], dy)
    return (y.detach(), *grads)


def _inputs(m, n, dtype, *, affine_dtype=None, with_bias=True):
    affine_dtype = affine_dtype or dtype
    x = (torch.randn(m, n, device=DEVICE) * 2 + 0.5).to(dtype)
    w = (torch.rand(n, device=DEVICE) + 0.5).to(affine_dtype)
    b = torch.randn(n, device=DEVICE).to(affine_dtype) if with_bias else None
    dy = torch.randn(m, n, device=DEVICE).to(dtype)
    return x, w, b, dy


def _check_against_torch(kind, x, w, b, dy, eps):
    """Ours vs torch in x's dtype (params cast to it: torch's CUDA kernels refuse mixed dtypes) vs float64."""
    low = [p.to(x.dtype) if p is not None else None for p in (w, b)]
    if kind == "layer":
        ours = _run(lambda t, *p: layer_norm(t, t.shape[-1], *p, eps=eps), x, [w, b], dy)
        theirs = _run(lambda t, *p: F.layer_norm(t, (t.shape[-1],), *p, eps=eps), x, low, dy)
        ref = _run(lambda t, *p: F.layer_norm(t, (t.shape[-1],), *p, eps=eps), x.double(),
                   [p.double() if p is not None else None for p in (w, b)], dy.double())
    else:
        ours = _run(lambda t, *p: rms_norm(t, t.shape[-1], *p, eps=eps), x, [w], dy)
        theirs = _run(lambda t, *p: F.rms_norm(t, (t.shape[-1],), *p, eps=eps), x, low[:1], dy)
        ref = _run(lambda t, *p: F.rms_norm(t, (t.shape[-1],), *p, eps=eps), x.double(),
                   [w.double() if w is not None else None], dy.double())
    names = ["y", "dx", "dw", "db"]
    expected_dtypes = [x.dtype, x.dtype] + [p.dtype for p in (w, b) if p is not None]
    atol = ATOL[x.dtype]
    for name, o, t, r, dt in zip(names, ours, theirs, ref, expected_dtypes, strict=False):
        assert o.dtype == dt, f"{name}: dtype {o.dtype}, expected {dt}"
        # dW/dB sum over M rows: their absolute error grows with M.
        slack = atol * (max(1, x.shape[0]) ** 0.5 if name in ("dw", "db") else 1)
        assert_no_worse_than_torch(name, o, t, r, atol=slack)
    return ours


@pytest.mark.parametrize("kind", ["layer", "rms"])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize(("m", "n"), _shapes(), ids=str)
def test_matches_torch_within_its_own_error(kind, dtype, m, n):
    x, w, b, dy = _inputs(m, n, dtype)
    _check_against_torch(kind, x, w, b if kind == "layer" else None, dy, 1e-5)


@pytest.mark.parametrize("offset", [300.0, -2000.0], ids=str)
@pytest.mark.parametrize("n", [1000, 20000], ids=str)  # one tile; the chunked path
def test_offset_rows_keep_their_variance_in_fp16(offset, n):
    """Rows far from zero (mean / std up to ~2000, fp16's limit): a one-pass variance E[x^2] - mean^2 in
    fp32 fails here (checked), the kernel's must match torch within its own error."""
    x = (torch.randn(3, n, device=DEVICE) + offset).to(torch.float16)
    w, dy = torch.rand(n, device=DEVICE) + 0.5, torch.randn(3, n, device=DEVICE).to(torch.float16)
    _check_against_torch("layer", x, w, torch.randn(n, device=DEVICE), dy, 1e-5)


@pytest.mark.parametrize("kind", ["layer", "rms"])
@pytest.mark.parametrize(("m", "n"), [(5, 7), (3, 1000), (2, 20000)], ids=str)
def test_kernel_equals_twin(kind, m, n):
    x, w, b, dy = _inputs(m, n, torch.float32)
    if kind == "layer":
        y, mean, rstd = twin.layer_norm_forward(x, w, b, 1e-5)
        dx, dw, db = twin.layer_norm_backward(dy, x, w, mean, rstd)
        ours = _run(lambda t, *p: layer_norm(t, n, *p), x, [w, b], dy)
        expected = (y, dx, dw, db)
    else:
        y, rstd = twin.rms_norm_forward(x, w, 1e-6)
        dx, dw = twin.rms_norm_backward(dy, x, w, rstd)
        ours = _run(lambda t, *p: rms_norm(t, n, *p, eps=1e-6), x, [w], dy)
        expected = (y, dx, dw)
    for o, e in zip(ours, expected, strict=True):
        torch.testing.assert_close(o, e.to(o.dtype), rtol=1e-4, atol=1e-4 * max(1, m) ** 0.5)


@pytest.mark.parametrize("kind", ["layer", "rms"])
@pytest.mark.parametrize("n", by_mode(interpreter=[2, 7, 33], cuda=[2, 7, 17, 33, 100, 1000, 5000, 40000]), ids=str)
def test_every_column_is_normalized_with_the_stored_statistics(kind, n):
    """y must be exactly ``(x - mean) * rstd`` with the *stored* fp32 mean and rstd, in every column.

    The lanes that share a row each hold a copy of its statistics; if they round differently (the
    compiler once fused a lane's own square into the cross-lane add) the columns of a row get 1/std one
    ulp apart and the stored copy is whichever lane won the shared-memory write. Without weight or bias
    the kernel's y is one sub and one mul per element, the same two roundings as torch's expression.
    """
    m = by_mode(interpreter=9, cuda=4099)
    x = torch.randn(m, n, device=DEVICE) * 3 + 1
    y, mean, rstd = ops._norm_fwd_impl(x, None, None, 1e-5, kind == "rms")
    centered = x if kind == "rms" else x - mean[:, None]
    assert torch.equal(y, centered * rstd[:, None])


def test_twin_backward_equals_autograd_in_float64():
    x = torch.randn(6, 33, dtype=torch.float64)
    w, b, dy = torch.randn(33, dtype=torch.float64), torch.randn(33, dtype=torch.float64), torch.randn_like(x)
    _, mean, rstd = twin.layer_norm_forward(x, w, b, 1e-5)
    auto = torch.autograd.grad(F.layer_norm(x.requires_grad_(), (33,), w.requires_grad_(), b.requires_grad_()),
                               (x, w, b), dy)
    for hand, ad in zip(twin.layer_norm_backward(dy, x, w, mean.double(), rstd.double()), auto, strict=True):
        torch.testing.assert_close(hand.double(), ad, rtol=1e-6, atol=1e-6)
    _, rstd = twin.rms_norm_forward(x, w, 1e-6)
    auto = torch.autograd.grad(F.rms_norm(x, (33,), w, 1e-6), (x, w), dy)
    for hand, ad in zip(twin.rms_norm_backward(dy, x, w, rstd.double()), auto, strict=True):
        torch.testing.assert_close(hand.double(), ad, rtol=1e-6, atol=1e-6)


def test_twin_grouped_reduction_equals_the_plain_sum():
    dy, xhat = torch.randn(37, 9), torch.randn(37, 9)
    dw, buffers = twin.grouped_weight_grad(dy, xhat, rows_per_program=4, group_size_m=3)
    torch.testing.assert_close(dw, (dy * xhat).sum(0))
    assert buffers.shape == (3, 9)


@pytest.mark.parametrize("dtype", [d for d in FLOAT_DTYPES if d != torch.float32], ids=str)
def test_mixed_precision_fp32_affine_with_low_precision_input(dtype):
    x, w, b, dy = _inputs(9, 300, dtype, affine_dtype=torch.float32)
    y, _, dw, db = _check_against_torch("layer", x, w, b, dy, 1e-5)
    assert y.dtype == dtype and dw.dtype == torch.float32 and db.dtype == torch.float32


@pytest.mark.parametrize("kind", ["layer", "rms"])
@pytest.mark.parametrize("n", [100, 8200], ids=str)  # the single-kernel and the wide (split-row) backward
def test_no_weight_no_bias(kind, n):
    x, _, _, dy = _inputs(7, n, torch.float32)
    _check_against_torch(kind, x, None, None, dy, 1e-5)
    if kind == "layer":
        x, w, _, dy = _inputs(7, n, torch.float32)
        _check_against_torch(kind, x, w, None, dy, 1e-5)


def test_multi_dim_normalized_shape_and_leading_dims():
    x = torch.randn(2, 3, 4, 5, device=DEVICE, requires_grad=True)
    w = torch.randn(4, 5, device=DEVICE, requires_grad=True)
    b = torch.randn(4, 5, device=DEVICE, requires_grad=True)
    y = layer_norm(x, (4, 5), w, b)
    y_ref = F.layer_norm(x, (4, 5), w, b)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    dy = torch.randn_like(y)
    for a, r in zip(torch.autograd.grad(y, (x, w, b), dy), torch.autograd.grad(y_ref, (x, w, b), dy), strict=True):
        torch.testing.assert_close(a, r, rtol=1e-4, atol=1e-4)
        assert a.shape == r.shape


def test_non_contiguous_input_and_row_strided_view():
    base = torch.randn(40, 130, device=DEVICE)
    for view in (base[:, :100], base.t()[:60], base[::2, 5:105]):
        torch.testing.assert_close(layer_norm(view, view.shape[-1]), F.layer_norm(view, (view.shape[-1],)),
                                   rtol=1e-5, atol=1e-5)
    x = torch.randn(16, 64, device=DEVICE, requires_grad=True)
    dy = torch.randn(64, 16, device=DEVICE).t()  # non-contiguous gradient
    (dx,) = torch.autograd.grad(layer_norm(x, 64), x, dy)
    (dx_ref,) = torch.autograd.grad(F.layer_norm(x, (64,)), x, dy)
    torch.testing.assert_close(dx, dx_ref, rtol=1e-4, atol=1e-4)


def test_width_one_gives_bias_and_zero_dx():
    x = torch.randn(5, 1, device=DEVICE, requires_grad=True)
    w = torch.randn(1, device=DEVICE, requires_grad=True)
    b = torch.randn(1, device=DEVICE, requires_grad=True)
    y = layer_norm(x, 1, w, b)
    torch.testing.assert_close(y, b.detach().expand(5, 1))
    (dx,) = torch.autograd.grad(y.sum(), x)
    assert torch.equal(dx, torch.zeros_like(dx))


def test_empty_batch():
    x = torch.randn(0, 3, 8, device=DEVICE, requires_grad=True)
    w = torch.ones(8, device=DEVICE, requires_grad=True)
    y = layer_norm(x, 8, w)
    assert y.shape == x.shape
    dx, dw = torch.autograd.grad(y.sum(), (x, w))
    assert dx.shape == x.shape and torch.equal(dw, torch.zeros_like(dw))


@pytest.mark.parametrize("kind", ["layer", "rms"])
@pytest.mark.parametrize(("m", "n"), by_mode(interpreter=[(33, 100), (5, 20000)],
                                             cuda=[(4096, 1024), (4096, 16384), (1000, 100000)]), ids=str)
def test_deterministic_mode_is_bitwise_reproducible(kind, m, n):
    x, w, b, dy = _inputs(m, n, torch.float32)
    fn = (lambda t, *p: layer_norm(t, n, *p, deterministic=True)) if kind == "layer" else (
        lambda t, *p: rms_norm(t, n, *p, deterministic=True))
    params = [w, b] if kind == "layer" else [w]
    first = _run(fn, x, params, dy)
    for _ in range(9):  # ten runs in all
        again = _run(fn, x, params, dy)
        for a, b_ in zip(first, again, strict=True):
            assert torch.equal(a, b_)


@pytest.mark.parametrize(("m", "n"), by_mode(interpreter=[(40, 64)], cuda=[(4096, 512), (4096, 4096), (2048, 20000)]),
                         ids=str)
def test_lock_mode_is_right_on_every_repeat(m, n):
    """A missing barrier or lock shows up as a wrong dW on some run, not every run (lock mode forced: calls this
    small would give each program its own buffer)."""
    from kernels.layernorm import configs

    x, w, b, dy = _inputs(m, n, torch.float32)
    _, _, dw_ref, db_ref = _run(lambda t, *p: F.layer_norm(t, (n,), *p), x.double(), [w.double(), b.double()],
                                dy.double())
    with configs.override(lock_free_max_elements=0):
        for _ in range(by_mode(interpreter=2, cuda=100)):
            _, _, dw, db = _run(lambda t, *p: layer_norm(t, n, *p), x, [w, b], dy)
            torch.testing.assert_close(dw.double(), dw_ref, rtol=1e-4, atol=1e-3)
            torch.testing.assert_close(db.double(), db_ref, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("kind", ["layer", "rms"])
def test_small_calls_give_each_program_its_own_buffer(kind):
    """At most ``lock_free_max_elements`` elements the backward takes the deterministic layout (bit for bit what
    ``deterministic=True`` gives); larger calls keep the locks, and both agree within rounding."""
    from kernels.layernorm import configs

    s = configs.SETTINGS
    assert configs.lock_free_partials(4096, s.lock_free_max_elements // 4096)
    assert not configs.lock_free_partials(4096, s.lock_free_max_elements // 4096 + 1)
    m, n = 40, 64
    x, w, b, dy = _inputs(m, n, torch.float32)
    params = [w, b] if kind == "layer" else [w]
    call = layer_norm if kind == "layer" else rms_norm
    default = _run(lambda t, *p: call(t, n, *p), x, params, dy)
    fixed = _run(lambda t, *p: call(t, n, *p, deterministic=True), x, params, dy)
    for a, b_ in zip(default, fixed, strict=True):
        assert torch.equal(a, b_)
    with configs.override(lock_free_max_elements=0):
        locked = _run(lambda t, *p: call(t, n, *p), x, params, dy)
    for a, b_ in zip(default, locked, strict=True):
        torch.testing.assert_close(a, b_, rtol=1e-5, atol=1e-5)


def test_the_cached_backward_workspace_is_reused_and_left_with_zero_locks_and_flags():
    """Eager backwards on one stream share their partial rows, locks and first-write flags; each leaves the locks
    and flags zero (the final-sum kernel resets the flags), which the next one relies on."""
    from kernels.layernorm import configs

    x, w, b, dy = _inputs(40, 64, torch.float32)
    ops._WORKSPACES.clear()
    with configs.override(lock_free_max_elements=0):
        for _ in range(3):
            _run(lambda t, *p: layer_norm(t, 64, *p), x, [w, b], dy)
    ((partial, locks),) = ops._WORKSPACES.values()
    assert partial.dtype == torch.float32 and locks.dtype == torch.int32
    assert torch.count_nonzero(locks).item() == 0


def test_modules_are_drop_ins_with_the_same_state_dict():
    torch_ln = torch.nn.LayerNorm((4, 6), eps=1e-6, device=DEVICE)
    torch.nn.init.normal_(torch_ln.weight)
    torch.nn.init.normal_(torch_ln.bias)
    ours = LayerNorm((4, 6), eps=1e-6, device=DEVICE)
    assert set(ours.state_dict()) == set(torch_ln.state_dict()) == {"weight", "bias"}
    ours.load_state_dict(torch_ln.state_dict())
    x = torch.randn(3, 4, 6, device=DEVICE)
    torch.testing.assert_close(ours(x), torch_ln(x), rtol=1e-5, atol=1e-5)
    assert repr(ours) == repr(torch_ln)  # torch's extra_repr
    no_bias = LayerNorm(8, bias=False)
    assert set(no_bias.state_dict()) == set(torch.nn.LayerNorm(8, bias=False).state_dict()) == {"weight"}
    assert LayerNorm(8, elementwise_affine=False).state_dict() == {}

    torch_rms = torch.nn.RMSNorm(6, device=DEVICE)
    torch.nn.init.normal_(torch_rms.weight)
    rms = RMSNorm(6, device=DEVICE)
    rms.load_state_dict(torch_rms.state_dict())
    torch.testing.assert_close(rms(x), torch_rms(x), rtol=1e-5, atol=1e-5)
    assert repr(rms) == repr(torch_rms) == "RMSNorm((6,), eps=None, elementwise_affine=True)"
    half = LayerNorm(8, dtype=torch.float16)
    assert half.weight.dtype == torch.float16


def test_bad_inputs_raise_clear_errors():
    x = torch.randn(4, 8, device=DEVICE)
    with pytest.raises(ValueError, match="normalized_shape"):
        layer_norm(x, 7)
    with pytest.raises(ValueError, match="normalized_shape"):
        layer_norm(x, (2, 4, 8))
    with pytest.raises(ValueError, match=r"weight must have shape \[8\]"):
        layer_norm(x, 8, torch.ones(7, device=DEVICE))
    with pytest.raises(ValueError, match=r"bias must have shape \[8\]"):
        layer_norm(x, 8, None, torch.ones(9, device=DEVICE))
    with pytest.raises(TypeError, match="x must be a floating-point tensor"):
        layer_norm(torch.ones(4, 8, dtype=torch.int64, device=DEVICE), 8)
    with pytest.raises(TypeError, match="weight must be a floating-point tensor with dtype"):
        layer_norm(x, 8, torch.ones(8, dtype=torch.int32, device=DEVICE))
    with pytest.raises(TypeError, match="normalized_shape must be an int"):
        rms_norm(x, "8")
    with pytest.raises(ValueError, match="weight is on meta"):
        layer_norm(x, 8, torch.ones(8, device="meta"))


@pytest.mark.skipif(INTERPRETER, reason="registered-op checks run the GPU kernels")
def test_registered_ops_pass_opcheck():
    x = torch.randn(8, 32, device=DEVICE, requires_grad=True)
    w = torch.randn(32, device=DEVICE, requires_grad=True)
    b = torch.randn(32, device=DEVICE, requires_grad=True)
    torch.library.opcheck(torch.ops.fused_kernels.norm_fwd.default, (x, w, b, 1e-5, False, False))
    torch.library.opcheck(torch.ops.fused_kernels.norm_fwd.default, (x, w, None, 1e-6, True, True))


@pytest.mark.cuda
def test_torch_compile_fullgraph_matches_eager():
    m = torch.nn.Sequential(torch.nn.Linear(64, 64), LayerNorm(64), torch.nn.GELU(), RMSNorm(64)).cuda()
    x = torch.randn(32, 64, device="cuda", requires_grad=True)
    compiled = torch.compile(m, fullgraph=True)
    y_eager, y_compiled = m(x), compiled(x)
    torch.testing.assert_close(y_compiled, y_eager, rtol=1e-5, atol=1e-5)
    g_eager = torch.autograd.grad(y_eager.sum(), [x, *m.parameters()])
    g_compiled = torch.autograd.grad(y_compiled.sum(), [x, *m.parameters()])
    for a, b in zip(g_eager, g_compiled, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)


ON_HOPPER = not INTERPRETER and torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
needs_hopper = pytest.mark.skipif(not ON_HOPPER, reason="needs an sm_90 GPU (H100, H200)")


def test_forward_path_comes_from_the_environment(monkeypatch):
    from kernels.layernorm import configs

    monkeypatch.delenv(configs.PATH_ENV, raising=False)
    assert configs.path() == "auto"
    with configs.forced_path("portable"):
        assert configs.path() == "portable"
    assert configs.path() == "auto"
    monkeypatch.setenv(configs.PATH_ENV, "fast")
    with pytest.raises(ValueError, match="FUSED_KERNELS_LAYERNORM_PATH"):
        configs.path()


@pytest.mark.parametrize("is_rms", [False, True], ids=["layer", "rms"])
@pytest.mark.parametrize(("w_bytes", "b_bytes"), [(0, 0), (2, 0), (2, 2), (4, 4)], ids=str)
def test_hopper_forward_plan_fits_one_programs_shared_memory(is_rms, w_bytes, b_bytes):
    """Every width the Hopper forward takes gets a ring of at least one row and at most one row plus all but one
    chunk, resident w and b only for chunks that exist, and all of it within one program's shared memory; rows the
    register path holds, 32-bit rows, widths that are not 16-byte multiples and rows over 14 slots are declined."""
    from kernels.layernorm import configs

    s = configs.SETTINGS
    taken = []
    for n in [*range(s.max_fused_fwd - 8, 120_001, 2040), 32776, 65536, 114688, 114696]:
        plan = configs.hopper_forward(n, 2, w_bytes, b_bytes, is_rms)
        if n <= s.max_fused_fwd or n % 8 or n > 14 * s.hopper_chunk:
            assert plan is None, n
            continue
        assert plan is not None, n
        taken.append(n)
        chunk, chunks = plan["CHUNK"], plan["CHUNKS"]
        assert chunks == -(-n // chunk) and 0 <= plan["EXTRA"] < chunks and 0 <= plan["RESIDENT"] <= chunks
        assert plan["EXTRA"] == 0 or is_rms
        shared = (chunks + plan["EXTRA"]) * chunk * 2 + plan["RESIDENT"] * chunk * (w_bytes + b_bytes)
        assert shared <= s.hopper_shared_bytes, (n, plan)
        if w_bytes + b_bytes and plan["RESIDENT"] < chunks:  # the spare memory holds as many w, b chunks as fit
            assert s.hopper_shared_bytes - shared < chunk * (w_bytes + b_bytes), (n, plan)
        assert configs.hopper_forward(n, 4, w_bytes, b_bytes, is_rms) is None
    assert 65536 in taken and 114688 in taken


def _path_forward(path, kind, x, w, b):
    from kernels.layernorm import configs

    with configs.forced_path(path):
        fn = layer_norm if kind == "layer" else rms_norm
        args = (w, b, 1e-5) if kind == "layer" else (w, 1e-5)
        n = x.shape[-1]
        plan = ops._hopper_forward_plan(x, w, b if kind == "layer" else None, n, x.stride(0), kind == "rms")
        y, mean, rstd = ops._norm_fwd_impl(x, w, b if kind == "layer" else None, 1e-5, kind == "rms")
        torch.testing.assert_close(fn(x, (n,), *args), y, rtol=0, atol=0)  # the public call takes the same path
        return plan, y, mean, rstd


@pytest.mark.parametrize("is_rms", [False, True], ids=["layer", "rms"])
@pytest.mark.parametrize(("w_bytes", "b_bytes"), [(0, 0), (2, 0), (2, 2), (4, 4), (4, 2)], ids=str)
def test_hopper_split_forward_plan_fits_its_programs_shared_memory(is_rms, w_bytes, b_bytes):
    """The split-row forward takes exactly the LayerNorm rows the shared-memory-row kernel would (RMSNorm only when
    asked), with column blocks covering the row and as many programs per SM as their ring and resident w and b fit."""
    from kernels.layernorm import configs

    s = configs.SETTINGS
    for n in [32768, 32776, 40000, 65536, 100000, 114688, 114696]:
        base = configs.hopper_forward(n, 2, w_bytes, b_bytes, is_rms)
        split = configs.hopper_split_forward(n, 2, w_bytes, b_bytes, is_rms)
        assert split is None if is_rms or base is None else split is not None, n
        with configs.override(hopper_split_rms_norm=True):
            forced = configs.hopper_split_forward(n, 2, w_bytes, b_bytes, is_rms)
        assert (forced is None) == (base is None), n
        if forced is None:
            continue
        plan, per_sm = forced
        assert plan["COL_BLOCKS"] == -(-n // plan["BLOCK_N"]) and plan["SHARES"] >= plan["COL_BLOCKS"]
        assert 0 < plan["PUBLISH_AHEAD"] < plan["RING"]
        shared = plan["BLOCK_N"] * (plan["RING"] * 2 + w_bytes + b_bytes)
        assert 1 <= per_sm <= s.hopper_split_programs_per_sm and per_sm * shared <= s.hopper_shared_bytes, (n, plan)
        assert per_sm == s.hopper_split_programs_per_sm or (per_sm + 1) * shared > s.hopper_shared_bytes
        assert per_sm * 132 // plan["COL_BLOCKS"] >= 1  # at least one lane on an H100


@needs_hopper
@pytest.mark.parametrize("kernel", ["split", "shared"])
@pytest.mark.parametrize("kind", ["layer", "rms"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("n", [32776, 40000, 65536, 114688], ids=str)
@pytest.mark.parametrize("affine", ["w+b", "w", "none", "fp32 w+b", "row-strided"])
def test_hopper_forward_equals_the_portable_forward(kernel, kind, dtype, n, affine):
    """Both Hopper forwards (the split-row kernel, LayerNorm's default, and the shared-memory-row kernel, RMSNorm's;
    each forced for the other kind too) on every layout they take (a partial last chunk or column block, one row plus
    extra slots, resident w and b or none, fp32 w and b: one split program per SM), more rows than programs, against
    the portable chunked path and float64; a second call gives the same bits."""
    from kernels.layernorm import configs

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    m = 2 * sms + 3
    x, w, b, _ = _inputs(m, n, dtype, affine_dtype=torch.float32 if affine == "fp32 w+b" else None,
                         with_bias=affine in ("w+b", "fp32 w+b", "row-strided"))
    if affine == "none":
        w = None
    if affine == "row-strided":
        x = torch.randn(m, n + 64, device=DEVICE).to(dtype)[:, :n]
    split = kernel == "split"
    with configs.override(hopper_split_layer_norm=split, hopper_split_rms_norm=split):
        plan, y, mean, rstd = _path_forward("auto", kind, x, w, b)
        _, y_again, mean_again, rstd_again = _path_forward("auto", kind, x, w, b)
    assert plan is not None
    assert plan[0] is (ops._hopper._norm_fwd_split_row_kernel if split else ops._hopper._norm_fwd_shared_row_kernel)
    assert torch.equal(y, y_again) and torch.equal(rstd, rstd_again) and torch.equal(mean, mean_again)
    portable_plan, y_portable, mean_portable, rstd_portable = _path_forward("portable", kind, x, w, b)
    assert portable_plan is None
    torch.testing.assert_close(rstd, rstd_portable, rtol=1e-5, atol=0)
    if kind == "layer":
        torch.testing.assert_close(mean, mean_portable, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(y.float(), y_portable.float(), rtol=1e-2, atol=ATOL[dtype])
    xd = x.double()
    centered = xd if kind == "rms" else xd - xd.mean(-1, keepdim=True)
    want = centered * torch.rsqrt(centered.square().mean(-1, keepdim=True) + 1e-5)
    if w is not None:
        want = want * w.double()
    if b is not None and kind == "layer":
        want = want + b.double()
    assert (y.double() - want).abs().max() <= 2 * (y_portable.double() - want).abs().max() + 1e-3
    if affine == "none":  # y is exactly (x - mean) * rstd with the stored statistics
        stats_centered = x.float() if kind == "rms" else x.float() - mean[:, None]
        assert torch.equal(y, (stats_centered * rstd[:, None]).to(dtype))


@needs_hopper
def test_hopper_forward_declines_what_it_cannot_take_and_those_calls_stay_right():
    """32-bit rows, rows the register path holds, a misaligned address or row stride and a forced portable path take
    the portable kernel, whose results they still get with the path forced to ``hopper``."""
    m, n = 5, 40000
    x, w, b, _ = _inputs(m, n, torch.bfloat16)
    offset = torch.randn(m * n + 1, device=DEVICE).to(torch.bfloat16)[1:].view(m, n)
    odd_stride = torch.randn(m, n + 3, device=DEVICE).to(torch.bfloat16)[:, :n]
    cases = {"fp32": x.float(), "narrow": x[:, :32768], "misaligned": offset, "odd row stride": odd_stride}
    for name, t in cases.items():
        plan, y, _, _ = _path_forward("hopper", "layer", t, w[: t.shape[1]], b[: t.shape[1]])
        assert plan is None, name
        _, y_portable, _, _ = _path_forward("portable", "layer", t, w[: t.shape[1]], b[: t.shape[1]])
        assert torch.equal(y, y_portable), name
    assert _path_forward("hopper", "layer", x, w, b)[0] is not None
    assert _path_forward("portable", "layer", x, w, b)[0] is None


def test_hopper_backward_plan_fits_the_wide_paths_programs():
    """The Hopper wide backward takes 16-bit rows of the wide path whose width is a multiple of 8, with a ring that two
    programs per SM hold in shared memory and a publishing lead shorter than the ring."""
    from kernels.layernorm import configs

    s = configs.SETTINGS
    for n in (s.max_fused_bwd, s.max_fused_bwd + 8, 20000, 65536, 100000, 20001):
        plan = configs.hopper_backward(n, 2, 2)
        if n <= s.max_fused_bwd or n % 8:
            assert plan is None, n
            continue
        assert plan["COL_BLOCKS"] == -(-n // plan["BLOCK_N"]) and 0 < plan["PUBLISH_AHEAD"] < plan["RING"]
        stats = configs.HOPPER_BWD_STATS_BYTES  # each slot's row statistics
        assert s.wide_programs_per_sm * plan["RING"] * (plan["BLOCK_N"] * 4 + stats) <= s.hopper_shared_bytes
        assert configs.hopper_backward(n, 4, 2) is None and configs.hopper_backward(n, 2, 4) is None
        fused = configs.hopper_backward(n, 2, 2, 2)  # the fused op's residual gradient in the ring too
        assert s.wide_programs_per_sm * fused["RING"] * (fused["BLOCK_N"] * 6 + stats) <= s.hopper_shared_bytes
        assert fused["RING"] >= 2 and configs.hopper_backward(n, 2, 2, 4) is None


def _path_backward(path, kind, x, w, dy):
    from kernels.layernorm import configs

    with configs.forced_path(path):
        n = x.shape[-1]
        plan = ops._hopper_backward_plan(x, dy, None, n, x.stride(0), dy.stride(0))
        _, mean, rstd = ops._norm_fwd_impl(x, w, None, 1e-5, kind == "rms")
        grads = ops._norm_bwd_impl(dy, x, w, mean, rstd, kind == "rms", kind == "layer", False)
        return plan, grads


@needs_hopper
@pytest.mark.parametrize("kind", ["layer", "rms"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(("m", "n"), [(5, 16384), (1000, 20000), (300, 65536), (2048, 8200)], ids=str)
@pytest.mark.parametrize("weight", [True, False], ids=["w", "no w"])
def test_hopper_wide_backward_equals_the_portable_one_and_repeats_bitwise(kind, dtype, m, n, weight):
    """The shared-memory-ring exchange against the portable split-row kernel: a partial last column block, fewer rows
    than the ring, more rows than lanes; dx, dW and dB, and the same bits on every repeat."""
    x, w, _, dy = _inputs(m, n, dtype)
    w = w if weight else None
    plan, (dx, dw, db) = _path_backward("auto", kind, x, w, dy)
    assert plan is not None
    portable_plan, (dx_p, dw_p, db_p) = _path_backward("portable", kind, x, w, dy)
    assert portable_plan is None
    torch.testing.assert_close(dx.float(), dx_p.float(), rtol=1e-2, atol=ATOL[dtype])
    if weight:
        torch.testing.assert_close(dw, dw_p, rtol=1e-4, atol=1e-3)
    if kind == "layer":
        torch.testing.assert_close(db, db_p, rtol=1e-4, atol=1e-3)
    for _ in range(5):
        again = _path_backward("auto", kind, x, w, dy)[1]
        for first, later in zip((dx, dw, db), again, strict=True):
            assert torch.equal(first, later)
    xr = x.detach().double().requires_grad_(True)
    wr = None if w is None else w.detach().double().requires_grad_(True)
    y = F.layer_norm(xr, (n,), wr, None, 1e-5) if kind == "layer" else F.rms_norm(xr, (n,), wr, 1e-5)
    want = torch.autograd.grad(y, xr, dy.double())[0]
    assert (dx.double() - want).abs().max() <= 2 * (dx_p.double() - want).abs().max() + 1e-3


@needs_hopper
@pytest.mark.parametrize("kind", ["layer", "rms"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(("m", "n"), [(5, 16384), (700, 20000), (300, 65536)], ids=str)
@pytest.mark.parametrize("p", [0.0, 0.3], ids=str)
@pytest.mark.parametrize("residual_grad", [True, False], ids=["dres", "no dres"])
def test_hopper_wide_backward_of_the_fused_op(kind, dtype, m, n, p, residual_grad, monkeypatch):
    """``add_dropout_norm`` on the wide path: the Hopper split-row backward with the residual stream's gradient in its
    ring (or none, when residual_out gets no gradient), dr stored and, with dropout, the mask drawn in the kernel
    (widths of whole dropout chunks; N = 20000 with dropout stays portable), against the portable kernel (every
    gradient), dx exactly ``dropout`` of dr, and the same bits on a repeat."""
    from kernels.layernorm import configs

    launched = []
    kernel_for = ops.kernel_for
    monkeypatch.setattr(ops, "kernel_for", lambda fn, **kw: launched.append(fn) or kernel_for(fn, **kw))
    x, res, w, b = _fused_inputs(m, n, kind, dtype, "same")
    w = w.to(dtype)
    b = None if b is None else b.to(dtype)
    dy = torch.randn(m, n, device=DEVICE).to(dtype)
    dr_out = torch.randn(m, n, device=DEVICE).to(dtype)

    def grads(path):
        with configs.forced_path(path):
            inputs, (y, r), _ = _fused_and_twin(x, res, w, b, kind, p, True)
            outs, cotangents = ((y, r), (dy, dr_out)) if residual_grad else ((y,), (dy,))
            return torch.autograd.grad(outs, [t for t in inputs if t is not None], cotangents)

    hopper, again = grads("auto"), grads("auto")
    took_hopper = ops._hopper._norm_bwd_split_row_kernel in launched
    assert took_hopper == (p == 0 or n % configs.DROPOUT_CHUNK == 0)
    portable = grads("portable")
    for name, got, repeat, want in zip(("dx", "dres", "dw", "db"), hopper, again, portable, strict=False):
        assert torch.equal(got, repeat), name
        scale = max(1.0, want.abs().max().item())
        torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=scale * 4 * ATOL[dtype], msg=name)
    assert torch.equal(hopper[0], dropout(hopper[1], p, seed=77))


@pytest.mark.parametrize("kind", ["layer", "rms"])
def test_chunked_forward_with_persistent_programs(kind):
    """The chunked forward at a small width: rows over several chunks (the last one partial), fewer
    programs than rows (each loops over rows), pass 2 reading the chunks last first."""
    from kernels.layernorm import configs

    # one program per SM, whatever fits in L2
    with configs.override(max_fused_fwd=64, chunk=32, chunk_l2_fraction=0.0):
        m, n = 300, 100
        x, w, b, dy = _inputs(m, n, torch.float32)
        cfg = configs.forward(n)
        assert not cfg["SINGLE_PASS"] and configs.forward_programs(m, n, cfg, 4, 0) < m
        _check_against_torch(kind, x, w, b if kind == "layer" else None, dy, 1e-5)
    assert configs.forward(n)["SINGLE_PASS"]  # the override is gone with the block


@pytest.mark.parametrize("kind", ["layer", "rms"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_load_order_and_cache_hints_change_no_bit(kind, dtype):
    """w and b loaded with the rows (``AFFINE_FIRST``) or after the reductions, with or without L2 eviction hints
    (``STREAM_HINTS``): the same y, mean and rstd, bit for bit."""
    from kernels.layernorm import configs

    inputs = {m: _inputs(m, n, dtype)[:3] for m, n in ((5, 100), (3, 1000))}
    outputs = {}
    for first, hints in ((False, False), (True, True)):
        with configs.override(fwd_affine_first=(128, 1024) if first else (),
                              fwd_hints_l2_fraction=1e9 if hints else 0.0):
            for m, (x, w, b) in inputs.items():
                n = x.shape[1]
                cfg = configs.forward(n)
                assert cfg["AFFINE_FIRST"] is first
                assert configs.forward_stream_hints(m, n, cfg, x.element_size(), l2_bytes=2**20) is hints
                outputs[first, m] = ops._norm_fwd_impl(x, w, b if kind == "layer" else None, 1e-5, kind == "rms")
    for m in (5, 3):
        for got, want in zip(outputs[True, m], outputs[False, m], strict=True):
            assert torch.equal(got, want)


# --- the twin of residual + dropout + norm --------------------------------------------------------------

ADD_DROPOUT_NORM_CASES = [
    # (kind, x dtype, residual: None | "same" | "fp32 stream", dropout_p, training)
    ("layer", torch.float32, "same", 0.0, True),
    ("layer", torch.float16, "same", 0.3, True),
    ("layer", torch.bfloat16, "fp32 stream", 0.3, True),
    ("rms", torch.bfloat16, None, 0.5, True),
    ("rms", torch.float16, "fp32 stream", 0.3, False),
    ("layer", torch.float32, None, 0.0, True),
]


def _block_inputs(kind, dtype, residual, n=48, seed=5):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 5, n, generator=g).to(dtype)
    res = None
    if residual == "same":
        res = torch.randn(3, 5, n, generator=g).to(dtype)
    elif residual == "fp32 stream":
        res = torch.randn(3, 5, n, generator=g)
    w = torch.randn(n, generator=g)
    b = torch.randn(n, generator=g) if kind == "layer" else None
    return x, res, w, b


@pytest.mark.parametrize(("kind", "dtype", "residual", "p", "training"), ADD_DROPOUT_NORM_CASES, ids=str)
def test_add_dropout_norm_twin_is_the_three_torch_ops(kind, dtype, residual, p, training):
    """The twin equals dropout (the dropout family's twin), then the add in torch, then torch's norm."""
    x, res, w, b = _block_inputs(kind, dtype, residual)
    y, r = twin.add_dropout_norm(x, res, w, b, kind=kind, dropout_p=p, seed=11, training=training)
    dropped = reference_dropout.dropout(x, p, seed=11) if training and p else x
    expected_r = dropped + res if res is not None else dropped  # torch promotes bf16 + fp32 to fp32
    assert r.dtype == expected_r.dtype and torch.equal(r, expected_r)
    n = x.shape[-1]
    norm = F.layer_norm(r.float(), (n,), w, b, 1e-5) if kind == "layer" else F.rms_norm(r.float(), (n,), w, 1e-5)
    assert y.dtype == dtype
    torch.testing.assert_close(y, norm.to(dtype), rtol=0, atol=ATOL[dtype])


def test_add_dropout_norm_twin_drops_what_the_dropout_kernel_drops():
    x = torch.randn(4, 1000, device=DEVICE)
    _, r = twin.add_dropout_norm(x, kind="rms", dropout_p=0.25, seed=123)
    assert torch.equal(r, dropout(x, 0.25, seed=123))


@pytest.mark.parametrize(("kind", "dtype", "residual", "p", "training"), ADD_DROPOUT_NORM_CASES, ids=str)
def test_add_dropout_norm_twin_backward_is_autograd_of_the_three_ops(kind, dtype, residual, p, training):
    x, res, w, b = _block_inputs(kind, dtype, residual)
    g = torch.Generator().manual_seed(9)
    dy = torch.randn(x.shape, generator=g).to(dtype)
    dres_out = torch.randn(x.shape, generator=g)
    _, r = twin.add_dropout_norm(x, res, w, b, kind=kind, dropout_p=p, seed=11, training=training)
    dx, dres, dw, db = twin.add_dropout_norm_backward(dy, dres_out.to(r.dtype), r, w, kind=kind, dropout_p=p,
                                                      seed=11, training=training, x_dtype=dtype)
    # autograd in float64 through the same ops (the residual stream unrounded: hence the low-precision slack)
    x64 = x.double().requires_grad_(True)
    res64 = res.double().requires_grad_(True) if res is not None else None
    r64 = reference_dropout.dropout(x64, p, seed=11) if training and p else x64
    r64 = r64 + res64 if res64 is not None else r64
    w64 = w.double().requires_grad_(True)
    b64 = b.double().requires_grad_(True) if b is not None else None
    n = x.shape[-1]
    y64 = F.layer_norm(r64, (n,), w64, b64, 1e-5) if kind == "layer" else F.rms_norm(r64, (n,), w64, 1e-5)
    named = {name: t for name, t in (("x", x64), ("w", w64), ("b", b64), ("res", res64)) if t is not None}
    grads = dict(zip(named, torch.autograd.grad((y64, r64), list(named.values()),
                                                (dy.double(), dres_out.to(r.dtype).double())), strict=True))
    tol = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 1e-1}[dtype]
    torch.testing.assert_close(dx.double(), grads["x"], rtol=tol, atol=tol)
    torch.testing.assert_close(dw.double(), grads["w"], rtol=tol, atol=tol * 10)
    if b is not None:
        torch.testing.assert_close(db.double(), grads["b"], rtol=tol, atol=tol * 10)
    if res is not None:
        torch.testing.assert_close(dres.double(), grads["res"], rtol=tol, atol=tol)
    assert dres.dtype == r.dtype and dx.dtype == dtype


# --- the fused residual + dropout + norm kernels ----------------------------------------------------------

FUSED_CASES = [  # (kind, x dtype, residual, dropout_p, training); bf16 runs as fp16 under the interpreter
    (kind, dtype if dtype in FLOAT_DTYPES else torch.float16, residual, p, training)
    for kind, dtype, residual, p, training in (
        ("layer", torch.float32, "same", 0.0, True),
        ("layer", torch.float16, "same", 0.3, True),
        ("layer", torch.bfloat16, "fp32 stream", 0.3, True),
        ("rms", torch.bfloat16, None, 0.5, True),
        ("rms", torch.float16, "fp32 stream", 0.3, False),
        ("rms", torch.float32, "same", 0.1, True),
        ("layer", torch.float32, None, 0.2, True),
    )
]
FUSED_SHAPES = by_mode(interpreter=[(37, 300), (3, 4096), (5, 33), (24, 512)],
                       cuda=[(37, 300), (3, 4096), (5, 33), (24, 512), (1000, 768), (300, 1024), (64, 8192),
                             (16, 20000), (8, 40000)])


def _fused_inputs(m, n, kind, dtype, residual, seed=3):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, n, generator=g).to(DEVICE, dtype)
    res = None
    if residual == "same":
        res = torch.randn(m, n, generator=g).to(DEVICE, dtype)
    elif residual == "fp32 stream":
        res = torch.randn(m, n, generator=g).to(DEVICE)
    w = (torch.rand(n, generator=g) + 0.5).to(DEVICE)
    b = torch.randn(n, generator=g).to(DEVICE) if kind == "layer" else None
    return x, res, w, b


def _fused_and_twin(x, res, w, b, kind, p, training, **kw):
    x, w = x.detach().requires_grad_(True), w.detach().requires_grad_(True)
    res = None if res is None else res.detach().requires_grad_(True)
    b = None if b is None else b.detach().requires_grad_(True)
    y, r = ops.add_dropout_norm(x, res, w, b, kind=kind, dropout_p=p, seed=77, training=training, **kw)
    y_twin, r_twin = twin.add_dropout_norm(x.detach(), None if res is None else res.detach(), w.detach(),
                                           None if b is None else b.detach(), kind=kind, dropout_p=p, seed=77,
                                           training=training, **kw)
    return (x, res, w, b), (y, r), (y_twin, r_twin)


@pytest.mark.parametrize(("m", "n"), FUSED_SHAPES, ids=str)
@pytest.mark.parametrize(("kind", "dtype", "residual", "p", "training"), FUSED_CASES, ids=str)
def test_fused_add_dropout_norm_equals_its_twin(kind, dtype, residual, p, training, m, n):
    """Forward: residual_out bit for bit (same mask, same roundings); y within the norm's rounding. Backward
    (both outputs get a gradient): every gradient against the twin's hand-written backward."""
    inputs, (y, r), (y_twin, r_twin) = _fused_and_twin(*_fused_inputs(m, n, kind, dtype, residual), kind, p, training)
    assert r.dtype == r_twin.dtype and y.dtype == dtype and y.shape == r.shape == (m, n)
    if INTERPRETER and dtype == torch.bfloat16 and r.dtype != dtype and p > 0 and training:
        # the interpreter rounds dropout(x) to bf16 toward zero before the fp32 add (a GPU, and the twin, to nearest
        # even): one bf16 unit of the dropped x apart at most
        unit = inputs[0].detach().float().abs() / (1 - p) * 2**-7
        assert ((r - r_twin).abs() <= unit).all()
        _, _, w, b = inputs  # y is the norm of the kernel's own residual_out then
        y_twin = twin.add_dropout_norm(r.detach(), None, w.detach(), None if b is None else b.detach(), kind=kind,
                                       out_dtype=dtype)[0]
    else:
        assert torch.equal(r, r_twin)
    # the statistics' last bits differ between summation orders, so y may round one ulp apart
    torch.testing.assert_close(y, y_twin, rtol=torch.finfo(dtype).eps, atol=ATOL[dtype])
    _, res, w, b = inputs
    g = torch.Generator().manual_seed(4)
    dy = torch.randn(m, n, generator=g).to(DEVICE, dtype)
    dr_out = torch.randn(m, n, generator=g).to(DEVICE, r.dtype)
    grads = torch.autograd.grad((y, r), [t for t in inputs if t is not None], (dy, dr_out))
    dx_t, dres_t, dw_t, db_t = twin.add_dropout_norm_backward(dy, dr_out, r.detach(), w.detach(), kind=kind,
                                                              dropout_p=p, seed=77, training=training, x_dtype=dtype)
    expected = [dx_t] + ([dres_t] if res is not None else []) + [dw_t] + ([db_t] if b is not None else [])
    for name, got, want in zip(("dx", "dres", "dw", "db"), grads, expected, strict=False):
        assert got.dtype == (want.dtype if name in ("dx", "dres") else torch.float32), name
        scale = max(1.0, want.abs().max().item())
        torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=scale * 4 * ATOL[got.dtype], msg=name)


def test_fused_add_dropout_norm_drops_what_the_dropout_kernel_drops():
    x = torch.randn(7, 3000, device=DEVICE)
    for p, seed in ((0.25, 123), (0.5, 2**63 + 5)):
        _, r = ops.add_dropout_norm(x, kind="rms", dropout_p=p, seed=seed)
        assert torch.equal(r, dropout(x, p, seed=seed))
    # the backward's dx is the same mask on the incoming gradient (gradient only through residual_out)
    xg = x.clone().requires_grad_(True)
    _, r = ops.add_dropout_norm(xg, kind="rms", dropout_p=0.25, seed=123)
    dr = torch.randn_like(r)
    (dx,) = torch.autograd.grad(r, xg, dr)
    assert torch.equal(dx, dropout(dr, 0.25, seed=123))


def test_fused_add_dropout_norm_with_cut_chunks_and_the_wide_paths():
    """Small tiles (programs that start and end inside a dropout chunk, several tiles per backward program)
    and rows wider than one tile (the chunked forward, the split-row backward with per-element masks) against
    the twin."""
    from kernels.layernorm import configs

    x, res, w, b = _fused_inputs(41, 300, "layer", torch.float32, "same")
    for changes in ({"add_dropout_norm_tile": 512, "bwd_tile": 1024},
                    {"max_fused_fwd": 64, "max_fused_bwd": 64, "chunk": 128, "wide_columns": 64}):
        with configs.override(**changes):
            inputs, (y, r), (y_twin, r_twin) = _fused_and_twin(x, res, w, b, "layer", 0.4, True)
            assert torch.equal(r, r_twin), changes
            torch.testing.assert_close(y, y_twin, rtol=0, atol=1e-5)
            dy, dr_out = torch.randn_like(y), torch.randn_like(r)
            dx, dres, dw, db = torch.autograd.grad((y, r), inputs, (dy, dr_out))
            expected = twin.add_dropout_norm_backward(dy, dr_out, r.detach(), w, kind="layer", dropout_p=0.4,
                                                      seed=77, x_dtype=torch.float32)
            for name, got, want in zip(("dx", "dres", "dw", "db"), (dx, dres, dw, db), expected, strict=True):
                torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, msg=f"{name} {changes}")


@pytest.mark.parametrize("kind", ["layer", "rms"])
def test_fused_add_dropout_norm_split_row_backward_draws_whole_chunks(kind):
    """Rows split into column blocks of one dropout chunk each (the mask drawn in the tile's layout): the
    gradients equal the twin's, and dx is exactly ``dropout`` of the residual's gradient."""
    from kernels.layernorm import configs

    x, res, w, b = _fused_inputs(3, 8192, kind, torch.float32, "same")
    with configs.override(max_fused_bwd=4096):
        assert not configs.fused_backward(8192)
        inputs, (y, r), _ = _fused_and_twin(x, res, w, b, kind, 0.3, True)
        dy, dr_out = torch.randn_like(y), torch.randn_like(r)
        grads = torch.autograd.grad((y, r), [t for t in inputs if t is not None], (dy, dr_out))
    expected = twin.add_dropout_norm_backward(dy, dr_out, r.detach(), w, kind=kind, dropout_p=0.3, seed=77,
                                              x_dtype=torch.float32)
    for name, got, want in zip(("dx", "dres", "dw", "db"), grads, expected, strict=False):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, msg=name)
    assert torch.equal(grads[0], dropout(grads[1], 0.3, seed=77))


@pytest.mark.cuda
@pytest.mark.parametrize(("kind", "n"), [("layer", 16384), ("rms", 65536), ("layer", 100000)], ids=str)
def test_split_row_backward_exchange_equals_two_launches_on_every_repeat(kind, n):
    """The one-launch backward (programs wait for each other's row sums) against the two-launch one, which
    cannot race: the same sums in the same order, so bitwise equal, on every one of many runs (a missing
    barrier or a stale read shows up on some runs only)."""
    from kernels.layernorm import configs

    m = 2048
    x, w, b, dy = _inputs(m, n, torch.bfloat16)
    fn = (lambda t, *p: layer_norm(t, n, *p)) if kind == "layer" else (lambda t, *p: rms_norm(t, n, *p))
    params = [w, b] if kind == "layer" else [w]
    assert configs.wide_backward(m, n, torch.cuda.get_device_properties(0).multi_processor_count)[2]
    with configs.forced_path("portable"):  # the portable kernel's exchange (the Hopper one has its own test)
        with configs.override(wide_exchange=False):
            expected = _run(fn, x, params, dy)
        for _ in range(30):
            got = _run(fn, x, params, dy)
            for name, a, e in zip(("y", "dx", "dw", "db"), got, expected, strict=False):
                assert torch.equal(a, e), name


def test_fused_add_dropout_norm_gradient_of_y_alone_and_inference():
    x, res, w, b = _fused_inputs(9, 64, "layer", torch.float32, "same")
    inputs, (y, r), _ = _fused_and_twin(x, res, w, b, "layer", 0.3, True)
    dy = torch.randn_like(y)
    dx, dres, _, _ = torch.autograd.grad(y, inputs, dy)  # residual_out unused: no gradient from it
    expected = twin.add_dropout_norm_backward(dy, None, r.detach(), w, kind="layer", dropout_p=0.3, seed=77,
                                              x_dtype=torch.float32)
    torch.testing.assert_close(dx, expected[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(dres, expected[1], rtol=1e-4, atol=1e-4)
    with torch.no_grad():
        y2, r2 = ops.add_dropout_norm(x, res, w, b, dropout_p=0.3, seed=77)
    assert torch.equal(r2, r) and torch.equal(y2, y.detach())
    y3, r3 = ops.add_dropout_norm(x, res, w, b, dropout_p=0.3, seed=77, training=False)
    assert torch.equal(r3, x + res)
    torch.testing.assert_close(y3, F.layer_norm(x + res, (64,), w, b), rtol=0, atol=1e-5)


@pytest.mark.parametrize("kind", ["layer", "rms"])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
def test_fused_add_dropout_norm_out_dtype_rounds_the_same_output_once(kind, out_dtype):
    """``out_dtype`` writes y in that dtype: the fp32 output the call gives without it, rounded once (what a
    matmul under autocast makes of it), autocast or not; residual_out does not change; the backward takes y's
    gradient in ``out_dtype`` and gives the twin's gradients."""
    x, res, w, b = _fused_inputs(33, 256, kind, torch.float32, "same")
    inputs, (y, r), (y_twin, r_twin) = _fused_and_twin(x, res, w, b, kind, 0.2, True, out_dtype=out_dtype)
    assert y.dtype == y_twin.dtype == out_dtype and r.dtype == torch.float32
    assert torch.equal(r, r_twin)
    y32, _ = ops.add_dropout_norm(x, res, w, b, kind=kind, dropout_p=0.2, seed=77)
    if INTERPRETER and out_dtype == torch.bfloat16:
        # the interpreter rounds fp32 to bf16 toward zero (a GPU to nearest even, as torch): one unit apart at most
        torch.testing.assert_close(y, y32.to(out_dtype), rtol=2**-7, atol=0)
    else:
        assert torch.equal(y, y32.to(out_dtype))
    torch.testing.assert_close(y.float(), y_twin.float(), rtol=2**-7, atol=ATOL[out_dtype])
    with torch.autocast(torch.device(DEVICE).type, dtype=torch.bfloat16):
        y_autocast, _ = ops.add_dropout_norm(x, res, w, b, kind=kind, dropout_p=0.2, seed=77, out_dtype=out_dtype)
    assert torch.equal(y_autocast, y)
    g = torch.Generator().manual_seed(5)
    dy = torch.randn(y.shape, generator=g).to(DEVICE, out_dtype)
    dr_out = torch.randn(r.shape, generator=g).to(DEVICE)
    grads = torch.autograd.grad((y, r), [t for t in inputs if t is not None], (dy, dr_out))
    expected = twin.add_dropout_norm_backward(dy, dr_out, r.detach(), w, kind=kind, dropout_p=0.2, seed=77,
                                              x_dtype=torch.float32)
    expected = [t for t in expected if t is not None]
    assert len(grads) == len(expected)
    for name, got, want in zip(("dx", "dres", "dw", "db"), grads, expected, strict=False):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, msg=name)


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    ({"x": "not a tensor"}, TypeError, "x must be a torch.Tensor"),
    ({"x": torch.ones(2, 3, dtype=torch.int32)}, TypeError, "x must"),
    ({"kind": "batch"}, ValueError, "kind"),
    ({"kind": "rms", "bias": torch.zeros(8)}, ValueError, "bias"),
    ({"residual": torch.zeros(2, 4)}, ValueError, "residual"),
    ({"weight": torch.ones(4)}, ValueError, "weight"),
    ({"dropout_p": 1.0}, ValueError, "dropout_p"),
    ({"dropout_p": -0.1}, ValueError, "dropout_p"),
    ({"eps": float("nan")}, ValueError, "eps"),
    ({"residual_dtype": torch.int8}, TypeError, "residual_dtype"),
    ({"out_dtype": torch.int32}, TypeError, "out_dtype"),
])
def test_fused_add_dropout_norm_bad_inputs(kwargs, error, match):
    args = {"x": torch.ones(2, 8, device=DEVICE)}
    args.update({k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()})
    x = args.pop("x")
    with pytest.raises(error, match=match):
        ops.add_dropout_norm(x, **args)


def test_add_dropout_norm_module_is_the_function_with_its_parameters():
    from kernels.layernorm import AddDropoutNorm

    block = AddDropoutNorm(64, p=0.2, residual_dtype=torch.float32).to(DEVICE)
    assert [name for name, _ in block.named_parameters()] == ["weight", "bias"]
    assert not hasattr(AddDropoutNorm(64, kind="rms"), "bias") or AddDropoutNorm(64, kind="rms").bias is None
    assert AddDropoutNorm(64, kind="rms").eps is None and block.eps == 1e-5
    x = torch.randn(5, 64, device=DEVICE, dtype=torch.float16)
    torch.manual_seed(3)
    y, r = block(x)
    torch.manual_seed(3)
    y_f, r_f = ops.add_dropout_norm(x, None, block.weight, block.bias, dropout_p=0.2, residual_dtype=torch.float32)
    assert r.dtype == torch.float32 and torch.equal(r, r_f) and torch.equal(y, y_f)
    block.eval()
    _, r_eval = block(x, r)
    assert torch.equal(r_eval, x.float() + r)
    assert "kind='layer'" in repr(block)
    for bad in ({"kind": "batch"}, {"normalized_shape": (4, 4)}, {"p": 1.0}):
        with pytest.raises(ValueError):
            AddDropoutNorm(**{"normalized_shape": 8, **bad})


def test_add_dropout_norm_ops_pass_opcheck_on_the_twin_path():
    """Schema, fake implementation and autograd registration of the two registered ops, on CPU tensors through
    the twin (the GPU kernels are checked by tests/test_integration.py's opcheck on a GPU)."""
    from kernels._common import cpu_runs_reference

    g = torch.Generator().manual_seed(0)
    x, res = (torch.randn(8, 32, generator=g).requires_grad_(True) for _ in range(2))
    w, b = (torch.randn(32, generator=g).requires_grad_(True) for _ in range(2))
    with cpu_runs_reference():
        torch.library.opcheck(torch.ops.fused_kernels.add_dropout_norm_fwd.default,
                              (x, res, w, b, 1e-5, False, 0.2, 5, None, torch.float32, torch.float32, False))
        _, r, mean, rstd = torch.ops.fused_kernels.add_dropout_norm_fwd(
            x.detach(), None, w.detach(), None, 1e-5, True, 0.2, 5, None, torch.float32, torch.float32, False)
        torch.library.opcheck(torch.ops.fused_kernels.add_dropout_norm_bwd.default,
                              (torch.randn(8, 32, generator=g), torch.randn(8, 32, generator=g), r, w.detach(), mean,
                               rstd, 1e-5, True, False, False, 0.2, 5, None, torch.float32, True))


@pytest.mark.cuda
@pytest.mark.parametrize("p", [0.2, 0.0])
@pytest.mark.parametrize("n", [256, 16384], ids=["one-tile rows", "split rows"])
def test_add_dropout_norm_compiles_fullgraph_and_matches_eager(n, p):
    """Split rows without dropout take the one-launch (cooperative) backward, with dropout two launches."""
    x, res, w, b = (t.requires_grad_(True) for t in _fused_inputs(64, n, "layer", torch.bfloat16, "fp32 stream"))
    f = torch.compile(lambda a, r_in: ops.add_dropout_norm(a, r_in, w, b, dropout_p=p, seed=5), fullgraph=True)
    y_c, r_c = f(x, res)
    y_e, r_e = ops.add_dropout_norm(x, res, w, b, dropout_p=p, seed=5)
    assert torch.equal(r_c, r_e)
    # Split rows: y one bf16 rounding apart at some 3e-5 of the elements (H100, from N = 8192 on; the compiled
    # and the eager call launch the same forward kernel, and why they round differently there is not yet
    # known), so the gradients that go through the saved statistics may differ by a bf16 ulp too.
    ulp = 2 ** -7 if n > 256 else 0
    torch.testing.assert_close(y_c, y_e, rtol=ulp, atol=1e-6 if n > 256 else 0)
    g_c = torch.autograd.grad((y_c.float().sum() + r_c.sum()), [x, res, w, b])
    g_e = torch.autograd.grad((y_e.float().sum() + r_e.sum()), [x, res, w, b])
    for a, c in zip(g_e, g_c, strict=True):
        torch.testing.assert_close(c, a, rtol=max(ulp, 1e-3), atol=1e-3)
