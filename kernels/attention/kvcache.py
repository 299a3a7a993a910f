"""Launchers of attention against a KV cache (inference, forward only): ``flash_attention_with_kvcache``, on
fp16/bf16/fp32 caches and float8_e4m3fn ones with their scales.

The kernels are in ``kernels/attention/_decode.py``; tiles and the split count come from
``kernels.attention.configs.decode_plan``. CPU tensors without the Triton interpreter, and float64 tensors, run the
twin ``reference.attention.attention_with_kvcache``. Under torch.compile a call is the opaque op
``fused_kernels::flash_attn_kvcache`` (it writes the caches; ``kernels._common.opaque``), which runs this eager
path when the compiled graph runs. ``attend_every_key`` runs a decode-shaped dense ``flash_attention`` forward on the
same kernel (the keys a full cache); its launch is recorded once per signature and replayed with the step's key
count and cache strides.

Eager calls check their arguments once per signature (a checked plan, ``kernels._common.eager``), record the append
and attention launches as one call (``_KVCACHE_CALLS``) and replay them with each call's tensors; with the compiled
tier on (``kernels._native``) a call runs a program instead. The trade-off: a decoding loop whose cache tensors keep
their shapes (a static cache) pays the checks once; one whose cache grows each step (a new shape per step) pays them
every step, plus a plan stored and dropped (``PlanCache`` empties past its limit).
"""

from __future__ import annotations

import torch
import triton

import reference.attention as twin
from kernels._common import (
    FLOAT_DTYPES,
    backend_for,
    cdiv,
    check_float_dtype,
    check_same_device,
    check_tensor,
    interpreter_needs_fp32,
    kernel_for,
)
from kernels._common.eager import PlanCache, plans_apply, tensor_key
from kernels._common.launch import (
    PreparedCache,
    current_stream_handle,
    int_key,
    launch_or_replay,
    multiprocessor_count,
    observed_calls,
    prepared_launches_enabled,
)
from kernels._common.launch import kernels_from as swap_kernels
from kernels._common.opaque import opaque_op
from kernels._common.runtime import INTERPRETER
from kernels._common.validate import indices_checked
from kernels._native import Refs
from kernels._native import active as native_active
from kernels._native import call_last as native_call_last
from kernels._native import launches as native_launches
from kernels._native import module as native_module
from kernels._native import observed as native_observed
from kernels._native import remember as native_remember
from kernels.attention import configs
from kernels.attention._decode import _kvcache_append_kernel, _kvcache_attn_kernel
from kernels.attention.checks import LOG2E, check_heads, dot_precision, resolve_scale, window_edges

#: new tokens per program of the append kernel
_APPEND_TOKENS = 16

_KERNEL_NAMES = ("_kvcache_append_kernel", "_kvcache_attn_kernel")


def kernels_from(module):
    """Inside ``with kernels_from(module):`` KV-cache calls launch ``module``'s jit kernels (another version of
    ``kernels/attention/_decode.py``, same signatures) instead of this checkout's: interleaved A/B timing of a decode
    kernel change in one process (``scripts/sweep_attention.py --decode-baseline``)."""
    return swap_kernels(globals(), module, _KERNEL_NAMES)


def _check_int32(name: str, t, dims: int) -> None:
    check_tensor(name, t)
    if t.dtype != torch.int32:
        raise TypeError(f"{name} must be an int32 tensor, got {t.dtype}")
    if t.dim() != dims:
        raise ValueError(f"{name} must be {dims}-D, got shape {list(t.shape)}")


#: the cache dtype that holds K/V quantised, with a scale per cache (``k_scale``, ``v_scale``)
FP8_CACHE = torch.float8_e4m3fn


