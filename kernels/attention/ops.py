"""Launchers, registered ops and autograd for FlashAttention-2.

Eager calls run ``_FlashAttentionFunction``; under torch.compile ``flash_attention`` calls the
registered ops ``fused_kernels::flash_attn_fwd`` / ``flash_attn_bwd``, which share the implementation. Their
portable kernels are traced into the compiled graph; a call that can take a Hopper (Gluon) kernel goes through
the opaque ops ``flash_attn_fwd_gluon`` / ``flash_attn_bwd_gluon`` instead, which run the eager dispatch.
CPU tensors without the Triton interpreter, and float64 tensors, run the twin ``reference.attention``; under
torch.compile through the opaque ops ``flash_attn_fwd_twin`` / ``flash_attn_bwd_twin`` (``kernels._common.opaque``).
Under the Triton interpreter bf16 calls run in fp32 and round once (``interpreter_needs_fp32``).

Launch configurations (tiles, warps, stages, one or two backward launches) come from the table in
``kernels.attention.configs``. An eager ``flash_attention`` or ``flash_attention_varlen`` call checks its arguments
once per call signature (``kernels._common.eager``) and replays the launches its signature's first call recorded;
with the compiled tier on, a C++ program runs it (``kernels._native``).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
from torch.library import triton_op

import reference.attention as twin
from kernels._common import (
    LIBRARY_NAMESPACE,
    autocast_cast,
    backend_for,
    cdiv,
    check_float_dtype,
    check_probability,
    check_same_device,
    check_seed,
    check_tensor,
    interpreter_needs_fp32,
    kernel_for,
    nothing_to_launch,
    unused_pointer,
)
from kernels._common.autocast import autocast_dtype
from kernels._common.eager import PlanCache, autocast_key, function_apply, plannable, plans_apply, tensor_key
from kernels._common.launch import (
    PreparedCache,
    TmaTensor,
    current_stream_handle,
    launch_or_replay,
    multiprocessor_count,
    observed_calls,
    prepared_launches_enabled,
)
from kernels._common.launch import kernels_from as swap_kernels
from kernels._common.opaque import opaque_op
from kernels._common.runtime import kernel_path_token
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
from kernels._common.validate import indices_checked
from kernels._native import UNREAD, Refs
from kernels._native import active as native_active
from kernels._native import call_last as native_call_last
from kernels._native import launches as native_launches
from kernels._native import layout as native_layout
from kernels._native import module as native_module
from kernels._native import observed as native_observed
from kernels._native import program_for as native_program_for
from kernels._native import remember as native_remember
from kernels.attention import _hopper, _hopper_bwd, _hopper_bwd_dq, _hopper_bwd_split, configs
from kernels.attention._kernels import (
    _attn_bwd_kernel,
    _attn_bwd_preprocess_kernel,
    _attn_fwd_kernel,
)
from kernels.attention.checks import LOG2E, check_heads, dot_precision, resolve_scale, window_edges

_KERNEL_NAMES = ("_attn_fwd_kernel", "_attn_bwd_kernel", "_attn_bwd_preprocess_kernel")


def kernels_from(module):
    """Inside ``with kernels_from(module):`` calls launch ``module``'s jit kernels (another version of
    ``kernels/attention/_kernels.py``, same signatures) instead of this checkout's: interleaved A/B timing of a
    kernel change in one process (``scripts/ab_kernels.py``)."""
    return swap_kernels(globals(), module, _KERNEL_NAMES)


def _band(left: int, right: int) -> tuple[tuple[int, int], dict]:
    """Kernel arguments of the visible band, run-time ``(LEFT, RIGHT)`` and constexpr flags: query i sees keys
    ``i + Sk - Sq - left ... i + Sk - Sq + right``; -1 leaves that side unbounded (and compiles its mask away)."""
    return (max(left, 0), max(right, 0)), {"HAS_LEFT": left >= 0, "HAS_RIGHT": right >= 0}


_NO_DROPOUT = (0, 0, None, 0, 1.0)


def _dropout_args(dropout_p: float, seed: Seed) -> tuple:
    """Attention dropout as ``(seed_lo, seed_hi, seed_tensor, threshold, inv_keep)``: the seed as
    ``kernels._common.seed.dropout_scalars`` passes it, the 8-bit keep threshold and the scale of
    ``reference.attention`` (``p`` rounded to a multiple of 1/256; a threshold of 0 keeps everything)."""
    if dropout_p == 0.0:
        return _NO_DROPOUT
    seed_lo, seed_hi, seed_tensor, _, _ = dropout_scalars(dropout_p, seed)
    return (seed_lo, seed_hi, seed_tensor, twin.attention_keep_threshold(dropout_p),
            twin.attention_keep_scale(dropout_p))


def _drop_launch_args(drop: tuple, like: torch.Tensor, traceable: bool) -> tuple[tuple, dict]:
    """The kernels' dropout arguments for ``_dropout_args``'s tuple: run-time ones and constexpr flags."""
    seed_lo, seed_hi, seed_tensor, threshold, inv_keep = drop
    seed_ptr, seed_in_memory = seed_pointer(seed_tensor, like, traceable)
    return (seed_lo, seed_hi, seed_ptr, seed_in_memory, threshold, inv_keep), {"DROPOUT": threshold != 0}


def _strides(t: torch.Tensor) -> tuple[int, int, int, int]:
    """(batch, head, seq, dim) strides: a dense (B, H, S, D) tensor's own, or a packed (total, H, D) one's
    with batch stride 0 (the sequence offset comes from the cumulative lengths)."""
    if t.dim() == 4:
        return tuple(t.stride())
    return 0, t.stride(1), t.stride(0), t.stride(2)


def _dims(q, k, varlen) -> tuple[int, int, int, int, int, int]:
    """``(batch, Hq, Hkv, Sq, Sk, D)``; packed: Sq/Sk are the longest sequence's (they size the grid)."""
    if varlen is None:
        return q.shape[0], q.shape[1], k.shape[1], q.shape[2], k.shape[2], q.shape[3]
    cu_q, _, max_sq, max_sk = varlen
    return cu_q.numel() - 1, q.shape[1], k.shape[1], max_sq, max_sk, q.shape[2]


def _seq_args(lse, varlen, traceable: bool) -> tuple:
    """The kernels' (cu_seqlens_q, cu_seqlens_k, stride_lb, stride_lh) for a (B, Hq, Sq) or (Hq, total_q)
    statistic ``lse``. Dense launches pass never-read placeholders for the cumulative lengths."""
    if varlen is None:
        return unused_pointer(lse, traceable), unused_pointer(lse, traceable), lse.stride(0), lse.stride(1)
    return varlen[0], varlen[1], 0, lse.stride(0)


def _launch_fwd(q, k, v, o, lse, left: int, right: int, scale: float, cfg: dict, drop: tuple = _NO_DROPOUT,
                varlen=None, *, traceable=False):
    b, hq, hkv, sq, sk, d = _dims(q, k, varlen)
    band, band_flags = _band(left, right)
    grid = (cdiv(sq, cfg["BLOCK_M"]), b * hq)
    drop_args, drop_flags = _drop_launch_args(drop, q, traceable)
    kernel_for(_attn_fwd_kernel, traceable=traceable)[grid](
        q, k, v, o, lse, *_seq_args(lse, varlen, traceable), *_strides(q), *_strides(k), *_strides(v), *_strides(o),
        hq, hq // hkv, sq, sk, d, scale * LOG2E, *band, *drop_args, **drop_flags,
        DOT_PRECISION=dot_precision(q.dtype), VARLEN=varlen is not None, **band_flags, **cfg,
    )


def _tma_ready(t: torch.Tensor, traced: bool = False) -> bool:
    """Whether TMA can read ``t`` in place: contiguous last dim, 16-byte aligned base and other strides. ``traced``:
    ``t`` is a fake tensor of torch.compile, whose address is not known; the strides alone decide."""
    return (traced or t.data_ptr() % 16 == 0) and _tma_strides(t.stride(), t.element_size())


def _tma_strides(strides: tuple[int, ...], element_size: int) -> bool:
    return strides[-1] == 1 and all(stride * element_size % 16 == 0 for stride in strides[:-1])


def _output_strides(t: torch.Tensor) -> tuple[int, ...]:
    """The strides of an output (o, or a gradient) laid out as the input ``t``: ``t``'s own where they are a
    permutation of a dense tensor's with the last dim contiguous, as ``(B, S, H, D)`` views of q, k and v are (SDPA
    lays its outputs out the same way), else contiguous. A caller's ``o.transpose(1, 2).reshape(B, S, H * D)`` is
    then a view, not a copy, and autograd need not copy a gradient into its input's layout."""
    shape, strides = t.shape, t.stride()
    try:
        return _cached_dense_strides_or_contiguous(shape, strides)
    except TypeError:  # the symbolic sizes of a traced call do not hash
        return _dense_strides_or_contiguous(shape, strides)


def _dense_strides_or_contiguous(shape: tuple[int, ...], strides: tuple[int, ...]) -> tuple[int, ...]:
    rank = len(shape)
    contiguous = [1] * rank
    for i in range(rank - 2, -1, -1):
        contiguous[i] = contiguous[i + 1] * max(shape[i + 1], 1)
    if 0 in shape or (shape[-1] != 1 and strides[-1] != 1):
        return tuple(contiguous)
    expected = 1
    for i in sorted((i for i in range(rank) if shape[i] != 1), key=strides.__getitem__):
        if strides[i] != expected:
            return tuple(contiguous)
        expected *= shape[i]
    # a dim of one element is never stepped over: its stride is free, and TMA wants it aligned
    return tuple(strides[i] if shape[i] != 1 else contiguous[i] for i in range(rank))


