"""Launch mechanics shared by every family's ops.

Each family exposes two paths to the same implementation: eager calls (a ``torch.autograd.Function``
that launches kernels directly) and the registered ``torch.library.triton_op``s that torch.compile
traces. Measured on the GPU machine (dropout README): in eager mode ``wrap_triton`` sends each launch
through a higher-order op costing ~300 us of host time, and ``triton.cdiv`` (itself a jit function)
~9 us, so launchers use :func:`kernel_for` and :func:`cdiv` from here.

Eager launches go through :class:`FastLauncher`: Triton 3.6's ``kernel[grid](...)`` spends ~28 us of
host time per launch on an H200 host (binding and specialising the arguments, building the cache key
string, launch-hook metadata, and a ``cuPointerGetAttribute`` driver call per tensor argument), several
times the memory time of a LayerNorm at M = 4096. The launcher keys its own cache of compiled kernels on
exactly what Triton specialises on and calls the compiled launcher directly (LayerNorm README, "Host
path"). Gluon kernels take their TMA arguments as :class:`TmaTensor` through the same launcher.

Even so, keying and converting ~40 arguments per launch in Python was most of an eager op's own host time. So an
op's first eager call with a given signature records its launches (:func:`launch_or_replay`, :class:`Recording`),
and later calls replay them (:class:`RecordedCall`) with their own tensors' addresses and per-call ints (the seed):
a list copy and the C launcher call per launch. The op states the signature: everything its launches depend on
besides those addresses and ints; a :class:`TmaTensor` over one of the op's tensors is made again over the later
call's tensor (its shape and strides are in the signature), its tensor map kept by address for the calls after.
Limits and the trade-off: a recording holds only tensors
the op names (and :func:`fixed_tensor` placeholders), so a call that launches on a tensor made inside it (a copy) is
never replayed; kernels must not specialise on the per-call ints (``do_not_specialize``); launch-table overrides and
kernel swaps call :func:`forget_recorded_launches`. Measured: docs/host-cost.md.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Iterator

import torch
from torch.library import wrap_triton
from triton import knobs

from kernels._common.runtime import INTERPRETER, is_fake

_I32_MIN, _I32_MAX, _U64_MIN = -(2**31), 2**31 - 1, 2**63


def int_key(value: int) -> tuple[bool, bool, int]:
    """What Triton specialises an int argument on: equal to 1, divisible by 16, and its width (i32, i64,
    u64). Finer than Triton for ``do_not_specialize`` arguments, which only costs a second cache entry."""
    width = 0 if _I32_MIN <= value <= _I32_MAX else (2 if value >= _U64_MIN else 1)
    return value == 1, value & 15 == 0, width


_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)
_GET_DEVICE = getattr(torch._C, "_cuda_getDevice", None)


def _current_raw_stream(device: int) -> int:
    """The current CUDA stream's handle (torch's C entry point: a ``torch.cuda.Stream`` object costs more)."""
    return _RAW_STREAM(device) if _RAW_STREAM is not None else torch.cuda.current_stream(device).cuda_stream


def current_stream_handle(device: torch.device) -> int:
    """The handle of ``device``'s current stream (0 off CUDA: the interpreter runs in program order)."""
    if device.type != "cuda":
        return 0
    return _current_raw_stream(device.index if device.index is not None else _current_device())


def _current_device() -> int:
    """The current CUDA device's index; torch's C entry point (``torch.cuda.current_device`` adds a Python
    lazy-init check, and CUDA is initialised by the time a launch has CUDA tensors to pass)."""
    return _GET_DEVICE() if _GET_DEVICE is not None else torch.cuda.current_device()


class TmaTensor:
    """A tensor that a Gluon kernel reads and writes through a TMA descriptor moving ``block_shape`` tiles: the
    argument our launchers pass where the kernel takes a ``TensorDescriptor``. It carries what Triton's launcher
    reads from a descriptor (base, shape, strides, padding) without the descriptor's per-call validation, and
    :class:`FastLauncher` keys it on what the kernel specialises on (dtype, block shape, shared layout). Every
    caller has checked the TMA rules already (16-byte aligned base and strides, contiguous last dim)."""

    __slots__ = ("base", "block_shape", "layout", "padding", "shape", "strides")

    def __init__(self, base: torch.Tensor, block_shape: tuple[int, ...], layout):
        self.base = base
        self.shape = base.shape
        self.strides = base.stride()
        self.block_shape = tuple(block_shape)
        self.layout = layout
        self.padding = "zero"

    @classmethod
    def slot(cls, block_shape: tuple[int, ...], layout) -> _TmaSlot:
        """A maker of this tile over any tensor (for launches replayed on later calls' tensors)."""
        return _TmaSlot(tuple(block_shape), layout)

    def descriptor(self):
        """The Gluon ``TensorDescriptor`` of the same tensor and tile, for Triton's own launch."""
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

        return TensorDescriptor(self.base, list(self.shape), list(self.strides), list(self.block_shape), self.layout)


