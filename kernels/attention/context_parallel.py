"""Context-parallel attention over ``torch.distributed``: ring attention of a sequence sharded across ranks.

    q_local = shard_sequence(q, 2)                      # this rank's shard of (B, H, S, D), "zigzag" by default
    o_local = context_parallel_attention(q_local, k_local, v_local, causal=True)
    o = unshard_sequence(o_local, 2)                    # the whole output, on every rank

Layouts: the sequence is cut into ``2 W`` equal chunks (W ranks in the group) and rank ``r`` holds chunks ``r`` and
``2 W - 1 - r`` (``"zigzag"``: every rank gets the same causal work), or into ``W`` chunks, rank ``r`` holding chunk
``r`` (``"contiguous"``). Every rank's shard has the same shape.

The ring (forward): each rank starts with its own K/V shard and, W - 1 times, sends the shard it holds to the next rank
and receives the previous rank's, with ``torch.distributed`` point-to-point operations issued before it attends to
the shard in hand, so the transfer runs beside the compute. With the shard of rank ``s`` in hand, rank ``r`` attends
with :func:`kernels.attention.flash_attention`'s kernels to exactly the chunk pairs the mask keeps: every key chunk
before a query chunk whole, a chunk against itself causally, later chunks not at all (zigzag at step ``t > 0``: the
whole local queries against ``s``'s first chunk when ``s < r``, the local second chunk against both of ``s``'s chunks
when ``s > r``; step 0 is the local causal attention). Partial outputs merge through their log-sum-exps
(``o = sum_p exp(lse_p - lse) o_p``, ``lse = log sum_p exp(lse_p)``), in fp32.

The backward runs the ring again: each rank computes its queries' gradient against every shard as it passes (the
next shard coming in meanwhile), with the merged log-sum-exp and output (so each block's gradients are its exact
share). Every block adds its gradients into fp32 accumulators (``ops._bwd_accumulate``: on the Hopper backward the
kernel adds them by TMA reductions, so a step costs no zeroing, cast or addition pass per block). A rank's share of
its own shard's dK/dV stays home; the other ranks' shares of a shard follow it one step behind, summed on the way (a
rank adds its share to the sum the shard's earlier holders sent during this step's compute and sends it on during
the next, in fp32), and the last holder sends the rows it touches home in k's dtype, the one transfer no compute
hides; the owner adds it to its own fp32 share and rounds once more (so a bf16 dK/dV carries two roundings where a
single sum would carry one). Steps whose K/V transfer runs beside the forward take the Hopper forward's one program
per tile rather than its persistent programs (``beside_transfer``): a static deal of tiles waits for the programs
the transfer kept off their SMs.

Limits: dense (B, H, S_local, D) shards, GQA/MQA, causal or full (no windows, no dropout); fp16/bf16/fp32 on GPUs
(NCCL), fp32 and any float on CPUs (gloo, the Triton interpreter or the twin). One collective per forward checks that
every rank's shard has the same shape (a host synchronisation). The trade-off: ring attention moves each K/V shard
W - 1 times and keeps one extra shard in flight; all-gathering K/V instead would hold the whole sequence's keys on
every rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import reference.attention as twin
from kernels._common import backend_for, check_float_dtype, check_tensor, interpreter_needs_fp32
from kernels.attention import configs
from kernels.attention._merge import merge_partial
from kernels.attention.checks import resolve_scale
from kernels.attention.ops import _bwd_accumulate, _fwd_impl, row_deltas

LAYOUTS = ("zigzag", "contiguous")


def _group_info(group) -> tuple[int, int]:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("context-parallel attention needs an initialised torch.distributed process group "
                           "(torch.distributed.init_process_group)")
    return dist.get_world_size(group), dist.get_rank(group)


def _check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


def _chunks(world: int, layout: str) -> int:
    return 2 * world if layout == "zigzag" else world


def _owned(rank: int, world: int, layout: str) -> tuple[int, ...]:
    """The chunks rank ``rank`` holds, in its shard's order."""
    return (rank, 2 * world - 1 - rank) if layout == "zigzag" else (rank,)