# A call asks four times, and the loop over Python ints costs ~20 us a time on a GPU machine's host: more than the
# replayed launches of a backward take.
_cached_dense_strides_or_contiguous = functools.lru_cache(maxsize=256)(_dense_strides_or_contiguous)


def _empty_output(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """An uninitialised output of ``t``'s shape in ``t``'s layout (``_output_strides``)."""
    return torch.empty_strided(t.shape, _output_strides(t), dtype=dtype or t.dtype, device=t.device)


def uses_hopper_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0,
                        varlen=None, traced: bool = False, left: int = -1, right: int = -1) -> bool:
    """Whether a forward call on these tensors (band edges ``left``, ``right``; -1: none) runs the Hopper kernel
    (``kernels/attention/_hopper.py``) rather than the portable one. The Hopper kernel takes sm_90, fp16/bf16, dense
    batches, no dropout, head dims with a Hopper tile and tensors TMA can read in place; of those calls the ``auto``
    path takes the ones ``configs.prefers_hopper_forward`` names, the ``hopper`` path all. ``traced``: fake tensors
    of torch.compile, whose addresses are checked when the call runs (``_tma_ready``)."""
    path = configs.path()
    if path == "portable" or varlen is not None or dropout_p != 0.0 or q.dtype not in _GLUON_DTYPES or q.dim() != 4:
        return False
    bd = configs.block_d(q.shape[-1])
    if bd not in configs.HOPPER_FORWARD or not configs.is_hopper(q.device):
        return False
    if not (_tma_ready(q, traced) and _tma_ready(k, traced) and _tma_ready(v, traced)
            and _tma_strides(_output_strides(q), q.element_size())):
        return False
    if path == "hopper":
        return True
    grouped = k.shape[1] != q.shape[1]
    rows = configs.hopper_forward_tile(bd, q.shape[2], left, right, k.shape[2], grouped).query_rows
    programs = cdiv(q.shape[2], rows) * q.shape[0] * q.shape[1]
    return configs.prefers_hopper_forward(bd, programs, configs.sm_count(q.device), q.shape[2], k.shape[2],
                                          full=left < 0 and right < 0, causal=left < 0 and right >= 0,
                                          grouped=grouped)


_GLUON_DTYPES = {torch.float16: _hopper.gl.float16, torch.bfloat16: _hopper.gl.bfloat16}
_SHARED_DTYPES = {**_GLUON_DTYPES, torch.float32: _hopper.gl.float32}


@functools.lru_cache(maxsize=64)
def _shared_layout(block: tuple[int, ...], dtype: torch.dtype):
    return _hopper.gl.NVMMASharedLayout.get_default_for(list(block), _SHARED_DTYPES[dtype])


def _descriptor(t: torch.Tensor, block: tuple[int, ...]) -> TmaTensor:
    """``t`` as a Gluon kernel's TMA argument: all of it (its own shape and strides), moved in ``block`` tiles."""
    return TmaTensor(t, block, _shared_layout(block, t.dtype))


def _splits_96(tile, block_d: int, d: int) -> bool:
    """Whether a Hopper kernel runs its products over 64 + 32 columns: head dims 65-96 in a 128-column tile whose
    ``split_96`` is set (the rest of the tile is TMA's zero padding)."""
    return bool(tile.split_96 and block_d == 128 and d <= 96)


def _launch_fwd_hopper(q, k, v, o, lse, left: int, right: int, scale: float, persistent: bool = True):
    b, hq, hkv, sq, sk, d = _dims(q, k, None)
    bd = configs.block_d(d)
    t = configs.hopper_forward_tile(bd, sq, left, right, sk, hkv != hq)
    q_block, kv_block = (1, 1, _hopper.CONSUMER_ROWS, bd), (1, 1, t.block_n, bd)
    band, band_flags = _band(left, right)
    tiles_m = cdiv(sq, t.query_rows)
    # persistent programs (as many per SM as fit: one, three for the one-consumer tile) walking the work items in
    # turn overlap a tile's epilogue with the next one's loads. The items must cost the same for that static deal:
    # without a band every tile does; under a causal mask (or a right edge alone) a head's i-th longest and i-th
    # shortest query blocks together do (PAIRED). A left edge leaves tiles that differ otherwise: one program per
    # tile, balanced by the hardware's dispatch.
    persistent = persistent and t.persistent and not band_flags["HAS_LEFT"]
    paired = persistent and band_flags["HAS_RIGHT"]
    items = (cdiv(tiles_m, 2) if paired else tiles_m) * b * hq
    grid = (min(items, t.programs_per_sm * configs.sm_count(q.device)) if persistent else tiles_m * b * hq,)
    kernel_for(_hopper._attn_fwd_hopper_kernel, traceable=False)[grid](
        _descriptor(q, q_block), _descriptor(k, kv_block), _descriptor(v, kv_block), _descriptor(o, q_block),
        lse, lse.stride(0), lse.stride(1), b, hq, hq // hkv, sq, sk, scale * LOG2E, *band, **band_flags,
        BLOCK_N=t.block_n, BLOCK_D=bd, STAGES=t.stages, CONSUMERS=t.consumers, CONSUMER_REGS=t.consumer_regs,
        PRODUCER_REGS=t.producer_regs, PERSISTENT=persistent, PAIRED=paired, O_IN_Q=t.o_in_q,
        D_SPLIT=_splits_96(t, bd, d), num_warps=4, maxnreg=t.maxnreg,
    )


def uses_hopper_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor, dropout_p: float = 0.0,
                         varlen=None, deterministic: bool = False, traced: bool = False) -> bool:
    """Whether a backward call on these tensors runs the Hopper kernel (``kernels/attention/_hopper_bwd.py``) rather
    than the portable one: sm_90, fp16/bf16, dense batches, head dims with a Hopper tile, tensors TMA can read in
    place, and ``deterministic`` False where the Hopper backward sums dQ by TMA reductions in arrival order (where it
    takes the dQ kernel of its own instead, ``configs.takes_hopper_dq_kernel``, nothing is summed so and
    ``deterministic`` calls come too); of those calls the ``hopper`` path takes all and ``auto`` the ones
    ``configs.prefers_hopper_backward`` names. ``traced`` as in :func:`uses_hopper_forward`."""
    path = configs.path()
    if path == "portable":
        return False
    if varlen is not None or q.dtype not in _GLUON_DTYPES or q.dim() != 4:
        return False
    bd = configs.block_d(q.shape[-1])
    if bd not in configs.HOPPER_BACKWARD:
        return False
    if deterministic and not configs.takes_hopper_dq_kernel(bd, dropout_p > 0, deterministic=True):
        return False
    if dropout_p > 0 and configs.HOPPER_BACKWARD[bd].dropout_consumer_regs is None:
        return False
    if path == "auto" and not configs.prefers_hopper_backward(bd, q.shape[-2], k.shape[-2], dropout_p > 0):
        return False
    if not configs.is_hopper(q.device):
        return False
    return (all(_tma_ready(t, traced) for t in (q, k, v, do))
            and all(_tma_strides(_output_strides(t), t.element_size()) for t in (q, k)))


def _key_grid(key_blocks: int, heads: int, left: int, right: int, device: torch.device) -> tuple[tuple[int, int], bool]:
    """The Hopper dK/dV kernels' grid and whether it is key-block-major (``configs.hopper_key_major``): (B * Hkv, key
    blocks), else (key blocks, B * Hkv); the GPU starts programs in grid order, x fastest."""
    key_major = configs.hopper_key_major(key_blocks * heads, multiprocessor_count(device.index), left, right)
    return ((heads, key_blocks) if key_major else (key_blocks, heads)), key_major


