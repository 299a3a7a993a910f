"""Seeds for counter-based RNG kernels, drawn from torch's generator for the tensor's device.

A kernel like our dropout needs one 64-bit key per call. With ``seed=None`` it is drawn here, so
``torch.manual_seed`` governs it and two calls get different keys:

- CUDA: from the device's Philox generator state, ``(initial_seed, offset)``, and the offset is advanced
  as a torch RNG op would advance it. No device-to-host copy, so no synchronisation.
- CPU: one int64 from the CPU generator.
"""

from __future__ import annotations

import torch

_MASK64 = (1 << 64) - 1


def splitmix64(z: int) -> int:
    """One step of SplitMix64: a bijective mixer on 64-bit integers (Steele, Lea and Flood, 2014)."""
    z = (z + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def draw_seed(device: torch.device) -> int:
    """A fresh 64-bit seed from torch's default generator for ``device``."""
    device = torch.device(device)
    if device.type == "cuda":
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "seed=None cannot be drawn inside CUDA graph capture: the drawn seed would be frozen into "
                "the graph and every replay would repeat one mask. Pass an explicit seed, or run outside "
                "capture."
            )
        index = device.index if device.index is not None else torch.cuda.current_device()
        gen = torch.cuda.default_generators[index]
        offset = gen.get_offset()
        gen.set_offset(offset + 4)  # torch's Philox ops advance the offset in steps of 4
        return splitmix64(splitmix64(gen.initial_seed()) ^ offset)
    return int(torch.empty((), dtype=torch.int64).random_().item()) & _MASK64
