"""Bounded trainer contributions inside a server: one poisoned trainer cannot dominate a server's gradient.

Before a server's gradient enters the all-reduce, the micro-batches it backpropagated are combined like this:

1. each micro-batch's gradient (all parameters of the stage as one vector) is clipped to ``clip_ratio``
   times the median norm of the last ``window`` micro-batches (no clipping until ``min_history`` norms are
   known), so no single micro-batch moves the sum far;
2. gradients are accumulated per trainer (the peer id that sent the micro-batch);
3. the per-trainer mean gradients are combined with the run's aggregator, weighted by each trainer's
   samples, when at least ``min_trainers_for_robust`` trainers contributed (fewer: the sample-weighted mean;
   a robust rule over two values is the mean anyway);
4. then each trainer is scored as the reducer scores servers (:mod:`swarm.averaging.exclusion`): its mean's
   distance to the combined gradient, times ``sqrt(samples / median samples)`` (a trainer with fewer
   micro-batches has a noisier mean: this puts every trainer on the same noise scale), is flagged beyond
   ``outlier_ratio`` (> 1) times the median of those distances. The epoch's gradient is combined again without
   the flagged trainers (at most half of them can be flagged: the (lower) median is an unflagged one's
   distance), and repeated flags exclude the trainer: this server then refuses its requests and drops its
   micro-batches (the exclusion expires like a server's).

Why step 4: a robust rule's error grows with the spread of the honest parts (Karimireddy et al., ICLR 2022,
sec. 3), and a trainer's mean of a few micro-batches is noisy. With 3 of 7 trainers flipping their labels,
CenteredClip alone ended 13% above the clean loss in ``bench/robustness.py``; their means sat 2.4-2.8x the
median distance from the aggregate epoch after epoch while honest trainers' stayed below 1.0x (in high
dimensions honest noise concentrates), so they are flagged every epoch and out after 9.

With the mean aggregator, no clipping and no outliers this equals hivemind's accumulation exactly (the mean over
micro-batches of equal size).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Sequence

import torch

from swarm.averaging.aggregation import Aggregator, MeanAggregator, spread
from swarm.averaging.exclusion import Exclusion, ExclusionBook
from swarm.averaging.reducer import Verdict


@dataclass
class _Account:
    """One trainer's accumulated gradient: ``flat`` float32 ``(numel,)``, and ``sums``, one view of it per
    parameter (shaped like it), so the epoch's combine needs no concatenation."""

    flat: torch.Tensor
    sums: list[torch.Tensor]
    samples: int = 0
    micro_batches: int = 0

    @classmethod
    def like(cls, grads: Sequence[torch.Tensor]) -> "_Account":
        flat = torch.zeros(sum(g.numel() for g in grads), dtype=torch.float32)
        sums, offset = [], 0
        for g in grads:
            sums.append(flat[offset:offset + g.numel()].view(g.shape))
            offset += g.numel()
        return cls(flat, sums)


@dataclass
class TrainerContributions:
    """Per-trainer gradient accumulators of one server.

    :param clip_ratio: clip a micro-batch gradient at this x the recent median norm (``0`` disables).
    :param outlier_ratio: flag a trainer this x farther (noise-normalized) from the combined gradient than the
        median trainer (``0`` disables, else > 1); ``exclusion`` turns repeated flags into exclusions.
    :raises ValueError: ``outlier_ratio`` in (0, 1]: every trainer could be flagged.
    """

    aggregator: Aggregator = field(default_factory=MeanAggregator)
    clip_ratio: float = 5.0
    window: int = 64
    min_history: int = 8
    min_trainers_for_robust: int = 3
    accounts: dict[str, _Account] = field(default_factory=dict)
    norms: deque = field(default_factory=lambda: deque(maxlen=64))
    clipped: int = 0
    outlier_ratio: float = 2.0
    exclusion: ExclusionBook = field(default_factory=ExclusionBook)
    new_exclusions: list[Exclusion] = field(default_factory=list)  # made by the last combine

    def __post_init__(self):
        if 0 < self.outlier_ratio <= 1:
            raise ValueError("outlier_ratio must be 0 (off) or above 1")

    def add(self, trainer: str, grads: Sequence[torch.Tensor], samples: int) -> float:
        """Add one micro-batch's gradients (one tensor per parameter); returns the scale applied (1 = unclipped).

        Non-finite gradients, and those of an excluded trainer, are dropped (scale 0).
        """
        if self.exclusion.is_excluded(trainer):
            return 0.0
        norm = float(torch.nn.utils.get_total_norm([g.detach().float() for g in grads], norm_type=2.0))
        if not math.isfinite(norm):
            return 0.0
        scale = 1.0
        if self.clip_ratio > 0 and len(self.norms) >= self.min_history:
            limit = self.clip_ratio * float(torch.tensor(list(self.norms)).median())
            if norm > limit > 0:
                scale, self.clipped = limit / norm, self.clipped + 1
        self.norms.append(norm)
        acc = self.accounts.get(trainer)
        if acc is None:
            acc = self.accounts[trainer] = _Account.like(grads)
        for s, g in zip(acc.sums, grads):
            s.add_(g.detach().float(), alpha=scale)
        acc.samples += samples
        acc.micro_batches += 1
        return scale

    @property
    def samples(self) -> int:
        return sum(a.samples for a in self.accounts.values())

    def combine(self, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The server's gradient, shaped like ``like``: zeros when nothing was accumulated. Scores the trainers
        (step 4 of the module docstring); the exclusions this made are in ``new_exclusions``."""
        self.new_exclusions = []
        accounts = {k: a for k, a in self.accounts.items() if a.micro_batches and not self.exclusion.is_excluded(k)}
        if not accounts:
            return [torch.zeros_like(t) for t in like]
        means = torch.empty(len(accounts), next(iter(accounts.values())).flat.numel())
        for row, a in zip(means, accounts.values()):
            torch.div(a.flat, a.micro_batches, out=row)
        weights = torch.tensor([float(a.samples) for a in accounts.values()])
        flat = self._aggregate(means, weights)
        if len(accounts) >= self.min_trainers_for_robust and self.outlier_ratio > 0:
            kept = self._score(list(accounts), means, weights, flat)
            if bool(kept.any()) and not bool(kept.all()):  # this epoch already without the flagged trainers
                flat = self._aggregate(means[kept], weights[kept])
        out, offset = [], 0
        for t in like:
            out.append(flat[offset:offset + t.numel()].view_as(t).to(t.dtype))
            offset += t.numel()
        return out

    def _aggregate(self, means: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        robust = len(means) >= self.min_trainers_for_robust
        return (self.aggregator if robust else MeanAggregator()).aggregate(means, weights)

    def _score(self, trainers: list[str], means: torch.Tensor, weights: torch.Tensor,
               combined: torch.Tensor) -> torch.Tensor:
        """Flag and book the trainers (step 4); returns the mask of those not flagged, bool ``(n,)``."""
        dist = (means - combined).norm(dim=1) * (weights / weights.median()).sqrt()
        limit = self.outlier_ratio * float(spread(dist))
        flagged = (dist > limit) & (limit > 0)
        self.new_exclusions = self.exclusion.record_round(
            {t: Verdict(accepted=True, flagged=bool(f)) for t, f in zip(trainers, flagged)})
        return ~flagged

    def reset(self) -> None:
        self.accounts.clear()
