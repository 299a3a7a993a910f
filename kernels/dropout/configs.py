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


def table() -> str:
    """What ``python -m kernels.dropout`` prints."""
    from reference.dropout import LANE_STRIDE

    return (f"every size and dtype: {CHUNKS_PER_PROGRAM} chunk of {4 * LANE_STRIDE} elements per program, "
            f"{NUM_WARPS} warps")
