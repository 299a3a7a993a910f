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


def kvcache_calls(shape, dtype, device, *, paged: bool, append: bool, scales=None) -> list:
    """Calls of ``flash_attention_with_kvcache`` of one signature (same shapes, strides and arguments) with their own
    data, lengths and page orders, one per entry of ``shape``'s lengths: a first call that checks its arguments and
    records its launches, then calls that take the stored plan and replay them. ``shape``: (Hq, Hkv, Sq, lengths per
    call, S_max, D); ``scales``: an FP8 cache's (k_scale, v_scale), or None for a cache in ``dtype``. Returns each
    call's output, log-sum-exp and caches after it (FP8 ones as their bytes)."""
    import reference.attention as twin
    from kernels.attention import flash_attention_with_kvcache

    hq, hkv, sq, lengths, s_max, d = shape
    out = []
    for step, seqlens in enumerate(lengths):
        g = torch.Generator().manual_seed(step)
        b = len(seqlens)
        q = torch.randn(b, hq, sq, d, generator=g).to(device, dtype)
        k_cache, v_cache = (torch.randn(b, hkv, s_max, d, generator=g).to(device, dtype) for _ in range(2))
        k, v = (torch.randn(b, hkv, sq, d, generator=g).to(device, dtype) if append else None for _ in range(2))
        kwargs = {}
        if scales is not None:
            heads = (1, hkv, 1, 1)
            k_cache, v_cache = (twin.quantize_fp8(c, twin.kv_scales(s, hkv, device).view(heads))
                                for c, s in ((k_cache, scales[0]), (v_cache, scales[1])))
            kwargs = {"k_scale": scales[0], "v_scale": scales[1]}
        if paged:
            order = torch.randperm(b * (s_max // 8), generator=g).tolist()
            (k_cache, kwargs["block_table"]), (v_cache, _) = (paged_cache(c, 8, order) for c in (k_cache, v_cache))
        lengths_t = torch.tensor(seqlens, dtype=torch.int32, device=device)
        o, lse = flash_attention_with_kvcache(q, k_cache, v_cache, lengths_t, k=k, v=v, return_lse=True, **kwargs)
        as_bytes = (lambda t: t.view(torch.uint8)) if scales is not None else (lambda t: t)
        out.append((o, lse, as_bytes(k_cache), as_bytes(v_cache)))
    return out
