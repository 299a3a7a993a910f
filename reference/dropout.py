"""Pure-PyTorch twin of the seeded dropout kernel: Philox4x32-10 in integer torch ops.

Read this beside ``kernels/dropout/_kernels.py``. Both compute, for element ``i`` of the input in
row-major order of its logical shape, the same 32-bit random word, and keep the element when that word
is at least ``keep_threshold(p)``. So ``dropout(x, p, seed=s)`` here is bit-identical to
``kernels.dropout.dropout(x, p, seed=s)``.

**Philox4x32-10** (Salmon, Moraes, Dror and Shaw, "Parallel random numbers: as easy as 1, 2, 3",
SC 2011) maps a 128-bit counter ``(c0, c1, c2, c3)`` and a 64-bit key ``(k0, k1)`` to four 32-bit words.
Each of 10 rounds multiplies two counter words by fixed odd constants, keeps the high and low halves of
the 64-bit products, and mixes them with the other two words and the key; the key is bumped by the
Weyl constants between rounds. Counter-based: the words for a counter are a pure function of
(counter, key), with no state, so any element's bits can be computed anywhere, in any order.

**Index to counter.** One Philox call gives four words, and the kernel uses all four. Elements are cut
into chunks of ``4 * LANE_STRIDE``; inside chunk ``c``, element ``c * 4 * LANE_STRIDE + w * LANE_STRIDE
+ j`` (``w`` in 0..3, ``j`` in 0..LANE_STRIDE-1) takes word ``w`` of the call with counter
``(g mod 2**32, g div 2**32, 0, 0)``, where ``g = c * LANE_STRIDE + j``; the key is the 64-bit seed
split the same way. The kernel loads four contiguous runs of ``LANE_STRIDE`` elements, one per word,
so its loads stay wide and no word is wasted.

**Keep rule.** Keep iff ``word >= keep_threshold(p)`` with ``keep_threshold(p) = min(round(p * 2**32),
2**32 - 1)``: an integer compare, no float conversion. Kept values are ``x * float32(1 / (1 - p))``,
rounded once to the input dtype; dropped values are ``x * 0`` (so a NaN stays NaN, as in torch).

Dependency rule: this file imports torch only.
"""

from __future__ import annotations

import torch

#: Philox4x32 round multipliers and Weyl key increments (Salmon et al., 2011).
PHILOX_M0, PHILOX_M1 = 0xD2511F53, 0xCD9E8D57
PHILOX_W0, PHILOX_W1 = 0x9E3779B9, 0xBB67AE85
PHILOX_ROUNDS = 10
#: Elements per Philox word run inside a chunk (part of the mask's definition, shared with the kernel).
LANE_STRIDE = 1024

_MASK32 = 0xFFFFFFFF
_MASK64 = (1 << 64) - 1


def _mulhilo32(a: torch.Tensor, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """High and low 32 bits of ``a * b`` for 32-bit ``a`` (held in int64) and a 32-bit constant ``b``.

    The 64-bit product would overflow int64, so ``a`` is split into 16-bit halves: both partial products
    fit in 48 bits.
    """
    lo_part = (a & 0xFFFF) * b  # < 2**48
    hi_part = (a >> 16) * b  # < 2**48; worth 2**16 each
    low_sum = lo_part + ((hi_part & 0xFFFF) << 16)  # the product's low 48 bits (plus carry)
    return (hi_part >> 16) + (low_sum >> 32), low_sum & _MASK32


def philox4x32(
    counter: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    key: tuple[int, int],
    rounds: int = PHILOX_ROUNDS,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Philox4x32-``rounds``: four int64 tensors of 32-bit counter words and a 32-bit key pair -> four
    int64 tensors of 32-bit random words."""
    c0, c1, c2, c3 = (torch.as_tensor(c, dtype=torch.int64) & _MASK32 for c in counter)
    k0, k1 = key[0] & _MASK32, key[1] & _MASK32
    for _ in range(rounds):
        hi0, lo0 = _mulhilo32(c0, PHILOX_M0)
        hi1, lo1 = _mulhilo32(c2, PHILOX_M1)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0 = (k0 + PHILOX_W0) & _MASK32
        k1 = (k1 + PHILOX_W1) & _MASK32
    return c0, c1, c2, c3


def random_words(seed: int, index: torch.Tensor) -> torch.Tensor:
    """The 32-bit word (as int64) that decides element ``index`` (int64 flat row-major positions)."""
    seed &= _MASK64
    index = index.to(torch.int64)
    chunk = index // (4 * LANE_STRIDE)
    word = (index // LANE_STRIDE) % 4
    group = chunk * LANE_STRIDE + index % LANE_STRIDE
    zeros = torch.zeros_like(group)
    words = philox4x32((group & _MASK32, group >> 32, zeros, zeros), (seed & _MASK32, seed >> 32))
    return torch.stack(words).gather(0, word.unsqueeze(0)).squeeze(0)


def keep_threshold(p: float) -> int:
    """Keep an element iff its word is >= this: ``round(p * 2**32)``, capped at ``2**32 - 1``."""
    return min(round(p * 2**32), _MASK32)


def keep_mask(numel: int, p: float, seed: int, *, start: int = 0, device=None) -> torch.Tensor:
    """Boolean keep-mask of the flat elements ``start .. start + numel - 1``."""
    index = torch.arange(start, start + numel, dtype=torch.int64, device=device)
    return random_words(seed, index) >= keep_threshold(p)


def dropout(x: torch.Tensor, p: float, *, seed: int) -> torch.Tensor:
    """Seeded dropout, bit-identical to the kernel for the same ``(seed, p)`` and logical shape."""
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"p must be in [0, 1], got {p}")
    if p == 0.0:
        return x
    if p == 1.0:
        return torch.zeros_like(x)
    keep = keep_mask(x.numel(), p, seed, device=x.device).reshape(x.shape)
    # fp32, as the kernel scales; float64 inputs (which only the twin runs) in float64, as torch's dropout does
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    scale = torch.tensor(1.0 / (1.0 - p), dtype=compute)
    factor = torch.where(keep, scale, torch.tensor(0.0, dtype=compute))
    return (x.to(compute) * factor).to(x.dtype)