def _launch_bwd_hopper(do, q, k, v, lse, delta, dq_out, dk, dv, left: int, right: int, scale: float,
                       drop: tuple = _NO_DROPOUT, dq_kernel: bool = False, dkv_acc: tuple | None = None,
                       group_parts: int = 1):
    """The Hopper backward: dK, dV written in place, or added into ``dkv_acc`` (dK's and dV's fp32 accumulators,
    (B, Hkv, Sk, padded D): zeroed by the preprocess kernel where ``group_parts`` programs per key block of a GQA
    group sum into them, ``configs.hopper_group_parts``, or holding a ring step's earlier blocks); dQ added into
    ``dq_out`` ((B, Hq, Sq, padded D) fp32, zeroed by the preprocess kernel or holding earlier blocks), or with
    ``dq_kernel`` written into ``dq_out`` (q's shape, dtype and layout) by a kernel of its own; ``drop`` as
    ``_dropout_args`` gives it."""
    b, hq, hkv, sq, sk, d = _dims(q, k, None)
    bd = configs.block_d(d)
    t = configs.HOPPER_BACKWARD[bd]
    band, band_flags = _band(left, right)
    dq_block = (1, 1, _hopper_bwd.QUERY_ROWS, _hopper_bwd.DQ_TILE)
    if t.split_head_dim:
        # Q and dO in 32-row halves (one per consumer's scores), K, V, dK and dV in 128-column halves (one per
        # consumer's columns)
        q_block, kv_block = (1, 1, _hopper_bwd_split.QUERY_HALF, bd), (1, 1, _hopper_bwd_split.KEY_ROWS, bd // 2)
        grid, key_major = _key_grid(cdiv(sk, _hopper_bwd_split.KEY_ROWS), b * hkv, left, right, q.device)
        dk_desc = _descriptor(dk, kv_block)
        # without dQ the kernel never reads its descriptor: dK's stands in
        dq_desc = dk_desc if dq_kernel else _descriptor(dq_out, dq_block)
        kernel_for(_hopper_bwd_split._attn_bwd_hopper_split_kernel, traceable=False)[grid](
            _descriptor(q, q_block), _descriptor(do, q_block), _descriptor(k, kv_block), _descriptor(v, kv_block),
            dk_desc, _descriptor(dv, kv_block), dq_desc,
            lse, delta, lse.stride(0), lse.stride(1), hkv, hq // hkv, sq, sk, scale, *band, **band_flags,
            BLOCK_D=bd, STAGES=t.stages, CONSUMER_REGS=t.consumer_regs, PRODUCER_REGS=t.producer_regs,
            WRITE_DQ=not dq_kernel, KEY_MAJOR=key_major, num_warps=4, maxnreg=t.maxnreg,
        )
        if dq_kernel:
            _launch_bwd_hopper_dq(do, q, k, v, lse, delta, dq_out, scale, band, band_flags)
        return
    block = (1, 1, _hopper_bwd.QUERY_ROWS, bd)
    grid, key_major = _key_grid(cdiv(sk, _hopper_bwd.KEY_ROWS), b * hkv * group_parts, left, right, q.device)
    drop_args, drop_flags = _drop_launch_args(drop, q, False)
    dropout = drop_flags["DROPOUT"]
    regs = (t.dropout_consumer_regs, t.dropout_producer_regs) if dropout else (t.consumer_regs, t.producer_regs)
    if dkv_acc is None:
        dk_desc, dv_desc = _descriptor(dk, block), _descriptor(dv, block)
    else:
        dk_desc, dv_desc = (_descriptor(acc, dq_block) for acc in dkv_acc)
    kernel_for(_hopper_bwd._attn_bwd_hopper_kernel, traceable=False)[grid](
        _descriptor(q, block), _descriptor(k, block), _descriptor(v, block), _descriptor(do, block),
        dk_desc, dv_desc, dk_desc if dq_kernel else _descriptor(dq_out, dq_block),
        lse, delta, lse.stride(0), lse.stride(1), hkv, hq // hkv, sq, sk, scale, *band, *drop_args, **band_flags,
        **drop_flags, BLOCK_D=bd, STAGES=t.stages, CONSUMER_REGS=regs[0], PRODUCER_REGS=regs[1],
        DQ_TURNS=t.dq_turns, WRITE_DQ=not dq_kernel, D_SPLIT=_splits_96(t, bd, d),
        KEY_MAJOR=key_major, GROUP_PARTS=group_parts, REDUCE_DKDV=dkv_acc is not None, num_warps=4,
        maxnreg=t.maxnreg,
    )
    if dq_kernel:
        _launch_bwd_hopper_dq(do, q, k, v, lse, delta, dq_out, scale, band, band_flags)


def _launch_bwd_hopper_dq(do, q, k, v, lse, delta, dq, scale: float, band: tuple, band_flags: dict):
    """dQ by the Hopper kernel of its own (``_hopper_bwd_dq.py``), written into ``dq`` (q's shape, dtype and
    layout)."""
    b, hq, hkv, sq, sk, d = _dims(q, k, None)
    bd = configs.block_d(d)
    t = configs.HOPPER_DQ[bd]
    q_block, kv_block = (1, 1, _hopper.CONSUMER_ROWS, bd), (1, 1, t.block_n, bd)
    grid = (cdiv(sq, _hopper_bwd_dq.QUERY_ROWS) * b * hq,)
    kernel_for(_hopper_bwd_dq._attn_bwd_hopper_dq_kernel, traceable=False)[grid](
        _descriptor(q, q_block), _descriptor(do, q_block), _descriptor(k, kv_block), _descriptor(v, kv_block),
        _descriptor(dq, q_block), lse, delta, lse.stride(0), lse.stride(1), hq, hq // hkv, sq, sk, scale, *band,
        **band_flags, BLOCK_N=t.block_n, BLOCK_D=bd, STAGES=t.stages, CONSUMER_REGS=t.consumer_regs,
        PRODUCER_REGS=t.producer_regs, num_warps=4, maxnreg=t.maxnreg,
    )


def _launch_bwd_preprocess(o, do, delta, varlen=None, *, traceable=False, dq_acc=None, dkv_acc=None):
    """``delta = rowsum(dO * O)``; also zeroes ``dq_acc`` ((B, Hq, Sq, padded D) fp32, contiguous) and each tensor of
    ``dkv_acc`` (dK's and dV's: (B, Hkv, Sk, padded D) fp32, contiguous) when given."""
    b, hq, _, sq, _, d = _dims(o, o, varlen)
    block_d = configs.block_d(d)
    block_m = configs.preprocess_block_m(block_d)
    cu_q, _, stride_lb, stride_lh = _seq_args(delta, varlen, traceable)
    zero_acc = dq_acc is not None
    unused = unused_pointer(delta, traceable)
    dk_acc, dv_acc = (unused, unused) if dkv_acc is None else dkv_acc
    kernel_for(_attn_bwd_preprocess_kernel, traceable=traceable)[(cdiv(sq, block_m), b * hq)](
        o, do, delta, dq_acc if zero_acc else unused, dk_acc, dv_acc,
        0 if dkv_acc is None else dkv_acc[0].numel() // block_d, cu_q, stride_lb, stride_lh,
        *_strides(o), *_strides(do), hq, sq, d,
        BLOCK_M=block_m, BLOCK_D=block_d, EVEN_D=d == block_d, VARLEN=varlen is not None, ZERO_DQ_ACC=zero_acc,
        ZERO_DKV_ACC=dkv_acc is not None,
    )


def _launch_bwd(do, q, k, v, lse, delta, dq, dk, dv, left: int, right: int, scale: float, dkdv_cfg: dict | None,
                dq_cfg: dict | None, drop: tuple = _NO_DROPOUT, varlen=None, *, traceable=False):
    """One launch of ``_attn_bwd_kernel``: dK/dV programs (``dkdv_cfg``; writes ``dk``, ``dv``) then dQ programs
    (``dq_cfg``; writes ``dq``). A None config leaves that part out, and its outputs may be None. Both parts in
    one launch share ``num_warps`` and ``num_stages``: the dQ config's are ignored when both are given."""
    b, hq, hkv, sq, sk, d = _dims(q, k, varlen)
    kv_blocks = cdiv(sk, dkdv_cfg["BLOCK_N"]) if dkdv_cfg else 1
    kv_programs = kv_blocks * b * hkv if dkdv_cfg else 0
    q_blocks = cdiv(sq, dq_cfg["BLOCK_M"]) if dq_cfg else 1
    q_programs = q_blocks * b * hq if dq_cfg else 0
    kv_cfg, q_cfg = dkdv_cfg or dq_cfg, dq_cfg or dkdv_cfg
    band, band_flags = _band(left, right)
    dq_strides, dk_strides = _strides(q if dq is None else dq), _strides(k if dk is None else dk)  # dv: as dk
    if dq is None:
        dq = unused_pointer(q, traceable)
    if dk is None:
        dk, dv = unused_pointer(q, traceable), unused_pointer(q, traceable)
    drop_args, drop_flags = _drop_launch_args(drop, q, traceable)
    kernel_for(_attn_bwd_kernel, traceable=traceable)[(kv_programs + q_programs,)](
        q, k, v, do, lse, delta, dq, dk, dv, *_seq_args(lse, varlen, traceable),
        *_strides(q), *_strides(k), *_strides(v), *_strides(do), *dq_strides, *dk_strides,
        hq, hkv, hq // hkv, sq, sk, d, scale, *band, *drop_args, kv_blocks, kv_programs, q_blocks,
        **band_flags, **drop_flags, DKDV=dkdv_cfg is not None, DQ=dq_cfg is not None,
        KV_BLOCK_M=kv_cfg["BLOCK_M"], KV_BLOCK_N=kv_cfg["BLOCK_N"], Q_BLOCK_M=q_cfg["BLOCK_M"],
        Q_BLOCK_N=q_cfg["BLOCK_N"], BLOCK_D=kv_cfg["BLOCK_D"], EVEN_D=kv_cfg["EVEN_D"],
        DOT_PRECISION=dot_precision(q.dtype), VARLEN=varlen is not None, num_warps=kv_cfg["num_warps"],
        num_stages=kv_cfg["num_stages"],
    )


def _twin_forward(q, k, v, left, right, scale, dropout_p, seed, varlen):
    kw = {"window_size": (left, right), "softmax_scale": scale, "dropout_p": dropout_p, "seed": seed_value(seed)}
    if varlen is None:
        return twin.flash_attention_forward(q, k, v, **kw)
    return twin.flash_attention_varlen_forward(q, k, v, varlen[0], varlen[1], **kw)


def _twin_backward(do, q, k, v, o, lse, left, right, scale, dropout_p, seed, varlen):
    kw = {"window_size": (left, right), "softmax_scale": scale, "dropout_p": dropout_p, "seed": seed_value(seed)}
    if varlen is None:
        return twin.flash_attention_backward(do, q, k, v, o, lse, **kw)
    return twin.flash_attention_varlen_backward(do, q, k, v, o, lse, varlen[0], varlen[1], **kw)


def _cu_seqlens(varlen) -> tuple:
    """A packed call's cumulative lengths ``(cu_seqlens_q, cu_seqlens_k)``; ``(None, None)`` for dense batches."""
    return (None, None) if varlen is None else varlen[:2]


def _twin_varlen(cu_seqlens_q, cu_seqlens_k):
    """The ``varlen`` argument of the twin wrappers for cumulative lengths (or None); the maxima, which size the
    kernels' grids, play no part there."""
    return None if cu_seqlens_q is None else (cu_seqlens_q, cu_seqlens_k, 0, 0)


def _contiguous_like(t: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(t, memory_format=torch.contiguous_format)


def _twin_forward_fake(q, k, v, window_left, window_right, scale, dropout_p, seed, seed_tensor, cu_seqlens_q,
                       cu_seqlens_k, max_seqlen_q, max_seqlen_k):
    stats = q.shape[:3] if cu_seqlens_q is None else (q.shape[1], q.shape[0])
    return _contiguous_like(q), q.new_empty(stats, dtype=torch.float64 if q.dtype == torch.float64 else torch.float32)


@opaque_op("flash_attn_fwd_twin", "(Tensor q, Tensor k, Tensor v, SymInt window_left, SymInt window_right, "
           "float scale, float dropout_p, SymInt seed, Tensor? seed_tensor, Tensor? cu_seqlens_q, "
           "Tensor? cu_seqlens_k, SymInt max_seqlen_q, SymInt max_seqlen_k) -> (Tensor, Tensor)", _twin_forward_fake)
def _twin_forward_op(q, k, v, window_left, window_right, scale, dropout_p, seed, seed_tensor, cu_seqlens_q,
                     cu_seqlens_k, max_seqlen_q, max_seqlen_k):
    """The twin's forward, run as it is when a compiled graph runs (``kernels._common.opaque``): ``(o, lse)``; a
    packed call's cumulative lengths are checked here, as an eager call's are before it runs."""
    if cu_seqlens_q is not None:
        _check_cumulative_lengths("q", cu_seqlens_q, q.shape[0], max_seqlen_q)
        _check_cumulative_lengths("k", cu_seqlens_k, k.shape[0], max_seqlen_k)
    o, lse = _twin_forward(q, k, v, window_left, window_right, scale, dropout_p,
                           seed_from_op_args(seed, seed_tensor), _twin_varlen(cu_seqlens_q, cu_seqlens_k))
    return _contiguous_like(q).copy_(o), lse if q.dtype == torch.float64 else lse.float()


@opaque_op("flash_attn_bwd_twin", "(Tensor do, Tensor q, Tensor k, Tensor v, Tensor o, Tensor lse, "
           "SymInt window_left, SymInt window_right, float scale, float dropout_p, SymInt seed, Tensor? seed_tensor, "
           "Tensor? cu_seqlens_q, Tensor? cu_seqlens_k) -> (Tensor, Tensor, Tensor)",
           lambda do, q, k, v, *_: (_contiguous_like(q), _contiguous_like(k), _contiguous_like(v)))
def _twin_backward_op(do, q, k, v, o, lse, window_left, window_right, scale, dropout_p, seed, seed_tensor,
                      cu_seqlens_q, cu_seqlens_k):
    """The twin's backward, run as it is when a compiled graph runs: ``(dq, dk, dv)``."""
    grads = _twin_backward(do, q, k, v, o, lse, window_left, window_right, scale, dropout_p,
                           seed_from_op_args(seed, seed_tensor), _twin_varlen(cu_seqlens_q, cu_seqlens_k))
    return tuple(_contiguous_like(t).copy_(g) for t, g in zip((q, k, v), grads, strict=True))


#: recorded launches of eager calls, by call signature (``_eager_signature``)
_FORWARD_CALLS = PreparedCache()
_BACKWARD_CALLS = PreparedCache()


def _eager_signature(q, k, v, left, right, scale, dropout_p, seed, varlen, traceable, *extra):
    """What an eager call's launches depend on besides the tensors' addresses and the seed (shapes, strides, dtype,
    device, band, scale, dropout, whether the seed is an int or on the device, the kernel path, the Hopper tiles; for
    a packed call also the cumulative lengths' shapes and strides and the longest sequences, which size the grid), or
    None for calls that are not replayed (traced calls, prepared launches off). A device seed (how compiled graphs and
    CUDA graphs pass it) is one of the replay's tensors (:func:`_seed_tensor`), as are the cumulative lengths
    (:func:`_cu_tensors`)."""
    if traceable or not prepared_launches_enabled():
        return None
    packed = None if varlen is None else (varlen[0].shape, varlen[0].stride(), varlen[1].shape, varlen[1].stride(),
                                          varlen[2], varlen[3])
    return (q.shape, q.stride(), k.shape, k.stride(), v.stride(), q.dtype, q.device.index, left, right, scale,
            dropout_p, type(seed) is int, configs.path(), configs.hopper_tables_version, packed, *extra)


def _cu_tensors(varlen) -> tuple:
    """A packed call's cumulative lengths as a replay's tensors (both None for a dense call)."""
    return (None, None) if varlen is None else (varlen[0], varlen[1])


def _seed_words(dropout_p: float, seed: Seed) -> tuple[int, int]:
    """The per-call ints of a replay: an int seed's key words (a device seed's kernels read it from memory)."""
    return key_words(seed) if dropout_p > 0 and type(seed) is int else (0, 0)


def _seed_tensor(seed: Seed) -> torch.Tensor | None:
    """A replay's tensor for the seed: the device seed, or None for an int seed (its launches take a fixed
    placeholder)."""
    return seed if isinstance(seed, torch.Tensor) else None


def _fwd_impl(q, k, v, left: int, right: int, scale: float, dropout_p: float = 0.0, seed: Seed = 0, varlen=None, *,
              traceable=False, beside_transfer=False):
    """``(o, lse)``: o laid out as q (``_output_strides``); lse (B, Hq, Sq), or (Hq, total_q) when packed.
    ``beside_transfer``: another kernel (a transfer) runs beside this one, so the Hopper forward takes one program per
    tile, whose dispatch gives the SMs it holds fewer tiles, rather than persistent programs, whose static deal would
    end with the programs it kept waiting.

    An eager dense call replays the launches recorded by the first call with the same signature
    (``kernels._common.launch.Recording``): a few us of host time instead of building ~40 arguments anew."""
    if backend_for(q, traced=traceable) == "reference":
        if traceable:
            return _twin_forward_op(q, k, v, left, right, scale, dropout_p, *op_seed_args(seed), *_cu_seqlens(varlen),
                                    *(varlen[2:] if varlen else (0, 0)))
        o, lse = _twin_forward(q, k, v, left, right, scale, dropout_p, seed, varlen)
        return o, lse if q.dtype == torch.float64 else lse.float()
    if interpreter_needs_fp32(q):
        o, lse = _fwd_impl(q.float(), k.float(), v.float(), left, right, scale, dropout_p, seed, varlen,
                           traceable=traceable)
        return o.to(q.dtype), lse
    if traceable and uses_hopper_forward(q, k, v, dropout_p, varlen, traced=True, left=left, right=right):
        return torch.ops.fused_kernels.flash_attn_fwd_gluon(q, k, v, left, right, scale)
    dims = _dims(q, k, varlen)
    b, hq = dims[:2]
    o = _empty_output(q)
    if varlen is None and dropout_p == 0.0 and not traceable and configs.decode_shaped(q.shape[2], k.shape[2]) \
            and q.numel() and k.shape[1]:
        from kernels.attention.kvcache import attend_every_key  # (kvcache imports this module)
        return o, attend_every_key(q, k, v, o, left, right, scale)
    stats_shape = (b, hq, q.shape[2]) if varlen is None else (hq, q.shape[0])
    lse = torch.empty(stats_shape, device=q.device, dtype=torch.float32)
    if nothing_to_launch(q) or k.numel() == 0 or b == 0:
        o.zero_()
        lse.fill_(float("-inf"))
        return o, lse
    signature = _eager_signature(q, k, v, left, right, scale, dropout_p, seed, varlen, traceable, beside_transfer)
    launch_or_replay(_FORWARD_CALLS, signature, (q, k, v, o, lse, _seed_tensor(seed), *_cu_tensors(varlen)),
                     lambda: _fwd_launches(q, k, v, o, lse, left, right, scale, dropout_p, seed, varlen, traceable,
                                           dims, beside_transfer),
                     _seed_words(dropout_p, seed) if signature else (), SEED_WORD_PARAMETERS)
    return o, lse


def _fwd_launches(q, k, v, o, lse, left, right, scale, dropout_p, seed, varlen, traceable, dims,
                  beside_transfer=False) -> None:
    """The forward's launches: the Hopper kernel where it takes the call, else the portable one (``dims``: the
    call's ``_dims``)."""
    if not traceable and uses_hopper_forward(q, k, v, dropout_p, varlen, left=left, right=right):
        _launch_fwd_hopper(q, k, v, o, lse, left, right, scale, persistent=not beside_transfer)
        return
    _, _, _, sq, _, d = dims
    cfg = configs.launch_config("fwd", d, q.dtype, left, right, sq, dropout=dropout_p > 0)
    _launch_fwd(q, k, v, o, lse, left, right, scale, cfg, _dropout_args(dropout_p, seed), varlen, traceable=traceable)


def _bwd_impl(do, q, k, v, o, lse, left: int, right: int, scale: float, dropout_p: float = 0.0, seed: Seed = 0,
              varlen=None, *, traceable=False, deterministic=False):
    """``(dq, dk, dv)``, laid out as q and k (``_output_strides``; dv as dk, whose strides the portable kernel shares
    with it). Eager dense calls replay recorded launches (as
    ``_fwd_impl``)."""
    dims = _dims(q, k, varlen)
    b, d = dims[0], dims[5]
    if not lse.is_contiguous():  # the kernels index delta, allocated contiguous below, with lse's strides
        lse = lse.contiguous()
    too_wide_for_fp32 = q.dtype == torch.float32 and configs.block_d(d) > configs.FP32_MAX_KERNEL_BWD_DIM
    if backend_for(q, traced=traceable) == "reference" or too_wide_for_fp32:
        if traceable:
            return _twin_backward_op(do, q, k, v, o, lse, left, right, scale, dropout_p, *op_seed_args(seed),
                                     *_cu_seqlens(varlen))
        return _twin_backward(do, q, k, v, o, lse, left, right, scale, dropout_p, seed, varlen)
    if nothing_to_launch(q) or k.numel() == 0 or b == 0:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    if interpreter_needs_fp32(q):
        dq, dk, dv = _bwd_impl(do.float(), q.float(), k.float(), v.float(), o.float(), lse, left, right, scale,
                               dropout_p, seed, varlen, traceable=traceable, deterministic=deterministic)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
    if traceable and uses_hopper_backward(q, k, v, do, dropout_p, varlen, deterministic, traced=True):
        return torch.ops.fused_kernels.flash_attn_bwd_gluon(do, q, k, v, o, lse, left, right, scale, dropout_p,
                                                            *op_seed_args(seed), deterministic)
    dk = _empty_output(k)
    dv = torch.empty_like(dk)
    delta = torch.empty_like(lse)
    signature = _eager_signature(q, k, v, left, right, scale, dropout_p, seed, varlen, traceable, do.stride(),
                                 o.stride(), deterministic)
    if not traceable and _hopper_backward_choice(signature, q, k, v, do, dropout_p, varlen, deterministic):
        bd = configs.block_d(d)
        dq_kernel = configs.takes_hopper_dq_kernel(bd, dropout_p > 0, deterministic)
        # dQ itself when a kernel of its own writes it, else the fp32 accumulator the reductions add into
        dq_out = (_empty_output(q) if dq_kernel else
                  torch.empty((b, q.shape[1], q.shape[2], bd), device=q.device, dtype=torch.float32))
        group_parts = configs.hopper_group_parts(q.shape[1] // k.shape[1], bd, dq_kernel,
                                                 _splits_96(configs.HOPPER_BACKWARD[bd], bd, d), deterministic, left,
                                                 right)
        # a group split over programs sums dK and dV in fp32 accumulators, cast below
        dkv_acc = None if group_parts == 1 else tuple(
            torch.empty((b, k.shape[1], k.shape[2], bd), device=q.device, dtype=torch.float32) for _ in range(2))
        # replayed like the portable launches: the TMA arguments are made again over the call's own tensors
        if signature is not None:
            signature = (signature, "hopper-dq" if dq_kernel else "hopper", group_parts)
        launch_or_replay(_BACKWARD_CALLS, signature,
                         (do, q, k, v, o, lse, delta, dq_out, dk, dv, _seed_tensor(seed), *_cu_tensors(varlen),
                          *(dkv_acc or ())),
                         lambda: _bwd_hopper_launches(do, q, k, v, o, lse, delta, dq_out, dk, dv, left, right, scale,
                                                      dropout_p, seed, dq_kernel, dkv_acc, group_parts),
                         _seed_words(dropout_p, seed) if signature else (), SEED_WORD_PARAMETERS)
        if dkv_acc is not None:
            dk.copy_(dkv_acc[0][..., :d])
            dv.copy_(dkv_acc[1][..., :d])
        if dq_kernel:
            return dq_out, dk, dv
        # the cast out of the padded accumulator writes dQ in q's layout
        if dq_out.shape[-1] == d and q.is_contiguous():
            return dq_out.to(q.dtype), dk, dv  # one call allocates and casts
        return _empty_output(q).copy_(dq_out[..., :d]), dk, dv
    dq = _empty_output(q)
    launch_or_replay(_BACKWARD_CALLS, signature,
                     (do, q, k, v, o, lse, delta, dq, dk, dv, _seed_tensor(seed), *_cu_tensors(varlen)),
                     lambda: _bwd_launches(do, q, k, v, o, lse, delta, dq, dk, dv, left, right, scale, dropout_p, seed,
                                           varlen, traceable, dims),
                     _seed_words(dropout_p, seed) if signature else (), SEED_WORD_PARAMETERS)
    return dq, dk, dv


def accumulates_in_kernel(do, q, k, v, dq_acc, dk_acc, dv_acc) -> bool:
    """Whether :func:`_bwd_accumulate` on these tensors has the Hopper backward add into the accumulators itself:
    the call takes the Hopper backward with dQ by reductions (head dims 64 and 128, not split 64 + 32) and TMA can
    write the accumulators in place."""
    if not uses_hopper_backward(q, k, v, do):
        return False
    d = q.shape[-1]
    bd = configs.block_d(d)
    return (bd in (64, 128) and not configs.takes_hopper_dq_kernel(bd, False)
            and not _splits_96(configs.HOPPER_BACKWARD[bd], bd, d)
            and all(acc.dtype == torch.float32 and acc.shape[-1] == bd and _tma_ready(acc)
                    for acc in (dq_acc, dk_acc, dv_acc)))


def row_deltas(o: torch.Tensor, do: torch.Tensor) -> torch.Tensor | None:
    """``rowsum(dO * O)`` (B, H, S) fp32 by the backward's preprocess kernel, for :func:`_bwd_accumulate` calls on
    row ranges of ``o``; None where the blocks take the twin (which computes its own)."""
    if backend_for(o) == "reference" or interpreter_needs_fp32(o) or nothing_to_launch(o):
        return None
    delta = torch.empty(o.shape[:3], device=o.device, dtype=torch.float32)
    _launch_bwd_preprocess(o, do, delta)
    return delta


def _bwd_accumulate(do, q, k, v, o, lse, left: int, right: int, scale: float, dq_acc, dk_acc, dv_acc, *,
                    delta=None) -> None:
    """Adds the gradients of one attention block (no dropout, dense) to fp32 accumulators: ``dq_acc`` (B, Hq, Sq,
    W) and ``dk_acc``, ``dv_acc`` (B, Hkv, Sk, W), W = ``configs.block_d(D)``; columns past D are left as they are.
    A block of a sum (the blocks of context-parallel attention's ring steps) then costs no zeroing, cast or addition
    pass of its own: where :func:`accumulates_in_kernel` holds, the Hopper backward adds dQ, dK and dV by
    TMA reductions straight into them; elsewhere the block's gradients are computed as :func:`_bwd_impl` does and
    added. ``lse`` is the block's rows' log-sum-exp of the whole attention (the merged one), ``o`` its output;
    ``delta``, when given, their ``rowsum(dO * O)`` (:func:`row_deltas`), else computed here."""
    d = q.shape[-1]
    if not lse.is_contiguous():  # the kernels index delta, allocated contiguous below, with lse's strides
        lse = lse.contiguous()
    if q.numel() == 0 or k.shape[2] == 0:
        return
    if not accumulates_in_kernel(do, q, k, v, dq_acc, dk_acc, dv_acc):
        dq, dk, dv = _bwd_impl(do, q, k, v, o, lse, left, right, scale)
        dq_acc[..., :d] += dq
        dk_acc[..., :d] += dk
        dv_acc[..., :d] += dv
        return
    if delta is None:
        delta = torch.empty_like(lse)
        _launch_bwd_preprocess(o, do, delta)
    elif not delta.is_contiguous():  # indexed with lse's strides
        delta = delta.contiguous()
    group_parts = configs.hopper_group_parts(q.shape[1] // k.shape[1], configs.block_d(d), False, False, False, left,
                                             right)
    _launch_bwd_hopper(do, q, k, v, lse, delta, dq_acc, None, None, left, right, scale, dkv_acc=(dk_acc, dv_acc),
                       group_parts=group_parts)


#: Whether a backward signature (:func:`_eager_signature` with dO's and O's strides and ``deterministic``) and the
#: alignment of its tensors' addresses take the Hopper backward: ``uses_hopper_backward`` costs as much host time as
#: a launch, and depends on nothing else.
_HOPPER_BACKWARD_CHOICES = PreparedCache()


def _hopper_backward_choice(signature, q, k, v, do, dropout_p: float, varlen, deterministic: bool) -> bool:
    """``uses_hopper_backward`` for an eager call, remembered by ``signature`` (None: not remembered)."""
    if signature is None:
        return uses_hopper_backward(q, k, v, do, dropout_p, varlen, deterministic)
    key = (signature, (q.data_ptr() | k.data_ptr() | v.data_ptr() | do.data_ptr()) & 15)
    choice = _HOPPER_BACKWARD_CHOICES.get(key)
    if choice is None:
        choice = uses_hopper_backward(q, k, v, do, dropout_p, varlen, deterministic)
        _HOPPER_BACKWARD_CHOICES.put(key, choice)
    return choice


def _bwd_hopper_launches(do, q, k, v, o, lse, delta, dq_out, dk, dv, left, right, scale, dropout_p, seed,
                         dq_kernel: bool, dkv_acc: tuple | None = None, group_parts: int = 1) -> None:
    """The Hopper backward: ``delta``, then the Gluon kernels. ``dq_out`` is dQ when ``dq_kernel`` (a kernel of its
    own writes it after the dK/dV kernel), else the fp32 accumulator, zeroed with ``delta``, as ``dkv_acc`` (dK's
    and dV's, where ``group_parts`` programs share a GQA group's keys)."""
    _launch_bwd_preprocess(o, do, delta, dq_acc=None if dq_kernel else dq_out, dkv_acc=dkv_acc)
    _launch_bwd_hopper(do, q, k, v, lse, delta, dq_out, dk, dv, left, right, scale, _dropout_args(dropout_p, seed),
                       dq_kernel, dkv_acc, group_parts)


def _bwd_launches(do, q, k, v, o, lse, delta, dq, dk, dv, left, right, scale, dropout_p, seed, varlen,
                  traceable, dims) -> None:
    """The portable backward: ``delta``, then dK/dV and dQ programs in one launch or two (``dims``: the call's
    ``_dims``)."""
    _launch_bwd_preprocess(o, do, delta, varlen, traceable=traceable)
    drop = _dropout_args(dropout_p, seed)
    _, _, _, sq, _, d = dims
    dkdv_cfg, dq_cfg = (configs.launch_config(kernel, d, q.dtype, left, right, sq, dropout=dropout_p > 0)
                        for kernel in ("dkdv", "dq"))
    if configs.fuse_backward(dkdv_cfg, dq_cfg):
        _launch_bwd(do, q, k, v, lse, delta, dq, dk, dv, left, right, scale, dkdv_cfg, dq_cfg, drop, varlen,
                    traceable=traceable)
    else:
        _launch_bwd(do, q, k, v, lse, delta, None, dk, dv, left, right, scale, dkdv_cfg, None, drop, varlen,
                    traceable=traceable)
        _launch_bwd(do, q, k, v, lse, delta, dq, None, None, left, right, scale, None, dq_cfg, drop, varlen,
                    traceable=traceable)


def _varlen(cu_q, cu_k, max_sq: int, max_sk: int):
    return None if cu_q is None else (cu_q, cu_k, max_sq, max_sk)


class _FlashAttentionFunction(torch.autograd.Function):
    """Eager autograd: saves q, k, v, o and the fp32 log-sum-exp (O(B·H·S) extra memory). ``args``:
    ``(left, right, scale, dropout_p, seed, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, deterministic)``,
    the cumulative lengths None for dense batches."""

    @staticmethod
    def forward(ctx, q, k, v, args):
        # the non-tensor arguments travel as one tuple: each argument of ``apply`` costs host time
        *band_drop, cu_q, cu_k, max_sq, max_sk, deterministic = args
        varlen = _varlen(cu_q, cu_k, max_sq, max_sk)
        o, lse = _fwd_impl(q, k, v, *band_drop, varlen)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.args, ctx.varlen, ctx.deterministic = tuple(band_drop), varlen, deterministic
        ctx.mark_non_differentiable(lse)
        # lse's gradient stays None: materialised, it would cost a zeros tensor (an allocation and a fill launch)
        # per backward
        ctx.set_materialize_grads(False)
        return o, lse

    @staticmethod
    def backward(ctx, do, _dlse):
        if do is None:  # o unused downstream: nothing flows back
            return None, None, None, None
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = _bwd_impl(do, q, k, v, o, lse, *ctx.args, ctx.varlen, deterministic=ctx.deterministic)
        return dq, dk, dv, None


@triton_op(f"{LIBRARY_NAMESPACE}::flash_attn_fwd", mutates_args=())
def flash_attn_fwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window_left: int, window_right: int,
                      scale: float, dropout_p: float, seed: int, seed_tensor: torch.Tensor | None,
                      cu_seqlens_q: torch.Tensor | None, cu_seqlens_k: torch.Tensor | None, max_seqlen_q: int,
                      max_seqlen_k: int, deterministic: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Registered forward: ``(o, lse)``; the band as in ``_band`` (causal is ``window_right = 0``); ``seed``
    is the 64-bit dropout seed as a signed int64, or ``seed_tensor`` (a 0-d int64 device tensor the kernel
    reads) when given; packed batches pass their cumulative lengths; ``deterministic`` is kept for the backward."""
    varlen = _varlen(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    return _fwd_impl(q, k, v, window_left, window_right, scale, dropout_p, seed_from_op_args(seed, seed_tensor),
                     varlen, traceable=True)


@triton_op(f"{LIBRARY_NAMESPACE}::flash_attn_bwd", mutates_args=())
def flash_attn_bwd_op(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                      lse: torch.Tensor, window_left: int, window_right: int, scale: float, dropout_p: float,
                      seed: int, seed_tensor: torch.Tensor | None, cu_seqlens_q: torch.Tensor | None,
                      cu_seqlens_k: torch.Tensor | None, max_seqlen_q: int, max_seqlen_k: int,
                      deterministic: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Registered backward: ``(dq, dk, dv)``."""
    varlen = _varlen(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    return _bwd_impl(do, q, k, v, o, lse, window_left, window_right, scale, dropout_p,
                     seed_from_op_args(seed, seed_tensor), varlen, traceable=True, deterministic=deterministic)


# A Gluon kernel cannot be traced into a compiled graph as ``wrap_triton`` traces the portable ones: calls that can
# take one go through these opaque ops, whose eager dispatch picks the Hopper or the portable kernel when they run
# (the address alignment TMA needs is only known then). They are defined with ``torch.library.Library`` rather than
# ``custom_op``: a compiled graph calls them once per attention call, and custom_op's Python autograd and backend
# wrappers cost ~100 us of host time per call (H100 host, a call of the backward op at a tiny size: 211 against
# 113 us for the same work called directly). Nothing differentiates them (they run inside compiled forward and
# backward graphs), so they register no autograd formula.
_GLUON_OPS = torch.library.Library(LIBRARY_NAMESPACE, "FRAGMENT")
_GLUON_OPS.define("flash_attn_fwd_gluon(Tensor q, Tensor k, Tensor v, SymInt window_left, SymInt window_right, "
                  "float scale) -> (Tensor, Tensor)")
_GLUON_OPS.define("flash_attn_bwd_gluon(Tensor do, Tensor q, Tensor k, Tensor v, Tensor o, Tensor lse, "
                  "SymInt window_left, SymInt window_right, float scale, float dropout_p, SymInt seed, "
                  "Tensor? seed_tensor, bool deterministic=False) -> (Tensor, Tensor, Tensor)")


def flash_attn_fwd_gluon_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window_left: int, window_right: int,
                            scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``flash_attn_fwd`` of a dense call without dropout, run eagerly: ``(o, lse)``."""
    return _fwd_impl(q, k, v, window_left, window_right, scale)


@torch.library.register_fake(f"{LIBRARY_NAMESPACE}::flash_attn_fwd_gluon", lib=_GLUON_OPS)
def _(q, k, v, window_left, window_right, scale):
    return _empty_output(q), q.new_empty(q.shape[:3], dtype=torch.float32)


def flash_attn_bwd_gluon_op(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                            lse: torch.Tensor, window_left: int, window_right: int, scale: float, dropout_p: float,
                            seed: int, seed_tensor: torch.Tensor | None, deterministic: bool = False,
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``flash_attn_bwd`` of a dense call, run eagerly: ``(dq, dk, dv)`` (``deterministic`` calls come here only where
    the Hopper backward sums nothing in arrival order)."""
    return _bwd_impl(do, q, k, v, o, lse, window_left, window_right, scale, dropout_p,
                     seed_from_op_args(seed, seed_tensor), deterministic=deterministic)


@torch.library.register_fake(f"{LIBRARY_NAMESPACE}::flash_attn_bwd_gluon", lib=_GLUON_OPS)
def _(do, q, k, v, o, lse, window_left, window_right, scale, dropout_p, seed, seed_tensor, deterministic=False):
    dk = _empty_output(k)
    return _empty_output(q), dk, torch.empty_like(dk)


# every device: the eager dispatch inside picks the kernel (or the twin on a CPU without the interpreter)
_GLUON_OPS.impl("flash_attn_fwd_gluon", flash_attn_fwd_gluon_op, "CompositeExplicitAutograd")
_GLUON_OPS.impl("flash_attn_bwd_gluon", flash_attn_bwd_gluon_op, "CompositeExplicitAutograd")


def _setup_context(ctx, inputs, output):
    q, k, v, left, right, scale, dropout_p, seed, seed_tensor, *varlen_args, deterministic = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse, seed_tensor)
    ctx.args = (left, right, scale, dropout_p, seed)
    ctx.varlen_args, ctx.deterministic = tuple(varlen_args), deterministic
    ctx.mark_non_differentiable(lse)


def _backward(ctx, do, _dlse):
    q, k, v, o, lse, seed_tensor = ctx.saved_tensors
    # dO of an output a caller transposed back arrives in o's layout: read in place, as the eager backward does
    do = do if do.stride() == o.stride() else do.contiguous()
    dq, dk, dv = torch.ops.fused_kernels.flash_attn_bwd(do, q, k, v, o, lse, *ctx.args, seed_tensor,
                                                        *ctx.varlen_args, ctx.deterministic)
    return dq, dk, dv, *([None] * 11)


flash_attn_fwd_op.register_autograd(_backward, setup_context=_setup_context)


class _AttentionPlan(NamedTuple):
    """A call's checked arguments (``kernels._common.eager``): all that ``_attend`` needs besides the tensors and
    the seed. Stored per call signature (``_PLANS`` for dense calls, ``_VARLEN_PLANS`` for packed ones)."""
    cast_dtype: torch.dtype | None  # autocast's dtype for the call, None outside autocast
    left: int  # the band: keys p - left .. p + right of query position p (-1: unbounded)
    right: int
    scale: float
    dropout_p: float
    deterministic: bool


def _attend(plan: _AttentionPlan, q, k, v, seed: Seed | None, varlen=None, apply=None):
    """``(o, lse)`` of a call with checked arguments ``plan``: q, k, v cast as autocast casts them (a no-op where
    they already are), the seed drawn (``None`` with dropout: from torch's generator), then the forward, through
    autograd when a gradient is needed (``apply``: the checked plan's lighter entry, or the Function's ``apply``),
    as the registered op under torch.compile, else directly."""
    if plan.cast_dtype is not None and not q.dtype == k.dtype == v.dtype == plan.cast_dtype:
        q, k, v = autocast_cast("attention", q, k, v)
    seed = seed_for_call(seed, q.device) if plan.dropout_p > 0 else 0
    left, right, scale, dropout_p = plan.left, plan.right, plan.scale, plan.dropout_p
    cu_q, cu_k, max_sq, max_sk = varlen if varlen is not None else (None, None, 0, 0)
    if torch.compiler.is_compiling():
        return torch.ops.fused_kernels.flash_attn_fwd(q, k, v, left, right, scale, dropout_p, *op_seed_args(seed),
                                                      cu_q, cu_k, max_sq, max_sk, plan.deterministic)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        args = (left, right, scale, dropout_p, seed, cu_q, cu_k, max_sq, max_sk, plan.deterministic)
        return (apply or _apply)(q, k, v, args)
    # Nothing to differentiate: skip autograd.Function.apply, whose host cost is a sizeable part of a
    # short forward's (record benchmarks/results/nvidia-h200/records/attention-bwd-fusion-probe.txt, section 1).
    return _fwd_impl(q, k, v, left, right, scale, dropout_p, seed, varlen)


def _validate(q, k, v, *, packed: bool = False) -> None:
    """Shape/dtype/device checks shared by the dense (B, H, S, D) and packed (total, H, D) entry points."""
    rank, layout = (3, "(total_tokens, heads, head_dim)") if packed else (4, "(batch, heads, seq, head_dim)")
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, t)
        if t.dim() != rank:
            raise ValueError(f"{name} must be {rank}-D {layout}, got shape {list(t.shape)}")
        check_float_dtype(name, t)
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    check_same_device(q=q, k=k, v=v)
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {list(k.shape)} and {list(v.shape)}")
    if not packed and q.shape[0] != k.shape[0]:
        raise ValueError(f"q and k must have the same batch size, got {q.shape[0]} and {k.shape[0]}")
    heads, d, d_k = (q.shape[-2], q.shape[-1], k.shape[-1]) if packed else (q.shape[1], q.shape[3], k.shape[3])
    kv_heads = k.shape[-2] if packed else k.shape[1]
    check_heads(heads, kv_heads, d, d_k)


def flash_attention(q, k, v, *, causal=False, softmax_scale=None, dropout_p=0.0, seed=None, window_size=(-1, -1),
                    return_lse=False, deterministic=False):
    """FlashAttention-2: ``softmax(q kᵀ · scale) v`` without materialising the scores.

    q ``(B, Hq, Sq, D)``, k/v ``(B, Hkv, Sk, D)`` with ``Hq % Hkv == 0`` (GQA/MQA), any strides, fp16/bf16/fp32.
    The output, and the gradients of q, k, v, take their input's layout where it is a permutation of a dense tensor
    (``(B, S, H, D)`` views stay ``(B, S, H, D)`` in memory, as SDPA's output does), else a contiguous one.
    Queries align bottom-right: query i sits at key position ``i + Sk - Sq``. ``causal`` keeps keys up to
    that position; ``window_size = (left, right)`` keeps keys from ``left`` before it to ``right`` after it
    (-1: unbounded; with ``causal`` the right side is 0), as in FlashAttention-2. Key blocks outside the
    band are skipped, so a sliding window costs O(S · window). A query that sees no key gets zeros and a
    log-sum-exp of -inf. ``return_lse`` adds the natural-log log-sum-exp (B, Hq, Sq) fp32 (of the undropped
    scores; float64 for float64 inputs, which run the twin in float64 on any device).

    ``dropout_p`` in [0, 1) drops normalised probabilities and rescales the kept ones by ``1 / (1 - p)``.
    Keep decisions are 8-bit, as in FlashAttention-2, so ``p`` is rounded to a multiple of 1/256 (at most
    0.002 off, and at most 255/256; the scale is the inverse of the rounded kept fraction). The keep mask is
    a pure function of ``seed`` and (batch, query head, query, key): the dropout family's Philox4x32-10 on the
    counter stated in ``reference.attention`` (no mask is stored; the backward draws it again). ``seed=None``
    draws one from torch's generator for the device, so ``torch.manual_seed`` governs it and two calls differ
    (under torch.compile and in CUDA graphs it is drawn on the device: each compiled call and each replay gets
    a new mask).

    Under ``torch.autocast`` q, k, v are cast to the autocast dtype, as SDPA's are.

    A decode-shaped call (at most ``configs.DECODE_MAX_QUERIES`` queries against at least ``configs.DECODE_MIN_KEYS``
    keys, no dropout) runs its forward on the split-KV kernel of :func:`flash_attention_with_kvcache`.

    On sm_90 GPUs a forward that :func:`uses_hopper_forward` names runs the Hopper kernel
    (``kernels/attention/_hopper.py``), and a backward that :func:`uses_hopper_backward` names the Hopper
    backward (``kernels/attention/_hopper_bwd.py``), eager or under torch.compile; the environment variable
    ``FUSED_KERNELS_ATTENTION_PATH`` (``auto``, ``hopper``, ``portable``) overrides the choice. Both paths
    compute the same attention to rounding.

    The Hopper backward at padded head dims 64 and 128 adds dQ up with fp32 TMA reductions in arrival order, so its
    dQ can differ in the last bits from run to run (at head dim 256 a dQ kernel of its own sums nothing so).
    ``deterministic=True`` takes a backward that is bitwise reproducible: on sm_90 without dropout, at padded head
    dims 128 and 256, the Hopper dK/dV kernel and then that dQ kernel; else the portable backward (as are dK and dV,
    and every gradient on other GPUs).
    """
    plans = plans_apply()
    key = None
    if plans and plannable(seed, causal, deterministic):
        key = _plan_key(q, k, v, causal, softmax_scale, dropout_p, window_size, deterministic)
        plan = _PLANS.get(key)
        if plan is not None:
            native = None
            if native_active():
                native, seed = _native_attention(key, plan, q, k, v, seed)
            o, lse = native if native is not None else _attend(plan, q, k, v, seed)
            return (o, lse) if return_lse else o
    if all(isinstance(t, torch.Tensor) for t in (q, k, v)):
        q, k, v = autocast_cast("attention", q, k, v)
    _validate(q, k, v)
    left, right = window_edges(window_size, bool(causal))
    dropout_p = check_probability("dropout_p", dropout_p, allow_one=False)
    seed = check_seed("seed", seed)
    plan = _AttentionPlan(autocast_dtype("attention", q.device.type), left, right,
                          resolve_scale(softmax_scale, q.shape[3]), dropout_p, bool(deterministic))
    _PLANS.put(key, plan)
    o, lse = _attend(plan, q, k, v, seed, apply=None if plans else _FlashAttentionFunction.apply)
    return (o, lse) if return_lse else o


#: checked eager calls of ``flash_attention`` (``kernels._common.eager``): plan key -> ``_AttentionPlan``
_PLANS = PlanCache()
_apply = function_apply(_FlashAttentionFunction)

#: compiled-tier programs (``kernels._native``) of dense ``flash_attention`` calls by (plan key, strides, stream): a
#: program, or False where none can be built (the call then takes the Python path)
_NATIVE_CALLS = PreparedCache()
#: the program each plan's calls (dense and packed) last ran through (``kernels._native.last_program``)
_NATIVE_LAST_CALLS = PreparedCache()


def _native_attention(key, plan: _AttentionPlan, q, k, v, seed: Seed | None, varlen=None) -> tuple:
    """``(result, seed)``: ``(o, lse)`` of a call through its compiled-tier program (built on the first call of its
    plan key, strides and stream), or None where it has none: CPU tensors, inputs autocast must cast, CUDA graph
    capture (which draws its seeds on the device), a misaligned tensor, a call whose launches cannot be replayed (the
    decode-shaped forward, which is not recorded); and the seed the Python path then takes (drawn here for None
    where the call has dropout; None inside CUDA graph capture, where nothing is drawn). ``varlen``: a packed
    call's, whose key holds the longest sequences."""
    inputs = [q, k, v] if varlen is None else [q, k, v, varlen[0], varlen[1]]
    words = [0, 0]
    if plan.dropout_p > 0:
        seed = host_seed(seed, q.device)
        if seed is None:
            return None, None
        words = list(key_words(seed))
    result = native_call_last(_NATIVE_LAST_CALLS, plan, inputs, words)
    if result is not None:
        return result, seed
    if not q.is_cuda or (plan.cast_dtype is not None and not q.dtype == k.dtype == v.dtype == plan.cast_dtype) or \
            torch.cuda.is_current_stream_capturing():
        return None, seed
    stream = current_stream_handle(q.device)
    program_key = (key, *(t.stride() for t in inputs), stream)
    program = native_program_for(_NATIVE_CALLS, program_key, lambda: _native_attention_program(
        q, k, v, plan, torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad), varlen))
    if program is None:
        return None, seed
    result = native_module().run(program, inputs, words, stream)
    if result is None:
        return None, seed
    native_remember(_NATIVE_LAST_CALLS, plan, program, inputs, stream)
    return result, seed