class _TmaSlot:
    """A TMA tile (block shape, shared layout) to be laid over a later call's tensor. ``width``: the arguments that
    Triton's launcher wrapper makes of one such argument (its tensor map, then the tensor's shape and strides, of
    the tile's rank)."""

    __slots__ = ("block_shape", "layout", "width")

    def __init__(self, block_shape: tuple[int, ...], layout):
        self.block_shape, self.layout = block_shape, layout
        self.width = 1 + 2 * len(block_shape)

    def over(self, tensor: torch.Tensor) -> TmaTensor:
        return TmaTensor(tensor, self.block_shape, self.layout)


def _plain_launch(kernel, grid, args, kwargs):
    """Triton's own ``kernel[grid](...)``, with each :class:`TmaTensor` made a descriptor, on the first CUDA tensor's
    device (Triton launches on the current one)."""
    args = [arg.descriptor() if type(arg) is TmaTensor else arg for arg in args]
    device = _tensor_device(args)
    if device is not None and device != _current_device():
        with torch.cuda.device(device):
            return kernel[grid](*args, **kwargs)
    return kernel[grid](*args, **kwargs)


def _tensor_device(args) -> int | None:
    """The CUDA device index of the first CUDA tensor among ``args`` (a descriptor's base counts), or None."""
    for arg in args:
        tensor = arg if isinstance(arg, torch.Tensor) else getattr(arg, "base", None)
        if isinstance(tensor, torch.Tensor):
            return tensor.device.index if tensor.is_cuda else None
    return None


