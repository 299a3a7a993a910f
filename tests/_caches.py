"""KV-cache fixtures shared by the twin's tests and the kernels' tests."""

from __future__ import annotations

import torch


def paged_cache(cache: torch.Tensor, block_size: int, order: list[int], *, spare_pages: int = 0):
    """The contiguous (B, Hkv, S_max, D) cache cut into pages of ``block_size`` stored in the shuffled slots ``order``
    of a pool with ``spare_pages`` more slots at its end (NaN, like every slot no page fills); returns
    ``(pages, block_table)``, the table on the cache's device."""
    b, hkv, s_max, d = cache.shape
    per_seq = s_max // block_size
    pages = torch.full((b * per_seq + spare_pages, hkv, block_size, d), float("nan"), dtype=cache.dtype,
                       device=cache.device)
    table = torch.empty(b, per_seq, dtype=torch.int32)
    for i in range(b):
        for j in range(per_seq):
            slot = order[i * per_seq + j]
            pages[slot] = cache[i, :, j * block_size:(j + 1) * block_size]
            table[i, j] = slot
    return pages, table.to(cache.device)
