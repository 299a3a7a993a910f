"""``python -m kernels._native``: build the compiled eager tier's extension now, into torch's extension cache
(``TORCH_EXTENSIONS_DIR``), so that a process finds it built: its first calls then take the tier instead of the
Python path while a background build runs. Exit status 1 when it cannot be built."""

from __future__ import annotations

import sys

import kernels._native as native_tier

built = native_tier.module()
if built is None:
    print("the compiled eager tier could not be built here (a C++ compiler and ninja are needed)", file=sys.stderr)
    sys.exit(1)
print(f"built {built.__name__}: {built.__file__}")