def _validate(q, k_cache, v_cache, cache_seqlens, k, v, block_table, k_scale, v_scale) -> int:
    """The argument checks that need no GPU synchronisation; returns the cache's capacity per sequence."""
    check_float_dtype("q", q)
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        check_float_dtype(name, t, (*FLOAT_DTYPES, FP8_CACHE))
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D, got shape {list(t.shape)}")
    fp8 = k_cache.dtype == FP8_CACHE
    if k_cache.dtype != v_cache.dtype or not (fp8 or q.dtype == k_cache.dtype):
        raise TypeError(f"q, k_cache, v_cache must share one dtype (or the caches both be {FP8_CACHE}, with k_scale "
                        f"and v_scale), got {q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    if fp8 and q.dtype == torch.float64:
        raise TypeError(f"an {FP8_CACHE} cache takes fp16, bf16 or fp32 queries, got {q.dtype}")
    _check_scales(k_scale, v_scale, fp8, k_cache.shape[1], q.device)
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache and v_cache must have the same shape, got {list(k_cache.shape)} and "
                         f"{list(v_cache.shape)}")
    batch, heads, _, d = q.shape
    kv_heads = k_cache.shape[1]
    check_heads(heads, kv_heads, d, k_cache.shape[3], k_name="k_cache", empty_ok=False)
    _check_int32("cache_seqlens", cache_seqlens, 1)
    if cache_seqlens.shape[0] != batch:
        raise ValueError(f"cache_seqlens must have one length per sequence ({batch}), got {cache_seqlens.shape[0]}")
    if block_table is None:
        if k_cache.shape[0] != batch:
            raise ValueError(f"a contiguous cache (B, Hkv, S_max, D) must have q's batch size {batch}, got "
                             f"{k_cache.shape[0]}")
        capacity = k_cache.shape[2]
    else:
        _check_int32("block_table", block_table, 2)
        if block_table.shape[0] != batch:
            raise ValueError(f"block_table must have one row per sequence ({batch}), got {block_table.shape[0]}")
        if k_cache.shape[2] == 0:
            raise ValueError("a paged cache (num_blocks, Hkv, block_size, D) needs block_size >= 1")
        capacity = block_table.shape[1] * k_cache.shape[2]
    if (k is None) != (v is None):
        raise ValueError("k and v must be given together")
    if k is not None:
        new_dtype = q.dtype if fp8 else k_cache.dtype  # an FP8 cache quantises what comes in
        for name, t in (("k", k), ("v", v)):
            check_tensor(name, t)
            if t.dtype != new_dtype:
                raise TypeError(f"{name} must have {'q' if fp8 else 'the cache'}'s dtype {new_dtype}, got {t.dtype}")
            if t.dim() != 4 or t.shape[0] != batch or t.shape[1] != kv_heads or t.shape[3] != d:
                raise ValueError(f"{name} must be (B, Hkv, Sq_new, D) = ({batch}, {kv_heads}, Sq_new, {d}), got "
                                 f"{list(t.shape)}")
        if k.shape != v.shape:
            raise ValueError(f"k and v must have the same shape, got {list(k.shape)} and {list(v.shape)}")
        if k.shape[2] > capacity:
            raise ValueError(f"{k.shape[2]} new tokens do not fit a cache of {capacity} positions per sequence")
    check_same_device(q=q, k_cache=k_cache, v_cache=v_cache, cache_seqlens=cache_seqlens, block_table=block_table,
                      k=k, v=v)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k_cache, v_cache, k, v)):
        names = [n for n, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("k", k), ("v", v))
                 if t is not None and t.requires_grad]
        raise ValueError(f"flash_attention_with_kvcache is forward-only (inference), but {', '.join(names)} "
                         f"require{'s' if len(names) == 1 else ''} grad: call it under torch.no_grad() or "
                         f"torch.inference_mode(), or pass detached tensors")
    return capacity


def _check_scales(k_scale, v_scale, fp8: bool, kv_heads: int, device: torch.device) -> None:
    """An FP8 cache needs both scales, each a positive finite float or an fp32 tensor of shape () or (Hkv,) on the
    cache's device; any other cache takes none."""
    if not fp8:
        if k_scale is not None or v_scale is not None:
            raise ValueError(f"k_scale and v_scale are for {FP8_CACHE} caches; this cache holds its values as they are")
        return
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        if scale is None:
            raise ValueError(f"an {FP8_CACHE} cache needs k_scale and v_scale (stored = value / scale); {name} is "
                             f"missing")
        if isinstance(scale, torch.Tensor):
            if scale.dtype != torch.float32 or scale.shape not in ((), (kv_heads,)):
                raise ValueError(f"{name} must be a float or an fp32 tensor of shape () or (Hkv,) = ({kv_heads},), "
                                 f"got a {scale.dtype} tensor of shape {list(scale.shape)}")
            check_same_device(k_cache=torch.empty(0, device=device), **{name: scale})
        elif isinstance(scale, bool) or not isinstance(scale, (int, float)) or not 0 < scale < float("inf"):
            raise ValueError(f"{name} must be a positive finite float or an fp32 tensor, got {scale!r}")


def _scale_args(k_scale, v_scale) -> tuple[tuple, dict]:
    """The kernels' scale arguments: (k value, v value, k pointer, v pointer, k stride, v stride) and the constexprs
    that say which scales are read from memory; 1.0 and nothing read for caches that are not FP8."""
    values, pointers, strides, flags = [], [], [], {}
    for name, scale in (("K", k_scale), ("V", v_scale)):
        in_memory = isinstance(scale, torch.Tensor)
        values.append(1.0 if scale is None or in_memory else float(scale))
        pointers.append(scale if in_memory else None)
        strides.append(scale.stride(0) if in_memory and scale.dim() else 0)
        flags[f"{name}_SCALE_IN_MEMORY"] = in_memory
    return (*values, *pointers, *strides), flags


