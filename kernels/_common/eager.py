"""Checked call plans: an eager op checks a call signature's arguments once, not on every call.

A public op's eager call spends host time on Python that depends only on what its arguments are, not on their
data: argument checks, the values derived from them (the window of an attention call, the norm's eps, the
autocast dtype, whether an autograd node is needed). Inside a training step that Python costs 2-3x what it costs
at a tiny size in isolation (docs/host-cost.md), and torch's own ops do the same work in C++.

So an op's first eager call with a given *plan key* runs the checks and stores what they derived (its *plan*),
and later calls with the same key take the plan without checking again. The key holds everything the checks and
the derived values read: each tensor argument's type, shape, dtype, device and ``requires_grad``, every other
argument with its type (``True == 1`` in a dict key; the checks refuse a bool where a number is due), the grad
mode and the autocast state. A call whose arguments the checks refuse stores no plan, so it raises every time.
The kernel-path switch of a family that has one (attention, layernorm) is in the key too, and for attention the
Hopper tables' version: no check reads them, but the compiled tier (``kernels._native``) runs a plan's calls through
one program, which holds one path's launches and one set of tiles.
Values that change per call (the seed) are not in the key and are checked per call; flags that are not plain bools
(read with ``bool()``) and windows that are not tuples of ints take the checks every time (:func:`plannable`).

Limits: plans apply to eager calls only (not while torch.compile traces, not under a functorch transform such as
``vmap``, which needs ``autograd.Function.apply``'s own path, nor inside a forward-mode AD level, whose dual tensors
the checks refuse); ``FUSED_KERNELS_EAGER_PLANS=0`` turns them off, so that every call checks its arguments (to rule
them in or out when chasing a bug, and to time them).
"""

from __future__ import annotations

import os

import torch
import torch.autograd.forward_ad as forward_ad

#: ``FUSED_KERNELS_EAGER_PLANS=0``: no plans (every eager call checks its arguments anew)
EAGER_PLANS = os.environ.get("FUSED_KERNELS_EAGER_PLANS", "1") == "1"

_functorch_active = torch._C._are_functorch_transforms_active


def plans_apply() -> bool:
    """Whether this call may take or store a plan: plans on, eager, no functorch transform and no forward-mode AD
    level active (whose dual tensors the checks refuse, and a plan's key does not tell apart)."""
    return (EAGER_PLANS and forward_ad._current_level < 0 and not torch.compiler.is_compiling()
            and not _functorch_active())


_SEED_LIMIT = 1 << 64


def plannable(seed, *flags) -> bool:
    """Whether a call with this ``seed`` and these boolean ``flags`` may take or store a plan: the seed None or a
    plain int in [0, 2**64) (checked here, as it changes from call to call), each flag a plain bool (anything else
    is read with ``bool()`` per call by the checks, and may not keep its value)."""
    if not (seed is None or (type(seed) is int and 0 <= seed < _SEED_LIMIT)):
        return False
    return all(type(flag) is bool for flag in flags)


def tensor_key(t) -> tuple | type | None:
    """What a plan reads of an optional tensor argument: type, shape, dtype, device, ``requires_grad``. For
    anything but a tensor or None, its type: the checks refuse it, so no plan is ever stored under such a key."""
    if t is None:
        return None
    if isinstance(t, torch.Tensor):
        return type(t), t.shape, t.dtype, t.device, t.requires_grad
    return type(t)


def autocast_key(device_type: str) -> torch.dtype | None:
    """The autocast dtype in force for ``device_type``, or None when autocast is off there."""
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None


class PlanCache:
    """Plans of one op, by plan key. Emptied when it grows past ``limit`` entries (arguments that change every
    call: the checks then run as without plans, plus one dict insertion)."""

    def __init__(self, limit: int = 256):
        self._entries: dict = {}
        self._limit = limit

    def get(self, key):
        """The plan stored under ``key``; None when there is none, and for keys that cannot be hashed (an argument
        of the wrong kind, such as a list: the checks then refuse it)."""
        try:
            return self._entries.get(key)
        except TypeError:
            return None

    def put(self, key, plan) -> None:
        if key is None:
            return
        try:
            hash(key)
        except TypeError:
            return
        if len(self._entries) >= self._limit:
            self._entries.clear()
        self._entries[key] = plan

    def clear(self) -> None:
        self._entries.clear()


def function_apply(function: type[torch.autograd.Function]):
    """``function.apply`` without the Python wrapper of ``autograd.Function.apply`` around torch's C ``apply``, for
    calls where :func:`plans_apply` holds.

    The wrapper binds default arguments (needed only for Functions with a ``setup_context``) and unwraps dead
    functorch wrappers (needed only under a functorch transform, which :func:`plans_apply` rules out). Skipping it
    saves ~4 us per call on a CPU (16.9 against 12.7 us for a Function of 5 arguments that allocates its two
    outputs)."""
    if function.setup_context is not torch.autograd.Function.setup_context:
        raise TypeError(f"{function.__name__} has a setup_context: its apply must bind default arguments")
    return torch._C._FunctionBase.__dict__["apply"].__get__(None, function)