class FastLauncher:
    """``launcher[grid](*args, **constexprs)`` for one ``@triton.jit`` kernel, same call as the kernel's.

    The first call with a given specialisation goes through Triton (compiling if needed) and keeps the
    compiled kernel under a key built from what Triton specialises on: each tensor's dtype and 16-byte
    alignment, each int's :func:`int_key`, the constexprs and launch options, the device. Later calls
    pass tensors as raw addresses (so the launcher skips its per-pointer driver check: our ops have
    already checked that every tensor is a CUDA tensor on one device) straight to the compiled
    launcher on the current stream.

    Launches on the first tensor's GPU: when it is not the current device, that device is made current
    around the launch (the callers have checked that all their tensors share one device, so the first one
    stands for all), as torch's own ops run on their tensors' device whichever is current; the check is the
    comparison the cache key needs anyway, so calls on the current device pay nothing for it. Falls back to
    the plain Triton launch under the interpreter, when a launch hook is installed (a profiler such as
    proton must see every launch), and for arguments of any other kind. The cached path needs every run-time
    argument positional and every constexpr by keyword (kernels list their run-time parameters first); a
    call of another form works but takes the plain launch every time (``tests/test_common.py`` checks each
    family's calls).
    The loop below runs for every argument of every launch: it dispatches on exact types and inlines
    :func:`int_key` as flat key entries (no tuple per argument), because a Python function call per
    argument cost ~20 us per attention launch on the H200 host (a profiling script since removed), and
    the flat key builds and hashes in about 0.6x the time of per-argument tuples (41 arguments, timed on
    a CPU). Compiled kernels without scratch memory are launched through Triton's C launcher itself,
    skipping the Python wrapper around it (``CudaLauncher`` in Triton's NVIDIA driver), which only
    allocates scratch memory.
    """

    def __init__(self, kernel):
        self.kernel = kernel
        self._params = list(kernel.params)
        self._compiled: dict[tuple, tuple] = {}

    def __getitem__(self, grid):
        return functools.partial(self._launch, grid)

    def _launch(self, grid, *args, **kwargs):
        if _RECORDING[0] is not None:
            return self._record(grid, args, kwargs, _RECORDING[0])
        if callable(grid) or hooks_installed():
            return _plain_launch(self.kernel, grid, args, kwargs)
        device = _current_device()
        bound = self._key_and_values(device, args, kwargs)
        if bound is None:
            return _plain_launch(self.kernel, grid, args, kwargs)
        if type(bound) is int:  # the tensors are on another GPU: launch there, as torch's ops do
            with torch.cuda.device(bound):
                return self._launch(grid, *args, **kwargs)
        key, values = bound
        entry = self._compiled.get(key)
        if entry is None:
            compiled = _plain_launch(self.kernel, grid, args, kwargs)
            self._remember(key, compiled, len(args), kwargs)
            return compiled
        launch, function, leading, tail = entry
        g0, g1, g2 = _grid3(grid)
        launch(g0, g1, g2, _current_raw_stream(device), function, *leading, *values, *tail)
        return None

    @staticmethod
    def _key_and_values(device: int, args: tuple, kwargs: dict) -> tuple[tuple, list] | int | None:
        """The cache key of a launch (what Triton specialises on) and the values its compiled launcher takes; the
        tensors' device index when it is not ``device`` (the caller makes it current and launches again); None when
        the launch must take Triton's own path (an argument of another kind)."""
        key = [device]
        values = []
        device_checked = False
        for arg in args:
            kind = type(arg)
            if kind is int:
                # flat entries, no tuple per argument (the key is built and hashed on every launch): an i32 is
                # 2 (equal to 1), True (divisible by 16) or False; a wider int a (divisible, width) pair
                if _I32_MIN <= arg <= _I32_MAX:
                    key.append(2 if arg == 1 else arg & 15 == 0)
                else:
                    key.append((arg & 15 == 0, 2 if arg >= _U64_MIN else 1))
                values.append(arg)
            elif kind is float or kind is bool:
                key.append(kind)
                values.append(arg)
            elif arg is None:  # an absent pointer: Triton makes it a constant
                key.append(None)
                values.append(None)
            elif isinstance(arg, torch.Tensor):
                if not device_checked:
                    if arg.device.index != device:
                        return arg.device.index if arg.is_cuda else None
                    device_checked = True
                address = arg.data_ptr()
                key.append(arg.dtype)  # a dtype entry is always followed by the alignment flag
                key.append(address & 15 == 0)
                values.append(address)
            elif kind is TmaTensor:
                if not device_checked:
                    if arg.base.device.index != device:
                        return arg.base.device.index if arg.base.is_cuda else None
                    device_checked = True
                key.append(arg.base.dtype)
                key.append(arg.block_shape)
                key.append(arg.layout)
                values.append(arg)  # Triton's launcher wrapper encodes the tensor map from it on every launch
            elif isinstance(arg, int) and not isinstance(arg, bool):  # an int subclass
                key.append(int_key(arg))
                values.append(int(arg))
            else:
                return None
        key.append(tuple(kwargs.items()))
        return tuple(key), values

    def _record(self, grid, args: tuple, kwargs: dict, recording: Recording):
        """Launch as usual, then add the launch to ``recording`` as a :class:`PreparedLaunch`; mark the recording
        failed when it cannot be replayed (it took Triton's own path, a tensor argument is neither one of the
        recording's tensors nor a :func:`fixed_tensor`, or one of them is not 16-byte aligned: the compiled kernel
        may assume the alignment it saw)."""
        _RECORDING[0] = None  # the launch itself, and anything it calls, runs as usual
        try:
            result = self._launch(grid, *args, **kwargs)
        finally:
            _RECORDING[0] = recording
        prepared = None
        if not (callable(grid) or hooks_installed()):
            device = _current_device()
            bound = self._key_and_values(device, args, kwargs)
            if type(bound) is int:  # launched on the tensors' GPU (see ``_launch``): its key is that device's
                device = bound
                bound = self._key_and_values(device, args, kwargs)
            entry = None if bound is None else self._compiled.get(bound[0])
            if entry is not None:
                prepared = self._prepared(entry, _grid3(grid), bound[1], args, device, recording)
        if prepared is None:
            recording.failed = True
        else:
            recording.launches.append(prepared)
        return result

    def _prepared(self, entry, grid, values, args, device, recording) -> PreparedLaunch | None:
        tensor_slots, tma_slots = [], []
        for position, arg in enumerate(args):
            if isinstance(arg, torch.Tensor):
                index = next((i for i, t in enumerate(recording.tensors) if t is arg), None)
                if index is not None:
                    if values[position] & 15:
                        return None
                    tensor_slots.append((position, index))
                elif id(arg) not in _FIXED_TENSORS:
                    return None
            elif type(arg) is TmaTensor:
                # over one of the recording's tensors: a replay makes the same tile over the call's own tensor
                # (shape and strides are part of the op's signature); the recorded one is not kept
                index = next((i for i, t in enumerate(recording.tensors) if t is arg.base), None)
                if index is None or arg.base.data_ptr() & 15:
                    return None
                tma_slots.append((position, index, arg.block_shape, arg.layout))
        names = [p.name for p in self._params[:len(args)]]
        int_slots = [(names.index(name), i) for i, name in enumerate(recording.int_names) if name in names]
        values = list(values)
        for position, *_ in tma_slots:
            values[position] = None
        return PreparedLaunch(entry, grid, values, tensor_slots, int_slots, device, tma_slots)

    def _remember(self, key, compiled, n_positional: int, kwargs: dict) -> None:
        """Cache ``compiled`` with the values of the parameters after the positional ones (constexprs, from
        the keywords or their defaults, in signature order), if the call had the expected form."""
        if compiled is None or any(p.is_constexpr for p in self._params[:n_positional]):
            return
        tail = []
        for p in self._params[n_positional:]:
            if not p.is_constexpr:
                return
            if p.name in kwargs:
                tail.append(kwargs[p.name])
            elif p.has_default:
                tail.append(p.default)
            else:
                return
        compiled._init_handles()
        # After (grid, stream, function): Triton's C launcher takes the cooperative-grid and PDL flags, the
        # scratch buffers, then what the Python wrapper takes (metadata, launch metadata, the enter and exit
        # hooks: None, none installed here). Kernels that need scratch memory keep the wrapper.
        runner = compiled.run
        direct = (getattr(runner, "global_scratch_size", None) == 0
                  and getattr(runner, "profile_scratch_size", None) == 0 and hasattr(runner, "launch"))
        launch, leading = runner, (compiled.packed_metadata, None, None, None)
        if direct:
            launch, leading = runner.launch, (runner.launch_cooperative_grid, runner.launch_pdl, None, None, *leading)
        self._compiled[key] = (launch, compiled.function, leading, tuple(tail))
        _COMPILED_BY_FUNCTION[compiled.function] = (compiled, [p.name for p in self._params])


