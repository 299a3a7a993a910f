"""Shared test setup: the mode (CUDA or interpreter) is chosen in ``kernels/_mode.py`` before triton is
imported; this file exposes it as fixtures and skips ``cuda``-marked tests in interpreter mode."""

from __future__ import annotations

import faulthandler
import os
import signal

import pytest
import torch

import kernels._mode  # noqa: F401  (must run before anything imports triton)
import kernels._native as native_tier
from kernels._mode import DEVICE, INTERPRETER, MODE


def _dump_stacks_on_sigterm():
    """``FK_STACKS_FILE=path``: a test process ended by SIGTERM (the GPU script's shard limit) first writes every
    thread's stack there, so that a shard stuck outside a test (session start, collection), where pytest's own
    timeout does not look, says where it was."""
    path = os.environ.get("FK_STACKS_FILE")
    if not path or not hasattr(faulthandler, "register"):
        return None
    stacks = open(path, "w")  # noqa: SIM115  (held open for the life of the process)
    faulthandler.register(signal.SIGTERM, file=stacks, all_threads=True, chain=True)
    return stacks


_STACKS = _dump_stacks_on_sigterm()


def pytest_sessionstart(session):
    native_tier.prepare()  # with FUSED_KERNELS_NATIVE=1, built before the first call rather than beside it


def pytest_report_header(config):
    name = torch.cuda.get_device_name() if not INTERPRETER else "CPU tensors, TRITON_INTERPRET=1"
    return f"fused-kernels test mode: {MODE} ({name}); torch {torch.__version__}"


def _shard(items):
    """``FK_TEST_SHARD=i/n`` keeps every n-th collected test from the i-th: the GPU script runs n
    processes side by side (compiling is CPU-bound), and round robin spreads the slow-to-compile
    cases (fp32, wide heads) evenly instead of leaving them to one shard. ``FK_TEST_FROM=k`` first drops
    the first k collected tests, so that a suite longer than one run's time limit resumes where it stopped."""
    items = items[int(os.environ.get("FK_TEST_FROM", "0")):]
    spec = os.environ.get("FK_TEST_SHARD")
    if not spec:
        return items
    index, count = (int(part) for part in spec.split("/"))
    if not 0 <= index < count:
        raise pytest.UsageError(f"FK_TEST_SHARD={spec!r}: expected i/n with 0 <= i < n")
    return [item for position, item in enumerate(items) if position % count == index]


def pytest_collection_modifyitems(config, items):
    items[:] = _shard(items)
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


_SHARDED_ON_A_GPU = bool(os.environ.get("FK_TEST_SHARD")) and not INTERPRETER


@pytest.fixture(autouse=True)
def _release_cached_gpu_memory():
    """Shards side by side on one GPU (``FK_TEST_SHARD``) give their freed memory back after each test: torch's
    caching allocator would otherwise keep each process's peak (4-8 GB of 16 processes on an 80 GB H100, where tests
    of large rows then failed with out-of-memory errors)."""
    yield
    if _SHARDED_ON_A_GPU and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