def _native_attention_program(q, k, v, plan: _AttentionPlan, needs_grad: bool, varlen=None):
    """The compiled-tier program of a call: its forward and (``needs_grad``) backward run once through the Python
    path with seed 0 (a program takes each call's seed words), the backward on an uninitialised gradient in o's
    layout, with their recorded launches observed; None when either has none the extension can replay. The
    forward's tensors (``_fwd_impl``): q, k, v, o, lse, the device seed, the cumulative lengths; the backward's
    (``_bwd_impl``): dO, q, k, v, o, lse, delta, dQ (or the fp32 accumulator a copy then casts into dQ), dK, dV, the
    device seed, the cumulative lengths, and where a GQA group is split over programs dK's and dV's fp32
    accumulators (copies cast them into dK and dV). A packed call's inputs are q, k, v and its two cumulative
    lengths, which the forward saves for the backward."""
    native = native_module()
    left, right, scale, dropout_p = plan.left, plan.right, plan.scale, plan.dropout_p
    with observed_calls() as seen:
        o, lse = _fwd_impl(q, k, v, left, right, scale, dropout_p, 0, varlen)
    found = native_observed(seen, _FORWARD_CALLS)
    launches = None if found is None else native_launches(found[0], found[1], native)
    if launches is None or found[1][3] is not o or found[1][4] is not lse:
        return None
    fwd = Refs(native)
    q_ref, k_ref, v_ref = (fwd.of("INPUT", i) for i in range(3))
    cu_refs = [fwd.none(), fwd.none()] if varlen is None else [fwd.of("INPUT", 3), fwd.of("INPUT", 4)]
    o_ref, lse_ref = fwd.like(o), fwd.like(lse)
    program = native.Program(
        device=q.device, launches=launches, allocs=fwd.allocs, fixed=fwd.fixed,
        tensors=Refs.flat([q_ref, k_ref, v_ref, o_ref, lse_ref, fwd.none(), *cu_refs]),
        outputs=Refs.flat([o_ref, lse_ref]),
        saved=Refs.flat([q_ref, k_ref, v_ref, o_ref, lse_ref, *(cu_refs if varlen is not None else [])]),
        non_differentiable=[1])
    if not needs_grad:
        return program
    do = torch.empty_like(o)
    with observed_calls() as seen:
        dq, dk, dv = _bwd_impl(do, q, k, v, o, lse, left, right, scale, dropout_p, 0, varlen,
                               deterministic=plan.deterministic)
    found = native_observed(seen, _BACKWARD_CALLS)
    launches = None if found is None else native_launches(found[0], found[1], native)
    if launches is None:
        return None
    _, _, _, _, _, recorded_lse, delta, dq_out, recorded_dk, recorded_dv, _, _, _, *dkv_acc = found[1]
    if recorded_lse is not lse or recorded_dk is not dk or recorded_dv is not dv:
        return None
    bwd = Refs(native)
    dq_ref = bwd.like(dq_out)
    saved_cu = [bwd.none(), bwd.none()] if varlen is None else [bwd.of("SAVED", 5), bwd.of("SAVED", 6)]
    if dkv_acc:  # a GQA group split over programs: dK and dV summed in fp32 accumulators, then cast
        acc_refs = [bwd.like(acc) for acc in dkv_acc]
        dk_ref, dv_ref = bwd.none(), bwd.none()
        dk_grad, dv_grad = bwd.copy(acc_refs[0], dk), bwd.copy(acc_refs[1], dv)
    else:
        acc_refs = []
        dk_ref, dv_ref = dk_grad, dv_grad = bwd.like(dk), bwd.like(dv)
    program.set_backward(
        launches=launches, allocs=bwd.allocs, fixed=bwd.fixed,
        tensors=Refs.flat([bwd.of("GRAD", 0), *(bwd.of("SAVED", i) for i in range(5)), bwd.like(delta), dq_ref,
                           dk_ref, dv_ref, bwd.none(), *saved_cu, *acc_refs]),
        grad_layouts=[native_layout(do.shape, do.dtype, do.stride()), UNREAD],
        input_grads=Refs.flat([dq_ref if dq is dq_out else bwd.copy(dq_ref, dq), dk_grad, dv_grad,
                               *([bwd.none(), bwd.none()] if varlen is not None else [])]),
        copies=bwd.copies)
    return program