def _check_indices(cache_seqlens: torch.Tensor, block_table: torch.Tensor | None, new_tokens: int, capacity: int,
                   k_cache: torch.Tensor) -> None:
    """The lengths and page numbers, read on the host: ``0 <= cache_seqlens[b]`` and ``cache_seqlens[b] + Sq_new <=
    capacity``; every block-table entry that a sequence's ``cache_seqlens[b] + Sq_new`` positions use names a page
    of the cache. One transfer of each to the host (a synchronisation on a GPU)."""
    lengths = cache_seqlens.tolist()
    for b, length in enumerate(lengths):
        if length < 0:
            raise ValueError(f"cache_seqlens[{b}] = {length} is negative")
        if length + new_tokens > capacity:
            raise ValueError(f"cache_seqlens[{b}] = {length} with {new_tokens} new tokens needs {length + new_tokens} "
                             f"positions, but the cache holds {capacity} per sequence")
    if block_table is None:
        return
    num_pages, page_size = k_cache.shape[0], k_cache.shape[2]
    table = block_table.tolist()
    for b, length in enumerate(lengths):
        for i in range(cdiv(length + new_tokens, page_size)):
            if not 0 <= table[b][i] < num_pages:
                raise ValueError(f"block_table[{b}, {i}] = {table[b][i]} names no page of the cache (it has "
                                 f"{num_pages} pages)")


#: arrival counters of the split kernel, zero between calls (the combining program resets its own), kept per
#: (device, stream): calls on one stream run in order, so they never share a counter at once
_ARRIVALS: dict[tuple, torch.Tensor] = {}
_ARRIVALS_LIMIT = 16


def _arrivals(device: torch.device, count: int) -> torch.Tensor:
    """At least ``count`` int32 zeros for the split kernel's arrival counts: from the per-stream cache, or fresh
    during CUDA graph capture (the graph keeps the zeroing with the addresses it captured)."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return torch.zeros(count, dtype=torch.int32, device=device)
    key = (device, current_stream_handle(device))
    counters = _ARRIVALS.get(key)
    if counters is None or counters.numel() < count:
        if counters is None and len(_ARRIVALS) >= _ARRIVALS_LIMIT:
            _ARRIVALS.clear()
        counters = _ARRIVALS[key] = torch.zeros(max(count, 1024), dtype=torch.int32, device=device)
    return counters


def _cache_bytes(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The caches as the append kernel writes them: an FP8 cache as its bytes (the kernel writes the FP8 bytes it
    rounds itself), any other as it is."""
    if k_cache.dtype == FP8_CACHE:
        return k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    return k_cache, v_cache


def _append_launch(k, v, k_bytes, v_bytes, cache_seqlens, block_table, capacity: int, k_scale, v_scale, quantize):
    """The launch that writes ``k``/``v`` into the caches (``k_bytes``/``v_bytes``: :func:`_cache_bytes`) at each
    sequence's ``cache_seqlens``."""
    batch, kv_heads, new_tokens, d = k.shape
    bd = configs.block_d(d)
    paged = block_table is not None
    table = block_table if paged else cache_seqlens
    grid = (cdiv(new_tokens, _APPEND_TOKENS), batch * kv_heads)
    scale_args, scale_flags = _scale_args(k_scale, v_scale)

    def launch():
        kernel_for(_kvcache_append_kernel, traceable=False)[grid](
            k, v, k_bytes, v_bytes, cache_seqlens, table, table.stride(0) if paged else 0,
            *k.stride(), *v.stride(), *k_bytes.stride(), *v_bytes.stride(),
            kv_heads, new_tokens, d, k_bytes.shape[2] if paged else 1, capacity, *scale_args,
            PAGED=paged, BLOCK_T=_APPEND_TOKENS, BLOCK_D=bd, QUANTIZE=quantize, **scale_flags, num_warps=4,
        )

    return launch