def hooks_installed() -> bool:
    """Whether a launch hook is installed (a profiler such as proton): every launch must then go through Triton."""
    return bool(knobs.runtime.launch_enter_hook.calls or knobs.runtime.launch_exit_hook.calls)


def _grid3(grid) -> tuple[int, int, int]:
    return (grid[0], 1, 1) if len(grid) == 1 else (grid[0], grid[1], grid[2] if len(grid) > 2 else 1)


class PreparedLaunch:
    """One recorded launch, replayed with an op call's own tensors and per-call ints (:class:`Recording`): the
    compiled kernel, the grid and every other argument are the recorded ones, except TMA arguments, made again over
    the call's own tensors. A replay costs the C launcher call and a list copy, where a launch through
    :class:`FastLauncher` keys and converts every argument (~40 per attention launch) in Python.

    TMA arguments: Triton's launcher wrapper (``wrap_handle_tensordesc`` in its NVIDIA driver) walks every argument
    in Python and encodes each tensor map anew on every launch. Where the compiled launcher can be reached behind
    that wrapper, a replay expands the arguments itself, and keeps each slot's encoded tensor map by address (the
    map depends on the address, the shape, the strides and the tile, and the op's signature fixes all but the
    address): a later call on a tensor at an address seen before encodes nothing."""

    __slots__ = ("_device", "_entry", "_expanded", "_grid", "_int_slots", "_tensor_slots", "_tma_slots", "_values")

    def __init__(self, entry, grid, values, tensor_slots, int_slots, device, tma_slots=()):
        self._entry, self._grid, self._values = entry, grid, values
        self._tensor_slots, self._int_slots, self._device = tensor_slots, int_slots, device
        self._tma_slots = tuple(tma_slots)
        self._expanded = _ExpandedTmaLaunch.of(self) if self._tma_slots else None

    def native_form(self, tensors: tuple = ()) -> dict | None:
        """This launch as the compiled tier (``kernels/_native``) takes it: the kernel's CUfunction, grid, block and
        shared memory, each parameter Triton's launcher passes (``(type, recorded value)``: constexprs left out,
        pointers as ``"ptr"``, a TMA argument as ``"tma"`` then its shape and strides), which parameters take the
        call's tensors and ints, and how each tensor map is encoded (read off ``tensors``, the recorded call's, whose
        shapes and strides the op's signature fixes); None for what that tier does not replay (clusters,
        programmatic launch, a launcher wrapper of another kind, scratch memory, FP4 tensor maps)."""
        launch, function, leading, tail = self._entry
        compiled_and_names = _COMPILED_BY_FUNCTION.get(function)
        if compiled_and_names is None or len(leading) != 8:
            return None
        compiled, names = compiled_and_names
        cooperative, pdl, _, _, (num_warps, num_ctas, shared), *_ = leading
        if pdl or num_ctas != 1:
            return None
        tensordesc_meta = ()
        if self._tma_slots:
            unwrapped = _unwrap_tensordesc_launcher(launch)
            if unwrapped is None:
                return None
            launch, _, tensordesc_meta, _ = unwrapped
        if getattr(launch, "__self__", None) is None:  # a Python wrapper: it does work a replay would skip
            return None
        signature = compiled.src.signature
        tma_of = {position: index for position, index, *_ in self._tma_slots}
        params, param_of, tma = [], {}, []
        descriptors = iter(tensordesc_meta)
        for position, value in enumerate([*self._values, *tail]):
            kind = signature.get(names[position]) if position < len(names) else "constexpr"
            if kind is None or kind == "constexpr":
                continue
            if not isinstance(kind, str):
                return None
            if kind.startswith("tensordesc"):
                meta = next(descriptors, None)
                if position not in tma_of or tma_of[position] >= len(tensors) or meta is None or meta["fp4_padded"]:
                    return None
                tensor = tensors[tma_of[position]]
                tma.append(_tensor_map_form(tensor, tma_of[position], meta, len(params)))
                params.append(("tma", None))
                params += [("i32", size) for size in tensor.shape] + [("i64", stride) for stride in tensor.stride()]
                continue
            param_of[position] = len(params)
            params.append(("ptr" if kind.startswith("*") else kind, value))
        tensor_slots = [i for position, index in self._tensor_slots for i in (param_of[position], index)]
        int_slots = [i for position, index in self._int_slots if position in param_of
                     for i in (param_of[position], index)]
        return {"function": function, "grid": list(self._grid), "block": 32 * num_warps, "shared": shared,
                "cooperative": bool(cooperative), "params": params, "tensor_slots": tensor_slots,
                "int_slots": int_slots, "tma": tma, "device": self._device}

    def __call__(self, addresses: list, ints: tuple, tensors: tuple = ()) -> None:
        if self._expanded is not None:
            self._expanded(addresses, ints, tensors)
            return
        values = self._values.copy()
        for position, index in self._tensor_slots:
            values[position] = addresses[index]
        for position, index in self._int_slots:
            values[position] = ints[index]
        for position, index, block_shape, layout in self._tma_slots:
            values[position] = TmaTensor(tensors[index], block_shape, layout)
        launch, function, leading, tail = self._entry
        g0, g1, g2 = self._grid
        launch(g0, g1, g2, _current_raw_stream(self._device), function, *leading, *values, *tail)


