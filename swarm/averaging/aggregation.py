"""How a reducer combines the parts of its partition, behind one small interface.

Every rule takes ``parts`` float32 ``(n, numel)`` (one row per sender, already decoded and checked finite)
and ``weights`` float32 ``(n,)`` (samples behind each part, already bounded by the reducer, see
:func:`bound_weights`) and returns float32 ``(numel,)``.

* :class:`MeanAggregator` — the sample-weighted mean; exact, not robust (one part can move it anywhere).
* :class:`MedianAggregator` — coordinate-wise median (Yin et al., "Byzantine-Robust Distributed Learning",
  ICML 2018); unweighted.
* :class:`TrimmedMeanAggregator` — coordinate-wise mean after dropping the ``floor(trim * n)`` largest and
  smallest values (Yin et al. 2018); unweighted.
* :class:`CenteredClipAggregator` — CenteredClip (Karimireddy, He, Jaggi, "Learning from History for
  Byzantine Robust Optimization", ICML 2021, eq. 2) as used by BTARD (Gorbunov et al., ICML 2022, Alg. 2):
  start from the coordinate-wise median and iterate ``v += sum_i w_i (x_i - v) min(1, tau / |x_i - v|) /
  sum_i w_i`` at most ``iterations`` times or until the update is below ``1e-6 |v|``. Here ``tau`` is
  ``tau_ratio`` times the median distance of the parts to the starting point, so one setting fits every layer
  and scale; this is our choice, BTARD tunes an absolute tau per model.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch


def _check(parts: torch.Tensor, weights: torch.Tensor) -> None:
    if parts.dim() != 2 or weights.shape != parts.shape[:1]:
        raise ValueError(f"parts must be (n, numel) and weights (n,), got {tuple(parts.shape)}, {tuple(weights.shape)}")
    if parts.shape[0] == 0:
        raise ValueError("no parts to aggregate")
    if not weights.sum() > 0:
        raise ValueError("weights must sum to a positive number of samples")


class Aggregator(ABC):
    """Combines ``n`` peers' parts of one partition into one."""

    name: str

    @abstractmethod
    def aggregate(self, parts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """``parts`` float32 ``(n, numel)``, ``weights`` float32 ``(n,)`` -> float32 ``(numel,)``.

        :raises ValueError: shapes disagree, no parts, or weights do not sum to a positive number.
        """


class MeanAggregator(Aggregator):
    """Sample-weighted mean: ``sum_i w_i x_i / sum_i w_i``."""

    name = "mean"

    def aggregate(self, parts, weights):
        _check(parts, weights)
        return (weights[:, None] * parts).sum(0) / weights.sum()


def coordinate_median(parts: torch.Tensor) -> torch.Tensor:
    """Coordinate-wise median of ``(n, numel)``; the mean of the two middle values when ``n`` is even."""
    n = parts.shape[0]
    ordered = parts.sort(dim=0).values
    if n % 2:
        return ordered[n // 2].clone()
    return (ordered[n // 2 - 1] + ordered[n // 2]) / 2


class MedianAggregator(Aggregator):
    name = "median"

    def aggregate(self, parts, weights):
        _check(parts, weights)
        return coordinate_median(parts)


class TrimmedMeanAggregator(Aggregator):
    """Drops ``floor(trim * n)`` values at each end of every coordinate, averages the rest."""

    name = "trimmed_mean"

    def __init__(self, trim: float = 0.3):
        if not 0 <= trim < 0.5:
            raise ValueError("trim must be in [0, 0.5)")
        self.trim = trim

    def aggregate(self, parts, weights):
        _check(parts, weights)
        n = parts.shape[0]
        b = min(int(self.trim * n), (n - 1) // 2)
        ordered = parts.sort(dim=0).values
        return ordered[b:n - b].mean(0)


class CenteredClipAggregator(Aggregator):
    name = "centered_clip"

    def __init__(self, tau_ratio: float = 1.0, iterations: int = 20):
        if tau_ratio <= 0 or iterations < 1:
            raise ValueError("tau_ratio must be > 0 and iterations >= 1")
        self.tau_ratio, self.iterations = tau_ratio, iterations

    def aggregate(self, parts, weights):
        _check(parts, weights)
        w = weights / weights.sum()
        v = coordinate_median(parts)
        dist = (parts - v).norm(dim=1)
        tau = self.tau_ratio * dist.median()
        if not tau > 0:
            return v  # the majority agrees exactly: the median is the answer
        for _ in range(self.iterations):
            diff = parts - v
            dist = diff.norm(dim=1)
            scale = torch.clamp(tau / dist.clamp_min(1e-30), max=1.0)
            step = (w * scale) @ diff
            v = v + step
            if step.norm() <= 1e-6 * v.norm():
                break
        return v


AGGREGATORS = ("mean", "median", "trimmed_mean", "centered_clip")


def make_aggregator(name: str, *, trim: float = 0.3, tau_ratio: float = 1.0, iterations: int = 20) -> Aggregator:
    """Aggregator by spec name (see :data:`AGGREGATORS`); raises ValueError otherwise."""
    if name == "mean":
        return MeanAggregator()
    if name == "median":
        return MedianAggregator()
    if name == "trimmed_mean":
        return TrimmedMeanAggregator(trim)
    if name == "centered_clip":
        return CenteredClipAggregator(tau_ratio, iterations)
    raise ValueError(f"unknown aggregator {name!r}; choose one of {list(AGGREGATORS)}")


def bound_weights(weights: torch.Tensor, max_ratio: float) -> torch.Tensor:
    """Sender-reported weights clipped to ``[0, max_ratio * median(weights)]`` (non-finite ones become 0).

    A sender claiming 1000x the samples of its peers gets at most ``max_ratio`` times the median's say.
    """
    w = torch.nan_to_num(weights.float(), nan=0.0, posinf=0.0, neginf=0.0).clamp_min(0.0)
    cap = max_ratio * w.median()
    return w.clamp(max=float(cap)) if cap > 0 else w