def flash_attention_with_kvcache(q, k_cache, v_cache, cache_seqlens, *, k=None, v=None, block_table=None, causal=True,
                                 softmax_scale=None, window_size=(-1, -1), return_lse=False, k_scale=None,
                                 v_scale=None):
    """Attention of new queries against a KV cache, for inference (forward only, no autograd).

    ``q`` (B, Hq, Sq, D). The cache is contiguous, ``k_cache``/``v_cache`` (B, Hkv, S_max, D), or paged,
    (num_blocks, Hkv, block_size, D) with ``block_table`` (B, max_blocks) int32: position ``t`` of sequence ``b``
    is row ``t % block_size`` of page ``block_table[b, t // block_size]``. ``cache_seqlens`` (B,) int32 counts the
    tokens already in each sequence's cache. ``k``/``v`` (B, Hkv, Sq_new, D), when given, are written into the cache
    at positions ``cache_seqlens[b] ...`` in place (the caller advances ``cache_seqlens`` afterwards). Sequence
    ``b``'s queries then attend to its ``L = cache_seqlens[b] + Sq_new`` keys, aligned bottom-right as in
    :func:`~kernels.attention.flash_attention`: with ``causal`` query ``i`` sees keys up to ``i + L - Sq``, and
    ``window_size = (left, right)`` bounds the band the same way. A query that sees no key gets zeros (and a
    log-sum-exp of -inf). GQA/MQA: ``Hq`` a multiple of ``Hkv``. Any strides; fp16, bf16, fp32, and float64 (the
    twin, on any device).

    FP8 caches: ``k_cache``/``v_cache`` may be ``torch.float8_e4m3fn`` (with fp16, bf16 or fp32 queries), holding
    ``K / k_scale`` and ``V / v_scale``; each scale is a positive float or an fp32 tensor of shape () or (Hkv,) (one
    per key/value head), and both are required. The kernel reads ``stored * scale`` (the K scale folded into the
    softmax scale, the V scale into the output); ``k``/``v``, in q's dtype, are quantised on the way in (``value /
    scale`` rounded to nearest, ties to even, saturating at +-448), exactly as the twin's
    ``reference.attention.quantize_fp8``.

    Returns the output (B, Hq, Sq, D) in q's dtype, and with ``return_lse`` also the natural-log log-sum-exp
    (B, Hq, Sq) fp32.

    Split-KV ("flash decoding"): the keys of each (sequence, key/value head) are split across programs, each
    computing every query head of the GQA group from one read of its K/V share, and the last split to finish
    combines the partial results; the split count comes from the shapes, the SM count and the cache's kind
    (``kernels.attention.configs.decode_plan``). No host synchronisation: a call can be captured in a CUDA graph.

    Index checks: on CPU tensors (and float64 ones) ``cache_seqlens`` and the block-table entries in use are read
    and checked on every call: a length below 0, a sequence whose ``cache_seqlens[b] + Sq_new`` positions overflow
    the cache's capacity (``S_max``, or ``max_blocks * block_size``), or a page number outside the cache raises
    ``ValueError``. On CUDA they live on the device and are not checked by default (a check waits for the GPU):
    ``cache_seqlens[b] + Sq_new`` is clamped to the capacity and at 0, new tokens past the capacity are dropped, and
    block-table entries must name pages of the cache. ``FUSED_KERNELS_CHECK_INDICES=1`` in the environment runs the
    CPU checks on CUDA calls too, at the cost of one synchronisation per call. Forward only: a call with grad mode
    on and a tensor that requires grad raises ``ValueError``.
    """
    plans = plans_apply()
    key = None
    # a window that is not a tuple of two plain ints takes the checks every call: (True, 0) equals (1, 0) as a key
    if plans and type(window_size) is tuple and len(window_size) == 2 and type(window_size[0]) is int and type(
            window_size[1]) is int:
        key = (tensor_key(q), tensor_key(k_cache), tensor_key(v_cache), tensor_key(cache_seqlens), tensor_key(k),
               tensor_key(v), tensor_key(block_table), causal, type(causal), softmax_scale, type(softmax_scale),
               window_size, return_lse, type(return_lse), _scale_key(k_scale),
               _scale_key(v_scale), torch.is_grad_enabled())
        plan = _PLANS.get(key)
        if plan is not None:
            o, lse = _kvcache_eager(key, plan, q, k_cache, v_cache, cache_seqlens, k, v, block_table,
                                    bool(return_lse), k_scale, v_scale)
            return (o, lse) if return_lse else o
    capacity = _validate(q, k_cache, v_cache, cache_seqlens, k, v, block_table, k_scale, v_scale)
    left, right = window_edges(window_size, bool(causal))
    scale = resolve_scale(softmax_scale, q.shape[3])
    if plans:
        plan = (capacity, left, right, scale)
        _PLANS.put(key, plan)
        if key is not None and _PLANS.get(key) is not plan:  # an unhashable argument: nothing kept under the key
            key = None
        o, lse = _kvcache_eager(key, plan, q, k_cache, v_cache, cache_seqlens, k, v, block_table, bool(return_lse),
                                k_scale, v_scale)
    elif torch.compiler.is_compiling():  # the lengths are known when the graph runs: the op reads and checks them then
        scale_values = [float(s) if s is not None and not isinstance(s, torch.Tensor) else 1.0
                        for s in (k_scale, v_scale)]
        scale_tensors = [s if isinstance(s, torch.Tensor) else None for s in (k_scale, v_scale)]
        o, lse = _kvcache_op(q, k_cache, v_cache, cache_seqlens, k, v, block_table, left, right, scale, return_lse,
                             *scale_values, *scale_tensors)
    else:
        o, lse = _kvcache_impl(q, k_cache, v_cache, cache_seqlens, k, v, block_table, left, right, scale, return_lse,
                               capacity, k_scale, v_scale)
    return (o, lse) if return_lse else o