#: encoded tensor maps kept per TMA argument of a prepared launch (addresses a caching allocator hands out again).
#: A model's layers share one prepared launch per shape, and the allocator hands each slot a few dozen addresses
#: over its steps: at 16 the maps of the GPT example (8 layers, d_model 1024) were emptied every step or two and
#: 14-42 maps encoded again per step, at 256 none after the first steps.
_TENSOR_MAPS_PER_SLOT = 256


class _ExpandedTmaLaunch:
    """A :class:`PreparedLaunch` with TMA arguments, launched through Triton's compiled launcher directly: the
    arguments laid out as Triton's wrapper would lay them out (each TMA argument as its tensor map, shape and
    strides), the tensor maps kept by address."""

    __slots__ = ("_device", "_encode", "_function", "_grid", "_int_slots", "_launch", "_leading", "_maps", "_meta",
                 "_template", "_tensor_slots", "_tma_slots")

    @classmethod
    def of(cls, prepared: PreparedLaunch) -> _ExpandedTmaLaunch | None:
        """The expanded form of ``prepared``, or None where Triton's wrapper is not the one this was written for
        (then the wrapper runs, as for a launch through :class:`FastLauncher`)."""
        launch, function, leading, tail = prepared._entry
        wrapped = _unwrap_tensordesc_launcher(launch)
        if wrapped is None:
            return None
        raw, tensordesc_indices, tensordesc_meta, encode = wrapped
        positions = sorted(position for position, *_ in prepared._tma_slots)
        if (sorted(tensordesc_indices) != positions or len(tensordesc_meta) != len(positions)
                or any(meta is None for meta in tensordesc_meta)):
            return None
        self = cls()
        self._launch, self._function, self._leading, self._device = raw, function, leading, prepared._device
        self._grid = prepared._grid
        meta_of = dict(zip(positions, tensordesc_meta, strict=True))
        # the argument list after the launcher's leading ones, each TMA argument widened to the width of its tensor
        # map, shape and strides (filled on every call); where each recorded value lands in it
        template, final = [], {}
        recorded = prepared._values + list(tail)
        tma_of = {position: (index, block_shape, layout)
                  for position, index, block_shape, layout in prepared._tma_slots}
        for position, value in enumerate(recorded):
            final[position] = len(template)
            if position in tma_of:
                template.extend([None] * TmaTensor.slot(*tma_of[position][1:]).width)
            else:
                template.append(value)
        self._template = template
        self._tensor_slots = tuple((final[position], index) for position, index in prepared._tensor_slots)
        self._int_slots = tuple((final[position], index) for position, index in prepared._int_slots)
        self._tma_slots = tuple((final[position], index, TmaTensor.slot(block_shape, layout))
                                for position, (index, block_shape, layout) in tma_of.items())
        self._meta = tuple(meta_of[position] for position in tma_of)
        self._maps = tuple({} for _ in tma_of)
        self._encode = encode
        return self

    def __call__(self, addresses: list, ints: tuple, tensors: tuple) -> None:
        args = self._template.copy()
        for at, index in self._tensor_slots:
            args[at] = addresses[index]
        for at, index in self._int_slots:
            args[at] = ints[index]
        for (at, index, slot), meta, maps in zip(self._tma_slots, self._meta, self._maps, strict=True):
            tensor = tensors[index]
            address = tensor.data_ptr()
            expanded = maps.get(address)
            if expanded is None:
                if len(maps) >= _TENSOR_MAPS_PER_SLOT:
                    maps.clear()
                expanded = self._encode(slot.over(tensor), meta)
                if len(expanded) != slot.width:  # a tensor whose rank is not its tile's: TMA has no such map
                    raise ValueError(f"TMA argument of rank {tensor.dim()} for a tile of rank {len(slot.block_shape)}")
                maps[address] = expanded
            args[at:at + slot.width] = expanded
        g0, g1, g2 = self._grid
        self._launch(g0, g1, g2, _current_raw_stream(self._device), self._function, *self._leading, *args)


