"""Shared test setup: the mode (CUDA or interpreter) is chosen in ``tests/_mode.py`` before triton is
imported; this file exposes it as fixtures and skips ``cuda``-marked tests in interpreter mode."""

from __future__ import annotations

import pytest
import torch

from tests import _mode  # noqa: F401  (must run before anything imports triton)
from tests._mode import DEVICE, INTERPRETER, MODE


def pytest_report_header(config):
    name = torch.cuda.get_device_name() if not INTERPRETER else "CPU tensors, TRITON_INTERPRET=1"
    return f"fused-kernels test mode: {MODE} ({name}); torch {torch.__version__}"


def pytest_collection_modifyitems(config, items):
    if not INTERPRETER:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (interpreter mode)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def device() -> torch.device:
    """The device the kernels are tested on: ``cuda`` on a GPU machine, ``cpu`` under the interpreter."""
    return torch.device(DEVICE)


@pytest.fixture(scope="session")
def interpreter() -> bool:
    """True when the kernels run in the Triton interpreter."""
    return INTERPRETER


@pytest.fixture(autouse=True)
def _fresh_seed():
    """Every test starts from the same torch RNG state, so a failure reproduces."""
    torch.manual_seed(0)
    yield