def _scale_key(scale):
    """What a plan reads of an FP8 scale: a tensor's :func:`tensor_key`, a number's type and value."""
    return tensor_key(scale) if isinstance(scale, torch.Tensor) else (type(scale), scale)


#: checked eager calls (``kernels._common.eager``): plan key -> ``(capacity, left, right, scale)``
_PLANS = PlanCache()


def _kvcache_eager(key, plan: tuple, q, k_cache, v_cache, cache_seqlens, k, v, block_table, return_lse: bool,
                   k_scale, v_scale):
    """``(o, lse)`` of an eager call whose arguments its ``plan`` covers: through the compiled tier where it is on
    and has a program, else the Python path with its launches recorded and replayed under ``key`` (None: a call
    whose key cannot be stored, which runs without either). Calls whose indices are checked on the host, calls
    under CUDA graph capture and calls inside ``configs.override_decode`` take the Python path."""
    capacity, left, right, scale = plan
    if key is not None and native_active() and q.is_cuda and not indices_checked(q.device) and \
            not configs.decode_overridden():
        out = _native_kvcache(key, plan, q, k_cache, v_cache, cache_seqlens, k, v, block_table, return_lse, k_scale,
                              v_scale)
        if out is not None:
            return out
    return _kvcache_impl(q, k_cache, v_cache, cache_seqlens, k, v, block_table, left, right, scale, return_lse,
                         capacity, k_scale, v_scale, key=key)


def _call_tensors(q, k_cache, v_cache, cache_seqlens, k, v, block_table, k_scale, v_scale) -> list:
    """The tensors a call passes, in a fixed order (absent ones left out): what a replay's signature takes the
    strides of, and the compiled tier's inputs."""
    return [t for t in (q, k_cache, v_cache, cache_seqlens, block_table, k, v, k_scale, v_scale)
            if isinstance(t, torch.Tensor)]


#: recorded launches of eager calls (the append and the attention kernel) by signature: the plan key, every tensor's
#: strides and the decode plan
_KVCACHE_CALLS = PreparedCache()

#: compiled-tier programs (``kernels._native``) by (plan key, strides, stream): a program, or False where none can be
#: built (the call then takes the Python path)
_NATIVE_KVCACHE = PreparedCache()
#: the program each plan's calls last ran through (``kernels._native.last_program``)
_NATIVE_LAST_KVCACHE = PreparedCache()


def _native_kvcache(key, plan, q, k_cache, v_cache, cache_seqlens, k, v, block_table, return_lse, k_scale, v_scale):
    """``(o, lse)`` through the call's compiled-tier program, or None where it has none. The first call of a key,
    strides and stream runs the Python path (its result is returned) and builds the program from the launches it
    replayed or recorded; a call that recorded nothing (nothing to compute, index checks on) builds none."""
    inputs = _call_tensors(q, k_cache, v_cache, cache_seqlens, k, v, block_table, k_scale, v_scale)
    outputs = native_call_last(_NATIVE_LAST_KVCACHE, plan, inputs, [])
    if outputs is not None:
        return (outputs[0], outputs[1]) if return_lse else (outputs[0], None)
    if torch.cuda.is_current_stream_capturing():
        return None
    stream = current_stream_handle(q.device)
    program_key = (key, tuple(t.stride() for t in inputs), stream)
    program = _NATIVE_KVCACHE.get(program_key)
    if program is None:
        capacity, left, right, scale = plan
        with observed_calls() as seen:
            out = _kvcache_impl(q, k_cache, v_cache, cache_seqlens, k, v, block_table, left, right, scale,
                                return_lse, capacity, k_scale, v_scale, key=key)
        _NATIVE_KVCACHE.put(program_key, _native_kvcache_program(seen, inputs, return_lse) or False)
        return out
    if program is False:
        return None
    outputs = native_module().run(program, inputs, [], stream)
    if outputs is None:
        return None
    native_remember(_NATIVE_LAST_KVCACHE, plan, program, inputs, stream)
    return (outputs[0], outputs[1]) if return_lse else (outputs[0], None)


