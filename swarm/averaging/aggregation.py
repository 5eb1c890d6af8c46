"""How a reducer combines the parts of its partition, behind one small interface.

Every rule takes ``parts`` float32 ``(n, numel)`` (one row per sender, already decoded and checked finite)
and ``weights`` float32 ``(n,)`` and returns float32 ``(numel,)``. A part of weight 0 carries no vote in any
rule (it is dropped before the rule runs). The robust rules (``robust = True``) use the weights only as a
vote: the reducer hands them 1 per part, because a sender's sample count is its own claim
(:func:`swarm.averaging.reducer.reduce_partition`); :class:`~swarm.averaging.contributions.TrainerContributions`
hands them the samples the server itself received from each trainer. An aggregate that overflows float32 is
refused (:class:`NonFiniteAggregate`), never returned.

* :class:`MeanAggregator` — the sample-weighted mean; exact, not robust (one part can move it anywhere).
* :class:`MedianAggregator` — coordinate-wise median (Yin et al., "Byzantine-Robust Distributed Learning",
  ICML 2018).
* :class:`TrimmedMeanAggregator` — coordinate-wise mean after dropping the ``f`` largest and smallest values,
  ``f = assumed_byzantine(n, trim)`` (Yin et al. 2018).
* :class:`CenteredClipAggregator` — CenteredClip (Karimireddy, He, Jaggi, "Learning from History for
  Byzantine Robust Optimization", ICML 2021, eq. 2) as used by BTARD (Gorbunov et al., ICML 2022, Alg. 2):
  start from the coordinate-wise median and iterate ``v += sum_i w_i (x_i - v) min(1, tau / |x_i - v|) /
  sum_i w_i`` at most ``iterations`` times or until the update is below ``1e-6 |v|``. Here ``tau`` is
  ``tau_ratio`` times the median distance of the parts to the starting point, so one setting fits every layer
  and scale; this is our choice, BTARD tunes an absolute tau per model. When half or more of the parts sit
  exactly on the median (an honest majority that agrees exactly, all-zero partitions, copies), that distance
  is 0 and the median itself is returned: any other radius would be chosen by the parts that differ, which
  may all be the attackers'. One part, or two of equal weight, return the median at once: the midpoint is the
  fixed point by symmetry, and iterating would only add rounding. The iterations run on the parts' Gram matrix
  (:func:`clip_iterations`: ``O(n^2)`` each), not over the parts (four passes of ``(n, numel)`` each): 3-4x
  faster for 4 parts of 430k values, the same fixed point within the stopping rule (relative differences of
  1e-7 to 1e-6 from iterating over the parts, measured).

Pre-aggregation (a wrapper around any rule, :func:`make_aggregator` ``pre=``) against attacks that exploit
heterogeneity between honest parts (ALIE, mimic) or duplicate an attacker's vector:

* :class:`NearestNeighborMixing` — NNM (Allouah et al., "Fixing by Mixing: A Recipe for Optimal Byzantine ML
  under Heterogeneity", AISTATS 2023, Alg. 1): each part is replaced by the mean of its ``n - f`` nearest
  parts (itself included) before the rule runs, ``f = assumed_byzantine(n, byzantine_fraction)``; deterministic.
* :class:`Bucketing` — Karimireddy, He, Jaggi, "Byzantine-Robust Learning on Heterogeneous Datasets via
  Bucketing", ICLR 2022, Alg. 1: the parts are shuffled into buckets of ``s``, each bucket averaged, and the
  rule runs on the bucket means. The shuffle is seeded by the parts' contents, so an auditor recomputing the
  partition (:mod:`swarm.averaging.auditor`) gets the same buckets.

What each rule guarantees, as the (f, kappa)-robustness of Allouah et al. 2023 (Definition 2: for every set S of
``n - f`` honest parts, ``|F(x) - mean_S|^2 <= kappa / |S| * sum_{i in S} |x_i - mean_S|^2``), is
:func:`kappa_bound`; ``bench/robustness.py`` measures the error it sees against it.
"""