def _tensor_map_form(tensor: torch.Tensor, index: int, meta: dict, param: int) -> dict:
    """How the compiled tier encodes the tensor map of a TMA parameter over tensor ``index`` of a call: what Triton's
    launcher passes to ``cuTensorMapEncodeTiled`` (``fill_tma_descriptor`` in its NVIDIA driver): the element type
    code, the swizzle, no out-of-bounds NaN fill (our tiles pad with zeros), the sizes and the tile innermost first,
    the strides in bytes innermost first without the innermost one."""
    from triton.backends.nvidia.driver import TMA_DTYPE_DEVICE_TO_HOST

    rank = tensor.dim()
    return {"param": param, "tensor": index, "elem_type": TMA_DTYPE_DEVICE_TO_HOST[meta["elem_type"]],
            "swizzle": meta["swizzle"], "fill": 0, "dims": list(reversed(tensor.shape)),
            "strides": [meta["elem_size"] * tensor.stride(i) for i in reversed(range(rank - 1))],
            "box": list(reversed(meta["block_size"]))}


def _unwrap_tensordesc_launcher(launch):
    """``(compiled launcher, tensordesc indices, tensordesc metadata, make_tensordesc_arg)`` behind Triton 3.6's
    ``wrap_handle_tensordesc`` wrapper ``launch``, or None when ``launch`` is not that wrapper."""
    code = getattr(launch, "__code__", None)
    if code is None or code.co_name != "inner" or launch.__closure__ is None:
        return None
    cells = dict(zip(code.co_freevars, (cell.cell_contents for cell in launch.__closure__), strict=True))
    needed = ("launcher", "tensordesc_indices", "tensordesc_meta")
    expand = launch.__globals__.get("make_tensordesc_arg")
    if any(name not in cells for name in needed) or expand is None:
        return None
    return cells["launcher"], cells["tensordesc_indices"], cells["tensordesc_meta"], expand


class Recording:
    """The launches of one op call, recorded to be replayed by later calls with the same signature.

    ``tensors``: every tensor the call's launches take (inputs, outputs, temporaries), in an order the op fixes;
    ``int_names``: the kernel parameters whose values change from call to call (seed words), in an order the op
    fixes. A launch that takes any other tensor (a copy made inside the call, say) fails the recording, unless
    the tensor is a :func:`fixed_tensor`, whose address is then part of the recording."""

    def __init__(self, tensors: tuple, int_names: tuple[str, ...] = ()):
        self.tensors, self.int_names = tensors, int_names
        self.launches: list[PreparedLaunch] = []
        self.failed = False

    def replay(self) -> RecordedCall | None:
        """What the recorded call launched, replayable; None when a launch could not be recorded."""
        return None if self.failed or not self.launches else RecordedCall(tuple(self.launches))


class RecordedCall:
    """The launches of a recorded op call, run again on a later call's tensors and per-call ints."""

    __slots__ = ("_launches",)

    def __init__(self, launches: tuple[PreparedLaunch, ...]):
        self._launches = launches

    def native_forms(self, tensors: tuple = ()) -> list[dict] | None:
        """Each launch's :meth:`PreparedLaunch.native_form` (``tensors``: a call's with this recording's signature);
        None when one has none."""
        forms = [launch.native_form(tensors) for launch in self._launches]
        return None if any(form is None for form in forms) else forms

    def __call__(self, tensors: tuple, ints: tuple = ()) -> bool:
        """Launch for ``tensors`` (same dtypes, shapes and strides as the recorded call's; None where it had
        None) and ``ints``; False, launching nothing, when it cannot run now (a launch hook is installed, the
        tensors are not on the current device, or one is not 16-byte aligned): the op then builds its launches
        anew."""
        if hooks_installed():
            return False
        addresses = []
        aligned = 0
        for t in tensors:
            address = 0 if t is None else t.data_ptr()
            aligned |= address
            addresses.append(address)
        if aligned & 15:
            return False
        device = self._launches[0]._device
        if device != _current_device():  # the tensors are on another GPU: launch there, as torch's ops do
            with torch.cuda.device(device):
                for launch in self._launches:
                    launch(addresses, ints, tensors)
            return True
        for launch in self._launches:
            launch(addresses, ints, tensors)
        return True


