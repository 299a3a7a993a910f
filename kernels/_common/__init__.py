"""Mechanics shared by every kernel family: interpreter detection and device dispatch, the
argument checks and the plans that run them once per call signature (``eager``), the Philox generator, seeds and
the ``torch.library`` namespace."""

from kernels._common.autocast import autocast_cast
from kernels._common.launch import (
    cdiv,
    kernel_for,
    l2_cache_bytes,
    multiprocessor_count,
    nothing_to_launch,
    unused_pointer,
)
from kernels._common.runtime import (
    INTERPRETER,
    backend_for,
    cpu_runs_reference,
    interpreter_needs_fp32,
    interpreter_requested,
    is_fake,
)
from kernels._common.seed import Seed, device_seed, draw_seed, seed_for_call, splitmix64
from kernels._common.validate import (
    FLOAT_DTYPES,
    check_finite_number,
    check_float_dtype,
    check_probability,
    check_same_device,
    check_seed,
    check_tensor,
)

#: Every public op is registered as ``torch.ops.fused_kernels.<name>``.
LIBRARY_NAMESPACE = "fused_kernels"

__all__ = [
    "FLOAT_DTYPES",
    "INTERPRETER",
    "LIBRARY_NAMESPACE",
    "Seed",
    "autocast_cast",
    "backend_for",
    "cdiv",
    "check_finite_number",
    "check_float_dtype",
    "check_probability",
    "check_same_device",
    "check_seed",
    "check_tensor",
    "cpu_runs_reference",
    "device_seed",
    "draw_seed",
    "interpreter_needs_fp32",
    "interpreter_requested",
    "is_fake",
    "kernel_for",
    "l2_cache_bytes",
    "multiprocessor_count",
    "nothing_to_launch",
    "seed_for_call",
    "splitmix64",
    "unused_pointer",
]
