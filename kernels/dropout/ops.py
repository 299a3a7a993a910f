"""Launcher, registered ops and autograd for seeded dropout.

Eager calls run ``_DropoutFunction`` (a plain ``torch.autograd.Function``); under torch.compile the
public function calls the registered ops, which share the same implementation. Ops
(``torch.ops.fused_kernels``):

- ``dropout(x, p, seed, seed_tensor=None) -> Tensor``: out-of-place, differentiable; its backward is the
  same op on the incoming gradient with the same ``(p, seed)`` (the mask is regenerated, nothing is saved
  but the seed). ``seed_tensor``, a 0-d int64 tensor on the device, replaces ``seed`` when given: the
  seed of a ``seed=None`` call under torch.compile (see ``kernels._common.seed``).
- ``dropout_(x, p, seed, seed_tensor=None) -> ()``: in place, for tensors that need no gradient.

Both are ``torch.library.triton_op``s, so torch.compile sees the Triton kernel. On CPU tensors without
the Triton interpreter, and on float64 tensors, they run the twin ``reference.dropout`` (bit-identical), under
torch.compile through the opaque op ``dropout_twin`` (``kernels._common.opaque``).

Launch rule: one program per ``4 * LANE_STRIDE * CHUNKS`` elements, CHUNKS and the warps from
``kernels.dropout.configs``; a strided view that one of the strided kernels fits runs there, in place, with the
result in the view's strides (``_launch_strided``).
"""

from __future__ import annotations

import torch
from torch.library import triton_op

import reference.dropout as twin
from kernels._common import (
    FLOAT_DTYPES,
    LIBRARY_NAMESPACE,
    backend_for,
    cdiv,
    check_float_dtype,
    check_probability,
    check_seed,
    check_tensor,
    interpreter_needs_fp32,
    kernel_for,
    nothing_to_launch,
)
from kernels._common.eager import PlanCache, function_apply, plannable, plans_apply, tensor_key
from kernels._common.launch import PreparedCache, current_stream_handle, recording
from kernels._common.opaque import opaque_op
from kernels._common.seed import (
    SEED_WORD_PARAMETERS,
    Seed,
    dropout_scalars,
    host_seed,
    key_words,
    op_seed_args,
    seed_for_call,
    seed_from_op_args,
    seed_pointer,
    seed_value,
)
from kernels._native import active as native_active
from kernels._native import call_last as native_call_last
from kernels._native import launches as native_launches
from kernels._native import layout as native_layout
from kernels._native import module as native_module
from kernels._native import program_for as native_program_for
from kernels._native import remember as native_remember
from kernels.dropout import configs
from kernels.dropout._kernels import _dropout_columns_kernel, _dropout_fwd_kernel, _dropout_rows_kernel
from reference.dropout import LANE_STRIDE

_CHUNK = 4 * LANE_STRIDE  # elements per Philox call group: four runs of LANE_STRIDE


def _launch(src: torch.Tensor, out: torch.Tensor, scalars: tuple, *, traceable: bool) -> None:
    """Run the kernel over contiguous ``src`` into contiguous ``out`` (which may be ``src``).

    ``traceable`` (inside the registered ops) launches through ``wrap_triton`` so torch.compile can trace
    the kernel; eager calls launch it directly (see ``kernels._common.launch``).
    """
    if nothing_to_launch(src):
        return
    n = src.numel()
    chunks, num_warps = configs.CHUNKS_PER_PROGRAM, configs.NUM_WARPS
    grid = (cdiv(n, _CHUNK * chunks),)
    seed_lo, seed_hi, seed_tensor, threshold, scale = scalars
    seed_ptr, seed_in_memory = seed_pointer(seed_tensor, src, traceable)
    kernel_for(_dropout_fwd_kernel, traceable=traceable)[grid](
        src, out, n, seed_lo, seed_hi, seed_ptr, seed_in_memory, threshold, scale, CHUNKS=chunks,
        num_warps=num_warps,
    )


