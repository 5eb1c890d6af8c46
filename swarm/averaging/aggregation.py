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
  and scale; this is our choice, BTARD tunes an absolute tau per model. When half or more of the parts sit
  exactly on the median (duplicated parts), the median distance is 0 and the median of the non-zero
  distances is used instead, so the parts that differ are still clipped (:func:`spread`).

Pre-aggregation (a wrapper around any rule, :func:`make_aggregator` ``pre=``) against attacks that exploit
heterogeneity between honest parts (ALIE, mimic) or duplicate an attacker's vector:

* :class:`NearestNeighborMixing` — NNM (Allouah et al., "Fixing by Mixing: A Recipe for Optimal Byzantine ML
  under Heterogeneity", AISTATS 2023, Alg. 1): each part is replaced by the mean of its ``n - f`` nearest
  parts (itself included) before the rule runs; deterministic.
* :class:`Bucketing` — Karimireddy, He, Jaggi, "Byzantine-Robust Learning on Heterogeneous Datasets via
  Bucketing", ICLR 2022, Alg. 1: the parts are shuffled into buckets of ``s``, each bucket averaged, and the
  rule runs on the bucket means. The shuffle is seeded by the parts' contents, so an auditor recomputing the
  partition (:mod:`swarm.averaging.auditor`) gets the same buckets.
"""

from __future__ import annotations

import hashlib
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
        tau = self.tau_ratio * spread((parts - v).norm(dim=1))
        if not tau > 0:
            return v  # every part is the median: nothing to clip
        for _ in range(self.iterations):
            diff = parts - v
            dist = diff.norm(dim=1)
            scale = torch.clamp(tau / dist.clamp_min(1e-30), max=1.0)
            step = (w * scale) @ diff
            v = v + step
            if step.norm() <= 1e-6 * v.norm():
                break
        return v


def spread(distances: torch.Tensor) -> torch.Tensor:
    """The typical distance of parts to a centre, float32 ``()``: the median of ``distances`` ``(n,)``, or, when
    half or more are exactly 0 (duplicated parts on the centre), the median of the non-zero ones (0 if none)."""
    med = distances.median()
    if med > 0:
        return med
    positive = distances[distances > 0]
    return positive.median() if positive.numel() else med


class NearestNeighborMixing(Aggregator):
    """NNM pre-aggregation around ``base`` (module docstring): ``f = floor(byzantine_fraction * n)``."""

    def __init__(self, base: Aggregator, byzantine_fraction: float):
        if not 0 <= byzantine_fraction < 0.5:
            raise ValueError("byzantine_fraction must be in [0, 0.5)")
        self.base, self.byzantine_fraction = base, byzantine_fraction
        self.name = f"nnm+{base.name}"

    def aggregate(self, parts, weights):
        _check(parts, weights)
        n = parts.shape[0]
        keep = n - min(int(self.byzantine_fraction * n), (n - 1) // 2)
        if keep >= n:
            return self.base.aggregate(parts, weights)
        dist = torch.cdist(parts[None].double(), parts[None].double())[0]
        nearest = dist.topk(keep, dim=1, largest=False).indices  # (n, keep), each row includes itself
        mixed = parts[nearest].mean(dim=1)
        return self.base.aggregate(mixed, weights)


class Bucketing(Aggregator):
    """Bucketing pre-aggregation around ``base`` (module docstring): buckets of ``bucket_size`` parts; a bucket's
    weight is the sum of its parts' weights."""

    def __init__(self, base: Aggregator, bucket_size: int = 2):
        if bucket_size < 1:
            raise ValueError("bucket_size must be >= 1")
        self.base, self.bucket_size = base, bucket_size
        self.name = f"bucketing+{base.name}"

    def aggregate(self, parts, weights):
        _check(parts, weights)
        rows = [hashlib.sha256(row.numpy().tobytes()).digest() + w.numpy().tobytes()
                for row, w in zip(parts, weights)]
        canonical = sorted(range(len(rows)), key=rows.__getitem__)  # the same order whatever the senders' order
        seed = int.from_bytes(hashlib.sha256(b"".join(sorted(rows))).digest()[:8], "big")
        shuffled = torch.tensor(canonical)[torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed))]
        buckets = shuffled.split(self.bucket_size)
        means = torch.stack([(weights[b, None] * parts[b]).sum(0) / weights[b].sum().clamp_min(1e-30)
                             for b in buckets])
        return self.base.aggregate(means, torch.stack([weights[b].sum() for b in buckets]))


AGGREGATORS = ("mean", "median", "trimmed_mean", "centered_clip")
PRE_AGGREGATIONS = ("none", "nnm", "bucketing")


def make_aggregator(name: str, *, trim: float = 0.3, tau_ratio: float = 1.0, iterations: int = 20,
                    pre: str = "none", byzantine_fraction: float = 0.3, bucket_size: int = 2) -> Aggregator:
    """Aggregator by spec name (see :data:`AGGREGATORS`), wrapped in pre-aggregation ``pre``
    (:data:`PRE_AGGREGATIONS`); raises ValueError for an unknown name."""
    rules = {"mean": MeanAggregator, "median": MedianAggregator, "trimmed_mean": lambda: TrimmedMeanAggregator(trim),
             "centered_clip": lambda: CenteredClipAggregator(tau_ratio, iterations)}
    if name not in rules:
        raise ValueError(f"unknown aggregator {name!r}; choose one of {list(AGGREGATORS)}")
    base = rules[name]()
    if pre == "nnm":
        return NearestNeighborMixing(base, byzantine_fraction)
    if pre == "bucketing":
        return Bucketing(base, bucket_size)
    if pre != "none":
        raise ValueError(f"unknown pre-aggregation {pre!r}; choose one of {list(PRE_AGGREGATIONS)}")
    return base


def bound_weights(weights: torch.Tensor, max_ratio: float) -> torch.Tensor:
    """Sender-reported weights clipped to ``[0, max_ratio * median(weights)]`` (non-finite ones become 0).

    A sender claiming 1000x the samples of its peers gets at most ``max_ratio`` times the median's say.
    """
    w = torch.nan_to_num(weights.float(), nan=0.0, posinf=0.0, neginf=0.0).clamp_min(0.0)
    cap = max_ratio * w.median()
    return w.clamp(max=float(cap)) if cap > 0 else w
