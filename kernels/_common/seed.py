"""Seeds for counter-based RNG kernels, drawn from torch's generator for the tensor's device.

A kernel like our dropout needs one 64-bit key per call. With ``seed=None`` it is drawn here, so
``torch.manual_seed`` governs it and two calls get different keys:

- CUDA: from the device's Philox generator state, ``(initial_seed, offset)``, and the offset is advanced
  as a torch RNG op would advance it. No device-to-host copy, so no synchronisation.
- CPU: one int64 from the CPU generator.

Inside torch.compile or CUDA graph capture a Python int cannot be drawn per call: dynamo cannot trace the
generator's offset (it would graph-break, or bake one seed into the graph), and a captured graph would
replay the seed drawn at capture, repeating one mask. There ``seed_for_call`` returns a 0-d int64 *tensor*
drawn by ``torch.randint`` on the device instead: a traced RNG op under compile and a graph-safe one under
capture (every replay draws anew), governed by ``torch.manual_seed`` either way. The kernels read it from
memory (``philox_key`` in ``kernels.dropout._kernels``).
"""

from __future__ import annotations

import torch

from kernels._common.launch import fixed_tensor
from reference.dropout import keep_threshold

_MASK32 = (1 << 32) - 1
_MASK64 = (1 << 64) - 1


def splitmix64(z: int) -> int:
    """One step of SplitMix64: a bijective mixer on 64-bit integers (Steele, Lea and Flood, 2014)."""
    z = (z + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


Seed = int | torch.Tensor
_INT64_MAX = (1 << 63) - 1


def device_seed(device: torch.device) -> torch.Tensor:
    """A fresh seed as a 0-d int64 tensor on ``device``, drawn by torch's RNG (traceable, graph-safe)."""
    return torch.randint(0, _INT64_MAX, (), dtype=torch.int64, device=device)


def seed_for_call(seed: int | None, device: torch.device) -> Seed:
    """The seed a call runs with: ``seed`` itself when given; for ``None`` a fresh one, as an int drawn on
    the host in eager mode (no launch, no sync) or as a device tensor (``device_seed``) under torch.compile
    and CUDA graph capture.

    Every eager dropout call with ``seed=None`` comes through here, so the CUDA branch does no more than it
    must: a tensor's ``device`` is taken as it is (no ``torch.device`` rebuilt), one capture check, and
    :func:`_draw_cuda_seed` (the measured cost was 26-28 us per call inside a GPT step on the H100 machine's
    host, 12 of them in ``draw_seed``)."""
    if seed is not None:
        return seed
    if type(device) is not torch.device:
        device = torch.device(device)
    if torch.compiler.is_compiling():
        return device_seed(device)
    if device.type == "cuda":
        # a CUDA tensor's device: CUDA is initialised, so the capture check needs no is_available first
        if torch.cuda.is_current_stream_capturing():
            return device_seed(device)
        return _draw_cuda_seed(device.index)
    return draw_seed(device)


def host_seed(seed: int | None, device: torch.device) -> int | None:
    """:func:`seed_for_call` of an eager call that needs the seed as an int on the host (the compiled eager tier):
    ``seed`` itself when given, else one drawn from torch's generator; None (nothing drawn) inside CUDA graph
    capture, where a seed is drawn on the device instead."""
    if seed is not None:
        return seed
    if device.type == "cuda":
        if torch.cuda.is_current_stream_capturing():
            return None
        return _draw_cuda_seed(device.index)
    return draw_seed(device)


def seed_value(seed: Seed) -> int:
    """The seed as an unsigned 64-bit int (a device seed is read back: for the CPU twin only)."""
    if isinstance(seed, torch.Tensor):
        seed = int(seed.item())
    return seed & _MASK64


_PLACEHOLDERS: dict[torch.device, torch.Tensor] = {}


def seed_pointer(seed_tensor: torch.Tensor | None, like: torch.Tensor,
                 traceable: bool) -> tuple[torch.Tensor, int]:
    """A kernel's ``(seed_ptr, seed_in_memory)`` arguments (``philox_key`` in ``kernels._common.philox``): a
    device seed itself and 1, or (no device seed: the key travels as ints) an int64 placeholder that is
    never read and 0.

    The placeholder is a tensor even in eager launches, where None would cost nothing: None makes Triton
    compile a second variant of the kernel, which a graph captured after an eager warm-up would then have to
    compile during capture (not allowed). Eager launches share one cached placeholder per device."""
    if seed_tensor is not None:
        return seed_tensor, 1
    if traceable:  # traced: a fresh tensor in the graph, never a cached one
        return torch.empty(1, dtype=torch.int64, device=like.device), 0
    device = like.device
    placeholder = _PLACEHOLDERS.get(device)
    if placeholder is None:
        # fixed: recorded launches may keep its address (kernels._common.launch.Recording)
        placeholder = _PLACEHOLDERS[device] = fixed_tensor(torch.empty(1, dtype=torch.int64, device=device))
    return placeholder, 0


def int32_word(word: int) -> int:
    """A 32-bit word (key half, keep threshold) as the signed int32 with the same bits.

    Kernels take such words as run-time ints and ``tl.cast`` them to uint32 (a same-width cast keeps the
    bits). Passed as int32 they always get one type: a word >= 2**31 would otherwise make Triton compile an
    int64 variant of the kernel, and makes inductor's launcher fail under torch.compile (it takes an int
    above the int32 range for a symbolic size and cannot evaluate it)."""
    word &= _MASK32
    return word - (1 << 32) if word >= (1 << 31) else word


def key_words(seed: int) -> tuple[int, int]:
    """The Philox key ``(k0, k1)`` of a 64-bit seed (its low and high halves), each as ``int32_word``."""
    return int32_word(seed), int32_word(seed >> 32)


def op_seed_args(seed: Seed) -> tuple[int, torch.Tensor | None]:
    """A registered op's ``(seed, seed_tensor)`` arguments: schemas carry int64, so a 64-bit unsigned seed
    travels as its two's-complement value; a device seed travels as the tensor (the int is then unused)."""
    if isinstance(seed, torch.Tensor):
        return 0, seed
    return (seed - (1 << 64) if seed >= (1 << 63) else seed), None


def seed_from_op_args(seed: int, seed_tensor: torch.Tensor | None) -> Seed:
    """Inverse of ``op_seed_args``."""
    return seed_tensor if seed_tensor is not None else seed & _MASK64


def draw_seed(device: torch.device) -> int:
    """A fresh 64-bit seed from torch's default generator for ``device`` (eager calls outside capture;
    ``seed_for_call`` never calls it inside, the check below guards direct callers)."""
    device = torch.device(device)
    if device.type == "cuda":
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "seed=None cannot be drawn inside CUDA graph capture: the drawn seed would be frozen into "
                "the graph and every replay would repeat one mask. Pass an explicit seed, or run outside "
                "capture."
            )
        return _draw_cuda_seed(device.index)
    return int(torch.empty((), dtype=torch.int64).random_().item()) & _MASK64