def _native_kvcache_program(seen: list, inputs: list, return_lse: bool):
    """The program of a call from its observed recorded launches (:data:`_KVCACHE_CALLS`), whose tensors are
    ``(q, k_cache, v_cache, k_bytes, v_bytes, cache_seqlens, block_table, k, v, k_scale, v_scale, o, lse, o_part,
    lse_part, arrivals)``; None when there are none it can replay."""
    found = native_observed(seen, _KVCACHE_CALLS)
    if found is None:
        return None
    native = native_module()
    launches = native_launches(found[0], found[1], native)
    if launches is None:
        return None
    q, k_cache, v_cache, _, _, cache_seqlens, block_table, k, v, k_scale, v_scale, o, lse, o_part, lse_part, \
        arrivals = found[1]
    refs = Refs(native)
    position = {id(t): i for i, t in enumerate(inputs)}

    def given(t):  # one of the call's tensors, or nothing
        return refs.of("INPUT", position[id(t)]) if isinstance(t, torch.Tensor) else refs.none()

    o_ref = refs.like(o)
    lse_ref = refs.like(lse) if lse is not None else refs.none()
    tensors = [given(q), given(k_cache), given(v_cache), given(k_cache), given(v_cache), given(cache_seqlens),
               given(block_table), given(k), given(v), given(k_scale), given(v_scale), o_ref, lse_ref,
               refs.like(o_part) if o_part is not None else refs.none(),
               refs.like(lse_part) if lse_part is not None else refs.none(),
               refs.hold(arrivals) if arrivals is not None else refs.none()]
    return native.Program(device=q.device, launches=launches, allocs=refs.allocs, fixed=refs.fixed,
                          tensors=Refs.flat(tensors), outputs=Refs.flat([o_ref, lse_ref] if return_lse else [o_ref]),
                          saved=[])


def _kvcache_fake(q, k_cache, v_cache, cache_seqlens, k, v, block_table, window_left, window_right, scale,
                  return_lse, k_scale_value=1.0, v_scale_value=1.0, k_scale=None, v_scale=None):
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    return torch.empty_like(q, memory_format=torch.contiguous_format), q.new_empty(
        q.shape[:3] if return_lse else (0,), dtype=lse_dtype)


@opaque_op("flash_attn_kvcache", "(Tensor q, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor cache_seqlens, Tensor? k, "
           "Tensor? v, Tensor? block_table, SymInt window_left, SymInt window_right, float scale, bool return_lse, "
           "float k_scale_value=1.0, float v_scale_value=1.0, Tensor? k_scale=None, Tensor? v_scale=None) "
           "-> (Tensor, Tensor)",
           _kvcache_fake)
def _kvcache_op(q, k_cache, v_cache, cache_seqlens, k, v, block_table, window_left, window_right, scale, return_lse,
                k_scale_value=1.0, v_scale_value=1.0, k_scale=None, v_scale=None):
    """A compiled graph's call: the eager path, ``(o, lse)`` (lse empty without ``return_lse``). An FP8 cache's
    scales come as tensors, or as the float values (1.0 for other caches)."""
    capacity = k_cache.shape[2] if block_table is None else block_table.shape[1] * k_cache.shape[2]
    fp8 = k_cache.dtype == FP8_CACHE
    k_scale = k_scale if k_scale is not None else k_scale_value if fp8 else None
    v_scale = v_scale if v_scale is not None else v_scale_value if fp8 else None
    o, lse = _kvcache_impl(q, k_cache, v_cache, cache_seqlens, k, v, block_table, window_left, window_right, scale,
                           return_lse, capacity, k_scale, v_scale)
    return o.contiguous(), _kvcache_fake(q, *[None] * 9, False)[1] if lse is None else lse