_RECORDING: list[Recording | None] = [None]
#: compiled kernels by CUfunction handle, with the kernel's parameter names (what :meth:`PreparedLaunch.native_form`
#: reads their signature from)
_COMPILED_BY_FUNCTION: dict[int, tuple] = {}
#: the list that :func:`observed_calls` collects into, or None
_OBSERVER: list[list | None] = [None]


@contextlib.contextmanager
def observed_calls() -> Iterator[list]:
    """Inside the block, every recorded-launch lookup of an op (:func:`replayed`, :func:`launch_or_replay`) appends
    ``(cache, signature, tensors)`` to the yielded list: what the compiled tier builds its programs from."""
    seen: list = []
    saved, _OBSERVER[0] = _OBSERVER[0], seen
    try:
        yield seen
    finally:
        _OBSERVER[0] = saved


#: ids of tensors that live as long as the process (placeholders), whose addresses recordings may keep
_FIXED_TENSORS: set[int] = set()
_FIXED_KEEP: list[torch.Tensor] = []


def fixed_tensor(t: torch.Tensor) -> torch.Tensor:
    """Mark ``t`` as kept alive for the process (it is referenced here): recorded launches may take its address."""
    if id(t) not in _FIXED_TENSORS:
        _FIXED_KEEP.append(t)
        _FIXED_TENSORS.add(id(t))
    return t


@contextlib.contextmanager
def recording(tensors: tuple, int_names: tuple[str, ...] = ()) -> Iterator[Recording]:
    """Inside the block, every :class:`FastLauncher` launch also goes into the yielded :class:`Recording`."""
    rec = Recording(tensors, int_names)
    saved, _RECORDING[0] = _RECORDING[0], rec
    try:
        yield rec
    finally:
        _RECORDING[0] = saved


class PreparedCache:
    """Recorded launches of one op, by call signature (a tuple of everything the launches' arguments depend on
    besides the tensors' addresses and the per-call ints). Emptied when it grows past ``limit`` entries (shapes
    that change every call) and by :func:`forget_recorded_launches`."""

    def __init__(self, limit: int = 256):
        self._entries: dict = {}
        self._limit = limit
        self._generation = _KERNEL_GENERATION[0]

    def get(self, signature):
        if self._generation != _KERNEL_GENERATION[0]:
            self._entries.clear()
            self._generation = _KERNEL_GENERATION[0]
        return self._entries.get(signature)

    def put(self, signature, prepared) -> None:
        if len(self._entries) >= self._limit:
            self._entries.clear()
        self._entries[signature] = prepared


def replayed(cache: PreparedCache, signature, tensors: tuple, ints: tuple = ()) -> bool:
    """Whether the launches recorded for ``signature`` ran now for ``tensors`` and ``ints``: an op asks this before
    it builds anything else for its launches, and builds them (``launch_or_replay``) only when the answer is no."""
    if signature is None:
        return False
    if _OBSERVER[0] is not None:
        _OBSERVER[0].append((cache, signature, tensors))
    replay = cache.get(signature)
    return bool(replay) and replay(tensors, ints)


def launch_or_replay(cache: PreparedCache, signature, tensors: tuple, launch: Callable[[], None],
                     ints: tuple = (), int_names: tuple[str, ...] = ()) -> None:
    """``launch()``, recorded the first time ``signature`` is seen and replayed for ``tensors`` and ``ints`` after
    (see :class:`Recording`); always ``launch()`` for a None signature, and for signatures whose recording
    failed. ``signature`` must hold everything the launches depend on besides the tensors' addresses and
    ``ints``."""
    if signature is None:
        launch()
        return
    if _OBSERVER[0] is not None:
        _OBSERVER[0].append((cache, signature, tensors))
    replay = cache.get(signature)
    if replay and replay(tensors, ints):
        return
    if replay is None:
        with recording(tensors, int_names) as rec:
            launch()
        cache.put(signature, rec.replay() or False)
        return
    launch()


#: bumped by :func:`forget_recorded_launches`
_KERNEL_GENERATION = [0]


def forget_recorded_launches() -> None:
    """Empty every :class:`PreparedCache` (on its next use): for whatever changes launches without changing a call's
    signature, i.e. kernels swapped in (:func:`kernels_from`) and launch-table overrides."""
    _KERNEL_GENERATION[0] += 1