def _collapsed_dims(x: torch.Tensor, out: torch.Tensor) -> list[tuple[int, int, int]]:
    """``(size, x stride, out stride)`` of the logical dims, size-1 dims dropped and neighbours merged where both
    tensors step through them as one (the outer stride is the inner one times the inner size)."""
    dims: list[tuple[int, int, int]] = []
    for size, xs, ys in zip(x.shape, x.stride(), out.stride(), strict=True):
        if size == 1:
            continue
        if dims and dims[-1][1] == xs * size and dims[-1][2] == ys * size:
            dims[-1] = (dims[-1][0] * size, xs, ys)
        else:
            dims.append((size, xs, ys))
    return dims


def _launch_strided(src: torch.Tensor, out: torch.Tensor, scalars: tuple, *, traceable: bool) -> bool:
    """Run a strided view through the kernel that reads it in place, when one fits its layout; False when none
    does (the caller copies it to contiguous first). Both kernels draw each element's word from its logical
    index, so a view gets the mask of its contiguous copy.

    - innermost logical dim contiguous (a permuted ``(B, S, H, D)`` view, a slice of rows), at most 4 dims after
      merging, that dim a power of two from 16 to ``LANE_STRIDE`` or a multiple of ``LANE_STRIDE``:
      ``_dropout_rows_kernel``;
    - 2-D, contiguous along the rows (a ``.t()`` of a contiguous matrix), the row length a multiple of
      ``4 * LANE_STRIDE``: ``_dropout_columns_kernel``."""
    dims = _collapsed_dims(src, out)
    seed_lo, seed_hi, seed_tensor, threshold, scale = scalars
    seed_ptr, seed_in_memory = seed_pointer(seed_tensor, src, traceable)
    seed_args = (seed_lo, seed_hi, seed_ptr, seed_in_memory, threshold, scale)
    if 1 < len(dims) <= 4 and dims[-1][1] == 1:
        inner = dims[-1][0]
        if (16 <= inner <= LANE_STRIDE and LANE_STRIDE % inner == 0) or inner % LANE_STRIDE == 0:
            dims = [(1, 0, 0)] * (4 - len(dims)) + dims
            (_, xs0, ys0), (s1, xs1, ys1), (s2, xs2, ys2), (s3, _, ys3) = dims
            n = src.numel()
            rows_per_chunk = max(1, _CHUNK // s3)
            span_chunks = _s1_fast_span(s1, xs1, s2, xs2, s3)
            kernel_for(_dropout_rows_kernel, traceable=traceable)[(cdiv(n, _CHUNK),)](
                src, out, n, s1, s2, s3, xs0, xs1, xs2, ys0, ys1, ys2, ys3, *seed_args, ROW=min(inner, LANE_STRIDE),
                ONE_WRAP=s2 >= rows_per_chunk, INDEX_64=n // s3 + rows_per_chunk >= 2**31, span_chunks=span_chunks,
                S1_FAST=span_chunks > 0, num_warps=configs.NUM_WARPS,
            )
            return True
    if len(dims) == 2 and dims[0][1] == 1 and dims[0][2] == 1 and dims[1][0] % _CHUNK == 0:
        (rows, _, _), (columns, xs_c, ys_c) = dims
        block_r, block_j = configs.COLUMNS_TILE[src.element_size()]
        kernel_for(_dropout_columns_kernel, traceable=traceable)[
            (cdiv(rows, block_r), LANE_STRIDE // block_j, columns // _CHUNK)](
            src, out, rows, columns, xs_c, ys_c, *seed_args, BLOCK_R=block_r, BLOCK_J=block_j,
            num_warps=configs.NUM_WARPS,
        )
        return True
    return False


def _s1_fast_span(s1: int, xs1: int, s2: int, xs2: int, s3: int) -> int:
    """Chunks per (S0, S1) index when ``_dropout_rows_kernel`` should order its programs S1 first (0: logical
    order): the view's S1 lies nearer in memory than S2 (a permuted ``(B, S, H, D)`` tensor: heads side by side) and
    every (S0, S1) span is whole chunks, so that no chunk straddles two of them."""
    if s1 > 1 and xs1 < xs2 and (s2 * s3) % _CHUNK == 0:
        return s2 * s3 // _CHUNK
    return 0


def _dropout_impl(x: torch.Tensor, p: float, seed: Seed, *, traceable: bool = False,
                  scalars: tuple | None = None) -> torch.Tensor:
    """Seeded dropout for ``0 < p < 1`` and a 64-bit unsigned ``seed`` (or a device seed): the one
    implementation behind the eager path and the registered op (``scalars``: ``dropout_scalars(p, seed)``
    when already known). A strided view is read in place where a kernel fits its layout (the result then has
    the view's strides, as torch's), else copied to contiguous first."""
    if backend_for(x, traced=traceable) == "reference":
        if traceable:
            return _dropout_twin_op(x, p, *op_seed_args(seed))
        return twin.dropout(x, p, seed=seed_value(seed))
    if interpreter_needs_fp32(x):
        return _dropout_impl(x.float(), p, seed, traceable=traceable, scalars=scalars).to(x.dtype)
    scalars = scalars or dropout_scalars(p, seed)
    if not x.is_contiguous() and not nothing_to_launch(x):
        out = torch.empty_like(x)
        if _launch_strided(x, out, scalars, traceable=traceable):
            return out
    src = x.contiguous()
    out = torch.empty_like(src)
    _launch(src, out, scalars, traceable=traceable)
    return out


@opaque_op("dropout_twin", "(Tensor x, float p, SymInt seed, Tensor? seed_tensor) -> Tensor",
           lambda x, p, seed, seed_tensor: torch.empty_like(x))
def _dropout_twin_op(x: torch.Tensor, p: float, seed: int, seed_tensor: torch.Tensor | None) -> torch.Tensor:
    """The twin's dropout, run as it is when a compiled graph runs (``kernels._common.opaque``)."""
    return torch.empty_like(x).copy_(twin.dropout(x, p, seed=seed_value(seed_from_op_args(seed, seed_tensor))))


class _DropoutFunction(torch.autograd.Function):
    """Eager autograd: the backward is the same dropout on the gradient, from the saved seed alone.

    Eager calls take this path rather than the registered op because the dispatcher's Python custom-op
    path costs tens of microseconds per call, as much as the kernel itself at 2**24 elements (see the
    family README); torch.compile traces the registered op instead.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, p: float, seed: Seed) -> torch.Tensor:
        ctx.p, ctx.seed, ctx.scalars = p, seed, dropout_scalars(p, seed)
        return _dropout_impl(x, p, seed, scalars=ctx.scalars)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        return _dropout_impl(grad_out, ctx.p, ctx.seed, scalars=ctx.scalars), None, None


@triton_op(f"{LIBRARY_NAMESPACE}::dropout", mutates_args=())
def dropout_op(x: torch.Tensor, p: float, seed: int, seed_tensor: torch.Tensor | None = None) -> torch.Tensor:
    """Registered op: seeded dropout for ``0 < p < 1``; ``seed`` is the 64-bit seed as a signed int64, or
    ``seed_tensor`` (a 0-d int64 device tensor, read by the kernel) when given."""
    return _dropout_impl(x, p, seed_from_op_args(seed, seed_tensor), traceable=True)


def _setup_context(ctx, inputs, output):
    _, ctx.p, ctx.seed, seed_tensor = inputs
    ctx.save_for_backward(seed_tensor)


def _backward(ctx, grad_out):
    (seed_tensor,) = ctx.saved_tensors
    return torch.ops.fused_kernels.dropout(grad_out, ctx.p, ctx.seed, seed_tensor), None, None, None


dropout_op.register_autograd(_backward, setup_context=_setup_context)


def _dropout_inplace_impl(x: torch.Tensor, p: float, seed: Seed, *, traceable: bool = False) -> None:
    if backend_for(x, traced=traceable) == "reference" or interpreter_needs_fp32(x):
        x.copy_(_dropout_impl(x, p, seed, traceable=traceable))
    elif x.is_contiguous():
        _launch(x, x, dropout_scalars(p, seed), traceable=traceable)
    elif nothing_to_launch(x) or not _launch_strided(x, x, dropout_scalars(p, seed), traceable=traceable):
        # each element is read and written by one thread, so the strided kernels can write into their input
        x.copy_(_dropout_impl(x, p, seed, traceable=traceable))


@triton_op(f"{LIBRARY_NAMESPACE}::dropout_", mutates_args={"x"})
def dropout_inplace_op(x: torch.Tensor, p: float, seed: int, seed_tensor: torch.Tensor | None = None) -> None:
    """Registered op: in-place seeded dropout for ``0 < p < 1`` on a tensor that needs no gradient."""
    _dropout_inplace_impl(x, p, seed_from_op_args(seed, seed_tensor), traceable=True)


def dropout(x: torch.Tensor, p: float = 0.5, training: bool = True, *, seed: int | None = None,
            inplace: bool = False) -> torch.Tensor:
    """Dropout whose mask is a pure function of ``(seed, element index)`` and is never stored.

    Args:
        x: fp16, bf16, fp32 or float64 tensor of any shape and strides (CUDA; CPU runs the interpreter or the
            twin; float64 runs the twin on every device).
        p: probability of zeroing an element, in ``[0, 1]``. Kept elements are scaled by ``1 / (1 - p)``.
        training: when False, ``x`` is returned unchanged (as ``torch.nn.functional.dropout``).
        seed: 64-bit seed. ``None`` draws one from torch's generator for ``x.device``, so
            ``torch.manual_seed`` governs it and two calls differ; under torch.compile and inside a CUDA
            graph it is drawn on the device, so every compiled call and every graph replay gets a new mask.
            The same ``(seed, p, shape)`` gives the same mask; element ``i`` (row-major in the logical
            shape) is decided by Philox word ``i``.
        inplace: write the result into ``x`` (returns ``x``).

    Returns ``x`` itself when ``p == 0`` or ``training`` is False; ``x * 0`` when ``p == 1`` (zeros, with
    NaN where ``x`` is NaN or infinite, as torch). A dropped element is ``x * 0`` too, so a NaN or Inf in
    ``x`` comes out as NaN wherever it is, as from ``torch.nn.functional.dropout``. The backward
    regenerates the mask from the seed: 0 bytes per element are saved.
    """
    plans = plans_apply()
    key = None
    if plans and plannable(seed, training, inplace) and type(p) in (float, int):
        key = (tensor_key(x), p, type(p), training, inplace, torch.is_grad_enabled())
        plan = _DROPOUT_PLANS.get(key)
        if plan is not None:
            if native_active() and not plan[1] and plan[0] not in (0.0, 1.0):
                out, seed = _native_dropout(key, plan, x, seed)
                if out is not None:
                    return out
            return _dropout_run(plan, x, seed, _apply_dropout)
    check_tensor("x", x)
    check_float_dtype("x", x, FLOAT_DTYPES)
    p = check_probability("p", p, allow_one=True)
    seed = check_seed("seed", seed)
    if not training or p in (0.0, 1.0):
        plan = (p if training else 0.0, bool(inplace), False)
        _DROPOUT_PLANS.put(key, plan)
        return _dropout_run(plan, x, seed, None)
    backend_for(x)  # a clear error for unsupported devices before any seed is drawn
    needs_grad = x.requires_grad and torch.is_grad_enabled()
    if torch.compiler.is_compiling():
        op_seed = op_seed_args(seed_for_call(seed, x.device))
        if inplace and not needs_grad:
            torch.ops.fused_kernels.dropout_(x, p, *op_seed)
            return x
        out = torch.ops.fused_kernels.dropout(x, p, *op_seed)
        return x.copy_(out) if inplace else out
    plan = (p, bool(inplace), needs_grad)
    _DROPOUT_PLANS.put(key, plan)
    return _dropout_run(plan, x, seed, _apply_dropout if plans else _DropoutFunction.apply)


#: checked eager calls (``kernels._common.eager``): plan key -> ``(p, inplace, needs_grad)``, p 0 when nothing is
#: dropped (``training=False`` too)
_DROPOUT_PLANS = PlanCache()
_apply_dropout = function_apply(_DropoutFunction)


#: compiled-tier programs (``kernels._native``) by plan key: a program, or False where none can be built
_NATIVE_DROPOUTS = PreparedCache()
#: the program each plan's calls last ran through (``kernels._native.last_program``)
_NATIVE_LAST_DROPOUTS = PreparedCache()


def _native_dropout(key, plan: tuple, x: torch.Tensor, seed: int | None) -> tuple:
    """``(out, seed)``: a dropout call (not in place, 0 < p < 1) through its compiled-tier program, built on the first
    call of its plan key; ``out`` None where it has none (CPU tensors, float64, which runs the twin, a tensor that is
    not contiguous, CUDA graph capture, which draws its seeds on the device, a misaligned tensor): the call then
    takes the Python path with ``seed``, the one drawn here for None where one was."""
    seed = host_seed(seed, x.device)
    if seed is None:
        return None, None
    words = list(key_words(seed))
    outputs = native_call_last(_NATIVE_LAST_DROPOUTS, plan, [x], words)
    if outputs is not None:
        return outputs[0], seed
    if not (x.is_cuda and x.is_contiguous()) or x.dtype == torch.float64:
        return None, seed
    program = native_program_for(_NATIVE_DROPOUTS, key, lambda: _native_dropout_program(x, plan[0], plan[2]))
    if program is None:
        return None, seed
    stream = current_stream_handle(x.device)
    outputs = native_module().run(program, [x], words, stream)
    if outputs is None:
        return None, seed
    native_remember(_NATIVE_LAST_DROPOUTS, plan, program, [x], stream)
    return outputs[0], seed


def _native_dropout_program(x: torch.Tensor, p: float, needs_grad: bool):
    """The program of a contiguous dropout call: its one launch recorded (on ``x``, into a scratch output, with any
    seed: the seed words are the call's ints), run forward on the input and backward on the gradient with the
    same seed, as ``_DropoutFunction``."""
    native = native_module()
    out = torch.empty_like(x)
    with recording((x, out), SEED_WORD_PARAMETERS) as rec:
        _launch(x, out, dropout_scalars(p, 0), traceable=False)
    launches = native_launches(rec.replay(), (x, out), native)
    if launches is None:
        return None
    contiguous = native_layout(x.shape, x.dtype)
    program = native.Program(device=x.device, launches=launches, allocs=[contiguous], fixed=[],
                             tensors=[native.INPUT, 0, native.ALLOC, 0], outputs=[native.ALLOC, 0], saved=[])
    if needs_grad:
        program.set_backward(launches=launches, allocs=[contiguous], fixed=[],
                             tensors=[native.GRAD, 0, native.ALLOC, 0], grad_layouts=[contiguous],
                             input_grads=[native.ALLOC, 0])
    return program


def _dropout_run(plan: tuple, x: torch.Tensor, seed: int | None, apply) -> torch.Tensor:
    """An eager dropout call with its checked arguments ``plan``: ``x`` itself for p = 0, ``x * 0`` for p = 1; else
    the seed drawn (``seed=None``), then the kernel in place, or the autograd Function through ``apply``, or the
    forward alone when no gradient is needed."""
    p, inplace, needs_grad = plan
    if p == 0.0:
        return x
    if p == 1.0:
        # x * 0, as torch: zeros, except that NaN and +-Inf become NaN (a bad value is never hidden)
        return x.mul_(0.0) if inplace else x * 0.0
    seed = seed_for_call(seed, x.device)
    if inplace and not needs_grad:
        _dropout_inplace_impl(x, p, seed)
        return x
    out = apply(x, p, seed) if needs_grad else _dropout_impl(x, p, seed)
    return x.copy_(out) if inplace else out