_CUDA_GENERATORS: dict[int, torch.Generator] = {}
#: ``splitmix64(initial_seed)`` of the last initial seed seen per device: it changes only with ``manual_seed``
_MIXED_INITIAL_SEED: dict[int, tuple[int, int]] = {}


def _draw_cuda_seed(index: int | None) -> int:
    """``draw_seed`` for CUDA device ``index`` (None: the current one), outside capture: the seed
    ``splitmix64(splitmix64(initial_seed) ^ offset)`` of the device's default generator, whose Philox offset
    is then advanced by 4, as torch's Philox ops advance it. No device work, no synchronisation."""
    if index is None:
        index = torch.cuda.current_device()
    gen = _CUDA_GENERATORS.get(index)
    if gen is None:
        gen = _CUDA_GENERATORS[index] = torch.cuda.default_generators[index]
    initial = gen.initial_seed()
    cached = _MIXED_INITIAL_SEED.get(index)
    if cached is None or cached[0] != initial:
        cached = _MIXED_INITIAL_SEED[index] = (initial, splitmix64(initial))
    offset = gen.get_offset()
    gen.set_offset(offset + 4)
    return splitmix64(cached[1] ^ offset)


#: the Philox kernels' parameters holding the seed's key words: the ints a recorded launch takes anew on every call
#: (``kernels._common.launch.Recording``)
SEED_WORD_PARAMETERS = ("seed_lo", "seed_hi")


def dropout_scalars(p: float, seed: Seed) -> tuple:
    """A Philox dropout kernel's scalar arguments for ``0 < p < 1``: ``(seed_lo, seed_hi, seed_tensor,
    threshold, scale)``. An int seed travels as its two key words (``seed_tensor`` None: the launcher passes
    a placeholder); a device seed (a 0-d int64 tensor) is read by the kernel and the words are 0. The keep
    threshold is the dropout family's rule (``reference.dropout.keep_threshold``) as a signed 32-bit word,
    the scale ``1 / (1 - p)``."""
    threshold = int32_word(keep_threshold(p))
    if isinstance(seed, torch.Tensor):
        return 0, 0, seed, threshold, 1.0 / (1.0 - p)
    return *key_words(seed), None, threshold, 1.0 / (1.0 - p)
