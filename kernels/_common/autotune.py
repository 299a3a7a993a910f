"""``@triton.autotune`` that runs exactly one config under the Triton interpreter.

The interpreter cannot time configs (it has no CUDA events), so under ``TRITON_INTERPRET=1`` only the
``interpreter_config`` (default: the first config) is kept; Triton's autotuner skips benchmarking and
pruning when it holds a single config. Kernels therefore list first a config that is valid for every
input. On a GPU all configs are kept and the tuned choice can be cached across processes
(``cache_results=True``, Triton's on-disk autotune cache).
"""

from __future__ import annotations

from collections.abc import Sequence

import triton

from kernels._common.runtime import INTERPRETER


def autotune(
    configs: Sequence[triton.Config],
    key: Sequence[str],
    *,
    interpreter_config: triton.Config | None = None,
    interpreter: bool | None = None,
    **autotune_kwargs,
):
    """Drop-in for ``triton.autotune(configs=..., key=...)`` that is safe under the interpreter.

    ``interpreter`` overrides the detected mode (for tests of this helper).
    """
    if not configs:
        raise ValueError("autotune needs at least one config")
    interpreting = INTERPRETER if interpreter is None else interpreter
    if interpreting:
        chosen = [interpreter_config if interpreter_config is not None else configs[0]]
        autotune_kwargs.pop("prune_configs_by", None)
        autotune_kwargs.pop("cache_results", None)
        return triton.autotune(configs=chosen, key=list(key), **autotune_kwargs)
    return triton.autotune(configs=list(configs), key=list(key), **autotune_kwargs)
