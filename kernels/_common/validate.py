"""Argument checks shared by every family's public entry points.

Each check raises ``TypeError`` (wrong kind of thing) or ``ValueError`` (right kind, wrong value) with a
message that names the argument and says what was expected, so a user never meets a Triton compile
error or a silently wrong answer.
"""

from __future__ import annotations

import math
import os

import torch
import torch.autograd.forward_ad as forward_ad
from torch.fx.experimental.symbolic_shapes import guard_scalar

#: dtypes the Triton kernels take (fp32 accumulation inside).
KERNEL_DTYPES: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16, torch.float32)
#: dtypes the public functions take: the kernels' and float64, which runs the twin on every device
#: (``kernels._common.runtime.backend_for``), as torch's own ops accept it.
FLOAT_DTYPES: tuple[torch.dtype, ...] = (*KERNEL_DTYPES, torch.float64)


def _dtype_names(dtypes) -> str:
    return ", ".join(str(d).replace("torch.", "") for d in dtypes)


def check_tensor(name: str, value) -> torch.Tensor:
    """``value`` must be a ``torch.Tensor``, and not a dual tensor of forward-mode AD: the ops have no jvp, and a
    call that needs no autograd node would otherwise return a result without its tangent."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if forward_ad._current_level >= 0 and forward_ad.unpack_dual(value).tangent is not None:
        raise NotImplementedError(f"{name} is a dual tensor (forward-mode AD): fused-kernels ops have no jvp; "
                                  "compute them outside torch.autograd.forward_ad.dual_level, or use reverse mode")
    return value


def check_float_dtype(name: str, t: torch.Tensor, allowed: tuple[torch.dtype, ...] = FLOAT_DTYPES) -> None:
    """``t`` must have one of the floating dtypes the kernels support."""
    check_tensor(name, t)
    if t.dtype not in allowed:
        what = "have" if t.is_floating_point() else "be a floating-point tensor with"
        raise TypeError(f"{name} must {what} dtype in ({_dtype_names(allowed)}), got {t.dtype}")


def check_same_device(**tensors: torch.Tensor | None) -> None:
    """All given (non-None) tensors must live on one device."""
    named = [(n, t) for n, t in tensors.items() if t is not None]
    if not named:
        return
    first_name, first = named[0]
    for name, t in named[1:]:
        if t.device != first.device:
            raise ValueError(
                f"{name} is on {t.device} but {first_name} is on {first.device}: all tensors must be on "
                f"one device"
            )


def concrete_scalar(value):
    """``value`` itself, or the value of a symbolic number: torch.compile turns a float or int argument
    that changed between calls into a ``SymFloat``/``SymInt`` ("automatic dynamic"). Our kernels take
    integers derived from such numbers (a dropout keep threshold, Philox key words), so they are
    specialised with a guard: a new value recompiles instead of flowing through as an expression."""
    if isinstance(value, (int, float, torch.SymFloat, torch.SymInt)) and not isinstance(value, bool):
        return guard_scalar(value)  # while dynamo traces, a symbolic float passes ``isinstance(_, float)``
    return value


def check_probability(name: str, p, *, allow_one: bool) -> float:
    """``p`` must be a real number in [0, 1] (or [0, 1) when ``allow_one`` is False); NaN is refused."""
    p = concrete_scalar(p)
    if isinstance(p, bool) or not isinstance(p, (int, float)):
        raise TypeError(f"{name} must be a float, got {type(p).__name__}")
    p = float(p)
    upper_ok = p <= 1.0 if allow_one else p < 1.0
    if math.isnan(p) or p < 0.0 or not upper_ok:
        interval = "[0, 1]" if allow_one else "[0, 1)"
        raise ValueError(f"{name} must be in {interval}, got {p}")
    return p


def check_finite_number(name: str, value, *, minimum: float | None = None) -> float:
    """``value`` must be a real, finite number (and ``>= minimum`` when given); returns it as a float."""
    value = concrete_scalar(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a float, got {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value) or (minimum is not None and value < minimum):
        bound = f"a finite number >= {minimum}" if minimum is not None else "a finite number"
        raise ValueError(f"{name} must be {bound}, got {value}")
    return value


def check_seed(name: str, seed) -> int | None:
    """``seed`` must be None or an integer in [0, 2**64)."""
    if seed is None:
        return None
    seed = concrete_scalar(seed)
    if isinstance(seed, torch.Tensor) and seed.numel() == 1 and not seed.is_floating_point():
        seed = int(seed.item())
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"{name} must be None or an int, got {type(seed).__name__}")
    if not 0 <= seed < 2**64:
        raise ValueError(f"{name} must be in [0, 2**64), got {seed}")
    return seed


#: ``FUSED_KERNELS_CHECK_INDICES=1``: index tensors of CUDA calls (cumulative lengths, cache lengths, block tables)
#: are read back and checked, as those of CPU calls always are.
CHECK_INDICES_ENV = "FUSED_KERNELS_CHECK_INDICES"


def indices_checked(device: torch.device) -> bool:
    """Whether a call on ``device`` reads its index tensors back and checks them: always off CUDA (they are on the
    host already), on CUDA only when ``FUSED_KERNELS_CHECK_INDICES=1`` is set (read at each call; a check waits for
    the GPU)."""
    return device.type != "cuda" or os.environ.get(CHECK_INDICES_ENV, "0") == "1"