from __future__ import annotations

import hashlib
import math
from abc import ABC, abstractmethod
from typing import Optional

import torch

from swarm.kernels.reference import all_finite


class NonFiniteAggregate(ValueError):
    """The rule's result overflowed float32 (parts near 3.4e38 sum or subtract to Inf): refused, not returned."""


def assumed_byzantine(n: int, fraction: float) -> int:
    """The number of Byzantine parts a rule assumes among ``n``: ``ceil(fraction * n)``, at most ``(n - 1) // 2``
    (a minority). Rounding up keeps small groups protected: with ``fraction = 0.3`` a group of 3 assumes 1, of 7
    assumes 3 (``floor`` would assume none in groups of 3 and turn NNM and the trimmed mean into the mean)."""
    if n < 1:
        return 0
    return max(0, min(math.ceil(fraction * n - 1e-9), (n - 1) // 2))


def _voters(parts: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows of ``parts`` and ``weights`` that carry a vote (weight > 0), after checking the shapes."""
    if parts.dim() != 2 or weights.shape != parts.shape[:1]:
        raise ValueError(f"parts must be (n, numel) and weights (n,), got {tuple(parts.shape)}, {tuple(weights.shape)}")
    if parts.shape[0] == 0:
        raise ValueError("no parts to aggregate")
    if not weights.sum() > 0:
        raise ValueError("weights must sum to a positive number of samples")
    voting = weights > 0
    return (parts, weights) if bool(voting.all()) else (parts[voting], weights[voting])


class Aggregator(ABC):
    """Combines ``n`` peers' parts of one partition into one."""

    name: str
    robust: bool = True
    """Whether a minority of parts has a bounded effect; a robust rule takes weights as votes, not as samples."""

    def aggregate(self, parts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """``parts`` float32 ``(n, numel)``, ``weights`` float32 ``(n,)`` -> float32 ``(numel,)``. Parts of weight
        0 are left out.

        :raises ValueError: shapes disagree, no parts, or weights do not sum to a positive number.
        :raises NonFiniteAggregate: the result is not finite (the parts overflow float32 arithmetic).
        """
        parts, weights = _voters(parts, weights)
        out = self._combine(parts, weights)
        if not all_finite(out):
            raise NonFiniteAggregate(
                f"{self.name} of {parts.shape[0]} parts is not finite: the parts (largest |value| "
                f"{float(parts.abs().max()):.3g}) overflow float32 arithmetic; such parts are refused")
        return out

    @abstractmethod
    def _combine(self, parts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The rule on checked parts, every weight positive."""


class MeanAggregator(Aggregator):
    """Sample-weighted mean: ``sum_i w_i x_i / sum_i w_i`` (weights normalized first, so finite parts never
    overflow)."""

    name = "mean"
    robust = False

    def _combine(self, parts, weights):
        return (weights / weights.sum()) @ parts


SORTING_NETWORK_ROWS = 16
"""Up to this many rows :func:`sorted_rows` sorts with a comparator network (3-8x faster than ``torch.sort`` along
the short axis for 2-16 rows of 5e5 values on one core, measured), beyond with ``torch.sort``."""


def sorted_rows(parts: torch.Tensor) -> list[torch.Tensor]:
    """The ``n`` rows of ``parts`` ``(n, numel)`` sorted coordinate-wise: row ``k`` holds the ``k``-th smallest value
    of every column, exactly ``parts.sort(dim=0).values[k]``.

    Few rows (at most :data:`SORTING_NETWORK_ROWS`) go through odd-even transposition sort (Knuth, TAOCP vol. 3,
    sec. 5.3.4, exercise 37: ``n`` rounds of compare-exchange of neighbours), each comparator an elementwise
    ``torch.minimum`` / ``torch.maximum`` of two whole rows: ``n (n - 1) / 2`` passes over the rows, where
    ``torch.sort`` along a short, strided axis sorts every column on its own. Min and max select values and
    never compute new ones, so the result is the sort's, bit for bit (parts are finite: NaN would not order)."""
    n = parts.shape[0]
    if n > SORTING_NETWORK_ROWS:
        return list(parts.sort(dim=0).values.unbind(0))
    rows = list(parts.unbind(0))
    for round_ in range(n):
        for i in range(round_ % 2, n - 1, 2):
            low, high = rows[i], rows[i + 1]
            rows[i], rows[i + 1] = torch.minimum(low, high), torch.maximum(low, high)
    return rows


def coordinate_median(parts: torch.Tensor) -> torch.Tensor:
    """Coordinate-wise median of ``(n, numel)``; the mean of the two middle values when ``n`` is even."""
    n = parts.shape[0]
    if n == 1:
        return parts[0].clone()
    if n == 2:  # the two middle values are the two values: no sorting (IEEE addition commutes, so bit for bit)
        return parts[0] / 2 + parts[1] / 2
    ordered = sorted_rows(parts)
    if n % 2:
        return ordered[n // 2].clone()
    return ordered[n // 2 - 1] / 2 + ordered[n // 2] / 2


class MedianAggregator(Aggregator):
    name = "median"

    def _combine(self, parts, weights):
        return coordinate_median(parts)


class TrimmedMeanAggregator(Aggregator):
    """Drops ``assumed_byzantine(n, trim)`` values at each end of every coordinate, averages the rest."""

    name = "trimmed_mean"

    def __init__(self, trim: float = 0.3):
        if not 0 <= trim < 0.5:
            raise ValueError("trim must be in [0, 0.5)")
        self.trim = trim

    def _combine(self, parts, weights):
        n = parts.shape[0]
        b = assumed_byzantine(n, self.trim)
        return torch.stack(sorted_rows(parts)[b:n - b]).mean(0)


class CenteredClipAggregator(Aggregator):
    name = "centered_clip"

    def __init__(self, tau_ratio: float = 0.5, iterations: int = 20):
        if tau_ratio <= 0 or iterations < 1:
            raise ValueError("tau_ratio must be > 0 and iterations >= 1")
        self.tau_ratio, self.iterations = tau_ratio, iterations

    def _combine(self, parts, weights):
        v = coordinate_median(parts)
        if parts.shape[0] <= 2 and bool((weights == weights[0]).all()):
            return v  # one part, or two of equal weight: the midpoint is the fixed point (symmetry), exactly
        diff = parts - v
        tau = self.tau_ratio * spread(diff.norm(dim=1))
        if not tau > 0:
            return v  # half or more of the parts are the median: nothing the rest says can be told from an attack
        alpha = clip_iterations(*gram_of(diff, v), (weights / weights.sum()).double(), float(tau), self.iterations)
        return v + alpha.to(diff.dtype) @ diff


GRAM_CHUNK = 1 << 16
"""Columns of the parts converted to float64 at a time for :func:`gram_of` (bounds its extra memory)."""


def gram_of(rows: torch.Tensor, center: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float]:
    """``(rows @ rows.T, rows @ center, |center|^2)`` in float64, of float32 ``rows`` ``(n, numel)`` and ``center``
    ``(numel,)``: ``(n, n)``, ``(n,)`` and a float, accumulated over :data:`GRAM_CHUNK` columns at a time."""
    n = rows.shape[0]
    gram, toward = torch.zeros(n, n, dtype=torch.float64), torch.zeros(n, dtype=torch.float64)
    center_sq = 0.0
    for a in range(0, rows.shape[1], GRAM_CHUNK):
        block, c = rows[:, a:a + GRAM_CHUNK].double(), center[a:a + GRAM_CHUNK].double()
        gram += block @ block.T
        toward += block @ c
        center_sq += float(c @ c)
    return gram, toward, center_sq


def clip_iterations(gram: torch.Tensor, toward: torch.Tensor, center_sq: float, w: torch.Tensor, tau: float,
                    iterations: int) -> torch.Tensor:
    """CenteredClip's iterations (module docstring) from ``v0``, run on coefficients: every step is a combination
    of the ``d_i = x_i - v_k``, so ``v_k = v0 + sum_i alpha_i (x_i - v0)``, and every distance and norm the
    iterations need follows from the Gram matrix of the ``x_i - v0`` (:func:`gram_of`: ``gram``, ``toward`` =
    their products with ``v0``, ``center_sq`` = ``|v0|^2``). The iterations then cost ``O(n^2)`` each instead of
    four passes over the ``(n, numel)`` parts. ``w`` float64 ``(n,)`` sums to 1. Returns ``alpha`` float64
    ``(n,)``: the aggregate is ``v0 + alpha @ (x - v0)``."""
    alpha = torch.zeros_like(toward)
    norms_sq = gram.diagonal()
    for _ in range(iterations):
        reach = gram @ alpha  # (x_i - v0) . (v_k - v0)
        dist = (norms_sq - 2 * reach + alpha @ reach).clamp_min(0).sqrt()  # |x_i - v_k|
        c = w * torch.clamp(tau / dist.clamp_min(1e-30), max=1.0)
        step = c - c.sum() * alpha  # v_{k+1} - v_k = sum_i step_i (x_i - v0)
        alpha = alpha + step
        v_sq = center_sq + 2 * float(alpha @ toward) + float(alpha @ gram @ alpha)
        if float(step @ gram @ step) <= 1e-12 * v_sq:  # |step| <= 1e-6 |v|
            break
    return alpha


def row_norms(rows: torch.Tensor, center: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The L2 norm of each row of ``rows`` float32 ``(n, numel)``, or its distance to ``center`` float32 ``(numel,)``:
    float64 ``(n,)``. Computed in float32 (7x faster than through a float64 copy on one core, measured; relative
    error ~1e-7), and again in float64 for the rows where float32 overflows (values beyond ~1e19), so a huge part
    gets its true norm rather than Inf."""
    diff = rows if center is None else rows - center
    norms = diff.norm(dim=1).double()
    overflow = ~torch.isfinite(norms)
    if bool(overflow.any()):
        exact = rows[overflow].double()
        norms[overflow] = (exact if center is None else exact - center.double()).norm(dim=1)
    return norms


def spread(distances: torch.Tensor) -> torch.Tensor:
    """The typical distance of parts to a centre: the median of ``distances`` ``(n,)``, float ``()``. It is 0 when
    half or more of the parts sit exactly on the centre; callers then clip or flag nothing (a radius taken from
    the other parts would be the attackers' to choose when the parts on the centre are the honest ones)."""
    return distances.median()


class NearestNeighborMixing(Aggregator):
    """NNM pre-aggregation around ``base`` (module docstring): ``f = assumed_byzantine(n, byzantine_fraction)``."""

    def __init__(self, base: Aggregator, byzantine_fraction: float):
        if not 0 <= byzantine_fraction < 0.5:
            raise ValueError("byzantine_fraction must be in [0, 0.5)")
        self.base, self.byzantine_fraction = base, byzantine_fraction
        self.name, self.robust = f"nnm+{base.name}", base.robust

    def _combine(self, parts, weights):
        n = parts.shape[0]
        keep = n - assumed_byzantine(n, self.byzantine_fraction)
        if keep >= n:
            return self.base.aggregate(parts, weights)
        dist = torch.cdist(parts[None].double(), parts[None].double())[0]
        nearest = dist.topk(keep, dim=1, largest=False).indices  # (n, keep), each row includes itself
        mixed = parts[nearest].mean(dim=1)
        return self.base.aggregate(mixed, weights)


class Bucketing(Aggregator):
    """Bucketing pre-aggregation around ``base`` (module docstring): buckets of ``bucket_size`` parts; a bucket's
    weight is the sum of its parts' weights (only parts with a vote are bucketed)."""

    def __init__(self, base: Aggregator, bucket_size: int = 2):
        if bucket_size < 1:
            raise ValueError("bucket_size must be >= 1")
        self.base, self.bucket_size = base, bucket_size
        self.name, self.robust = f"bucketing+{base.name}", base.robust

    def _combine(self, parts, weights):
        rows = [hashlib.sha256(row.numpy().tobytes()).digest() + w.numpy().tobytes()
                for row, w in zip(parts, weights)]
        canonical = sorted(range(len(rows)), key=rows.__getitem__)  # the same order whatever the senders' order
        seed = int.from_bytes(hashlib.sha256(b"".join(sorted(rows))).digest()[:8], "big")
        shuffled = torch.tensor(canonical)[torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed))]
        buckets = shuffled.split(self.bucket_size)
        means = torch.stack([(weights[b] / weights[b].sum()) @ parts[b] for b in buckets])
        return self.base.aggregate(means, torch.stack([weights[b].sum() for b in buckets]))


AGGREGATORS = ("mean", "median", "trimmed_mean", "centered_clip")
PRE_AGGREGATIONS = ("none", "nnm", "bucketing")


def make_aggregator(name: str, *, trim: float = 0.3, tau_ratio: float = 0.5, iterations: int = 20,
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

    A sender claiming 1000x the samples of its peers gets at most ``max_ratio`` times the median's say. Used only
    for the mean: robust rules get one vote per part (module docstring).
    """
    w = torch.nan_to_num(weights.float(), nan=0.0, posinf=0.0, neginf=0.0).clamp_min(0.0)
    cap = max_ratio * w.median()
    return w.clamp(max=float(cap)) if cap > 0 else w


def kappa_bound(name: str, n: int, f: int, assumed: Optional[int] = None) -> Optional[float]:
    """The ``kappa`` for which rule ``name`` (``"median"``, ``"nnm+trimmed_mean"``, ...) is (f, kappa)-robust
    among ``n`` parts with ``f`` Byzantine (module docstring), or None where none is proven; ``inf`` when
    ``2f >= n``. ``assumed``: the ``f`` the rule is set to assume (``assumed_byzantine`` of its ``trim`` or
    ``byzantine_fraction``); the proofs for the trimmed mean and NNM hold when it equals ``f``, so otherwise None.
    No rule does better than ``f / (n - 2f)`` (Allouah et al. 2023, their lower bound).

    Upper bounds from Allouah et al. 2023 (their table of rules): coordinate-wise trimmed mean ``6f/(n-2f) (1 +
    f/(n-2f))``, coordinate-wise median ``4 (1 + f/(n-2f))^2``; NNM in front of a (f, kappa)-robust rule gives
    ``8f/(n-f) (kappa + 1)`` (their lemma on NNM). The mean has none (``inf`` for ``f >= 1``). CenteredClip with a
    radius from the parts themselves has no proven kappa (Karimireddy et al. 2021 prove their bound for an
    honest-variance-tuned radius and under 10% Byzantine), so None: ``bench/robustness.py`` reports what it
    measures.
    """
    pre, _, rule = name.rpartition("+")
    if 2 * f >= n:
        return math.inf
    if assumed is not None and assumed != f and (rule == "trimmed_mean" or pre == "nnm"):
        return None
    r = f / (n - 2 * f)
    base = {"trimmed_mean": 6 * r * (1 + r), "median": 4 * (1 + r) ** 2,
            "mean": 0.0 if f == 0 else math.inf}.get(rule)
    if base is None or pre == "bucketing":
        return None
    return 8 * f / (n - f) * (base + 1) if pre == "nnm" and f > 0 else base
