"""Seeded dropout: kernel == twin bit for bit, the statistics of the mask, autograd, API behaviour.

Interpreter mode runs small shapes in fp16/fp32; CUDA mode adds bf16, large shapes and a tensor past
2**31 elements.
"""

from __future__ import annotations

import math

import pytest
import torch
import triton
import triton.language as tl

import reference.dropout as twin
from kernels._mode import DEVICE, FLOAT_DTYPES, by_mode
from kernels.dropout import Dropout, dropout, keep_threshold, philox4x32

SHAPES = by_mode(
    interpreter=[(0,), (1,), (7,), (4096,), (4097,), (3, 1000), (2, 3, 5, 7)],
    cuda=[(0,), (1,), (7,), (4097,), (3, 1000), (2, 3, 5, 7), (1 << 20,), (1000, 4099), (1 << 24,)],
)
SEEDS = [0, 1, 12345, 2**32 + 7, 2**64 - 1]
STAT_N = by_mode(interpreter=1 << 16, cuda=1 << 24)


# --- the RNG itself ----------------------------------------------------------------------------------

# Known-answer vectors of Philox4x32-10 from the Random123 distribution (kat_vectors).
PHILOX_KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF, 0xFFFFFFFF), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    (
        (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
        (0xA4093822, 0x299F31D0),
        (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
    ),
]


@pytest.mark.parametrize(("counter", "key", "expected"), PHILOX_KAT)
def test_twin_philox_matches_random123_vectors(counter, key, expected):
    words = twin.philox4x32(tuple(torch.tensor([c]) for c in counter), key)
    assert tuple(int(w) for w in words) == expected


@triton.jit
def _philox_probe_kernel(ctr_ptr, out_ptr, k0, k1, N: tl.constexpr):
    idx = tl.arange(0, N)
    c0 = tl.load(ctr_ptr + idx * 4 + 0).to(tl.uint32)
    c1 = tl.load(ctr_ptr + idx * 4 + 1).to(tl.uint32)
    c2 = tl.load(ctr_ptr + idx * 4 + 2).to(tl.uint32)
    c3 = tl.load(ctr_ptr + idx * 4 + 3).to(tl.uint32)
    w0, w1, w2, w3 = philox4x32(c0, c1, c2, c3, k0.to(tl.uint32), k1.to(tl.uint32))
    tl.store(out_ptr + idx * 4 + 0, w0.to(tl.int64))
    tl.store(out_ptr + idx * 4 + 1, w1.to(tl.int64))
    tl.store(out_ptr + idx * 4 + 2, w2.to(tl.int64))
    tl.store(out_ptr + idx * 4 + 3, w3.to(tl.int64))


@pytest.mark.parametrize(("counter", "key", "expected"), PHILOX_KAT)
def test_kernel_philox_matches_random123_vectors(counter, key, expected):
    ctr = torch.tensor([counter, counter], dtype=torch.int64, device=DEVICE)
    out = torch.full_like(ctr, -1)
    _philox_probe_kernel[(1,)](ctr, out, key[0], key[1], N=2)
    assert [int(w) for w in out[0]] == list(expected)
    assert torch.equal(out[0], out[1])


# --- kernel == twin --------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("p", [0.1, 0.5, 0.77])
def test_kernel_equals_twin_bit_for_bit(shape, dtype, p):
    x = torch.randn(shape, device=DEVICE).to(dtype)
    seed = 987654321
    y = dropout(x, p, seed=seed)
    expected = twin.dropout(x, p, seed=seed)
    assert y.shape == x.shape and y.dtype == dtype
    assert torch.equal(y, expected)


@pytest.mark.parametrize("seed", SEEDS)
def test_every_seed_word_reaches_the_mask(seed):
    x = torch.randn(3 * 4096 + 5, device=DEVICE)
    assert torch.equal(dropout(x, 0.5, seed=seed), twin.dropout(x, 0.5, seed=seed))


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("p", [0.5, 0.75, 0.3])
def test_kept_values_are_x_over_one_minus_p(dtype, p):
    x = torch.randn(5000, device=DEVICE).to(dtype)
    y = dropout(x, p, seed=5)
    kept = twin.keep_mask(x.numel(), p, 5, device=DEVICE)
    assert torch.equal(y != 0, kept & (x != 0))
    assert torch.equal(y[~kept], torch.zeros_like(y[~kept]))
    exact = (x[kept].double() / (1.0 - p)).to(dtype)
    if p in (0.5, 0.75):  # the scale is a power of two: no rounding at all
        assert torch.equal(y[kept], exact)
    else:  # x * fp32(1/(1-p)) rounded once: within one ulp of the exact quotient
        torch.testing.assert_close(y[kept], exact, rtol=2 * torch.finfo(dtype).eps, atol=0)


# --- statistics ------------------------------------------------------------------------------------


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_keep_rate_within_five_sigma(p):
    x = torch.ones(STAT_N, device=DEVICE)
    kept = (dropout(x, p, seed=77) != 0).double()
    sigma = math.sqrt(p * (1 - p) / STAT_N)
    assert abs(kept.mean().item() - (1 - p)) < 5 * sigma


@pytest.mark.parametrize("lag", [1, 2, 4, 1023, 1024, 4096])
def test_neighbours_are_uncorrelated(lag):
    """Lag 1 crosses elements of one word run; 1024 pairs word w with w+1 of the same Philox call."""
    kept = (dropout(torch.ones(STAT_N, device=DEVICE), 0.5, seed=31337) != 0).double()
    a, b = kept[:-lag], kept[lag:]
    corr = ((a - a.mean()) * (b - b.mean())).mean() / (a.std() * b.std())
    assert abs(corr.item()) < 5 / math.sqrt(a.numel())


def test_same_seed_same_mask_other_seed_other_mask():
    x = torch.randn(10000, device=DEVICE)
    a, b, c = dropout(x, 0.5, seed=1), dropout(x, 0.5, seed=1), dropout(x, 0.5, seed=2)
    assert torch.equal(a, b)
    agreement = ((a != 0) == (c != 0)).double().mean().item()
    assert 0.45 < agreement < 0.55  # independent masks agree on about half the elements


def test_manual_seed_governs_seed_none():
    x = torch.randn(10000, device=DEVICE)
    torch.manual_seed(42)
    a, b = dropout(x, 0.5), dropout(x, 0.5)
    torch.manual_seed(42)
    a2, b2 = dropout(x, 0.5), dropout(x, 0.5)
    assert torch.equal(a, a2) and torch.equal(b, b2)
    assert not torch.equal(a, b)


# --- autograd --------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_gradient_is_the_regenerated_mask_times_scale(dtype):
    p, seed = 0.3, 2024
    x = torch.randn(4097, device=DEVICE, dtype=dtype, requires_grad=True)
    y = dropout(x, p, seed=seed)
    dy = torch.randn_like(y)
    y.backward(dy)
    kept = twin.keep_mask(x.numel(), p, seed, device=DEVICE)
    factor = torch.where(kept, torch.tensor(1.0 / (1.0 - p), dtype=torch.float32), 0.0).to(DEVICE)
    assert torch.equal(x.grad, (dy.float() * factor).to(dtype))
    assert torch.equal(x.grad, twin.dropout(dy, p, seed=seed))


def test_backward_saves_no_tensor():
    saved = []
    x = torch.randn(4096, device=DEVICE, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = dropout(x, 0.5, seed=3)
    y.sum().backward()
    assert saved == []
    assert x.grad is not None


@pytest.mark.filterwarnings("ignore:Input #0 requires gradient and is not a double")
def test_gradcheck_in_float32():
    x = torch.randn(37, device=DEVICE, requires_grad=True)
    # Linear in x, so finite differences in float32 are exact up to rounding of x +- eps.
    torch.autograd.gradcheck(lambda t: dropout(t, 0.4, seed=9), (x,), eps=1e-2, atol=1e-3, rtol=1e-3)


# --- layouts, edges, API ---------------------------------------------------------------------------


def test_non_contiguous_views_use_the_logical_index():
    base = torch.randn(64, 130, device=DEVICE)
    for view in (base.t(), base[:, ::3], base[5:60:2, 7:100]):
        assert not view.is_contiguous()
        assert torch.equal(dropout(view, 0.5, seed=11), dropout(view.contiguous(), 0.5, seed=11))
    dy = torch.randn(130, device=DEVICE).expand(64, 130)  # a stride-0 gradient
    x = torch.randn(64, 130, device=DEVICE, requires_grad=True)
    dropout(x, 0.5, seed=11).backward(dy)
    assert torch.equal(x.grad, twin.dropout(dy.contiguous(), 0.5, seed=11))


def _strided_view(name: str, dtype: torch.dtype) -> torch.Tensor:
    big = DEVICE != "cpu"
    make = lambda *shape: torch.randn(*shape, device=DEVICE).to(dtype)
    if name == "permuted (B, S, H, D)":
        return make(2, 1000 if big else 70, 8 if big else 3, 64).permute(0, 2, 1, 3)
    if name == "permuted, whole chunks per head":
        return make(2, 1024 if big else 64, 8 if big else 3, 64).permute(0, 2, 1, 3)
    if name == "rows of a slice":
        return make(300 if big else 50, 96)[:, 16:48]
    if name == "wide rows of a slice":
        return make(5 if big else 3, 4096)[:, 1024:3072]
    if name == "transposed":
        return make(3 * 4096 if big else 2 * 4096, 1001 if big else 19).t()
    if name == "transposed, rows not whole chunks":
        return make(1000, 19).t()
    return make(5, 6, 70).permute(2, 0, 1)  # innermost logical dim strided, not 2-D


# view -> the strided kernel that reads it in place (None: copied to contiguous first)
STRIDED_VIEWS = {"permuted (B, S, H, D)": "rows", "permuted, whole chunks per head": "rows",
                 "rows of a slice": "rows", "wide rows of a slice": "rows",
                 "transposed": "columns", "transposed, rows not whole chunks": None, "3-D permuted": None}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("name", list(STRIDED_VIEWS))
def test_strided_views_are_read_in_place_with_the_mask_of_their_contiguous_copy(name, dtype, monkeypatch):
    """The strided kernels read a view where it lies and write a result with the view's strides (as torch's
    dropout does); their mask is the contiguous copy's, bit for bit, forward, backward and in place. Views no
    kernel fits are copied to contiguous first."""
    from kernels.dropout import ops

    view = _strided_view(name, dtype)
    assert not view.is_contiguous()
    launched = []
    kernel_for = ops.kernel_for
    monkeypatch.setattr(ops, "kernel_for", lambda kernel, **kw: launched.append(kernel) or kernel_for(kernel, **kw))
    expected = twin.dropout(view.contiguous(), 0.3, seed=21)
    y = dropout(view, 0.3, seed=21)
    assert torch.equal(y, expected)
    kernel = STRIDED_VIEWS[name]
    assert launched == [getattr(ops, f"_dropout_{kernel}_kernel" if kernel else "_dropout_fwd_kernel")]
    if kernel:
        assert y.stride() == torch.empty_like(view).stride()
    x = view.detach().clone().requires_grad_(True)  # clone keeps a dense view's strides
    dropout(x, 0.3, seed=21).backward(view)
    assert torch.equal(x.grad, expected)
    in_place = view.clone()
    dropout(in_place, 0.3, seed=21, inplace=True)
    assert torch.equal(in_place, expected)


def test_permuted_views_of_whole_chunks_per_head_run_in_memory_order():
    """The rows kernel orders its programs heads first exactly where every head's span is whole chunks and the heads
    lie nearer in memory than the rows (the view the strided test above checks bit for bit)."""
    from kernels.dropout import ops

    # (B, S, H, D) viewed as (B, H, S, D): S1 = H (stride D), S2 = S (stride H * D), S3 = D
    assert ops._s1_fast_span(3, 64, 64, 3 * 64, 64) == 1
    assert ops._s1_fast_span(8, 64, 1024, 8 * 64, 64) == 16
    assert ops._s1_fast_span(3, 64, 70, 3 * 64, 64) == 0  # a chunk would straddle two heads
    assert ops._s1_fast_span(3, 70 * 64, 70, 64, 64) == 0  # a contiguous (B, H, S, D) tensor's order is logical
    assert ops._s1_fast_span(1, 64, 64, 64, 64) == 0


def test_p_zero_and_eval_return_x_and_p_one_returns_zeros():
    x = torch.randn(100, device=DEVICE, requires_grad=True)
    assert dropout(x, 0.0) is x
    assert dropout(x, 0.5, training=False) is x
    y = dropout(x, 1.0)
    assert torch.equal(y, torch.zeros_like(y))
    y.sum().backward()
    assert torch.equal(x.grad, torch.zeros_like(x))


def test_empty_tensor():
    x = torch.randn(0, 5, device=DEVICE, requires_grad=True)
    y = dropout(x, 0.5, seed=1)
    assert y.shape == (0, 5)
    y.sum().backward()
    assert x.grad.shape == (0, 5)


def test_inplace_matches_out_of_place():
    x = torch.randn(5000, device=DEVICE)
    expected = dropout(x, 0.4, seed=8)
    y = x.clone()
    out = dropout(y, 0.4, seed=8, inplace=True)
    assert out is y and torch.equal(y, expected)
    strided = torch.randn(100, 80, device=DEVICE).t()
    expected = dropout(strided, 0.4, seed=8)
    dropout(strided, 0.4, seed=8, inplace=True)
    assert torch.equal(strided, expected)


def test_inplace_with_autograd_gives_the_dropout_gradient():
    leaf = torch.randn(3000, device=DEVICE, requires_grad=True)
    h = leaf * 1.0
    out = dropout(h, 0.5, seed=4, inplace=True)
    assert out is h
    out.sum().backward()
    assert torch.equal(leaf.grad, twin.dropout(torch.ones(3000, device=DEVICE), 0.5, seed=4))


def test_module_is_a_drop_in_for_nn_dropout():
    m = Dropout(0.25)
    assert repr(m) == repr(torch.nn.Dropout(0.25)).replace("Dropout", "Dropout", 1)
    x = torch.randn(1000, device=DEVICE)
    torch.manual_seed(0)
    y = m(x)
    assert ((y != 0).double().mean().item() - 0.75) < 0.1
    m.eval()
    assert m(x) is x
    assert Dropout(0.5, inplace=True).inplace
    assert m.state_dict() == {}
    with pytest.raises(ValueError, match=r"p must be in \[0, 1\]"):
        Dropout(1.5)


@pytest.mark.parametrize("p", [-0.1, 1.01, float("nan"), float("inf")])
def test_bad_p_raises_value_error(p):
    with pytest.raises(ValueError, match=r"p must be in \[0, 1\]"):
        dropout(torch.randn(4, device=DEVICE), p)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.bool, torch.complex64])