def shard_sequence(x: torch.Tensor, dim: int, *, group=None, layout: str = "zigzag") -> torch.Tensor:
    """This rank's shard of ``x`` along ``dim`` (the sequence dimension) for :func:`context_parallel_attention`: the
    chunks of ``layout`` this rank holds, concatenated (a copy for "zigzag", a view for "contiguous"). ``x`` is the
    whole tensor, the same on every rank; its length along ``dim`` must divide into ``2 W`` chunks ("zigzag") or
    ``W`` ("contiguous")."""
    _check_layout(layout)
    world, rank = _group_info(group)
    length, count = x.shape[dim], _chunks(world, layout)
    if length % count:
        raise ValueError(f"a sequence of {length} cannot be cut into {count} equal chunks ({layout} layout over "
                         f"{world} ranks): make it a multiple of {count}")
    chunks = x.chunk(count, dim)
    owned = _owned(rank, world, layout)
    return chunks[owned[0]] if len(owned) == 1 else torch.cat([chunks[i] for i in owned], dim)


def unshard_sequence(x_local: torch.Tensor, dim: int, *, group=None, layout: str = "zigzag") -> torch.Tensor:
    """The whole tensor from every rank's shard (an all-gather; differentiable: the gradient of the whole goes back
    to each rank's shard), the inverse of :func:`shard_sequence`."""
    _check_layout(layout)
    world, _ = _group_info(group)
    from torch.distributed.nn.functional import all_gather

    shards = all_gather(x_local.contiguous(), group=group or dist.group.WORLD)
    pieces: dict[int, torch.Tensor] = {}
    for rank, shard in enumerate(shards):
        owned = _owned(rank, world, layout)
        for chunk, piece in zip(owned, shard.chunk(len(owned), dim), strict=True):
            pieces[chunk] = piece
    return torch.cat([pieces[i] for i in range(_chunks(world, layout))], dim)


def _blocks(step: int, rank: int, source: int, world: int, layout: str, causal: bool, length: int):
    """The (query rows, key rows, causal) blocks rank ``rank`` attends at ring step ``step`` with rank ``source``'s
    K/V shard in hand; rows as slices of the local shards (``length`` rows each)."""
    whole = slice(0, length)
    if not causal:
        return [(whole, whole, False)]
    if step == 0:
        return [(whole, whole, True)]  # the local chunks in order: the local causal attention is the global one
    if layout == "contiguous":
        return [(whole, whole, False)] if source < rank else []
    half = length // 2
    first, second = slice(0, half), slice(half, length)
    if source < rank:  # source's first chunk precedes both local chunks, its second follows both
        return [(whole, first, False)]
    return [(second, whole, False)]  # both of source's chunks precede the local second chunk, follow the first


def _ring_peers(group, world: int, rank: int) -> tuple[int, int]:
    """Global ranks of the next and the previous rank of the ring."""
    to_global = (lambda r: dist.get_global_rank(group, r)) if group is not None else (lambda r: r)
    return to_global((rank + 1) % world), to_global((rank - 1) % world)


#: message tags: the K/V shards and their gradients travel side by side between the same two ranks
_KV_TAG, _GRAD_TAG = 1, 2


def _exchange(sends, receives, next_rank: int, previous_rank: int, group, tag: int):
    """Start sending each of ``sends`` to the next rank and receiving the previous rank's into ``receives`` (the two
    ranks post their tensors in the same order)."""
    ops = ([dist.P2POp(dist.isend, t, next_rank, group, tag) for t in sends]
           + [dist.P2POp(dist.irecv, t, previous_rank, group, tag) for t in receives])
    return dist.batch_isend_irecv(ops) if ops else []


def _check_shapes(q, k, v, group) -> None:
    """Every rank's shards have the same shape (one all-reduce of the shapes and their negatives, MAX)."""
    shapes = torch.tensor([*q.shape, *k.shape, *v.shape], dtype=torch.int64)
    both = torch.cat([shapes, -shapes]).to(q.device)
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    both = both.cpu()  # one synchronisation
    top, bottom = both[: shapes.numel()], -both[shapes.numel():]
    if not torch.equal(top, bottom):
        raise ValueError(f"context-parallel shards must have one shape on every rank; this rank's q, k, v are "
                         f"{list(q.shape)}, {list(k.shape)}, {list(v.shape)}, and other ranks' differ")


