"""Pure-PyTorch twins of the kernels: the same math, written to be read.

Rule: nothing here imports ``kernels`` or ``triton``; a twin that shares code with the kernel proves
nothing. ``import reference`` gives ``reference.dropout``, ``reference.layernorm``,
``reference.attention``.
"""

from reference import attention, dropout, layernorm

__all__ = ["attention", "dropout", "layernorm"]