def test_unsupported_dtype_raises_type_error(dtype):
    x = torch.zeros(4, device=DEVICE, dtype=dtype)
    with pytest.raises(TypeError, match="x must"):
        dropout(x, 0.5)


def test_bad_seed_and_non_tensor():
    with pytest.raises(ValueError, match="seed must be in"):
        dropout(torch.randn(4, device=DEVICE), 0.5, seed=-3)
    with pytest.raises(TypeError, match="seed must be None or an int"):
        dropout(torch.randn(4, device=DEVICE), 0.5, seed=0.5)
    with pytest.raises(TypeError, match=r"x must be a torch\.Tensor"):
        dropout([1.0, 2.0], 0.5)


def test_keep_threshold_rule():
    assert keep_threshold(0.5) == 2**31 == twin.keep_threshold(0.5)
    assert keep_threshold(1 - 1e-15) == 2**32 - 1
    for p in (1e-9, 0.1, 0.3, 0.9):
        assert keep_threshold(p) == twin.keep_threshold(p)


def test_registered_as_torch_library_ops():
    x = torch.randn(100, device=DEVICE)
    assert torch.equal(torch.ops.fused_kernels.dropout(x, 0.5, 3), dropout(x, 0.5, seed=3))
    torch.library.opcheck(torch.ops.fused_kernels.dropout.default, (x, 0.5, 3),
                          test_utils=("test_schema", "test_faketensor"))
    seed_tensor = torch.tensor(3, dtype=torch.int64, device=DEVICE)
    torch.library.opcheck(torch.ops.fused_kernels.dropout.default, (x, 0.5, 0, seed_tensor),
                          test_utils=("test_schema", "test_faketensor"))


