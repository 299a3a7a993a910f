"""Launch configurations of the LayerNorm/RMSNorm kernels: tile, warps and grid for each row width, and why.

Every choice is computed from the row width ``n`` (and, for grids, the row count ``m`` and the GPU's SM
count and L2 size) by the functions below, from the settings in :class:`Settings`: each field is one
decision with its reason. The measurements behind them are in the family's ``TUNING.md``.

- **forward**: rows up to ``max_fused_fwd`` elements stay in registers, several rows per program when
  rows are short (a tile of about ``fwd_tile`` elements, ``fwd_elements_per_thread`` per thread; measured
  rows and warps for the widths in ``fwd_row_tiles``); w and b load with the rows at the widths in
  ``fwd_affine_first``, and a call whose traffic fits in L2 marks the rows to leave it first; wider rows are
  read in chunks of ``chunk`` by persistent programs whose rows in flight fit in L2, so the second pass over
  a row reads it from L2.
- **forward on Hopper, rows wider than ``max_fused_fwd``**: each row read once into shared memory
  (``kernels/layernorm/_hopper.py``), slots of ``hopper_chunk`` elements, one program per SM, the spare shared
  memory holding w and b of the leading chunks (and for RMSNorm the next row's first chunks):
  :func:`hopper_forward`.
- **backward, rows up to ``max_fused_bwd``**: tiles of about ``bwd_tile`` elements,
  ``min(row tiles, programs_per_sm * SMs)`` programs, each owning a contiguous range of rows and adding
  its partial dW/dB once into one of ``min(programs, max_group_size_m)`` fp32 buffers under a lock (one
  buffer per program, no lock, with ``deterministic=True`` and for calls of at most ``lock_free_max_elements``
  elements, where the programs' waits for the locks at the end outweigh the extra buffers); a second kernel sums
  the buffers.
- **backward, wider rows**: programs over (``wide_columns``-column block, lane of ``wide_rows``-row tiles),
  at most ``wide_programs_per_sm * SMs`` in all so that all are resident at once; they exchange the row sums
  through memory and each lane writes its own buffer (lock-free, deterministic). On Hopper, 16-bit rows take the
  same grid with a shared-memory ring of ``hopper_bwd_ring`` rows per program: :func:`hopper_backward`.
- **residual + dropout + norm forward**: when ``n`` is a power of two and a tile of about
  ``add_dropout_norm_row_tile`` elements is whole dropout chunks (4096 elements), one pass over the tile
  with the mask drawn in its layout (``CHUNK_TILE``); otherwise a flat dropout pass and a norm pass over
  tiles of about ``add_dropout_norm_tile`` elements (whole chunks then dominate the two a program cuts).
  Its backward is the backward's, ``CHUNK_TILE`` when its tiles are whole chunks.

Print the effective table::

    python -m kernels.layernorm

Tests and tools change a setting through :func:`override`, never by assigning to this module.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Iterator

from kernels._common.launch import cdiv, forget_recorded_launches, l2_cache_bytes, multiprocessor_count
from kernels._common.runtime import forced_kernel_path, kernel_path
from reference.dropout import LANE_STRIDE

DROPOUT_CHUNK = 4 * LANE_STRIDE  # elements per Philox chunk of the dropout layout
REGISTERS_PER_SM = 65536  # 32-bit registers of one SM (every NVIDIA GPU from sm_50 to sm_90)


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@dataclasses.dataclass(frozen=True)
class Settings:
    # Forward.
    max_fused_fwd: int = 32768  # widest row kept in registers: a 32768-element row is 64 per thread at 16 warps
    fwd_tile: int = 4096  # elements per program: several short rows share one, so each thread has work
    fwd_elements_per_thread: int = 64  # a 64-element strip per thread keeps many 16-byte loads in flight
    fwd_min_warps: int = 4  # at least 4 warps per program for rows over fwd_narrow ...
    fwd_narrow: int = 2048  # ... and 2 for rows up to this width, so more programs fit per SM
    # (padded width, rows, warps) measured faster than the rule above, on the device time of M = 4096 rows and at
    # M * N = 2^27 alike (H100, bf16): fewer rows or more warps per program at these widths.
    fwd_row_tiles: tuple[tuple[int, int, int], ...] = ((1024, 2, 2), (2048, 1, 4), (4096, 1, 8))
    # Padded widths whose programs load w and b with the rows, before the row reductions: after them the loads
    # wait out their latency behind the reductions' barriers (0.93-0.97x at M = 4096). At 16384 the registers
    # they hold meanwhile cost more than that (LayerNorm 0.75-0.77x at its 8 warps: 232 registers against 207).
    fwd_affine_first: tuple[int, ...] = (1024, 2048, 4096, 8192)
    # A call whose x and y fit in this fraction of L2 loads the rows to leave L2 first and w and b last: measured
    # 1.03-1.07x at M = 4096, N <= 2048 (16-32 MB), 0.98-0.99x on calls of 256 MB.
    fwd_hints_l2_fraction: float = 1.0
    chunk: int = 8192  # chunked forward: elements per chunk of a wide row (and per row-terms step)
    chunk_warps: int = 8
    chunk_loop_stages: int = 3  # software pipelining of the chunk loop
    chunk_l2_fraction: float = 0.5  # rows in flight of the chunked forward fill at most this much of L2
    # Hopper forward of rows wider than max_fused_fwd (kernels/layernorm/_hopper.py): each row held in shared
    # memory, in slots of hopper_chunk elements, one program of hopper_warps warps per SM (16-bit rows of
    # 40000-65536, H100, the best of each against the best of the other: 8192-element slots 0.99-1.03x 4096,
    # 16 warps 0.99-1.04x 8; two programs per SM, which fit rows up to 113 KB, 0.99-1.01x one).
    hopper_chunk: int = 8192
    hopper_warps: int = 16
    hopper_shared_bytes: int = 227 * 1024 - 1024  # one program's shared memory on sm_90, less reduction scratch
    # Spare shared memory (beyond the row) holds w and b of the leading chunks for all of a program's rows
    # (LayerNorm 65536: 0.84-0.85 of copy against 0.82 reading them from L2 for every row, where they are 2/3 of
    # the program's L2 reads), and for RMSNorm half of it holds the next row's first chunks, which then load
    # while this row's statistics are computed (RMSNorm 65536: 0.94 against 0.93; LayerNorm 0.82 with the
    # spare memory all next-row slots).
    hopper_rms_extra_fraction: float = 0.5
    # Hopper forward of the same LayerNorm rows split by columns (_norm_fwd_split_row_kernel): programs of
    # hopper_split_columns columns exchange their shares of each row's statistics, so every program holds its
    # columns' w and b in shared memory and nothing is read twice (H100, bf16, M * N = 2^27, against the kernel
    # above: N 40000 1.03x, 65536 1.09x, 100000 1.16x with 8192 columns, 8 warps, two programs per SM, a ring of
    # 4 rows published 2 ahead; 16384 columns, one 16-warp program per SM: 0.95x, 1.06x, 1.09x). RMSNorm stays on the
    # kernel above (0.94x at 40000 and 100000, 1.04x at 65536: its extra ring slots already hide the reductions).
    hopper_split_layer_norm: bool = True
    hopper_split_rms_norm: bool = False
    hopper_split_columns: int = 8192
    hopper_split_warps: int = 8
    hopper_split_ring: int = 4
    hopper_split_publish_ahead: int = 2
    hopper_split_programs_per_sm: int = 2
    # Hopper wide backward (the split-row exchange with rows copied into a shared-memory ring, 16-bit x and dy):
    # slots per program, and rows by which publishing a row's shares runs ahead of finishing one (< ring). H100,
    # M * N = 2^27, N 16384-65536: ring 4 / ahead 2 0.76-0.82 of copy, ring 6 / ahead 2-4 the same within 0.01,
    # ring 6 / ahead 5 (one row of copies in flight) 0.67-0.76.
    hopper_bwd_ring: int = 4
    hopper_bwd_publish_ahead: int = 2
    # Fused residual + dropout + norm forward: elements per program. Its first pass walks whole dropout
    # chunks (4096 elements, one Philox call per four); a program draws the chunks cut by its ends in full,
    # so larger tiles waste a smaller share of Philox work.
    add_dropout_norm_tile: int = 16384
    add_dropout_norm_row_tile: int = 4096  # the one-pass forward's tile: one dropout chunk, as the forward's
    # Draw the mask in the tile's layout when tiles are whole chunks (else a flat pass re-reads the tile).
    dropout_chunk_tiles: bool = True
    # ... in the forward only while a program's warps span at most one run of a chunk (4 warps of 8-element
    # strips): more warps draw the same Philox words twice or more, and the flat pass is then faster
    # (N = 16384, bf16: 68% of copy with 8 warps against 90% for the flat pass and 95% with 4 warps).
    chunk_tile_max_warps: int = 4
    chunk_tile_elements_per_thread: int = 128  # the one-pass forward: 4 warps up to N = 16384
    # The backward with the mask drawn in its tiles: at most this many warps (N = 8192, bf16: 16 warps
    # 69% of copy, 8 warps 84-90%: fewer warps draw fewer duplicate Philox words).
    chunk_tile_bwd_max_warps: int = 8
    # Backward.
    max_fused_bwd: int = 8192  # widest row the single-kernel backward keeps in registers (x, dy, w and dx)
    bwd_tile: int = 4096  # elements per program iteration: several short rows at once
    bwd_elements_per_thread: int = 16  # 32 for rows up to bwd_narrow (4 warps per 4096-element tile)
    bwd_narrow: int = 2048
    bwd_loop_stages: int = 3  # pipelining of the row loop: 52-62% -> 81-88% of copy for N <= 8192
    programs_per_sm: int = 2  # two programs per SM hide each other's reduction and lock waits
    max_group_size_m: int = 64  # lock mode: partial-dW/dB buffers (about four programs per lock on 132 SMs)
    # Calls of at most this many elements give each program its own buffer instead (H100, M = 4096: 1.08-1.52x
    # up to N = 4096, where the programs all reach their locks at once and wait in turn; 0.97-1.01x at 8192, and
    # 0.98-1.00x at M * N = 2^27, where the extra buffers' traffic costs more than the waits).
    lock_free_max_elements: int = 1 << 24
    # Wide backward: a column block of one dropout chunk's width (the fused op's mask drawn in its layout),
    # one row per tile: x, dy, w and the dW/dB sums of 16 columns per thread fit 128 registers, two programs
    # per SM.
    wide_columns: int = 4096
    wide_rows: int = 1
    wide_warps: int = 8
    wide_programs_per_sm: int = 2  # registers capped so that this many are resident per SM (the grid's size)
    wide_exchange: bool = True  # one launch exchanging the row sums (False: two launches, x and dy read twice)
    dwdb_block_n: int = 64  # columns per program of the final dW/dB sum


SETTINGS = Settings()
_active = SETTINGS

#: Which forward wide rows take on a GPU: ``auto`` (default) and ``hopper`` take the Hopper kernel
#: (``kernels/layernorm/_hopper.py``) on sm_90 for every call it supports (it measured faster than the portable
#: chunked path at every width it takes), ``portable`` never. Read at each call (:func:`forced_path`).
PATH_ENV = "FUSED_KERNELS_LAYERNORM_PATH"


def path() -> str:
    """The kernel path calls take now (``PATH_ENV``; ``auto`` when unset)."""
    return kernel_path(PATH_ENV)


def forced_path(name: str) -> contextlib.AbstractContextManager[None]:
    """Inside the block, calls take kernel path ``name`` (``auto``, ``hopper`` or ``portable``)."""
    return forced_kernel_path(PATH_ENV, name)


@contextlib.contextmanager
def override(**changes) -> Iterator[Settings]:
    """Inside the block the kernels launch with ``changes`` applied to :data:`SETTINGS` (e.g.
    ``override(max_fused_fwd=64, chunk=32)`` to run the chunked forward on small rows in a test)."""
    global _active
    saved = _active
    _active = dataclasses.replace(saved, **changes)
    _clear_caches()
    forget_recorded_launches()  # eager calls replay launches recorded with the other settings
    try:
        yield _active
    finally:
        _active = saved
        forget_recorded_launches()
        _clear_caches()


def _clear_caches() -> None:
    for cached in (_forward_cached, _backward_cached, _add_dropout_norm_forward_cached, _fused_backward_plan_cached):
        cached.cache_clear()


def _forward(n) -> dict:
    s = _active
    if n > s.max_fused_fwd:
        return {"BLOCK_M": 1, "BLOCK_N": s.chunk, "SINGLE_PASS": False, "LOOP_STAGES": s.chunk_loop_stages,
                "num_warps": s.chunk_warps}
    block_n = next_pow2(n)
    block_m = max(1, min(64, s.fwd_tile // block_n))
    min_warps = 2 if block_n <= s.fwd_narrow else s.fwd_min_warps
    num_warps = max(min_warps, min(32, block_m * block_n // (32 * s.fwd_elements_per_thread)))
    for width, rows, warps in s.fwd_row_tiles:
        if width == block_n:
            block_m, num_warps = rows, warps
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "SINGLE_PASS": True, "LOOP_STAGES": 1, "num_warps": num_warps,
            "AFFINE_FIRST": block_n in s.fwd_affine_first}


def add_dropout_norm_forward(n, dropout: bool = True) -> dict:
    """Launch parameters of the fused residual + dropout + norm forward for rows of ``n``: ``SINGLE_PASS``
    (for the launcher) when the kernel normalises the rows itself, else it only writes residual_out, one
    row per program, and the chunked norm forward follows; ``CHUNK_TILE`` when each tile is whole dropout
    chunks (the one-pass kernel). One shared dict per plain-int ``n`` (never mutate it), as ``forward``."""
    return _add_dropout_norm_forward_cached(n, dropout) if type(n) is int else _add_dropout_norm_forward(n, dropout)


def _add_dropout_norm_forward(n, dropout: bool) -> dict:
    s = _active
    if n > s.max_fused_fwd:
        return {"BLOCK_M": 1, "BLOCK_N": 16, "SINGLE_PASS": False, "CHUNK_TILE": False, "num_warps": 4}
    block_n = next_pow2(n)
    min_warps = 2 if block_n <= s.fwd_narrow else s.fwd_min_warps

    def warps(block_m, per_thread=s.fwd_elements_per_thread):
        return max(min_warps, min(32, block_m * block_n // (32 * per_thread)))

    block_m = max(1, min(64, s.add_dropout_norm_row_tile // block_n))
    chunk_warps = warps(block_m, s.chunk_tile_elements_per_thread)
    if is_chunk_tile(n, block_m, block_n) and (not dropout or chunk_warps <= s.chunk_tile_max_warps):
        return {"BLOCK_M": block_m, "BLOCK_N": block_n, "SINGLE_PASS": True, "CHUNK_TILE": True,
                "num_warps": chunk_warps}
    block_m = max(1, min(64, s.add_dropout_norm_tile // block_n))
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "SINGLE_PASS": True, "CHUNK_TILE": False,
            "num_warps": warps(block_m)}


def is_chunk_tile(n, block_m: int, block_n: int) -> bool:
    """Whether ``block_m`` rows of ``n`` (tiles of ``block_n >= n`` columns, starting at multiples of
    ``block_m`` rows) are always whole dropout chunks: the kernels can then draw the mask in the tile's
    own layout."""
    return _active.dropout_chunk_tiles and block_n == n and (block_m * block_n) % DROPOUT_CHUNK == 0


def _backward(n) -> dict:
    s = _active
    block_n = next_pow2(n)
    block_m = max(1, min(64, s.bwd_tile // block_n))
    per_thread = 2 * s.bwd_elements_per_thread if block_n <= s.bwd_narrow else s.bwd_elements_per_thread
    num_warps = max(1, min(16, block_m * block_n // (32 * per_thread)))
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "LOOP_STAGES": s.bwd_loop_stages, "num_warps": num_warps}


_forward_cached = functools.cache(_forward)
_backward_cached = functools.cache(_backward)
_add_dropout_norm_forward_cached = functools.cache(_add_dropout_norm_forward)


def forward(n) -> dict:
    """Launch parameters of the forward for rows of ``n``: one shared dict per plain-int ``n`` (never mutate
    it); computed afresh for a symbolic ``n`` (torch.compile with dynamic shapes)."""
    return _forward_cached(n) if type(n) is int else _forward(n)


def forward_stream_hints(m, n, cfg: dict, elt_size: int, device_index: int = 0, *, l2_bytes: int | None = None) -> bool:
    """Whether a register-path forward of ``m`` rows of ``n`` marks its rows to leave L2 first (and w and b last):
    when x and y together fit in ``fwd_hints_l2_fraction`` of L2. False for the chunked path, which re-reads rows
    from L2, and for a symbolic ``m`` (torch.compile with dynamic shapes: no guard on the row count)."""
    if not cfg["SINGLE_PASS"] or type(m) is not int or type(n) is not int:
        return False
    l2_bytes = l2_cache_bytes(device_index) if l2_bytes is None else l2_bytes
    return 2 * m * n * elt_size <= _active.fwd_hints_l2_fraction * l2_bytes


def forward_programs(m: int, n: int, cfg: dict, elt_size: int, device_index: int = 0, *, sms: int | None = None,
                     l2_bytes: int | None = None) -> int:
    """Forward grid: a tile of rows per program; for the chunked path, persistent programs whose rows in
    flight fit in ``chunk_l2_fraction`` of L2 (at least one per SM). SM count and L2 size are the device's
    unless given."""
    tiles = cdiv(m, cfg["BLOCK_M"])
    if cfg["SINGLE_PASS"]:
        return tiles
    sms = multiprocessor_count(device_index) if sms is None else sms
    l2_bytes = l2_cache_bytes(device_index) if l2_bytes is None else l2_bytes
    fitting = int(l2_bytes * _active.chunk_l2_fraction) // (n * elt_size)
    return min(tiles, max(sms, fitting))


def hopper_forward(n: int, x_bytes: int, w_bytes: int, b_bytes: int, is_rms: bool) -> dict | None:
    """Launch parameters of the Hopper shared-memory-row forward for rows of ``n`` (elements of ``x_bytes``; w
    and b of ``w_bytes`` and ``b_bytes``, 0 where absent), or None where it does not apply: rows that fit in
    registers (the portable kernel is one pass there too), 32-bit rows, widths not a multiple of 16 bytes, and rows
    too wide for one program's shared memory (over 14 slots: 114688 16-bit elements). One program per SM
    (:func:`hopper_forward_programs`)."""
    s = _active
    if type(n) is not int or n <= s.max_fused_fwd or x_bytes != 2 or (n * x_bytes) % 16:
        return None
    chunk = s.hopper_chunk
    chunks = cdiv(n, chunk)
    slot = chunk * x_bytes
    spare = s.hopper_shared_bytes - chunks * slot
    if spare < 0:
        return None
    extra = min(chunks - 1, int(spare * s.hopper_rms_extra_fraction) // slot) if is_rms else 0
    affine = chunk * (w_bytes + b_bytes)
    resident = min(chunks, (spare - extra * slot) // affine) if affine else 0
    return {"CHUNK": chunk, "CHUNKS": chunks, "VEC": 16 // x_bytes, "EXTRA": extra, "AHEAD": 2,
            "RESIDENT": resident, "num_warps": s.hopper_warps}


def hopper_split_forward(n: int, x_bytes: int, w_bytes: int, b_bytes: int, is_rms: bool) -> tuple[dict, int] | None:
    """``(launch parameters, programs per SM)`` of the Hopper split-row forward for LayerNorm rows of ``n`` that
    :func:`hopper_forward` takes (and RMSNorm rows with ``hopper_split_rms_norm``), or None where the
    shared-memory-row kernel runs them. The grid is column blocks x lanes, every program resident at once:
    lanes = programs per SM x SMs // column blocks, at most the row count."""
    s = _active
    if not (s.hopper_split_rms_norm if is_rms else s.hopper_split_layer_norm):
        return None
    if hopper_forward(n, x_bytes, w_bytes, b_bytes, is_rms) is None:
        return None
    columns = s.hopper_split_columns
    col_blocks = cdiv(n, columns)
    per_program = columns * (s.hopper_split_ring * x_bytes + w_bytes + b_bytes)
    per_sm = min(s.hopper_split_programs_per_sm, s.hopper_shared_bytes // per_program)
    return {"BLOCK_N": columns, "COL_BLOCKS": col_blocks, "SHARES": next_pow2(col_blocks), "VEC": 16 // x_bytes,
            "RING": s.hopper_split_ring, "PUBLISH_AHEAD": min(s.hopper_split_publish_ahead, s.hopper_split_ring - 1),
            "num_warps": s.hopper_split_warps}, per_sm


#: Shared memory per ring slot of the Hopper backward besides the rows: the row's mean and rstd (fp32), which travel
#: with it.
HOPPER_BWD_STATS_BYTES = 8


def hopper_backward(n: int, x_bytes: int, dy_bytes: int, dres_bytes: int = 0) -> dict | None:
    """Launch parameters of the Hopper split-row backward (``kernels/layernorm/_hopper.py``) for rows of ``n`` of the
    wide path, with the grid of :func:`wide_backward`, or None where it does not apply (32-bit x, dy or dres, widths
    not a multiple of 16 bytes, a ring that would not fit ``wide_programs_per_sm`` programs' shared memory).
    ``dres_bytes``: the element size of the fused op's residual gradient, which travels in the ring too (0: none)."""
    s = _active
    if type(n) is not int or fused_backward(n) or x_bytes != 2 or dy_bytes != 2 or dres_bytes not in (0, 2) or n % 8:
        return None
    per_slot = s.wide_columns * (x_bytes + dy_bytes + dres_bytes) + HOPPER_BWD_STATS_BYTES
    ring = min(s.hopper_bwd_ring, (s.hopper_shared_bytes // s.wide_programs_per_sm) // per_slot)
    if ring < 2:
        return None
    col_blocks = cdiv(n, s.wide_columns)
    # registers capped so that wide_programs_per_sm programs fit (the fused op's dropout mask would take 171 at 8 warps)
    max_registers = min(255, REGISTERS_PER_SM // (s.wide_programs_per_sm * s.wide_warps * 32)) // 8 * 8
    return {"BLOCK_N": s.wide_columns, "COL_BLOCKS": col_blocks, "SHARES": next_pow2(col_blocks), "VEC": 8,
            "RING": ring, "PUBLISH_AHEAD": min(s.hopper_bwd_publish_ahead, ring - 1), "num_warps": s.wide_warps,
            "maxnreg": max_registers}


def lock_free_partials(m, n) -> bool:
    """Whether a single-kernel backward of ``m`` rows of ``n`` gives each program its own partial dW/dB buffer (the
    deterministic layout, no locks) although determinism was not asked for: small calls (plain ints only; a traced
    call with symbolic sizes keeps the locks)."""
    return type(m) is int and type(n) is int and m * n <= _active.lock_free_max_elements


def fused_backward(n) -> bool:
    """Whether rows of ``n`` take the single-kernel backward (else the wide, column-blocked one)."""
    return n <= _active.max_fused_bwd


def add_dropout_norm_backward(n) -> dict:
    """Launch parameters of the single-kernel backward when it applies a dropout mask (the fused residual +
    dropout + norm): ``CHUNK_TILE`` when its tiles are whole dropout chunks (at most
    ``chunk_tile_bwd_max_warps``), else the flat pass inside the row loop, which cannot be pipelined."""
    cfg = backward(n)
    if is_chunk_tile(n, cfg["BLOCK_M"], cfg["BLOCK_N"]):
        return {**cfg, "CHUNK_TILE": True, "num_warps": min(cfg["num_warps"], _active.chunk_tile_bwd_max_warps)}
    return {**cfg, "CHUNK_TILE": False, "LOOP_STAGES": 1}


def backward(n) -> dict:
    """Launch parameters of the single-kernel backward for rows of ``n`` (shared dict, as ``forward``)."""
    return _backward_cached(n) if type(n) is int else _backward(n)


def fused_backward_plan(m, n, dropout: bool, deterministic: bool, sms: int) -> tuple[dict, int, int, int]:
    """``(launch parameters, programs, rows per program, partial buffers)`` of the single-kernel backward for
    ``m`` rows of ``n``, with or without a dropout mask; cached for plain ints (the eager backward asks on every
    call: its Python was a sizeable part of the call's host time)."""
    if type(m) is int and type(n) is int:
        return _fused_backward_plan_cached(m, n, dropout, deterministic, sms)
    return _fused_backward_plan(m, n, dropout, deterministic, sms)


def _fused_backward_plan(m, n, dropout: bool, deterministic: bool, sms: int) -> tuple[dict, int, int, int]:
    cfg = add_dropout_norm_backward(n) if dropout else {**backward(n), "CHUNK_TILE": False}
    return cfg, *backward_grid(m, cfg, sms, deterministic)


_fused_backward_plan_cached = functools.lru_cache(maxsize=1024)(_fused_backward_plan)


def backward_grid(m: int, cfg: dict, sms: int, deterministic: bool) -> tuple[int, int, int]:
    """``(programs, rows per program, partial buffers)`` of the single-kernel backward."""
    tiles = cdiv(m, cfg["BLOCK_M"])
    programs = min(tiles, _active.programs_per_sm * sms)
    rows_per_program = cdiv(tiles, programs) * cfg["BLOCK_M"]
    programs = cdiv(m, rows_per_program)
    slots = programs if deterministic else min(programs, _active.max_group_size_m)
    return programs, rows_per_program, slots


def wide_backward(m: int, n: int, sms: int) -> tuple[int, int, bool, dict]:
    """``(column blocks, lanes, exchange, launch parameters)`` of the wide (split-row) backward: a grid of
    column blocks x lanes of row tiles, each lane writing its own partial buffer. ``exchange``: the one-launch
    form, whose programs wait for each other and so must all be resident at once (at most
    ``wide_programs_per_sm`` per SM; the kernel's registers are sized for that); otherwise two launches."""
    s = _active
    col_blocks = cdiv(n, s.wide_columns)
    capacity = s.wide_programs_per_sm * sms
    lanes = max(1, min(cdiv(m, s.wide_rows), capacity // col_blocks))
    exchange = s.wide_exchange and col_blocks <= capacity
    max_registers = min(255, REGISTERS_PER_SM // (s.wide_programs_per_sm * s.wide_warps * 32)) // 8 * 8
    return col_blocks, lanes, exchange, {"BLOCK_M": s.wide_rows, "BLOCK_N": s.wide_columns,
                                         "COL_BLOCKS": col_blocks, "SHARES": next_pow2(col_blocks),
                                         "num_warps": s.wide_warps, "maxnreg": max_registers}


def dwdb(n: int, slots: int) -> dict:
    """Launch parameters of the final dW/dB sum over ``slots`` partial buffers (grid: column blocks)."""
    block_n = min(_active.dwdb_block_n, next_pow2(n))
    return {"BLOCK_S": min(32, next_pow2(slots)), "BLOCK_N": block_n, "num_warps": 4}


def table(m: int = 4096, sms: int = 132, l2_bytes: int = 50 * 2**20, elt_size: int = 2) -> str:
    """What ``python -m kernels.layernorm`` prints: the choices for a grid of widths at ``m`` rows (and at
    M·N = 2^27) on a GPU of ``sms`` SMs and ``l2_bytes`` of L2 (default: an H100/H200), 16-bit inputs."""
    lines = [f"{sms} SMs, {l2_bytes >> 20} MiB L2, {8 * elt_size}-bit inputs",
             f"{'M':>7} {'N':>6}  {'forward (rows/prog, block, warps) x programs':<58} backward"]
    for n in (256, 1024, 2048, 4096, 8192, 16384, 32768, 65536):
        for rows in sorted({m, 2**27 // n}):
            f = forward(n)
            fwd = (f"({f['BLOCK_M']}, {f['BLOCK_N']}, {f['num_warps']}w) x "
                   f"{forward_programs(rows, n, f, elt_size, sms=sms, l2_bytes=l2_bytes)}"
                   + ("" if f["SINGLE_PASS"] else " chunked") + (", wb first" if f.get("AFFINE_FIRST") else "")
                   + (", hints" if forward_stream_hints(rows, n, f, elt_size, l2_bytes=l2_bytes) else ""))
            if fused_backward(n):
                b = backward(n)
                programs, per_program, slots = backward_grid(rows, b, sms, deterministic=False)
                bwd = (f"({b['BLOCK_M']}, {b['BLOCK_N']}, {b['num_warps']}w) x {programs}, {per_program} rows each, "
                       f"{slots} locked buffers")
            else:
                cols, lanes, exchange, w = wide_backward(rows, n, sms)
                bwd = (f"wide: {cols} column blocks x {lanes} lanes of {w['BLOCK_M']}-row tiles, {w['num_warps']}w, "
                       f"{w['maxnreg']} registers"
                       + ("" if exchange else ", two launches"))
            lines.append(f"{rows:>7} {n:>6}  {fwd:<58} {bwd}")
    lines.append("sm_90, eager, 16-bit rows, w and b in x's dtype: LayerNorm split by columns (blocks x lanes, "
                 "ring of rows); RMSNorm the shared-memory forward (slots of CHUNK, extra ring slots, chunks with w "
                 "resident)")
    for n in (40000, 65536, 100000):
        split = hopper_split_forward(n, elt_size, elt_size, elt_size, False)
        rms = hopper_forward(n, elt_size, elt_size, 0, True)
        parts = []
        if split is not None:
            p, per_sm = split
            parts.append(f"LayerNorm: {p['COL_BLOCKS']} x {p['BLOCK_N']} columns x {per_sm * sms // p['COL_BLOCKS']} "
                         f"lanes, ring {p['RING']}, published {p['PUBLISH_AHEAD']} ahead, {p['num_warps']}w")
        if rms is not None:
            parts.append(f"RMSNorm: {rms['CHUNKS']} x {rms['CHUNK']}, {rms['EXTRA']} extra, {rms['RESIDENT']} "
                         f"resident, {rms['num_warps']}w")
        lines.append(f"{'':>7} {n:>6}  " + "; ".join(parts))
    bwd = hopper_backward(16384, elt_size, elt_size)
    if bwd is not None:
        lines.append(f"sm_90, eager, 16-bit x and dy, rows over {_active.max_fused_bwd}: the split-row backward with a "
                     f"ring of {bwd['RING']} rows, shares published {bwd['PUBLISH_AHEAD']} rows ahead, "
                     f"{bwd['num_warps']}w")
    return "\n".join(lines)
