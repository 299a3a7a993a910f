"""fused-kernels: Triton kernels for dropout, LayerNorm/RMSNorm and FlashAttention-2.

Import one family at a time: ``kernels.dropout``, ``kernels.layernorm``, ``kernels.attention``.
(The import name ``kernels`` is also used by an unrelated PyPI package; this one is distributed as
``fused-kernels``.)
"""

__version__ = "0.1.0"


def replace_modules(model, **kwargs):
    """Make ``nn.LayerNorm``/``nn.RMSNorm``/``nn.Dropout`` inside ``model`` compute with the fused kernels,
    in place, keeping every parameter, hook and tie; returns ``{name: torch class}`` of what it replaced
    (see :func:`kernels.swap.replace_modules`)."""
    from kernels.swap import replace_modules as _replace_modules

    return _replace_modules(model, **kwargs)