def _kvcache_impl(q, k_cache, v_cache, cache_seqlens, k, v, block_table, left: int, right: int, scale: float,
                  return_lse: bool, capacity: int, k_scale=None, v_scale=None, *, key=None):
    """``(o, lse)`` of a call whose arguments are checked (``lse`` None without ``return_lse``): the index checks
    where they run, then the twin, or the append and the attention kernels (``key``: an eager call's plan key, under
    which their launches are recorded and replayed)."""
    reference = backend_for(q) == "reference"
    if reference or indices_checked(q.device):
        _check_indices(cache_seqlens, block_table, 0 if k is None else k.shape[2], capacity, k_cache)
    if reference:
        o, lse = twin.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens, k=k, v=v, block_table=block_table,
                                             causal=False, softmax_scale=scale, window_size=(left, right),
                                             return_lse=True, k_scale=k_scale, v_scale=v_scale)
        return o, (lse if q.dtype == torch.float64 else lse.float()) if return_lse else None
    new_tokens = 0 if k is None else k.shape[2]
    appends = bool(new_tokens and q.shape[0] and k.shape[1])
    k_bytes, v_bytes = _cache_bytes(k_cache, v_cache) if appends else (k_cache, v_cache)
    append = _append_launch(k, v, k_bytes, v_bytes, cache_seqlens, block_table, capacity, k_scale, v_scale,
                            k_cache.dtype == FP8_CACHE) if appends else None
    if interpreter_needs_fp32(q) or (INTERPRETER and k_cache.dtype == FP8_CACHE):
        # the interpreter's dot cannot take bf16 tiles (nor widen FP8 ones to them): fp32, rounded once at the end
        if append is not None:
            append()
        o, lse = _attend(q.float(), k_cache.float(), v_cache.float(), cache_seqlens, new_tokens, block_table, left,
                         right, scale, return_lse, capacity, k_scale=k_scale, v_scale=v_scale)
        return o.to(q.dtype), lse
    o, lse, o_part, lse_part, arrivals, attend, decode = _attend_parts(
        q, k_cache, v_cache, cache_seqlens, new_tokens, block_table, left, right, scale, return_lse, capacity,
        k_scale=k_scale, v_scale=v_scale)

    def launch():
        if append is not None:
            append()
        if attend is not None:
            attend()

    if key is None or not prepared_launches_enabled():
        launch()
        return o, lse
    signature = (key, tuple(t.stride() for t in _call_tensors(q, k_cache, v_cache, cache_seqlens, k, v, block_table,
                                                               k_scale, v_scale)), decode)
    launch_or_replay(_KVCACHE_CALLS, signature,
                     (q, k_cache, v_cache, k_bytes, v_bytes, cache_seqlens, block_table, k, v,
                      k_scale if isinstance(k_scale, torch.Tensor) else None,
                      v_scale if isinstance(v_scale, torch.Tensor) else None, o, lse, o_part, lse_part, arrivals),
                     launch)
    return o, lse


#: int32 zeros per device, never written: the cache lengths of a dense call through the decode kernel
_ZEROS: dict[torch.device, torch.Tensor] = {}


def _zero_lengths(device: torch.device, batch: int) -> torch.Tensor:
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return torch.zeros(batch, dtype=torch.int32, device=device)  # a graph keeps the address it captured
    zeros = _ZEROS.get(device)
    if zeros is None or zeros.numel() < batch:
        zeros = _ZEROS[device] = torch.zeros(max(batch, 256), dtype=torch.int32, device=device)
    return zeros


def attend_every_key(q, k, v, o, left: int, right: int, scale: float) -> torch.Tensor:
    """``flash_attention``'s forward of a decode-shaped dense call (a few queries, many keys) through the split-KV
    kernel: k/v (B, Hkv, Sk, D) are a full cache of Sk keys, nothing appended. Writes ``o`` (any strides) and
    returns the log-sum-exp (B, Hq, Sq) fp32."""
    sk = k.shape[2]
    return _attend(q, k, v, _zero_lengths(q.device, q.shape[0]), sk, None, left, right, scale, True, sk, o=o,
                   replay=True)[1]


#: recorded launches of dense decode calls (``kernels._common.launch``): a decoding step's keys grow by one per
#: step, so the key count and the cache strides it moves are per-call ints of the replay, their specialisation
#: (what Triton compiles on: equal to 1, divisible by 16) part of the signature
_DENSE_DECODE_CALLS = PreparedCache()
_PER_STEP_INTS = ("new_tokens", "capacity", "stride_kb", "stride_kh", "stride_vb", "stride_vh")


