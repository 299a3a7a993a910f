"""Peer implementations shared by the benchmarks and the measurement scripts."""

from __future__ import annotations

import torch.nn.functional as F

SDPA_BACKENDS = ("sdpa-flash", "sdpa-cudnn", "sdpa-efficient")


def sdpa_attention(provider: str, causal: bool, dropout_p: float = 0.0, enable_gqa: bool = False):
    """``F.scaled_dot_product_attention`` forced onto one backend (``provider`` in ``SDPA_BACKENDS``); with
    ``enable_gqa`` K/V may have fewer heads than Q (SDPA's native grouped-query attention). A backend that cannot
    take the inputs raises ``RuntimeError`` ("No available kernel")."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = {"sdpa-flash": SDPBackend.FLASH_ATTENTION, "sdpa-cudnn": SDPBackend.CUDNN_ATTENTION,
               "sdpa-efficient": SDPBackend.EFFICIENT_ATTENTION}[provider]

    def run(q, k, v):
        with sdpa_kernel(backend):
            if enable_gqa:
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal, dropout_p=dropout_p, enable_gqa=True)
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, dropout_p=dropout_p)

    return run
