"""fused-kernels: Triton kernels for dropout, LayerNorm/RMSNorm and FlashAttention-2.

Import one family at a time: ``kernels.dropout``, ``kernels.layernorm``, ``kernels.attention``.
(The import name ``kernels`` is also used by an unrelated PyPI package; this one is distributed as
``fused-kernels``.)
"""

__version__ = "0.1.0"