def _plan_key(q, k, v, causal, softmax_scale, dropout_p, window_size, deterministic) -> tuple | None:
    """What the checks of a ``flash_attention`` call read (``kernels._common.eager``), or None (no plan) for a
    window that is not a tuple of two plain ints. The strides are not in it: the checks do not read them. The kernel
    path and the Hopper tables are, though no check reads them: the compiled tier runs a plan's calls through one
    program, which holds the launches of one path and one set of tiles (``configs.forced_path`` or
    ``configs.hopper_tiles`` after a call must not replay the launches made before)."""
    if type(window_size) is not tuple or len(window_size) != 2 or type(window_size[0]) is not int or type(
            window_size[1]) is not int:
        return None
    return (tensor_key(q), tensor_key(k), tensor_key(v), causal, softmax_scale, type(softmax_scale), dropout_p,
            type(dropout_p), window_size, deterministic, torch.is_grad_enabled(), autocast_key("cuda"),
            autocast_key("cpu"), kernel_path_token(configs.PATH_ENV), configs.hopper_tables_version)


def _validate_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) -> None:
    _validate(q, k, v, packed=True)
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        check_tensor(name, cu)
        if cu.dtype != torch.int32 or cu.dim() != 1 or cu.numel() < 1:
            raise TypeError(f"{name} must be a 1-D int32 tensor of cumulative lengths (batch + 1 entries), got "
                            f"{cu.dtype} of shape {list(cu.shape)}")
    check_same_device(q=q, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
    if cu_seqlens_q.numel() != cu_seqlens_k.numel():
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must have the same length, got {cu_seqlens_q.numel()} and "
                         f"{cu_seqlens_k.numel()}")
    for name, m in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if isinstance(m, bool) or not isinstance(m, int) or m < 0:
            raise TypeError(f"{name} must be a non-negative int, got {m!r}")
    # a traced call's lengths are known when the graph runs: the twin's op checks them then (``_twin_forward_op``)
    if (backend_for(q) == "reference" or indices_checked(q.device)) and not torch.compiler.is_compiling():
        _check_cumulative_lengths("q", cu_seqlens_q, q.shape[0], max_seqlen_q)
        _check_cumulative_lengths("k", cu_seqlens_k, k.shape[0], max_seqlen_k)