def _ring_forward(q, k, v, group, causal: bool, scale: float, layout: str):
    world, rank = _group_info(group)
    next_rank, previous_rank = _ring_peers(group, world, rank)
    length = q.shape[2]
    out = lse = None
    kv = (k.contiguous(), v.contiguous())  # point-to-point operations send whole tensors
    # one kernel merges each partial result (torch's ops where no kernel runs: CPUs without the interpreter, bf16
    # under it); with two ranks every row is merged once after step 0, so the running output stays in q's dtype and
    # is merged in place (the merge's math is fp32 and rounds once, as an fp32 running output cast at the end would)
    merge_in_kernel = backend_for(q) != "reference" and not interpreter_needs_fp32(q)
    in_place = world == 1 or (merge_in_kernel and world == 2)
    for step in range(world):
        pending = None
        if step < world - 1:
            incoming = (torch.empty_like(kv[0]), torch.empty_like(kv[1]))
            pending = _exchange(kv, incoming, next_rank, previous_rank, group, _KV_TAG)
        source = (rank - step) % world
        for rows, keys, block_causal in _blocks(step, rank, source, world, layout, causal, length):
            o_part, lse_part = _fwd_impl(q[:, :, rows], kv[0][:, :, keys], kv[1][:, :, keys], -1,
                                         0 if block_causal else -1, scale, beside_transfer=pending is not None)
            if out is None:  # step 0 covers every row: its result is the start of the merge
                out, lse = (o_part if in_place else o_part.float()), lse_part.float().contiguous()
            elif merge_in_kernel:
                merge_partial(out, lse, rows.start, o_part, lse_part.float())
            else:
                twin.merge_partial(out, lse, rows.start, o_part, lse_part.float())
        if pending is not None:
            for request in pending:
                request.wait()
            kv = incoming
    return (out if out.dtype == q.dtype else out.to(q.dtype)), lse


def _touched(step: int, holder: int, source: int, world: int, layout: str, causal: bool, length: int) -> slice:
    """The key rows of ``source``'s shard that rank ``holder`` attends to at ring step ``step`` (one slice: the
    blocks of a step share their keys, or take the whole shard; empty when it attends to none)."""
    blocks = _blocks(step, holder, source, world, layout, causal, length)
    if not blocks:
        return slice(0, 0)
    return slice(min(b[1].start for b in blocks), max(b[1].stop for b in blocks))


def _returned_rows(source: int, world: int, layout: str, causal: bool, length: int) -> slice:
    """The key rows of ``source``'s shard whose gradient the other ranks' shares touch (from the first row any of
    them attends to to the last): what comes home at the last ring step. Both ends of the hop compute it alike."""
    touched = [_touched(step, (source + step) % world, source, world, layout, causal, length)
               for step in range(1, world)]
    touched = [t for t in touched if t.stop > t.start]
    if not touched:
        return slice(0, 0)
    return slice(min(t.start for t in touched), max(t.stop for t in touched))