def test_a_seed_on_the_device_keys_the_same_mask_as_the_int():
    """``seed_tensor`` (how seed=None travels under torch.compile and CUDA graphs) holds the int64 whose bits
    the int seed gives; the kernel must split it into the same Philox key, in both ops and the backward."""
    x = torch.randn(3000, device=DEVICE, requires_grad=True)
    for seed in (3, 2**63 + 12345, 2**33 + 1):
        signed = seed - 2**64 if seed >= 2**63 else seed
        on_device = torch.tensor(signed, dtype=torch.int64, device=DEVICE)
        expected = dropout(x, 0.4, seed=seed)
        got = torch.ops.fused_kernels.dropout(x, 0.4, 0, on_device)
        assert torch.equal(got, expected)
        assert torch.equal(torch.autograd.grad(got, x, torch.ones_like(got))[0],
                           torch.autograd.grad(expected, x, torch.ones_like(got))[0])
        inplace = x.detach().clone()
        torch.ops.fused_kernels.dropout_(inplace, 0.4, 0, on_device)
        assert torch.equal(inplace, expected)


# --- GPU-only: size and memory ----------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.big_memory
def test_past_two_to_the_31_elements():
    n = 2**31 + 17
    x = torch.randn(n, device="cuda", dtype=torch.float16)
    p, seed = 0.5, 99
    y = dropout(x, p, seed=seed)
    for start, count in ((0, 5000), (2**31 - 4100, 4117), (2**31 - 70000, 3000)):
        keep = twin.keep_mask(count, p, seed, start=start, device="cuda")
        window = x[start : start + count]
        expected = torch.where(keep, window * 2, torch.zeros_like(window))
        assert torch.equal(y[start : start + count], expected), f"window at {start}"
    del x, y
    torch.cuda.empty_cache()


