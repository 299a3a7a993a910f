"""Launch configurations of the attention kernels: which tile each call gets, and why.

A call is described by a :class:`Query` (kernel, padded head dim, dtype, visible band, query length,
dropout). :data:`ROWS` is one flat table read top to bottom: the first row that matches the query gives
its :class:`Tile`; every (kernel, head dim, dtype) has a last catch-all row, so every query finds one.
Each row carries a one-line reason; the measurements behind them are in the family's ``TUNING.md``.

Terms used in the rows:

- **mask**: ``full`` (no band edge), ``narrow`` (both sides bounded, at most ``NARROW_BAND`` keys wide:
  a sliding window) or ``band`` (anything else with an edge: causal, a one-sided or a wide window).
- **Sq**: queries per sequence (the longest sequence for packed batches); rows give an inclusive range.
- **backward launches**: the dK/dV and dQ programs share one launch when their tiles agree on warps and
  pipeline stages (:func:`fuse_backward`); otherwise they run as two launches.

Print the effective table for a grid of shapes::

    python -m kernels.attention

Tests and tools force other tiles through :func:`override`, never by editing the table.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Iterator
from typing import NamedTuple

import torch

from kernels._common.launch import cdiv, forget_recorded_launches
from kernels._common.runtime import forced_kernel_path, kernel_path
from kernels._common.runtime import is_hopper as is_hopper  # the attention family's name for it

#: Head dims are padded to a power of two of at least 16; the kernels take up to 1024.
MAX_HEAD_DIM = 1024
#: A two-sided window of at most this many keys is a "narrow" band.
NARROW_BAND = 2048
#: fp32 backward tiles above this padded head dim do not fit in shared memory even at 16 x 16 (256 KiB
#: asked for at D = 1024): that backward runs the tiled twin on the GPU instead (correct, slow).
FP32_MAX_KERNEL_BWD_DIM = 512

ANY_LENGTH = (0, math.inf)
ALL_MASKS = frozenset({"full", "band", "narrow"})


class Tile(NamedTuple):
    block_m: int  # query rows per block (every kernel)
    block_n: int  # keys per block
    num_warps: int
    num_stages: int


class Query(NamedTuple):
    kernel: str  # "fwd", "dkdv" or "dq"
    block_d: int  # padded head dim
    dtype: str  # "16-bit" or "fp32"
    mask: str  # "full", "band" or "narrow"
    sq: int
    dropout: bool


class Row(NamedTuple):
    kernel: str
    dims: tuple[int, ...]  # padded head dims
    dtype: str
    masks: frozenset[str]
    seq: tuple[float, float]  # lo <= Sq <= hi
    dropout: bool | None  # None: with or without
    tile: Tile
    why: str

    def matches(self, q: Query) -> bool:
        return (q.kernel == self.kernel and q.block_d in self.dims and q.dtype == self.dtype and q.mask in self.masks
                and self.seq[0] <= q.sq <= self.seq[1] and self.dropout in (None, q.dropout))


def _row(kernel, dims, tile, why, *, dtype="16-bit", masks=ALL_MASKS, seq=ANY_LENGTH, dropout=None) -> Row:
    return Row(kernel, tuple(dims), dtype, frozenset(masks), seq, dropout, Tile(*tile), why)


_SMALL = (16, 32, 64)
_WIDE = (512, 1024)
_NARROW = {"narrow"}
_BOUNDED = {"band", "narrow"}
_SHORT = (0, 1024)

ROWS: tuple[Row, ...] = (
    # Sliding windows: each query block visits about 17 key blocks, so the short loops favour small query
    # blocks (window-1024 sweep at S = 16384).
    _row("fwd", (64, 128), (64, 64, 4, 3), "narrow window: short key loops favour 64-row query blocks (+10% at D 128)",
         masks=_NARROW),
    _row("dkdv", (64, 128), (32, 64, 4, 3), "narrow window: 64-key blocks waste less of each band edge (+8%)",
         masks=_NARROW),
    _row("dq", (64,), (64, 32, 4, 3), "narrow window: small dQ tiles (+26% at D 64)", masks=_NARROW),
    _row("dq", (128,), (128, 64, 8, 3), "narrow window, D 128: the default dQ tile", masks=_NARROW),
    # Full attention over long queries: each K/V tile read from L2 serves more rows (a 64-row block at D = 128
    # needs about 6 TB/s of L2 reads at 400 TFLOP/s). Measured without dropout only.
    _row("fwd", (64,), (128, 64, 8, 3), "full, Sq >= 1024: 128-row blocks halve K/V re-reads (+2 to +6%)",
         masks={"full"}, seq=(1024, math.inf), dropout=False),
    _row("fwd", (128,), (256, 64, 16, 3), "full, Sq >= 1024: 256-row blocks, 16 warps (+2 to +10%)",
         masks={"full"}, seq=(1024, math.inf), dropout=False),
    # Dropout, D = 64: the keep mask is drawn in the scores' layout and transposed for dK/dV, which 32 x 128 tiles
    # pay for in spills (fwd + bwd, H100, p = 0.1: +9 to +14% at S 1024-4096, equal on short causal bands).
    _row("dkdv", (64,), (64, 64, 4, 3), "dropout: 64 x 64 tiles (+9 to +14% fwd + bwd)", dropout=True),
    # Short sequences.
    _row("fwd", (128,), (64, 64, 4, 3), "Sq <= 1024: 64-row blocks, 4 warps (+7 to +8% over 128 rows)", seq=_SHORT),
    _row("dkdv", (64,), (32, 64, 4, 3), "short band: small tiles, one launch with dQ (+9% at S 1024)",
         masks=_BOUNDED, seq=_SHORT),
    _row("dq", (64,), (64, 64, 4, 3), "short band: matches dK/dV's warps and stages, so one launch",
         masks=_BOUNDED, seq=_SHORT),
    # Long sequences at D = 64: 128-row query blocks (causal at S = 1024 lost 1-4% with them, so from 1025 on).
    _row("fwd", (64,), (128, 64, 8, 3), "Sq > 1024: 128-row blocks, 8 warps (+2 to +5%)", seq=(1025, math.inf),
         dropout=False),
    # Full attention, dQ at D = 64 with 4 warps so that it shares one launch with dK/dV.
    _row("dq", (64,), (128, 64, 4, 3), "full: 4 warps to share dK/dV's launch (+1 to +8%)", masks={"full"}),
    # Defaults, 16-bit inputs.
    _row("fwd", _SMALL, (64, 64, 4, 3), "default"),
    _row("fwd", (128,), (128, 64, 8, 3), "default"),
    _row("fwd", (256,), (64, 32, 4, 2), "default: D 256 tiles must fit shared memory"),
    _row("dkdv", _SMALL, (32, 128, 4, 3), "default: long key blocks amortise the dK/dV accumulators"),
    _row("dkdv", (128,), (64, 128, 8, 3), "default"),
    _row("dkdv", (256,), (64, 32, 4, 2), "default, D 256: 32 keys, 64-query steps (1.14-1.20x 32 x 32 tiles)"),
    _row("dq", (*_SMALL, 128), (128, 64, 8, 3), "default"),
    _row("dq", (256,), (64, 64, 4, 2), "default, D 256: 64 x 64 tiles, one launch with dK/dV (1.24-1.31x 32 x 32)"),
    _row("fwd", _WIDE, (32, 64, 8, 1), "D > 256: small blocks so the tiles fit shared memory"),
    _row("dkdv", _WIDE, (16, 16, 8, 2), "D > 256: small blocks so the tiles fit shared memory"),
    _row("dq", _WIDE, (16, 32, 8, 1), "D > 256: small blocks so the tiles fit shared memory"),
    # fp32: twice the bytes per tile and IEEE dots; one tile per head dim for every kernel.
    *(_row(kernel, dims, tile, why, dtype="fp32") for kernel in ("fwd", "dkdv", "dq") for dims, tile, why in (
        (_SMALL, (64, 32, 4, 2), "fp32: about half the 16-bit tile"),
        ((128,), (32, 32, 4, 2), "fp32: about half the 16-bit tile"),
        ((256,), (32, 16, 4, 1), "fp32: D 256 tiles must fit shared memory"),
        (_WIDE, (16, 16, 8, 1), "fp32, D > 256: small blocks so the tiles fit shared memory"))),
)

#: Which kernels run on a GPU: ``auto`` (default) takes the Hopper kernels (``kernels/attention/_hopper.py``,
#: ``_hopper_bwd.py``, ``_hopper_bwd_split.py``) on sm_90 for the calls they support and measured faster on
#: (:func:`prefers_hopper_forward`, :func:`prefers_hopper_backward`), ``hopper`` for every call they support,
#: ``portable`` never. Read at each call, so a test or a tool can set it with
#: ``forced_path``.
PATH_ENV = "FUSED_KERNELS_ATTENTION_PATH"


class HopperForwardTile(NamedTuple):
    block_n: int  # keys per block
    stages: int  # K/V shared-memory ring slots
    consumers: int  # 64-row consumer warpgroups per program (1, 2 or 3): the query tile is 64 * consumers rows
    consumer_regs: int  # registers per thread of each consumer warpgroup (setmaxnreg)
    producer_regs: int  # of the TMA producer warpgroup
    maxnreg: int  # the kernel's register cap, from which the default partition's share follows
    # calls without a left band edge: persistent programs (as many per SM as fit) walking the tiles (else one per tile)
    persistent: bool = True
    o_in_q: bool = False  # O is staged for its TMA store in the consumer's Q tile (else in a tile of its own)
    # head dims 65-96 (a 128-column tile): Q K^T and P V over their 96 columns as 64 + 32
    split_96: bool = False

    @property
    def query_rows(self) -> int:
        return 64 * self.consumers

    @property
    def programs_per_sm(self) -> int:
        """Programs of this tile that an SM holds at once, by registers: the cap times 128 threads per warpgroup,
        the consumers' and the producer's (Triton pads the producer warp to a warpgroup). A persistent launch
        starts that many per SM; the shared memory of every tile here allows as many."""
        return max(1, 65536 // (self.maxnreg * 128 * (self.consumers + 1)))


#: Hopper forward tiles by padded head dim: S and O accumulators (64 x BLOCK_N and 64 x D fp32 per warpgroup)
#: and P must fit in a consumer's registers (64K per SM over the consumers and the producer's 24); Q (64 x D per
#: consumer) plus the K/V ring in 227 KiB of shared memory.
HOPPER_FORWARD: dict[int, HopperForwardTile] = {
    # D 64: three consumers of 160 registers (S, P and a 64 x 64 O fit), 1.03-1.10x two consumers of 240 at
    # S 3000-16384 (H100, bf16, interleaved rounds): a third warpgroup's matmuls run under the others' softmax.
    # Not persistent: the tile loop's state would spill these 160-register consumers.
    64: HopperForwardTile(128, 2, 3, 160, 24, 128, persistent=False),
    # head dims 65-96 over 64 + 32 columns (split_96): 1.03-1.09x the whole 128-column tile at D 96 (H100, bf16,
    # S 1024-4096, causal and not)
    128: HopperForwardTile(128, 2, 2, 240, 24, 168, split_96=True),
    # D 256: 64-key blocks with O staged in the Q tile, so that Q (64 KiB) and a two-slot K/V ring (128 KiB) fit in
    # shared memory (a tile of O's own would need 262 KB); the 64 x 256 O accumulator takes 128 registers. 1.18-1.29x
    # 32-key blocks with an O tile of its own (H100, bf16, S 1024-8192): a 32-key Q K^T reads as many shared-memory
    # bytes per FLOP as the tensor cores can take, a 64-key one two thirds.
    256: HopperForwardTile(64, 2, 2, 240, 24, 168, o_in_q=True),
}


class HopperBackwardTile(NamedTuple):
    stages: int  # Q/dO shared-memory ring slots (the key tile is 128 rows: two 64-row consumer warpgroups)
    consumer_regs: int  # registers per thread of each consumer warpgroup (setmaxnreg)
    producer_regs: int  # of the TMA producer warpgroup
    maxnreg: int  # the kernel's register cap, from which the default partition's share follows
    dq_turns: bool  # one consumer per step computes all of dQ's columns, the two in turn (else half each)
    # with dropout the producer is a warpgroup that draws the keep masks: registers per thread of it and of each
    # consumer then (None: the kernel has no dropout; such calls take the portable backward)
    dropout_consumer_regs: int | None
    dropout_producer_regs: int | None
    # both consumers take the same 64 keys and split the head dim (``_hopper_bwd_split.py``), where one consumer's
    # dK and dV rows of 64 keys would not fit in its registers; else each takes 64 keys (``_hopper_bwd.py``)
    split_head_dim: bool = False
    # head dims 65-96 (a 128-column tile): every product over their 96 columns as 64 + 32 (a quarter less tensor
    # work, and dK and dV in 96 registers per thread instead of 128)
    split_96: bool = False


#: Hopper backward tiles by padded head dim: dK and dV (64 x D fp32 per warpgroup), S^T and dP^T (64 x 64) and
#: a dQ part must fit in 240 registers; K, V (128 x D), the Q/dO ring and dS^T in 227 KiB of shared memory. Three
#: warpgroups share 504 registers per thread: with dropout the mask-drawing producer takes 56 at D 64 (1.02-1.03x
#: against 40, which leaves the consumers 232) and 40 at D 128 (1.09-1.12x against 56: the consumer spills less).
HOPPER_BACKWARD: dict[int, HopperBackwardTile] = {
    64: HopperBackwardTile(2, 240, 24, 168, True, dropout_consumer_regs=224, dropout_producer_regs=56),
    # at D 128 a whole dQ tile would not fit: 64 more fp32 registers per thread, 32 KiB more shared memory; by turns
    # as two 64-column products it ran 0.85-0.91x (H100, bf16, S 1024-16384; ptxas spilled 344 bytes). Head
    # dims 65-96 over 64 + 32 columns (split_96): forward + backward 1.10-1.15x the whole 128-column tile at D 96
    # (H100, bf16, S 1024-4096, causal and not)
    128: HopperBackwardTile(2, 240, 24, 168, False, dropout_consumer_regs=232, dropout_producer_regs=40,
                            split_96=True),
    # at D 256 dK and dV of 64 keys are 256 fp32 registers per thread: each consumer keeps 128 columns of them
    256: HopperBackwardTile(2, 240, 24, 168, False, dropout_consumer_regs=None, dropout_producer_regs=None,
                            split_head_dim=True),
}


#: ``auto`` takes the Hopper forward from this many programs per SM on, by padded head dim (H100, bf16 and fp16,
#: kernels alone, 5 interleaved rounds, Hopper / portable forward). D 128, from half a program per SM: 1.28-1.31x
#: at Sq 512 Sk 8192 (B1 H18-64: 0.55-1.94 per SM; at 0.97 per SM 598 TFLOP/s against SDPA-cuDNN's 584),
#: 1.16-1.81x causal at S 1024-2048, 1.03-1.82x full at S 512-2048. Below half a program per SM the portable
#: kernel's smaller query blocks reach SMs that 128-row Hopper tiles leave idle: 0.92-0.94x at Sk 8192 (0.36-0.48
#: per SM; 1.15x causal S 2048 at 0.48). D 256: 1.59-1.95x at every grid measured (0.36-1.45 per SM). D 64
#: (192-row tiles, one program per tile): 0.79x at 1.33 per SM (B1 H16 Sq 2048 Sk 8192), 1.18x at 2.00.
HOPPER_MIN_PROGRAMS_PER_SM: dict[int, float] = {64: 2.0, 128: 0.5, 256: 0.0}


#: ``auto`` takes the Hopper forward when queries and keys both reach this length, by padded head dim.
HOPPER_FORWARD_MIN_LENGTH: dict[int, int] = {64: 2048, 128: 1, 256: 1}
#: The same for calls without a band edge (full attention), where they differ: D 64 from S 1024 on the short tile
#: (:data:`HOPPER_FORWARD_SHORT`).
HOPPER_FORWARD_MIN_LENGTH_FULL: dict[int, int] = {64: 1024}

#: Shorter calls at these padded head dims, without a left band edge, take another tile than :data:`HOPPER_FORWARD`'s:
#: ``(tile, full attention below this many queries, a right band edge alone (causal) below this many)``. At D 64 two
#: persistent consumers of 240 registers (causal: paired tiles) instead of three of 160, one program per tile: the
#: three-consumer tile's 192 rows leave the last tile of a 1024-row head a third full, its programs are too short
#: for their prologue and epilogue to hide, and under a causal mask its consumers' walks differ. H100, bf16, public
#: calls, 5 interleaved rounds, two leases, TFLOP/s of two consumers against three and the default path before:
#: full S 1024 394-397 against 375 and 372-377 (the portable kernel) at B16 H32, 352-354 against 326 and 351 at
#: B8 H16; causal S 2048 354-355 against 338 and 329-332, S 3000 354-355 against 352 and 346; but full S 2048
#: 411-415 against 433 and 407-424, causal S 4096 392-394 against 399 and 386-400. The choice against the default
#: before it, same protocol: full S 1024 1.04-1.06x at B16 H32 and 0.99-1.00x at B8 H16, S 1536 1.02-1.03x; causal
#: S 2048 1.07-1.14x, S 3000 1.03x, and S 3584 0.99x, hence the causal bound 3072
#: (record ``attention-forward-d64-short-2026-11-26.txt``).
HOPPER_FORWARD_SHORT: dict[int, tuple[HopperForwardTile, int, int]] = {
    64: (HopperForwardTile(128, 2, 2, 240, 24, 168), 2048, 3072),
    # D 128 under a causal mask below 1024 queries: 64-key blocks in three slots, so that the diagonal blocks carry
    # less masked work. Against the 128-key tile (H100, public calls, 5 interleaved rounds): 1.06-1.17x at S 256-900
    # (D 96 S 512 1.18x), 1.00x at S 1024, 0.90-0.91x from S 2048, and 0.88-0.97x on full attention at S 512-1024
    # (record ``attention-forward-d128-short-causal-2026-11-26.txt``)
    128: (HopperForwardTile(64, 3, 2, 240, 24, 168, split_96=True), 0, 1024),
}


#: Shorter calls under a causal mask (a right band edge alone) at these padded head dims: ``(tile, least, below)``,
#: both lengths in ``[least, below)``. At D 64 one consumer warpgroup of 64 rows per program and 64-key blocks; the
#: kernel's cap of 80 registers (the consumer takes 136 from the producer's warpgroup) and 49 KiB of shared memory
#: leave room for three programs per SM, which overlap each other's softmax, prologue and epilogue the way the
#: consumers of one program do, and a 64-row tile's walk is half as long as a 128-row tile's. Persistent, three
#: programs per SM, each walking pairs of a head's i-th longest and i-th shortest tiles: against one program per
#: tile (H100, bf16, public calls, 5 interleaved rounds, causal) 1.05x at B16 H32 S 1024 (316 against 302 TFLOP/s;
#: cuDNN 328), 1.07x at B16 H16, 1.04x at B4 H32 S 2000, 1.11x at B4 H16 S 512 and 1.20x at B2 H16 S 1024 (fewer
#: pairs than programs: each takes one, where single tiles left SMs idle), 0.99-1.00x where the pairs are 2.6 per
#: program (B8 H16 S 1024, B32 H16 S 256: some programs walk three, others two) (record
#: ``attention-forward-one-consumer-persistent-2026-11-26.txt``). O in a tile of its own rather than staged in the Q
#: tile (8 KiB more), so that the producer loads the next tile's Q while O leaves: 1.01-1.03x at S 1024, 1.04x at S
#: 512, 1.03x at S 768, 0.99x at S 1536, 1.00-1.01x at S 2000 (persistent both, bf16 and fp16, same record). One
#: program per tile, O staged in Q, against the default path before it (the portable kernel at these lengths) and
#: SDPA-cuDNN in the same rounds, TFLOP/s: S 256 146 against 141 (cuDNN 171), S 512 228 against 219 (256), S 768 269
#: against 260 (296), S 1024 302 against 291 (335), S 1536 329 against 321 (363), at B·S 16k H 32; B8 H16 S 1024 263
#: against 256, B4 H16 S 512 110 against 107 (111 against 112 in another run), B2 H16 S 1024 162 against 163. At S
#: 2048 the two-consumer tile is faster (352 against 329), and so is it on full attention (S 1024: 405 against 367):
#: a 64-row tile loads each K/V block for half as many rows. At S 1024 a cap of 128 (two programs per SM) ran 0.83x
#: this tile, 128-key blocks (two programs: they need more than 136 registers) 0.88x, a cap of 64 (four programs,
#: spilling) 0.96-1.01x, three ring slots 0.98-0.99x (record ``attention-forward-one-consumer-2026-11-26.txt``).
HOPPER_FORWARD_SHORT_CAUSAL: dict[int, tuple[HopperForwardTile, int, int]] = {
    64: (HopperForwardTile(64, 2, 1, 136, 24, 80), 256, 2048),
}


#: Full attention (no band edge) at these padded head dims with both lengths in ``[least, below)`` takes the same
#: one-consumer tile, three persistent programs per SM: at 512 keys a 128-row tile's walk is 4 key blocks, too short
#: for its prologue and epilogue to hide, where three 64-row programs per SM overlap each other's. H100, bf16 / fp16,
#: public calls, 5 interleaved rounds, against the portable kernel that took these calls: S 256 1.18x, S 384 1.12x,
#: S 512 1.06-1.10x (B64 H12, B64 H16, B32 H32), S 768 1.04x, S 896 1.01x; at S 1024 0.95-0.99x the two-consumer
#: tile, which keeps those calls (record ``attention-forward-short-full-one-consumer-2026-12-07.txt``).
HOPPER_FORWARD_SHORT_FULL: dict[int, tuple[int, int]] = {64: (256, 1024)}

#: Grouped-query calls (fewer K/V heads than query heads) under a causal mask take the one-consumer tile up to this
#: bound on both lengths (exclusive) instead of :data:`HOPPER_FORWARD_SHORT_CAUSAL`'s. H100, bf16, public calls, 5
#: interleaved rounds, against the two-consumer paired tile that took them: S 2048 1.04-1.05x at B8 H16/2 and B4
#: H32/8, 1.01-1.02x at B16 H16/4 and B8 H32/4, S 2560 1.03x at B8 H16/2, S 3072 1.04x at B4 H16/4; S 4096 0.98x at
#: B2 H32/8. Calls without a group keep the bound: 0.93-1.05x at S 2048-2560, depending on the grid (record
#: ``attention-forward-grouped-causal-one-consumer-2026-12-08.txt``).
HOPPER_FORWARD_GROUPED_CAUSAL_BELOW: dict[int, int] = {64: 3072 + 1}


def _one_consumer_tile(block_d: int, sq: int, sk: int, left: int, right: int, grouped: bool = False
                       ) -> HopperForwardTile | None:
    """The tile of :data:`HOPPER_FORWARD_SHORT_CAUSAL` for this call (a right band edge alone, to
    :data:`HOPPER_FORWARD_GROUPED_CAUSAL_BELOW` where ``grouped``, or none at all within
    :data:`HOPPER_FORWARD_SHORT_FULL`'s lengths), or None where it does not apply."""
    entry = HOPPER_FORWARD_SHORT_CAUSAL.get(block_d)
    if entry is None or left >= 0:
        return None
    tile, least, below = entry
    if right < 0:
        if block_d not in HOPPER_FORWARD_SHORT_FULL:
            return None
        least, below = HOPPER_FORWARD_SHORT_FULL[block_d]
    elif grouped:
        below = max(below, HOPPER_FORWARD_GROUPED_CAUSAL_BELOW.get(block_d, below))
    return tile if least <= sq < below and least <= sk < below else None


def hopper_forward_tile(block_d: int, sq: int, left: int = -1, right: int = -1, sk: int | None = None,
                        grouped: bool = False) -> HopperForwardTile:
    """The Hopper forward's tile for a call with padded head dim ``block_d``, ``sq`` queries, ``sk`` keys (None: as
    many as queries) and band edges ``left``, ``right`` (-1: none), ``grouped`` where K/V have fewer heads than the
    queries: the tile of :data:`HOPPER_FORWARD_SHORT_CAUSAL` or :data:`HOPPER_FORWARD_SHORT` where one applies, else
    :data:`HOPPER_FORWARD`'s."""
    one_consumer = _one_consumer_tile(block_d, sq, sq if sk is None else sk, left, right, grouped)
    if one_consumer is not None:
        return one_consumer
    short = HOPPER_FORWARD_SHORT.get(block_d)
    if short is not None and left < 0:
        tile, full_below, right_edge_below = short
        if sq < (full_below if right < 0 else right_edge_below):
            return tile
    return HOPPER_FORWARD[block_d]


#: Padded head dims at which ``auto`` takes the Hopper forward on every grid for calls under a causal mask (a right
#: band edge alone) that take the paired persistent tile of :data:`HOPPER_FORWARD_SHORT`: its work items are pairs
#: of a head's longest and shortest query blocks, which keep every program equally busy however few there are, where
#: the portable kernel's programs of unequal length leave SMs idle. H100, public calls, 5 interleaved rounds, Hopper /
#: portable (bf16, fp16), D 64 at 0.12-1.94 programs per SM: B1 H16 S 2048 1.485x / 1.489x, H8 1.096x / 1.113x, H4
#: 1.093x / 1.121x, H2 1.075x / 1.085x, B1 H12 S 2560 1.53x / 1.57x, B1 H8 S 3000 1.56x / 1.55x (record
#: ``attention-forward-one-consumer-2026-11-26.txt``). Full attention on that tile keeps the grid bound (B1 H16 S 1024
#: 0.855x, S 2048 0.76x).
HOPPER_FORWARD_PAIRED_ANY_GRID: frozenset[int] = frozenset({64})


def prefers_hopper_forward(block_d: int, programs: int, sms: int, sq: int, sk: int, full: bool = False,
                           causal: bool = False, grouped: bool = False) -> bool:
    """Whether ``auto`` runs a supported forward call (padded head dim ``block_d``, ``programs`` Hopper tiles on
    ``sms`` SMs, lengths ``sq`` and ``sk``; ``full``: no band edge) on the Hopper kernel: on a grid of at least
    :data:`HOPPER_MIN_PROGRAMS_PER_SM` tiles per SM for its head dim, with Sq and Sk both reaching
    :data:`HOPPER_FORWARD_MIN_LENGTH` (:data:`HOPPER_FORWARD_MIN_LENGTH_FULL` for full attention where it has the
    head dim). Measured on an H100 (bf16, kernels alone, interleaved rounds), Hopper / portable forward at D 64, with
    three consumers of 64 rows: 1.00-1.05x at S 2048 (16k to 64k tokens, H 32), 1.04-1.07x at S 2560-4096,
    1.10-1.14x at S 16384; but 0.94x at S 2000 on 704 programs, 0.95x at S 1536 causal, 0.79-0.96x at S 1024, where
    a program is short enough that its prologue and epilogue, with one program per SM, weigh. Full attention at
    S 1024 takes the persistent two-consumer tile instead (:data:`HOPPER_FORWARD_SHORT`): 1.00-1.06x the portable
    forward; under a causal mask that tile still trails it there (0.92-0.95x). At D 128 and 256 the length does not
    matter (1 in the table). ``causal``: a right band edge alone. Such calls on the tile of
    :data:`HOPPER_FORWARD_SHORT_CAUSAL` take it at every grid and length it applies to (each measured at or above the
    portable kernel), and on the paired tile of :data:`HOPPER_FORWARD_SHORT` at every grid where the head dim is in
    :data:`HOPPER_FORWARD_PAIRED_ANY_GRID`; so do full calls within :data:`HOPPER_FORWARD_SHORT_FULL`'s lengths.
    ``grouped``: K/V have fewer heads than the queries (:data:`HOPPER_FORWARD_GROUPED_CAUSAL_BELOW`)."""
    if (causal or full) and _one_consumer_tile(block_d, sq, sk, -1, 0 if causal else -1, grouped) is not None:
        return True
    least = HOPPER_FORWARD_MIN_LENGTH[block_d]
    if full:
        least = HOPPER_FORWARD_MIN_LENGTH_FULL.get(block_d, least)
    if sq < least or sk < least:
        return False
    short = HOPPER_FORWARD_SHORT.get(block_d)
    paired = (causal and block_d in HOPPER_FORWARD_PAIRED_ANY_GRID and short is not None
              and hopper_forward_tile(block_d, sq, -1, 0, sk, grouped) == short[0])
    return paired or programs >= HOPPER_MIN_PROGRAMS_PER_SM[block_d] * sms


#: Tiles of the Hopper dQ kernel (``_hopper_bwd_dq.py``: 128 query rows per program in two consumers, the K/V
#: blocks and ring as the forward's, dQ in registers and written once, in the output dtype) by padded head dim.
HOPPER_DQ: dict[int, HopperForwardTile] = {
    # three ring slots: a consumer holds K_j until dS_j K_j is done in the next step, so with two the producer could
    # load K_{j+1} only once step j ends (Q and dO 128 KiB + 3 x 32 KiB of K/V: 229,832 bytes of the 232,448)
    256: HopperForwardTile(32, 3, 2, 240, 24, 168, persistent=False),
    # D 128 and 64 (deterministic calls at D 128, A/B at 64): 64-key blocks in four slots at D 128 (three ran alike in
    # another run: S 2048 causal 364 against 365 TFLOP/s), 128-key blocks in three at D 64
    128: HopperForwardTile(64, 4, 2, 240, 24, 168, persistent=False),
    64: HopperForwardTile(128, 3, 2, 240, 24, 168, persistent=False),
}
#: Head dims whose Hopper backward computes dQ with that kernel, after a dK/dV kernel without dQ; the others add dQ
#: into an fp32 accumulator by TMA reductions from the dK/dV programs. At D 256 a dK/dV program holds only 64 keys
#: and writing its dQ tiles out limited it: the two kernels ran the backward 1.38-1.50x faster than the one kernel
#: with reductions (H100, bf16, S 1024-4096; 1.41-1.58x at S 64-512), though they compute 7 matmuls, not 5.
#: :func:`hopper_dq_kernel` switches it for tests and A/B tools (``dims=()``: the one kernel with reductions).
HOPPER_BACKWARD_DQ: frozenset[int] = frozenset({256})

#: Head dims whose ``deterministic`` calls take the Hopper backward with the dQ kernel, where the others take the
#: portable backward. At D 128 the two kernels ran 1.06-1.19x the portable deterministic backward (H100, bf16, kernel
#: calls, S 1024-8192, causal and not), but only 0.90-1.06x the one kernel with reductions, which the other calls keep.
#: At D 64 they ran 0.85-0.90x the one kernel, about what the portable backward runs (0.86-0.92x), so not there.
HOPPER_DETERMINISTIC_DQ: frozenset[int] = frozenset({128})


#: The Hopper backward with dQ by reductions (head dims 64 and 128) gives a program at most this many query heads of a
#: GQA group, for causal calls (a bounded right side, an unbounded left) and for the others ("full"; None: the whole
#: group); a larger group is split over several programs per key block, which add dK and dV into fp32 accumulators
#: (then cast). A program walks its heads' Q, dO and fp32 dQ rows, so the 132 programs in flight hold about 17 MB per
#: head at D 128 whatever the length: past L2 (50 MB) the dQ reductions and the reloads go to DRAM. H200, bf16, D 128,
#: backward against the whole group per program: causal 2 heads 1.02-1.10x at groups 4, 7 and 8 (4 heads 0.94-1.09x);
#: full 0.97-0.99x at every group, where the accumulators' reductions cost more than the reloads they save.
HOPPER_BACKWARD_GROUP_HEADS: dict[str, int | None] = {"causal": 2, "full": None}


def hopper_group_parts(group: int, block_d: int, dq_kernel: bool, d_split: bool, deterministic: bool, left: int,
                       right: int) -> int:
    """Programs per key block of one (batch, K/V head) in the Hopper backward with band ``(left, right)``: the fewest
    parts of ``group`` (query heads per K/V head) with at most :data:`HOPPER_BACKWARD_GROUP_HEADS` heads each (parts
    of ``cdiv(group, parts)`` heads, the last one the rest); 1 where the kernel sums no dK/dV (dQ by its own kernel,
    head dims 65-96, ``deterministic`` calls: the sums' order is the arrival's)."""
    heads = HOPPER_BACKWARD_GROUP_HEADS["causal" if right >= 0 and left < 0 else "full"]
    if heads is None or dq_kernel or d_split or deterministic or block_d not in (64, 128):
        return 1
    return cdiv(group, heads)


@contextlib.contextmanager
def hopper_group_heads(heads: int) -> Iterator[None]:
    """Inside the block, the Hopper backward gives a program at most ``heads`` query heads of a group, causal or not
    (:data:`HOPPER_BACKWARD_GROUP_HEADS`): for tests and for tools that time one split against another."""
    global HOPPER_BACKWARD_GROUP_HEADS
    if type(heads) is not int or heads < 1:
        raise ValueError(f"heads must be a positive int, got {heads!r}")
    saved = HOPPER_BACKWARD_GROUP_HEADS
    HOPPER_BACKWARD_GROUP_HEADS = {"causal": heads, "full": heads}
    _hopper_tables_changed()
    try:
        yield
    finally:
        HOPPER_BACKWARD_GROUP_HEADS = saved
        _hopper_tables_changed()


def takes_hopper_dq_kernel(block_d: int, dropout: bool, deterministic: bool = False) -> bool:
    """Whether the Hopper backward at padded head dim ``block_d`` computes dQ with its kernel of its own (which has
    no dropout, and sums nothing in arrival order) rather than by TMA reductions."""
    if dropout:
        return False
    return block_d in HOPPER_BACKWARD_DQ or (deterministic and block_d in HOPPER_DETERMINISTIC_DQ)


#: ``auto`` takes the Hopper backward without dropout when the keys reach this length, by padded head dim (and the
#: queries :data:`HOPPER_BACKWARD_MIN_QUERIES`).
HOPPER_BACKWARD_MIN_LENGTH: dict[int, int] = {64: 1024, 128: 512, 256: 64}
#: ... and the queries this many (at most the keys' minimum): a program owns 128 keys and walks the queries, so the
#: keys fill the GPU and short queries only shorten each program's walk.
HOPPER_BACKWARD_MIN_QUERIES: dict[int, int] = {64: 512, 128: 256, 256: 64}
#: ``auto`` takes the Hopper backward with dropout when queries and keys both reach this length, by padded head dim.
HOPPER_DROPOUT_BACKWARD_MIN_LENGTH: dict[int, int] = {64: 1024, 128: 512}


def prefers_hopper_backward(block_d: int, sq: int, sk: int, dropout: bool = False) -> bool:
    """Whether ``auto`` runs a supported backward call (padded head dim ``block_d``) on the Hopper kernel: without
    dropout when Sk reaches :data:`HOPPER_BACKWARD_MIN_LENGTH` and Sq :data:`HOPPER_BACKWARD_MIN_QUERIES`; with
    dropout when both reach :data:`HOPPER_DROPOUT_BACKWARD_MIN_LENGTH`. Measured on an H100 (bf16 and fp16, 16k
    tokens, public calls, the backward of one recorded forward, 7 interleaved rounds), Hopper / portable backward:

    - D 128 without dropout: 1.15-1.22x at S 1024-2048; 1.14-1.17x at S 512, 1.05x causal; Sq 256 / Sk 512
      1.15-1.17x, causal too; but 0.96-0.97x at S 256; with short queries and long keys (kernel calls, H 32): Sq 512
      1.20-1.24x at Sk 2048-8192, Sq 256 1.53x at Sk 8192;
    - D 64 without dropout: 1.11-1.15x at S 2048; at S 1024 1.02-1.06x full and 0.99-1.03x causal (H 32),
      1.04-1.10x with 8 K/V heads; Sq 512 / Sk 1024 1.00x full, 1.04x causal; but 0.90-1.01x at S 512 (0.90-0.94x
      causal), where the call is short enough that the extra passes (the dQ accumulator's zeroing and cast) weigh;
      with long keys (kernel calls, H 32): Sq 512 / Sk 8192 1.25x, Sq 1024 / Sk 4096 1.09x;
    - with dropout (each keep mask drawn once, where the portable backward draws it twice and recomputes two
      matmuls): D 128 1.08-1.31x from S 512 on; D 64 1.19-1.51x from S 1024 on, at S 512 0.87x causal and 1.34x
      full;
    - D 256, no dropout (kernel calls, the dK/dV kernel then the dQ kernel): 1.66-1.76x from S 1024 on,
      1.47-1.74x at S 128-512, 1.29-1.43x at S 64, the shortest measured."""
    if dropout and HOPPER_BACKWARD[block_d].dropout_consumer_regs is None:
        return False
    if dropout:
        least = HOPPER_DROPOUT_BACKWARD_MIN_LENGTH[block_d]
        return sq >= least and sk >= least
    return sk >= HOPPER_BACKWARD_MIN_LENGTH[block_d] and sq >= HOPPER_BACKWARD_MIN_QUERIES[block_d]


def path() -> str:
    """The kernel path calls take now (``PATH_ENV``; ``auto`` when unset)."""
    return kernel_path(PATH_ENV)


@functools.cache
def sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def forced_path(name: str) -> contextlib.AbstractContextManager[None]:
    """Inside the block, calls take kernel path ``name`` (one of ``kernels._common.runtime.KERNEL_PATHS``)."""
    return forced_kernel_path(PATH_ENV, name)


# The one place a different tile can be forced (see ``override``).
_adjust: Callable[[Query, Tile], Tile] | None = None
_fuse: bool | None = None


def block_d(d: int) -> int:
    """The padded head dim the kernels tile: the next power of two, at least 16."""
    return max(16, 1 << (d - 1).bit_length())


def mask_kind(left: int, right: int) -> str:
    """``full``, ``narrow`` or ``band`` for the visible band ``(left, right)`` (-1: unbounded side)."""
    if left < 0 and right < 0:
        return "full"
    if left >= 0 and right >= 0 and left + right + 1 <= NARROW_BAND:
        return "narrow"
    return "band"


def query(kernel: str, d: int, dtype: torch.dtype, left: int = -1, right: int = -1, sq: int = 0,
          dropout: bool = False) -> Query:
    return Query(kernel, block_d(d), "fp32" if dtype == torch.float32 else "16-bit", mask_kind(left, right), sq,
                 bool(dropout))


def lookup(q: Query) -> Row:
    """The first row of :data:`ROWS` that matches ``q`` (ignores ``override``)."""
    for row in ROWS:
        if row.matches(q):
            return row
    raise LookupError(f"no launch configuration for {q}")  # a table bug: tests check every combination


def tile(q: Query) -> Tile:
    """The tile for ``q``: the table's, or what an active ``override`` makes of it."""
    chosen = lookup(q).tile
    return _adjust(q, chosen) if _adjust is not None else chosen


def _launch_config(kernel, d, dtype, left, right, sq, dropout) -> dict:
    t = tile(query(kernel, d, dtype, left, right, sq, dropout))
    bd = block_d(d)
    return {"BLOCK_M": t.block_m, "BLOCK_N": t.block_n, "BLOCK_D": bd, "EVEN_D": d == bd, "num_warps": t.num_warps,
            "num_stages": t.num_stages}


# Scanning the rows costs microseconds; a call's host path should not pay it again for a seen shape.
_launch_config_cached = functools.lru_cache(maxsize=4096)(_launch_config)


def launch_config(kernel: str, d: int, dtype: torch.dtype, left: int = -1, right: int = -1, sq: int = 0,
                  dropout: bool = False) -> dict:
    """Keyword arguments of a launch of ``kernel`` for head dim ``d``, band ``(left, right)``, ``sq`` queries
    (one shared dict per distinct call: never mutate it)."""
    plain = type(d) is type(left) is type(right) is type(sq) is int and type(dropout) is bool
    if _adjust is not None or not plain:  # an override, or symbolic sizes under torch.compile
        return _launch_config(kernel, d, dtype, left, right, sq, dropout)
    return _launch_config_cached(kernel, d, dtype, left, right, sq, dropout)


def fuse_backward(dkdv_cfg: dict, dq_cfg: dict) -> bool:
    """Whether dK/dV and dQ run as one launch: when their configs agree on warps and pipeline stages."""
    if _fuse is not None:
        return _fuse
    return dkdv_cfg["num_warps"] == dq_cfg["num_warps"] and dkdv_cfg["num_stages"] == dq_cfg["num_stages"]


def preprocess_block_m(bd: int) -> int:
    """Rows per program of the backward's ``delta = rowsum(dO * O)``: about 8192 elements per tile."""
    return max(16, min(128, 8192 // bd))


# --- decoding against a KV cache (kernels/attention/_decode.py) -----------------------------------------------

#: programs the split-KV kernel aims for per SM, contiguous and paged caches: a contiguous cache's program keeps two
#: K/V blocks in flight (up to 192 KiB of shared memory: one program per SM), a paged one's loop loads the page
#: numbers one stage ahead of K and V and keeps one (74 KiB: two programs per SM fit, and they hide each other's
#: latency). The split count rounds down, so that the programs fit one wave (a partial second wave doubles the time)
#: A causal Hopper backward (dK/dV kernels) of at most this many programs per SM starts its programs key block by key
#: block, every (sequence, key/value head) at once (grid (B * Hkv, key blocks)), instead of every key block of one
#: (sequence, key/value head) at once: the programs of the first key blocks see the most queries, so they start first
#: and the last wave is not one long program. Larger grids keep the (sequence, head) order, whose programs running
#: side by side share their Q and dO reads in L2. 0: never.
HOPPER_BACKWARD_KEY_MAJOR_PROGRAMS_PER_SM = 2


def hopper_key_major(programs: int, multiprocessors: int, left: int, right: int) -> bool:
    """Whether a Hopper dK/dV launch of ``programs`` programs with band ``(left, right)`` runs key block by key block
    (:data:`HOPPER_BACKWARD_KEY_MAJOR_PROGRAMS_PER_SM`): causal (a bounded right side, an unbounded left) and a small
    grid."""
    return right >= 0 and left < 0 and programs <= HOPPER_BACKWARD_KEY_MAJOR_PROGRAMS_PER_SM * multiprocessors

#: A dense call with at most this many queries against at least ``DECODE_MIN_KEYS`` keys is decode-shaped: its forward
#: runs the split-KV kernel of the KV-cache calls, whose programs split the keys and serve a whole GQA group from one
#: read of K/V, where the training kernel's grid has one program per (sequence, query head) reading every key.
DECODE_MAX_QUERIES = 16
DECODE_MIN_KEYS = 256


def decode_shaped(queries: int, keys: int) -> bool:
    """Whether a dense forward of ``queries`` queries against ``keys`` keys runs the split-KV kernel."""
    return queries <= DECODE_MAX_QUERIES and keys >= DECODE_MIN_KEYS


#: programs per SM the split count aims at, by whether the cache is paged or FP8: a contiguous 16-bit cache's programs
#: stream at copy speed one per SM, while page gathers and an FP8 tile's widening to q's dtype keep a program from
#: saturating memory alone (twice the splits: FP8 1.09-1.37x faster at B 1-8, a 16-bit cache 0.86x at B 1)
DECODE_PROGRAMS_PER_SM = {False: 1, True: 2}
#: ... times this for a paged FP8 cache at head dims up to 64 whose (sequence, head) programs fill the SMs already:
#: its program (145 registers, 23 KB of shared memory at D 64) leaves room for three per SM, and its page gathers,
#: which do not pipeline, need more programs to hide their latency (H100, B 32 Hq 32/Hkv 8 Sk 8192 D 64, pages of
#: 16: 1.31x the plan with two per SM; at D 128, 0.96x at B 64 and 0.78x at B 1, so not taken there)
DECODE_PAGED_FP8_NARROW_FACTOR = 2
#: a split covers at least this many key blocks of the cache's capacity, so that its query load and partial
#: results stay small beside its share of K and V
DECODE_MIN_BLOCKS_PER_SPLIT = 4
#: ... except that a cache of few blocks still splits up to this many ways (down to one block a split): a step of a
#: few MB is latency, not bytes, and more programs each wait on less (H100, B 1 Hq 32/Hkv 8 D 128: Sk 1024 in 8
#: splits 1.28x contiguous and 1.53x paged over 2, at D 64 1.25x and 1.54x; Sk 2048 in 8 1.14x and 1.28x over 4; B 4
#: Sk 1024 in 4 / 8 1.03x / 1.23x; at Sk 8192 twice the 16 splits is 0.72x and 0.91x, so the 4-block rule stays from
#: 32 blocks on). FP8 caches alike: Sk 1024 in 8 splits 1.46x / 1.57x over 2, Sk 2048 1.25x / 1.30x over 4, D 64
#: 1.40x / 1.62x, B 4 1.15x / 1.29x.
DECODE_SMALL_CACHE_SPLITS = 8
#: A paged FP8 cache past D 64 loads each key block's page numbers one iteration ahead (``DecodePlan.pages_ahead``),
#: so the pipeliner keeps two K/V blocks in flight, as in a contiguous cache (74 KiB of shared memory: two programs
#: per SM still fit). H100, D 128, pages of 16: B 1 Sk 32768 1.08x, B 8 1.09x, B 64 Sk 8192 1.12x. Not at D 64,
#: where a paged FP8 cache runs four programs per SM (0.83x), nor for 16-bit caches (139 KiB: one program per SM;
#: 0.98-1.01x at two per SM's split count, 1.07x at B 1 with one per SM's).
DECODE_PAGED_FP8_PAGES_AHEAD = True
#: One sequence in a paged 16-bit cache loads its page numbers a block ahead too, and runs one program per SM (the
#: split count of a contiguous cache): at D 128 its programs (139 KiB of shared memory) never shared an SM, so the
#: second per SM only ran as a second wave. H100, B 1 Hq 32/Hkv 8 D 128, pages of 16, against two programs per SM
#: without it: Sk 16384 1.12x, Sk 32768 1.06x, Sk 65536 1.03x, Sk 131072 1.02x, Hkv 32 0.99x, D 64 1.08x; batches of
#: several sequences (balanced splits) gain less or lose (B 2 1.03x, B 4 0.99x), so they keep their plan.
DECODE_PAGED_ONE_SEQUENCE_AHEAD = True
DECODE_MAX_SPLITS = 128
#: Balanced splits for batches of several sequences in a 16-bit cache: each key/value head's programs, one wave of
#: them, share the batch's key blocks (read from the lengths on the GPU) evenly, a share crossing sequence boundaries,
#: instead of cutting each sequence into the same number of splits: a ragged batch's long sequences no longer hold
#: the step (H100, lengths uniform in [Sk / 8, Sk]: 1.00-1.16x per-sequence splits at B 8-64, 1.11-1.16x at B 8;
#: uniform batches 0.97-1.00x).
DECODE_BALANCED_SPLITS = True
#: ... where a full cache gives each per-sequence split at least this many key blocks: below, a step is a few
#: microseconds of latency, and shares that cross sequences (two parts, two partial writes) cost more than they even out
DECODE_BALANCED_MIN_BLOCKS = 16


class DecodePlan(NamedTuple):
    block_m: int  # rows per program: queries of the GQA group's heads, (head, query) packed
    block_n: int  # keys per block
    num_warps: int
    num_stages: int
    splits: int  # key splits per (batch, key/value head), 1: nothing to combine; balanced: programs per head
    balanced: bool = False  # the batch's keys shared evenly by `splits` programs per head (DECODE_BALANCED_SPLITS)
    pages_ahead: bool = False  # paged: each key block's page numbers loaded one iteration before its K and V


def _decode_plan(batch: int, kv_heads: int, rows: int, d: int, dtype: torch.dtype, capacity: int, paged: bool,
                 multiprocessors: int, fp8: bool = False) -> DecodePlan:
    bd = block_d(d)
    row_tile = min(64, block_d(rows))
    key_bytes = bd * (4 if dtype == torch.float32 else 2)
    # 32 KiB per K (and V) block: 128 keys at D 128 in 16 bits, fewer for wider rows
    key_tile = max(16, min(128, 32768 // key_bytes))
    # K and V blocks of each pipeline stage in shared memory: up to 3 stages within 192 KiB (128 from D 512 on, where
    # the query tile takes shared memory too)
    budget = (192 if bd <= 256 else 128) * 1024
    stages = max(1, min(3, budget // (key_tile * key_bytes * 2)))
    programs = batch * kv_heads * cdiv(rows, row_tile)
    blocks = cdiv(capacity, key_tile)
    one_sequence_ahead = (DECODE_PAGED_ONE_SEQUENCE_AHEAD and paged and not fp8 and batch == 1
                          and dtype in (torch.float16, torch.bfloat16))
    per_sm = DECODE_PROGRAMS_PER_SM[(paged and not one_sequence_ahead) or fp8]
    if paged and fp8 and bd <= 64 and programs >= multiprocessors:
        per_sm *= DECODE_PAGED_FP8_NARROW_FACTOR
    by_keys = cdiv(blocks, DECODE_MIN_BLOCKS_PER_SPLIT)
    by_keys = max(by_keys, min(blocks, DECODE_SMALL_CACHE_SPLITS))
    splits = max(1, min(per_sm * multiprocessors // max(programs, 1), by_keys, DECODE_MAX_SPLITS))
    # a full cache gives each split cdiv(blocks, splits) blocks; the splits that would be left empty are dropped, as
    # they only lengthen the combine (33 splits of 256 blocks: the 33rd gets none)
    splits = cdiv(blocks, cdiv(blocks, splits)) if blocks else 1
    # balanced: one wave of programs per head and row block, sharing the batch's keys (where a wave has room for
    # every head and row block); not for an FP8 cache, whose step the widening bounds, not memory, and which the
    # balanced kernel's extra registers slowed by 3-9% on uniform batches
    wave = DECODE_PROGRAMS_PER_SM[paged] * multiprocessors // (kv_heads * cdiv(rows, row_tile))
    if (DECODE_BALANCED_SPLITS and not fp8 and batch > 1 and wave >= 1
            and blocks >= DECODE_BALANCED_MIN_BLOCKS * splits):
        return DecodePlan(row_tile, key_tile, 4, stages, min(wave, DECODE_MAX_SPLITS * batch), True)
    # a paged FP8 cache's K/V loads wait on no page-number load of their own iteration (DECODE_PAGED_FP8_PAGES_AHEAD)
    ahead = (DECODE_PAGED_FP8_PAGES_AHEAD and paged and fp8 and bd > 64) or one_sequence_ahead
    return DecodePlan(row_tile, key_tile, 4, stages, splits, pages_ahead=ahead)


_decode_plan_cached = functools.lru_cache(maxsize=1024)(_decode_plan)
_adjust_decode: Callable[[DecodePlan], DecodePlan] | None = None


def decode_plan(batch: int, kv_heads: int, rows: int, d: int, dtype: torch.dtype, capacity: int, paged: bool,
                multiprocessors: int, fp8: bool = False) -> DecodePlan:
    """Tiles and split count of a KV-cache call: ``rows = (Hq // Hkv) * Sq`` query rows per key/value head, a cache
    of ``capacity`` positions per sequence (``paged`` or contiguous; ``fp8``: float8_e4m3fn, its tiles widened to
    ``dtype``, q's), on a GPU of ``multiprocessors`` SMs. The split count comes from the shapes only
    (``DECODE_PROGRAMS_PER_SM`` programs per SM, each split at least ``DECODE_MIN_BLOCKS_PER_SPLIT`` key blocks of the
    capacity or, in a small cache, up to ``DECODE_SMALL_CACHE_SPLITS`` splits; no more splits than a full cache
    fills), never from the lengths, which live on the GPU."""
    plan = _decode_plan_cached(batch, kv_heads, rows, d, dtype, capacity, paged, multiprocessors, fp8)
    return _adjust_decode(plan) if _adjust_decode is not None else plan


def decode_overridden() -> bool:
    """Whether an :func:`override_decode` block is in force (the compiled tier, whose programs are kept by the
    call's arguments alone, then steps aside)."""
    return _adjust_decode is not None


@contextlib.contextmanager
def override_decode(adjust: Callable[[DecodePlan], DecodePlan]) -> Iterator[None]:
    """Inside the block, every KV-cache call runs ``adjust(table_plan)``: for tests (many splits on small caches)
    and for tools that time another tile or split count."""
    global _adjust_decode
    saved = _adjust_decode
    _adjust_decode = adjust
    try:
        yield
    finally:
        _adjust_decode = saved


_HOPPER_TABLE_STATES: dict[tuple, int] = {}


def _hopper_tables_changed() -> None:
    global hopper_tables_version
    state = (HOPPER_BACKWARD_DQ, tuple(HOPPER_BACKWARD_GROUP_HEADS.items()), tuple(HOPPER_FORWARD.items()),
             tuple(HOPPER_FORWARD_SHORT.items()), tuple(HOPPER_FORWARD_SHORT_CAUSAL.items()), tuple(HOPPER_DQ.items()),
             tuple(HOPPER_BACKWARD.items()))
    hopper_tables_version = _HOPPER_TABLE_STATES.setdefault(state, len(_HOPPER_TABLE_STATES))


#: A number for the present contents of the Hopper tables (:data:`HOPPER_FORWARD`, :data:`HOPPER_DQ`,
#: :data:`HOPPER_BACKWARD`, :data:`HOPPER_BACKWARD_DQ`, :data:`HOPPER_BACKWARD_GROUP_HEADS`), part of an eager call's
#: replay signature: a launch recorded under other tiles is not replayed under these. Changed by
#: :func:`hopper_dq_kernel`, :func:`hopper_group_heads` and :func:`hopper_tiles`, the ways to change them.
hopper_tables_version = 0
_hopper_tables_changed()


@contextlib.contextmanager
def hopper_dq_kernel(dims=tuple(HOPPER_DQ)) -> Iterator[None]:
    """Inside the block, the Hopper backward computes dQ with its kernel of its own at these padded head dims
    (:data:`HOPPER_BACKWARD_DQ`): for tests and for tools that time it against the reductions."""
    global HOPPER_BACKWARD_DQ
    saved = HOPPER_BACKWARD_DQ
    HOPPER_BACKWARD_DQ = frozenset(dims)
    _hopper_tables_changed()
    try:
        yield
    finally:
        HOPPER_BACKWARD_DQ = saved
        _hopper_tables_changed()


@contextlib.contextmanager
def hopper_tiles(forward: dict[int, HopperForwardTile] | None = None,
                 dq: dict[int, HopperForwardTile] | None = None,
                 backward: dict[int, HopperBackwardTile] | None = None) -> Iterator[None]:
    """Inside the block, the Hopper forward, dQ and backward kernels take these tiles at these padded head dims
    (entries of :data:`HOPPER_FORWARD`, :data:`HOPPER_DQ` and :data:`HOPPER_BACKWARD`): for tools that time a tile
    against the table's. A forward tile given here serves every length of its head dim (its short tiles of
    :data:`HOPPER_FORWARD_SHORT` and :data:`HOPPER_FORWARD_SHORT_CAUSAL` step aside)."""
    saved = (dict(HOPPER_FORWARD), dict(HOPPER_FORWARD_SHORT), dict(HOPPER_FORWARD_SHORT_CAUSAL), dict(HOPPER_DQ),
             dict(HOPPER_BACKWARD))
    HOPPER_FORWARD.update(forward or {})
    for d in forward or {}:
        HOPPER_FORWARD_SHORT.pop(d, None)
        HOPPER_FORWARD_SHORT_CAUSAL.pop(d, None)
    HOPPER_DQ.update(dq or {})
    HOPPER_BACKWARD.update(backward or {})
    _hopper_tables_changed()
    try:
        yield
    finally:
        tables = (HOPPER_FORWARD, HOPPER_FORWARD_SHORT, HOPPER_FORWARD_SHORT_CAUSAL, HOPPER_DQ, HOPPER_BACKWARD)
        for table, before in zip(tables, saved, strict=True):
            table.clear()
            table.update(before)
        _hopper_tables_changed()


@contextlib.contextmanager
def override(adjust: Callable[[Query, Tile], Tile] | None = None, *, fuse: bool | None = None) -> Iterator[None]:
    """Inside the block, every tile is ``adjust(query, table_tile)`` and, when ``fuse`` is given, the backward
    runs as one launch (True) or two (False) whatever the tiles. For tests (small blocks that cross every
    loop edge) and for tools that time a candidate tile against the table's."""
    global _adjust, _fuse
    saved = _adjust, _fuse
    _adjust, _fuse = adjust, fuse
    forget_recorded_launches()  # eager calls replay launches recorded with the table's tiles
    try:
        yield
    finally:
        _adjust, _fuse = saved
        forget_recorded_launches()


def table(dims=(64, 128), lengths=(512, 1024, 1025, 4096), dtypes=(torch.bfloat16, torch.float32)) -> str:
    """The effective choices over a grid, one line each: what ``python -m kernels.attention`` prints."""
    bands = {"full": (-1, -1), "causal": (-1, 0), "window 512": (256, 255)}
    lines = [f"{'D':>4} {'dtype':>8} {'mask':>10} {'Sq':>6} {'drop':>5}  {'fwd':>16} {'dK/dV':>16} {'dQ':>16}  bwd"]
    for d in dims:
        for dtype in dtypes:
            for name, (left, right) in bands.items():
                for sq in lengths:
                    for dropout in (False, True):
                        cfgs = [launch_config(k, d, dtype, left, right, sq, dropout) for k in ("fwd", "dkdv", "dq")]
                        cells = [f"({c['BLOCK_M']},{c['BLOCK_N']},{c['num_warps']}w,{c['num_stages']}s)" for c in cfgs]
                        launches = "1 launch" if fuse_backward(cfgs[1], cfgs[2]) else "2 launches"
                        lines.append(f"{d:>4} {str(dtype)[6:]:>8} {name:>10} {sq:>6} {'yes' if dropout else 'no':>5}  "
                                     f"{cells[0]:>16} {cells[1]:>16} {cells[2]:>16}  {launches}")
    return "\n".join(lines)