def _attend(q, k_cache, v_cache, cache_seqlens, new_tokens: int, block_table, left: int, right: int, scale: float,
            return_lse: bool, capacity: int, o: torch.Tensor | None = None, replay: bool = False, k_scale=None,
            v_scale=None):
    """The attention kernel over the cache (the new tokens appended already): ``(o, lse)``. ``replay``: the launch is
    recorded once per signature and replayed (a dense decode call of a contiguous cache, see
    :data:`_DENSE_DECODE_CALLS`)."""
    o, lse, o_part, lse_part, arrivals, launch, plan = _attend_parts(
        q, k_cache, v_cache, cache_seqlens, new_tokens, block_table, left, right, scale, return_lse, capacity, o,
        k_scale, v_scale)
    if launch is None:
        return o, lse
    if not (replay and block_table is None and prepared_launches_enabled()):
        launch()
        return o, lse
    kv_heads, d = k_cache.shape[1], q.shape[3]
    per_step = (new_tokens, capacity, *k_cache.stride()[:2], *v_cache.stride()[:2])
    signature = (q.shape, q.stride(), o.stride(), kv_heads, d, k_cache.stride()[2:], v_cache.stride()[2:], q.dtype,
                 q.device.index, left, right, scale, return_lse, plan, tuple(int_key(i) for i in per_step))
    launch_or_replay(_DENSE_DECODE_CALLS, signature,
                     (q, k_cache, v_cache, o, lse, o_part, lse_part, arrivals, cache_seqlens), launch, per_step,
                     _PER_STEP_INTS)
    return o, lse


def _attend_parts(q, k_cache, v_cache, cache_seqlens, new_tokens: int, block_table, left: int, right: int,
                  scale: float, return_lse: bool, capacity: int, o: torch.Tensor | None = None, k_scale=None,
                  v_scale=None) -> tuple:
    """``(o, lse, o_part, lse_part, arrivals, launch, plan)``: the attention kernel's outputs and temporaries (the
    split kernel's partial results and arrival counters, None without a split), its launch (None when there is
    nothing to compute) and its ``configs.decode_plan`` (which ``capacity`` moves). Every argument of the launch
    follows from the shapes, strides, dtypes, ``new_tokens``, ``capacity`` and the other arguments."""
    batch, heads, sq, d = q.shape
    if o is None:
        o = torch.empty((batch, heads, sq, d), dtype=q.dtype, device=q.device)
    lse = torch.empty((batch, heads, sq), dtype=torch.float32, device=q.device) if return_lse else None
    if o.numel() == 0:
        return o, lse, None, None, None, None, None
    kv_heads = k_cache.shape[1]
    group = heads // kv_heads
    rows = group * sq
    multiprocessors = multiprocessor_count(q.device.index or 0) if q.is_cuda else 4
    paged = block_table is not None
    plan = configs.decode_plan(batch, kv_heads, rows, d, q.dtype, capacity, paged, multiprocessors,
                               k_cache.dtype == FP8_CACHE)
    scale_args, scale_flags = _scale_args(k_scale, v_scale)
    bd = configs.block_d(d)
    table = block_table if paged else cache_seqlens
    row_blocks = cdiv(rows, plan.block_m)
    # balanced: per key/value head, `splits` programs share the batch's key blocks evenly, across sequence
    # boundaries (a part per sequence a program touches; slot b + p of the head); else splits per (sequence, head)
    balanced = plan.balanced and batch > 1
    split = plan.splits > 1 or balanced
    grid = (kv_heads, plan.splits, row_blocks) if balanced else (batch * kv_heads, plan.splits, row_blocks)
    if split:
        parts = (kv_heads * (plan.splits + batch) if balanced else grid[0] * grid[1]) * rows
        o_part = torch.empty((parts, bd), dtype=torch.float32, device=q.device)
        lse_part = torch.empty((parts,), dtype=torch.float32, device=q.device)
        arrivals = _arrivals(q.device, batch * kv_heads * row_blocks)
    else:
        o_part = lse_part = arrivals = None

    page = k_cache.shape[2] if paged else 1
    page_shift = page.bit_length() - 1 if paged and page & (page - 1) == 0 else -1

    def launch():
        kernel_for(_kvcache_attn_kernel, traceable=False)[grid](
            q, k_cache, v_cache, o, lse, o_part, lse_part, arrivals, cache_seqlens, table,
            table.stride(0) if paged else 0, *q.stride(), *k_cache.stride(), *v_cache.stride(), *o.stride(),
            *((lse.stride(0), lse.stride(1)) if return_lse else (0, 0)),
            kv_heads, group, sq, new_tokens, d, page, capacity,
            scale * LOG2E, left, right, plan.splits, *scale_args, batch,
            HAS_LEFT=left >= 0, HAS_RIGHT=right >= 0, PAGED=paged, SPLIT=split, STORE_LSE=return_lse,
            BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, BLOCK_D=bd, EVEN_D=d == bd,
            DOT_PRECISION=dot_precision(q.dtype), **scale_flags, BALANCED=balanced,
            BLOCK_B=triton.next_power_of_2(batch) if balanced else 1, PAGE_SHIFT=page_shift,
            PAGES_AHEAD=paged and plan.pages_ahead, num_warps=plan.num_warps,
            num_stages=plan.num_stages,
        )

    return o, lse, o_part, lse_part, arrivals, launch, plan
