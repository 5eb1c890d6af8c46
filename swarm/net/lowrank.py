"""Activations between stages in under 2 bits a value: each message's principal components and a ternary residual.

The ``lowrank_ternary`` activation codec. A stage's activations are far from isotropic: at the demo's stage boundary
one direction of the residual stream holds ~98% of the variance and the next three most of the rest
(``bench/activations.py``, docs/averaging.md), which blockwise absmax codes spend their levels on. Per float tensor
of shape ``S`` (``d = S[-1]`` the width, ``n`` the product of the other sizes, the rows) the codec sends:

1. ``g``, the tensor's absmax (float32 ``(1,)``): what follows is relative to it, so it fits float16 whatever the
   tensor's magnitude (gradients are ~1e-7);
2. the rows' mean ``mu`` (float16 ``(d,)``), their top ``k = min(RANK, d, n)`` principal directions ``V`` (float16
   ``(d * k,)``, found by subspace iteration from a fixed start: Halko, Martinsson & Tropp 2011, alg. 4.4), and each
   row's coefficients on them (int8 ``(n * k,)``, one float32 scale per direction ``(k,)``);
3. what remains, ``R``, in three levels ``{-a, 0, +a}`` per row: trits five to a byte (uint8 ``(ceil(n d / 5),)``)
   and one float16 ``a`` per row ``(n,)``;
4. ``S`` (int32 ``(len(S),)``).

At the demo's micro-batch (8 x 128 rows of 192) that is 1.93 bits a value, 16.6x fewer bytes than float32. Two
roundings of ``R`` share the wire:

* ``nearest`` (activations): a value is ``±a`` past 0.612 of its row's RMS, ``a`` the mean magnitude of those
  values: the optimal ternary quantizer of a Gaussian (Max, "Quantizing for minimum distortion", 1960) with its
  level set to the row's own conditional mean;
* ``unbiased`` (gradients): ``a`` is the row's absmax and a value becomes ``±a`` with probability ``|R| / a``, else
  0, so the decoded gradient is unbiased (stochastic rounding, as QSGD: Alistarh et al. 2017). Biased rounding of
  the gradients costs far more than their noise (docs/averaging.md). The draws come from ``seed``: two servers given
  the same request send the same codes, which spot checks compare.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from swarm.protocol import ProtocolError

NAME = "lowrank_ternary"

RANK = 4
"""Principal directions sent per tensor (8 bits per row each: 0.17 bits a value at width 192)."""

OVERSAMPLE = 4
"""Extra directions the subspace iteration carries (Halko et al.'s ``p``)."""

POWER_ITERATIONS = 2
"""Subspace iterations after the first product: enough when the top directions stand out, as they do here."""

THRESHOLD = 0.612
"""``nearest``: the ternary threshold in units of the row's RMS (Max 1960, 3 levels of a unit Gaussian)."""

AGREEMENT = 0.2
"""Relative difference below which two servers' replies agree in a spot check under this codec, at least: three
levels a row turn small differences into whole steps (the demo's boundary gradients 1% apart decode 9.8% apart,
nearest rounding 8.5%; blockwise8bit 1.5%). A lie smaller than this hides in the codec's own noise."""

_TRIT_POWERS = torch.tensor([1, 3, 9, 27, 81], dtype=torch.int32)
WIRE_TENSORS = 8
"""Tensors per encoded float tensor: codes, row levels, mean, directions, coefficients, their scales, g, shape."""


def encode(x: torch.Tensor, *, unbiased: bool = False, seed: int = 0) -> list[torch.Tensor]:
    """Float tensor ``x`` (any shape, any float dtype) -> its :data:`WIRE_TENSORS` wire tensors (module docstring).

    :raises ValueError: ``x`` holds NaN or Inf.
    """
    shape = tuple(x.shape)
    y = x.detach().float().reshape(math.prod(shape[:-1]), shape[-1]) if shape else x.detach().float().reshape(1, 1)
    g = float(y.abs().max()) if y.numel() else 0.0
    if not math.isfinite(g):
        raise ValueError(f"{NAME} cannot send NaN or Inf; the tensor of shape {shape} holds one")
    y = y / g if g > 0 else y
    n, d = y.shape
    k = min(RANK, d, n)
    mu = y.mean(dim=0).half() if n else torch.zeros(d, dtype=torch.float16)
    centred = y - mu.float()
    directions = _top_directions(centred, k).half()
    coefficients = centred @ directions.float()
    coef_scales = (coefficients.abs().amax(dim=0) / 127.0 if n else torch.zeros(k)).clamp_min(1e-30)
    coef_codes = torch.round(coefficients / coef_scales).clamp(-127, 127).to(torch.int8)
    residual = centred - (coef_codes.float() * coef_scales) @ directions.float().T
    trits, levels = (_unbiased if unbiased else _nearest)(residual, seed)
    return [_pack_trits(trits.flatten()), levels.clamp(max=65504.0).half(), mu, directions.flatten(),
            coef_codes.flatten(), coef_scales, torch.tensor([g], dtype=torch.float32),
            torch.tensor(shape, dtype=torch.int32)]


def decode(tensors: Sequence[torch.Tensor], shape: tuple[int, ...]) -> torch.Tensor:
    """The wire tensors of one float tensor of ``shape`` (its last tensor, the shape, already read) -> float32.

    :raises ProtocolError: a tensor of the wrong dtype or size, a byte that is no five trits, a scale that is not
        finite, values past float32's range.
    """
    n, d = (math.prod(shape[:-1]), shape[-1]) if shape else (1, 1)
    k = min(RANK, d, n)
    specs = [(torch.uint8, math.ceil(n * d / 5)), (torch.float16, n), (torch.float16, d), (torch.float16, d * k),
             (torch.int8, n * k), (torch.float32, k), (torch.float32, 1)]
    if len(tensors) != len(specs):
        raise ProtocolError(f"{NAME} tensor has {len(tensors)} parts, expected {len(specs)}")
    for t, (dtype, numel) in zip(tensors, specs):
        if t.dtype != dtype or t.dim() != 1 or t.numel() != numel:
            raise ProtocolError(f"{NAME} part is {t.dtype}{tuple(t.shape)}, expected {dtype}({numel},)")
    codes, levels, mu, directions, coef_codes, coef_scales, g = tensors
    if not all(bool(torch.isfinite(t.float()).all()) for t in (levels, mu, directions, coef_scales, g)):
        raise ProtocolError(f"{NAME} scale, mean or direction is not finite")
    trits = _unpack_trits(codes, n * d).view(n, d)
    y = mu.float() + (coef_codes.float().view(n, k) * coef_scales) @ directions.float().view(d, k).T
    y = (y + (trits.float() - 1.0) * levels.float()[:, None]) * g.float()
    if not bool(torch.isfinite(y).all()):
        raise ProtocolError(f"{NAME} tensor decodes to values past float32's range")
    return y.view(shape)


def _top_directions(centred: torch.Tensor, k: int) -> torch.Tensor:
    """Orthonormal float32 ``(d, k)``: the top ``k`` right singular vectors of ``centred`` ``(n, d)``, by subspace
    iteration from a fixed Gaussian start (the same rows give the same directions)."""
    n, d = centred.shape
    if k == 0:
        return torch.zeros(d, 0)
    width = min(k + OVERSAMPLE, d)
    start = torch.randn(d, width, generator=torch.Generator().manual_seed(0))
    q = torch.linalg.qr(centred.T @ (centred @ start)).Q
    for _ in range(POWER_ITERATIONS):
        q = torch.linalg.qr(centred.T @ (centred @ q)).Q
    projected = centred @ q
    _, vectors = torch.linalg.eigh(projected.T @ projected)  # ascending
    return q @ vectors[:, -k:].flip(1)


def _nearest(residual: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``(n, d)`` -> trits (uint8, 0/1/2 for -a/0/+a) and each row's ``a`` (float32 ``(n,)``)."""
    rms = residual.pow(2).mean(dim=1, keepdim=True).sqrt()
    past = residual.abs() > THRESHOLD * rms
    levels = (residual.abs() * past).sum(dim=1) / past.sum(dim=1).clamp_min(1)
    return (torch.sign(residual) * past + 1).to(torch.uint8), levels


def _unbiased(residual: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``(n, d)`` -> trits rounded at random to ``{-a, 0, a}`` with ``E = residual``, and each row's absmax."""
    levels = residual.abs().amax(dim=1) if residual.numel() else torch.zeros(residual.shape[0])
    odds = residual.abs() / levels.clamp_min(1e-30)[:, None]
    draws = torch.rand(residual.shape, generator=torch.Generator().manual_seed(seed % 2 ** 63))
    return (torch.sign(residual) * (draws < odds) + 1).to(torch.uint8), levels


def _pack_trits(trits: torch.Tensor) -> torch.Tensor:
    """uint8 values 0..2 ``(m,)`` -> uint8 ``(ceil(m / 5),)``, five base-3 digits a byte, the first the lowest."""
    padded = torch.nn.functional.pad(trits.to(torch.int32), (0, -trits.numel() % 5), value=1).view(-1, 5)
    return (padded * _TRIT_POWERS).sum(dim=1).to(torch.uint8)


def _unpack_trits(packed: torch.Tensor, m: int) -> torch.Tensor:
    """Inverse of :func:`_pack_trits`: ``m`` trits, uint8 ``(m,)``.

    :raises ProtocolError: a byte above 242 (= 3**5 - 1), which no five trits make.
    """
    if packed.numel() and int(packed.max()) > 242:
        raise ProtocolError(f"{NAME} byte {int(packed.max())} is not five trits (0..242)")
    return ((packed.to(torch.int32)[:, None] // _TRIT_POWERS) % 3).flatten()[:m].to(torch.uint8)