def prepared_launches_enabled() -> bool:
    """Prepared launches run for eager CUDA calls through :class:`FastLauncher` (not under the interpreter, not
    with ``FUSED_KERNELS_PLAIN_LAUNCH=1``, nor ``FUSED_KERNELS_PREPARED_LAUNCH=0``)."""
    return not INTERPRETER and not PLAIN_LAUNCH and PREPARED_LAUNCH


_LAUNCHERS: dict[int, FastLauncher] = {}


def _fast_launcher(kernel) -> FastLauncher:
    """The one :class:`FastLauncher` of ``kernel``. Looked up by the kernel object's id, checked by identity (an id
    can be reused once an object is gone): hashing a ``JITFunction`` goes through its ``cache_key`` property, 0.6 us
    per lookup on a CPU against 0.15 for this."""
    launcher = _LAUNCHERS.get(id(kernel))
    if launcher is None or launcher.kernel is not kernel:
        launcher = _LAUNCHERS[id(kernel)] = FastLauncher(kernel)
    return launcher


#: ``FUSED_KERNELS_PLAIN_LAUNCH=1`` sends every eager launch through Triton's own ``kernel[grid]`` (to rule
#: the launcher in or out when chasing a bug).
PLAIN_LAUNCH = os.environ.get("FUSED_KERNELS_PLAIN_LAUNCH", "0") == "1"

#: ``FUSED_KERNELS_PREPARED_LAUNCH=0`` turns prepared launches off: every eager call then builds its launches
#: anew (to rule them in or out when chasing a bug, and to time them).
PREPARED_LAUNCH = os.environ.get("FUSED_KERNELS_PREPARED_LAUNCH", "1") == "1"


class _PlainLauncher:
    """``launcher[grid](...)`` through Triton's own launch (``PLAIN_LAUNCH``), :class:`TmaTensor` arguments included."""

    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        return lambda *args, **kwargs: _plain_launch(self.kernel, grid, args, kwargs)


def kernel_for(kernel, *, traceable: bool):
    """``wrap_triton(kernel)`` inside a registered op (torch.compile traces it); for eager launches a
    :class:`FastLauncher` on GPU, the kernel itself under the interpreter."""
    if traceable:
        return wrap_triton(kernel)
    if INTERPRETER:
        return kernel
    return _PlainLauncher(kernel) if PLAIN_LAUNCH else _fast_launcher(kernel)


@contextlib.contextmanager
def kernels_from(namespace: dict, module, names: tuple[str, ...]) -> Iterator[None]:
    """Inside the block, the launcher module whose globals are ``namespace`` launches ``module``'s jit kernels
    named ``names`` (those it has) instead of its own: another version of a family's ``_kernels.py``, timed
    against this one in the same process. Each family's ``ops.kernels_from`` wraps this."""
    saved = {name: namespace[name] for name in names}
    namespace.update({name: getattr(module, name) for name in names if hasattr(module, name)})
    forget_recorded_launches()
    try:
        yield
    finally:
        namespace.update(saved)
        forget_recorded_launches()


def cdiv(a: int, b: int) -> int:
    """Ceiling division of Python ints (not ``triton.cdiv``: see the module docstring)."""
    return -(-a // b)


def nothing_to_launch(t: torch.Tensor) -> bool:
    """True for empty tensors, and for fakes under the interpreter (an interpreted kernel would read their
    missing data; compiled kernels see fakes through ``wrap_triton``, which records the launch)."""
    return t.numel() == 0 or (INTERPRETER and is_fake(t))


@functools.cache
def multiprocessor_count(device_index: int) -> int:
    """Streaming multiprocessors of a CUDA device (4 under the interpreter: programs run one by one)."""
    if INTERPRETER or not torch.cuda.is_available():
        return 4
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.cache
def l2_cache_bytes(device_index: int) -> int:
    """L2 cache size of a CUDA device in bytes (4 MiB under the interpreter, where nothing is cached)."""
    if INTERPRETER or not torch.cuda.is_available():
        return 4 << 20
    return torch.cuda.get_device_properties(device_index).L2_cache_size


def unused_pointer(like: torch.Tensor, traceable: bool = True) -> torch.Tensor | None:
    """What to pass for a pointer that a compile-time branch never touches: None in eager launches (Triton
    makes it a constant: no allocation), a one-element tensor on ``like``'s device when ``traceable``
    (``wrap_triton`` wants tensors).

    Never pass another argument of the same launch instead: inside torch.compile a Triton launch is
    functionalized by cloning each argument the kernel may write, one clone per argument, and the
    caller's tensor is replaced by the clones in argument order. Two arguments sharing storage then leave
    the caller with whichever clone came last, possibly the unwritten one (torch's own note on this is in
    ``torch/_higher_order_ops/triton_kernel_wrap.py``, "if two kernel inputs are views of each other")."""
    return torch.empty(1, device=like.device, dtype=torch.int32) if traceable else None