def _ring_backward(do, q, k, v, o, lse, group, causal: bool, scale: float, layout: str):
    world, rank = _group_info(group)
    next_rank, previous_rank = _ring_peers(group, world, rank)
    length, d = q.shape[2], q.shape[3]
    width = configs.block_d(d)  # the accumulators take the kernels' padded head dim: TMA reductions land in place
    fp32 = {"dtype": torch.float32, "device": q.device}
    dq = torch.zeros((*q.shape[:3], width), **fp32)
    kv_shape = (2, *k.shape[:3], width)

    delta = row_deltas(o, do)  # rowsum(dO * O): every block of every step needs its rows' share

    def attend(kv, blocks, acc):
        """Add the gradients of ``blocks`` (the K/V shard ``kv`` in hand) into dq and ``acc`` (dK, dV)."""
        for rows, keys, block_causal in blocks:
            _bwd_accumulate(do[:, :, rows], q[:, :, rows], kv[0][:, :, keys], kv[1][:, :, keys], o[:, :, rows],
                            lse[:, :, rows], -1, 0 if block_causal else -1, scale, dq[:, :, rows], acc[0][:, :, keys],
                            acc[1][:, :, keys], delta=None if delta is None else delta[:, :, rows])

    # Step 0: the local blocks, whose K/V gradient stays here. Steps 1 .. W-1: the shard in hand belongs to another
    # rank; the sum of the other ranks' shares of a shard follows it round the ring one step behind (a rank adds its
    # share to what the shard's earlier holders sent during this step's compute and sends it on during the next);
    # the last holder sends the rows the sum touches home in k's dtype once its compute is done (sent in pieces
    # beside the last compute, it cost that compute more than it hid: TUNING.md).
    own = torch.zeros(kv_shape, **fp32)
    kv = (k.contiguous(), v.contiguous())
    received, chain_requests = None, []
    coming = _returned_rows(rank, world, layout, causal, length)
    home_requests, home_buffer = [], None
    for step in range(world):
        kv_requests = []
        if step < world - 1:  # the next shard comes in while this one's gradients are computed
            incoming = (torch.empty_like(kv[0]), torch.empty_like(kv[1]))
            kv_requests = _exchange(kv, incoming, next_rank, previous_rank, group, _KV_TAG)
        source = (rank - step) % world
        blocks = _blocks(step, rank, source, world, layout, causal, length)
        if step == 0:
            attend(kv, blocks, own)
        else:
            acc = torch.zeros(kv_shape, **fp32)
            attend(kv, blocks, acc)
            for request in chain_requests:
                request.wait()
            if received is not None:
                acc += received
            if step < world - 1:  # the others' shares so far, on to the shard's next holder
                received = torch.empty_like(acc)
                chain_requests = _exchange([acc], [received], next_rank, previous_rank, group, _GRAD_TAG)
            else:  # home, to the shard's owner: the rows they touch, in k's dtype
                chain_requests = []
                going = _returned_rows(source, world, layout, causal, length)
                sends = [acc[:, :, :, going, :d].to(k.dtype).contiguous()] if going.stop > going.start else []
                if coming.stop > coming.start:
                    home_buffer = torch.empty((*kv_shape[:3], coming.stop - coming.start, d), dtype=k.dtype,
                                              device=q.device)
                home_requests = _exchange(sends, [] if home_buffer is None else [home_buffer], next_rank,
                                          previous_rank, group, _GRAD_TAG)
        for request in kv_requests:
            request.wait()
        if step < world - 1:
            kv = incoming
    dq = dq[..., :d].to(q.dtype)  # enqueued before the wait below: it runs while the last hop is in flight
    for request in home_requests:
        request.wait()
    if home_buffer is not None:
        own[:, :, :, coming, :d] += home_buffer
    return dq, own[0][..., :d].to(k.dtype), own[1][..., :d].to(v.dtype)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, causal, scale, layout):
        o, lse = _ring_forward(q, k, v, group, causal, scale, layout)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.args = (group, causal, scale, layout)
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = _ring_backward(do.contiguous(), q, k, v, o, lse, *ctx.args)
        return dq, dk, dv, None, None, None, None


def context_parallel_attention(q, k, v, *, group=None, causal=False, softmax_scale=None, layout="zigzag"):
    """Attention over a sequence sharded across the ranks of ``group`` (default: the world), by ring attention
    (see the module docstring). ``q`` (B, Hq, S_local, D), ``k``/``v`` (B, Hkv, S_local, D): this rank's shards
    in ``layout`` (:func:`shard_sequence` makes them), the same shape on every rank. Returns this rank's shard of the
    output, what :func:`kernels.attention.flash_attention` gives for these rows on the whole sequence. Differentiable
    in q, k and v (the backward runs the ring again). ``causal`` masks by global position; ``softmax_scale`` defaults
    to ``1 / sqrt(D)``."""
    _check_layout(layout)
    _group_info(group)
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, t)
        check_float_dtype(name, t)
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D (batch, heads, seq_local, head_dim), got shape {list(t.shape)}")
    if k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[2:] != k.shape[2:] or q.shape[1] % k.shape[1]:
        raise ValueError(f"shards must be q (B, Hq, S_local, D) and k, v (B, Hkv, S_local, D) with Hq a multiple of "
                         f"Hkv, got {list(q.shape)}, {list(k.shape)}, {list(v.shape)}")
    if layout == "zigzag" and q.shape[2] % 2:
        raise ValueError(f"a zigzag shard holds two equal chunks: its length must be even, got {q.shape[2]}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    _check_shapes(q, k, v, group)
    scale = resolve_scale(softmax_scale, q.shape[3])
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return _RingAttention.apply(q, k, v, group, bool(causal), scale, layout)
    return _ring_forward(q, k, v, group, bool(causal), scale, layout)[0]