def _check_cumulative_lengths(of: str, cu: torch.Tensor, rows: int, max_seqlen: int) -> None:
    """``cu_seqlens_<of>``, read on the host: starts at 0, never decreases, ends at q's row count (every query row
    belongs to a sequence: rows past the end would be left unwritten) or within k's, and no sequence is longer than
    ``max_seqlen_<of>`` (the kernels' grid would leave its rows past that unwritten)."""
    values = cu.tolist()
    name = f"cu_seqlens_{of}"
    if values[0] != 0:
        raise ValueError(f"{name} must start at 0, got {values[0]}")
    for b in range(len(values) - 1):
        length = values[b + 1] - values[b]
        if length < 0:
            raise ValueError(f"{name} must not decrease, but {name}[{b + 1}] = {values[b + 1]} < {name}[{b}] = "
                             f"{values[b]}")
        if length > max_seqlen:
            raise ValueError(f"sequence {b} has {length} {'queries' if of == 'q' else 'keys'}, more than "
                             f"max_seqlen_{of} = {max_seqlen}")
    if (values[-1] != rows) if of == "q" else (values[-1] > rows):
        relation = "equal" if of == "q" else "be at most"
        raise ValueError(f"{name}[-1] = {values[-1]} must {relation} the number of rows of {of}, {rows}")


