"""Launch configuration of the dropout kernel, and why.

One program per ``CHUNKS_PER_PROGRAM`` chunks of ``4 * LANE_STRIDE`` elements (four runs of 1024, one per
Philox word), ``NUM_WARPS`` warps each. The same for every size and dtype: a run of 1024 elements over
128 threads is 8 elements per thread per load, 16-byte accesses in fp16/bf16 and two of them in fp32.
The sweep behind it is in the family's ``TUNING.md``.

Print it::

    python -m kernels.dropout
"""

from __future__ import annotations

#: Chunks of ``4 * LANE_STRIDE`` elements per program. Two chunks lost 2-18% at n = 2^27.
CHUNKS_PER_PROGRAM = 1
#: Warps per program. 4 warps: 92% of copy in fp16, 93% in fp32 at n = 2^27; 2 and 8 warps no better.
NUM_WARPS = 4
#: A transposed view's tile (``_dropout_columns_kernel``) by element size: rows along the contiguous direction x
#: lanes of each of a chunk's four runs. 512 bytes per column in 16-bit types (256 rows) and 256 in fp32 (64 rows).
#: H100, (8192, 16384).t(), 7 interleaved rounds, GB/s: bf16 2,431 with (64, 32), 2,578 with (128, 16), 2,658 with
#: (256, 16); fp16 2,148, 2,577, 2,666; fp32 2,903 with (64, 32), 2,893 with (128, 16), 1,453 with (256, 16).
COLUMNS_TILE: dict[int, tuple[int, int]] = {2: (256, 16), 4: (64, 32)}


def table() -> str:
    """What ``python -m kernels.dropout`` prints."""
    from reference.dropout import LANE_STRIDE

    tiles = ", ".join(f"{8 * size}-bit {r} rows x {j} lanes" for size, (r, j) in COLUMNS_TILE.items())
    return (f"every size and dtype: {CHUNKS_PER_PROGRAM} chunk of {4 * LANE_STRIDE} elements per program, "
            f"{NUM_WARPS} warps; transposed views: {tiles} of each of a chunk's four runs")
