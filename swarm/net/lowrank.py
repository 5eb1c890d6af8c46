"""Activations between stages in 2 to 3.3 bits a value: each message's principal components and a coarse residual.

The ``lowrank_ternary`` and ``lowrank_3bit`` activation codecs (:class:`LowRank`). A stage's activations are far from
isotropic: at the demo's stage boundary one direction of the residual stream holds ~98% of the variance and the next
three most of the rest (``bench/activations.py``, docs/averaging.md), which blockwise absmax codes spend their
levels on. Per float tensor of shape ``S`` (``d = S[-1]`` the width, ``n`` the product of the other sizes, the
rows) the codec sends:

1. ``g``, the tensor's absmax (float32 ``(1,)``): what follows is relative to it, so it fits float16 whatever the
   tensor's magnitude (gradients are ~1e-7);
2. the rows' mean ``mu`` (float16 ``(d,)``), their top ``k = min(RANK, d, n)`` principal directions ``V`` (float16
   ``(d * k,)``, found by subspace iteration from a fixed start: Halko, Martinsson & Tropp 2011, alg. 4.4), and each
   row's coefficients on them (int8 ``(n * k,)``, one float32 scale per direction ``(k,)``);
3. what remains, ``R``, in a few levels per row scaled by one float16 ``a`` per row ``(n,)``: ``lowrank_ternary``
   three, ``{-a, 0, +a}``, trits five to a byte (uint8 ``(ceil(n d / 5),)``); ``lowrank_3bit`` eight,
   ``(2c - 7) a / 7`` for codes ``c`` 0..7, three bits a value (uint8 ``(ceil(3 n d / 8),)``);
4. ``S`` (int32 ``(len(S),)``).

At the demo's micro-batch (8 x 128 rows of 192) that is 1.93 bits a value for ``lowrank_ternary``, 16.6x fewer
bytes than float32, and 3.33 bits for ``lowrank_3bit``, 9.6x. Two roundings of ``R`` share the wire:

* ``nearest`` (activations): ternary, a value is ``±a`` past 0.612 of its row's RMS, ``a`` the mean magnitude of
  those values: the optimal ternary quantizer of a Gaussian (Max, "Quantizing for minimum distortion", 1960) with
  its level set to the row's own conditional mean; eight levels, the nearest level at Max's optimal uniform step,
  ``a`` then refit to the codes by least squares;
* ``unbiased`` (gradients): ``a`` is the row's absmax and a value is rounded at random to one of its two nearest
  levels, so the decoded gradient is unbiased (stochastic rounding, as QSGD: Alistarh et al. 2017). Biased rounding
  of the gradients costs far more than their noise (docs/averaging.md). The draws come from ``seed``: two servers
  given the same request send the same codes, which spot checks compare.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from swarm.net.bitpack import pack_bits, unpack_bits
from swarm.protocol import ProtocolError

RANK = 4
"""Principal directions sent per tensor (8 bits per row each: 0.17 bits a value at width 192)."""

OVERSAMPLE = 4
"""Extra directions the subspace iteration carries (Halko et al.'s ``p``)."""

POWER_ITERATIONS = 2
"""Subspace iterations after the first product: enough when the top directions stand out, as they do here."""

THRESHOLD = 0.612
"""Ternary ``nearest``: the threshold in units of the row's RMS (Max 1960, 3 levels of a unit Gaussian)."""

UNIFORM_SCALE = 2.05
"""8-level ``nearest``: the outer level in units of the row's RMS before the least-squares refit: the optimal
uniform 8-level quantizer of a unit Gaussian has step 0.586 (Max 1960), so its outer level is 3.5 x 0.586."""

_TRIT_POWERS = torch.tensor([1, 3, 9, 27, 81], dtype=torch.int32)
WIRE_TENSORS = 8
"""Tensors per encoded float tensor: codes, row levels, mean, directions, coefficients, their scales, g, shape."""


@dataclass(frozen=True)
class LowRank:
    """One low-rank codec: the principal part (module docstring) and a residual in ``levels`` levels a row.

    :param name: the codec's wire name.
    :param levels: 3 (``{-a, 0, a}``, trits five to a byte) or 8 (``(2c - 7) a / 7`` for codes ``c`` 0..7, three
        bits a value).
    :param agreement: relative L2 difference below which two servers' replies agree in a spot check under this
        codec, at least (:func:`~swarm.net.codecs.agreement_floor`): a few levels a row turn small differences
        into whole steps. The demo's boundary gradients 1% apart decode 9.8% apart under ternary rounding (nearest
        rounding 8.5%, blockwise8bit 1.5%); a rank-4-plus-noise tensor of the same shape 6.7% apart under ternary,
        3.5% under eight levels (blockwise8bit 1.6%). A lie smaller than this hides in the codec's own noise.
    :raises ValueError: ``levels`` other than 3 or 8.
    """

    name: str
    levels: int
    agreement: float

    def __post_init__(self):
        if self.levels not in (3, 8):
            raise ValueError(f"low-rank codec {self.name!r} with {self.levels} residual levels; choose 3 or 8")

    def code_bytes(self, values: int) -> int:
        """Bytes of the residual's codes for ``values`` values."""
        return math.ceil(values / 5) if self.levels == 3 else math.ceil(values * 3 / 8)

    def encode(self, x: torch.Tensor, *, unbiased: bool = False, seed: int = 0) -> list[torch.Tensor]:
        """Float tensor ``x`` (any shape, any float dtype) -> its :data:`WIRE_TENSORS` wire tensors (module
        docstring); the residual rounded without bias (gradients) if ``unbiased``, with draws from ``seed``.

        :raises ValueError: ``x`` holds NaN or Inf.
        """
        shape = tuple(x.shape)
        y = x.detach().float().reshape(math.prod(shape[:-1]), shape[-1]) if shape else x.detach().float().view(1, 1)
        g = float(y.abs().max()) if y.numel() else 0.0
        if not math.isfinite(g):
            raise ValueError(f"{self.name} cannot send NaN or Inf; the tensor of shape {shape} holds one")
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
        if self.levels == 3:
            codes, levels = (_unbiased if unbiased else _nearest)(residual, seed)
            packed = _pack_trits(codes.flatten())
        else:
            codes, levels = (_unbiased8 if unbiased else _nearest8)(residual, seed)
            packed = pack_bits(codes.flatten(), 3)
        return [packed, levels.clamp(max=65504.0).half(), mu, directions.flatten(), coef_codes.flatten(), coef_scales,
                torch.tensor([g], dtype=torch.float32), torch.tensor(shape, dtype=torch.int32)]

    def decode(self, tensors: Sequence[torch.Tensor], shape: tuple[int, ...]) -> torch.Tensor:
        """The wire tensors of one float tensor of ``shape`` (its last tensor, the shape, already read) -> float32.

        :raises ProtocolError: a tensor of the wrong dtype or size, a byte that is no five trits, a scale that is
            not finite, values past float32's range.
        """
        n, d = (math.prod(shape[:-1]), shape[-1]) if shape else (1, 1)
        k = min(RANK, d, n)
        specs = [(torch.uint8, self.code_bytes(n * d)), (torch.float16, n), (torch.float16, d),
                 (torch.float16, d * k), (torch.int8, n * k), (torch.float32, k), (torch.float32, 1)]
        if len(tensors) != len(specs):
            raise ProtocolError(f"{self.name} tensor has {len(tensors)} parts, expected {len(specs)}")
        for t, (dtype, numel) in zip(tensors, specs):
            if t.dtype != dtype or t.dim() != 1 or t.numel() != numel:
                raise ProtocolError(f"{self.name} part is {t.dtype}{tuple(t.shape)}, expected {dtype}({numel},)")
        codes, levels, mu, directions, coef_codes, coef_scales, g = tensors
        if not all(bool(torch.isfinite(t.float()).all()) for t in (levels, mu, directions, coef_scales, g)):
            raise ProtocolError(f"{self.name} scale, mean or direction is not finite")
        if self.levels == 3:
            unit = _unpack_trits(codes, n * d, self.name).float() - 1.0
        else:
            unit = unpack_bits(codes, 3, n * d).float() * (2.0 / 7.0) - 1.0
        y = mu.float() + (coef_codes.float().view(n, k) * coef_scales) @ directions.float().view(d, k).T
        y = (y + unit.view(n, d) * levels.float()[:, None]) * g.float()
        if not bool(torch.isfinite(y).all()):
            raise ProtocolError(f"{self.name} tensor decodes to values past float32's range")
        return y.view(shape)


TERNARY = LowRank("lowrank_ternary", levels=3, agreement=0.2)
EIGHT_LEVELS = LowRank("lowrank_3bit", levels=8, agreement=0.1)
CODECS = {c.name: c for c in (TERNARY, EIGHT_LEVELS)}
"""The low-rank codecs by wire name."""


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


def _nearest8(residual: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``(n, d)`` -> codes 0..7 of the nearest of 8 uniform levels ``(2c - 7) a / 7`` (uint8) and each row's
    ``a`` (float32 ``(n,)``): :data:`UNIFORM_SCALE` times the row's RMS, then refit by least squares to the codes."""
    rms = residual.pow(2).mean(dim=1, keepdim=True).sqrt()
    start = (UNIFORM_SCALE * rms).clamp_min(1e-30)
    codes = torch.round((residual / start).clamp(-1.0, 1.0) * 3.5 + 3.5)
    unit = codes * (2.0 / 7.0) - 1.0
    levels = (residual * unit).sum(dim=1) / unit.pow(2).sum(dim=1).clamp_min(1e-30)
    return codes.to(torch.uint8), levels.clamp_min(0.0)


def _unbiased8(residual: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``(n, d)`` -> codes 0..7 rounded at random between the two nearest of 8 uniform levels on the row's
    ``[-absmax, absmax]`` with ``E = residual`` (uint8), and each row's absmax."""
    levels = residual.abs().amax(dim=1) if residual.numel() else torch.zeros(residual.shape[0])
    position = (residual / levels.clamp_min(1e-30)[:, None]).clamp(-1.0, 1.0) * 3.5 + 3.5
    lower = position.floor().clamp(max=6.0)
    draws = torch.rand(residual.shape, generator=torch.Generator().manual_seed(seed % 2 ** 63))
    return (lower + (draws < position - lower)).to(torch.uint8), levels


def _pack_trits(trits: torch.Tensor) -> torch.Tensor:
    """uint8 values 0..2 ``(m,)`` -> uint8 ``(ceil(m / 5),)``, five base-3 digits a byte, the first the lowest."""
    padded = torch.nn.functional.pad(trits.to(torch.int32), (0, -trits.numel() % 5), value=1).view(-1, 5)
    return (padded * _TRIT_POWERS).sum(dim=1).to(torch.uint8)


def _unpack_trits(packed: torch.Tensor, m: int, name: str) -> torch.Tensor:
    """Inverse of :func:`_pack_trits`: ``m`` trits, uint8 ``(m,)``.

    :raises ProtocolError: a byte above 242 (= 3**5 - 1), which no five trits make.
    """
    if packed.numel() and int(packed.max()) > 242:
        raise ProtocolError(f"{name} byte {int(packed.max())} is not five trits (0..242)")
    return ((packed.to(torch.int32)[:, None] // _TRIT_POWERS) % 3).flatten()[:m].to(torch.uint8)