@pytest.mark.cuda
def test_backward_allocates_nothing_the_size_of_the_input():
    n = 1 << 26
    x = torch.randn(n, device="cuda", dtype=torch.float16, requires_grad=True)
    dy = torch.randn(n, device="cuda", dtype=torch.float16)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    y = dropout(x, 0.5, seed=1)
    after_forward = torch.cuda.memory_allocated()
    # Only y itself is new: no mask (torch would add n bytes of bool).
    assert after_forward - before == y.numel() * y.element_size()
    torch.cuda.reset_peak_memory_stats()
    y.backward(dy)
    peak = torch.cuda.max_memory_allocated()
    assert peak - after_forward <= x.numel() * x.element_size()  # the gradient, nothing else


@pytest.mark.cuda
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "permuted"])
def test_torch_compile_of_the_op_alone_is_bit_exact(layout):
    """Compiled calls trace the same kernels (the strided ones for views they fit) and give the eager mask."""
    base = {"contiguous": lambda: torch.randn(3, 5000, device="cuda"),
            "transposed": lambda: torch.randn(8192, 3, device="cuda").t(),
            "permuted": lambda: torch.randn(2, 100, 4, 64, device="cuda").permute(0, 2, 1, 3)}[layout]()
    x = base.detach().requires_grad_(True)  # detach keeps the view's strides
    compiled = torch.compile(lambda t: dropout(t, 0.3, seed=1234), fullgraph=True)
    y_eager, y_compiled = dropout(x, 0.3, seed=1234), compiled(x)
    assert torch.equal(y_eager, y_compiled)
    assert torch.equal(y_eager, twin.dropout(x.detach().contiguous(), 0.3, seed=1234))
    dy = torch.randn_like(y_eager)
    (g_eager,) = torch.autograd.grad(y_eager, x, dy)
    (g_compiled,) = torch.autograd.grad(y_compiled, x, dy)
    assert torch.equal(g_eager, g_compiled)


@pytest.mark.cuda
def test_torch_compile_inside_arithmetic_keeps_the_mask_without_graph_breaks():
    def f(t):
        return dropout(t * 2.0, 0.3, seed=1234) + 1.0

    x = torch.randn(3, 5000, device="cuda", requires_grad=True)
    y_eager, y_compiled = f(x), torch.compile(f, fullgraph=True)(x)
    # Inductor may fuse the surrounding arithmetic (one rounding fewer); the mask must not change.
    assert torch.equal(y_eager == 1.0, y_compiled == 1.0)
    torch.testing.assert_close(y_compiled, y_eager, rtol=3e-7, atol=3e-7)