def flash_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal=False,
                           softmax_scale=None, dropout_p=0.0, seed=None, window_size=(-1, -1), return_lse=False):
    """FlashAttention-2 over packed variable-length batches, without padding.

    q ``(total_q, Hq, D)``, k/v ``(total_k, Hkv, D)``: sequence ``b`` is rows ``cu_seqlens_q[b] ..
    cu_seqlens_q[b + 1]`` of q and ``cu_seqlens_k[b] .. cu_seqlens_k[b + 1]`` of k/v (int32 cumulative
    lengths, ``batch + 1`` entries starting at 0). ``max_seqlen_q/k`` bound the lengths (they size the
    grid; a smaller value than the true maximum leaves rows unwritten, so pass the real maximum). Each
    sequence is attended alone, with the masks and dropout of :func:`flash_attention` (sequence ``b``
    draws the dropout mask of batch row ``b``). ``return_lse`` adds the log-sum-exp as ``(Hq, total_q)``.

    Index checks: on CPU tensors (and float64 ones) the cumulative lengths are read and checked on every call
    (``ValueError`` unless they start at 0, never decrease, end at ``total_q`` (and within ``total_k``) and no
    sequence exceeds its ``max_seqlen``). On CUDA they are not read back by default (that waits for the GPU);
    ``FUSED_KERNELS_CHECK_INDICES=1`` in the environment checks them there too.
    """
    plans = plans_apply()
    key = None
    if plans and plannable(seed, causal):
        key = _plan_key(q, k, v, causal, softmax_scale, dropout_p, window_size, False)
        if key is not None:
            key = (key, tensor_key(cu_seqlens_q), tensor_key(cu_seqlens_k), max_seqlen_q, type(max_seqlen_q),
                   max_seqlen_k, type(max_seqlen_k))
            plan = _VARLEN_PLANS.get(key)
            if plan is not None:
                if backend_for(q) == "reference" or indices_checked(q.device):  # read back on every call
                    _check_cumulative_lengths("q", cu_seqlens_q, q.shape[0], max_seqlen_q)
                    _check_cumulative_lengths("k", cu_seqlens_k, k.shape[0], max_seqlen_k)
                varlen = (cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k))
                native = None
                if native_active():
                    native, seed = _native_attention(key, plan, q, k, v, seed, varlen)
                o, lse = native if native is not None else _attend(plan, q, k, v, seed, varlen)
                return (o, lse) if return_lse else o
    if all(isinstance(t, torch.Tensor) for t in (q, k, v)):
        q, k, v = autocast_cast("attention", q, k, v)
    _validate_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    left, right = window_edges(window_size, bool(causal))
    dropout_p = check_probability("dropout_p", dropout_p, allow_one=False)
    seed = check_seed("seed", seed)
    plan = _AttentionPlan(autocast_dtype("attention", q.device.type), left, right,
                          resolve_scale(softmax_scale, q.shape[2]), dropout_p, False)
    _VARLEN_PLANS.put(key, plan)
    o, lse = _attend(plan, q, k, v, seed, (cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k)),
                     apply=None if plans else _FlashAttentionFunction.apply)
    return (o, lse) if return_lse else o


#: checked eager calls of ``flash_attention_varlen``: plan key (``_plan_key``'s, the cumulative lengths' tensor keys,
#: the longest sequences with their types) -> ``_AttentionPlan``
_VARLEN_PLANS = PlanCache()
