"""Where the test and benchmark suites (and the tools in ``scripts/``) run the kernels: picked once, before
anything imports triton. Import it first; ``kernels/__init__.py`` imports nothing, so this is safe.

- ``cuda``: a CUDA GPU is present. Kernels compile for it; the full shape and dtype grid runs.
- ``interpreter``: no GPU. ``TRITON_INTERPRET=1`` is set here, before triton is imported, so every
  ``@triton.jit`` kernel runs in the Triton interpreter on CPU tensors; shapes are small and tests marked
  ``cuda`` are skipped. bf16 is tested too: the launchers run the interpreter's bf16 matrix products in fp32
  (numpy has no bf16; ``kernels._common.runtime.interpreter_needs_fp32``).

``FUSED_KERNELS_TEST_MODE=interpreter`` forces the interpreter on a GPU machine (as does an explicit
``TRITON_INTERPRET=1``); ``FUSED_KERNELS_TEST_MODE=cuda`` on a machine without a GPU is an error.
The test suite, the benchmark suite and the tools import this module, so all choose the same way.
"""

from __future__ import annotations

import os
import sys

import torch

_forced = os.environ.get("FUSED_KERNELS_TEST_MODE", "").strip().lower()
if _forced not in ("", "cuda", "interpreter"):
    raise RuntimeError(f"FUSED_KERNELS_TEST_MODE must be 'cuda' or 'interpreter', got {_forced!r}")
_interpret_env = os.environ.get("TRITON_INTERPRET", "0").strip().lower() in {"1", "true", "yes", "on", "y"}

if _forced == "cuda" and not torch.cuda.is_available():
    raise RuntimeError("FUSED_KERNELS_TEST_MODE=cuda but torch sees no CUDA device")
if _forced == "interpreter" or _interpret_env or not torch.cuda.is_available():
    MODE = "interpreter"
else:
    MODE = "cuda"

INTERPRETER: bool = MODE == "interpreter"
DEVICE: str = "cpu" if INTERPRETER else "cuda"

if INTERPRETER:
    if "triton" in sys.modules and not _interpret_env:
        raise RuntimeError(
            "triton was imported before the test mode was chosen; the interpreter can no longer be "
            "switched on. Set TRITON_INTERPRET=1 in the environment."
        )
    os.environ["TRITON_INTERPRET"] = "1"


def by_mode(*, interpreter, cuda):
    """The interpreter's value in interpreter mode, the CUDA value otherwise (shapes, grids, dtypes)."""
    return interpreter if INTERPRETER else cuda


#: the floating dtypes the kernels take, tested in both modes
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
