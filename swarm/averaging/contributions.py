"""Bounded trainer contributions inside a server: one poisoned trainer cannot dominate a server's gradient.

Before a server's gradient enters the all-reduce, the micro-batches it backpropagated are combined like this:

1. each micro-batch's gradient (all parameters of the stage as one vector) is clipped to ``clip_ratio``
   times the median norm of the last ``window`` micro-batches (no clipping until ``min_history`` norms are
   known), so no single micro-batch moves the sum far;
2. gradients are accumulated per trainer (the peer id that sent the micro-batch);
3. the per-trainer mean gradients are combined with the run's aggregator, weighted by each trainer's
   samples, when at least ``min_trainers_for_robust`` trainers contributed (fewer: the sample-weighted mean;
   a robust rule over two values is the mean anyway).

With the mean aggregator and no clipping this equals hivemind's accumulation exactly (the mean over
micro-batches of equal size).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Sequence

import torch

from swarm.averaging.aggregation import Aggregator, MeanAggregator


@dataclass
class _Account:
    sums: list[torch.Tensor]
    samples: int = 0
    micro_batches: int = 0


@dataclass
class TrainerContributions:
    """Per-trainer gradient accumulators of one server.

    :param clip_ratio: clip a micro-batch gradient at this x the recent median norm (``0`` disables).
    """

    aggregator: Aggregator = field(default_factory=MeanAggregator)
    clip_ratio: float = 5.0
    window: int = 64
    min_history: int = 8
    min_trainers_for_robust: int = 3
    accounts: dict[str, _Account] = field(default_factory=dict)
    norms: deque = field(default_factory=lambda: deque(maxlen=64))
    clipped: int = 0

    def add(self, trainer: str, grads: Sequence[torch.Tensor], samples: int) -> float:
        """Add one micro-batch's gradients (one tensor per parameter); returns the scale applied (1 = unclipped).

        Non-finite gradients are dropped (scale 0): they would poison every later average.
        """
        norm = float(torch.sqrt(sum((g.detach().float() ** 2).sum() for g in grads)))
        if not torch.isfinite(torch.tensor(norm)):
            return 0.0
        scale = 1.0
        if self.clip_ratio > 0 and len(self.norms) >= self.min_history:
            limit = self.clip_ratio * float(torch.tensor(list(self.norms)).median())
            if norm > limit > 0:
                scale, self.clipped = limit / norm, self.clipped + 1
        self.norms.append(norm)
        acc = self.accounts.get(trainer)
        if acc is None:
            acc = self.accounts[trainer] = _Account([torch.zeros_like(g, dtype=torch.float32) for g in grads])
        for s, g in zip(acc.sums, grads):
            s.add_(g.detach().float(), alpha=scale)
        acc.samples += samples
        acc.micro_batches += 1
        return scale

    @property
    def samples(self) -> int:
        return sum(a.samples for a in self.accounts.values())

    def combine(self, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The server's gradient, shaped like ``like``: zeros when nothing was accumulated."""
        accounts = [a for a in self.accounts.values() if a.micro_batches]
        if not accounts:
            return [torch.zeros_like(t) for t in like]
        means = torch.stack([torch.cat([s.flatten() for s in a.sums]) / a.micro_batches for a in accounts])
        weights = torch.tensor([float(a.samples) for a in accounts])
        rule = self.aggregator if len(accounts) >= self.min_trainers_for_robust else MeanAggregator()
        flat = rule.aggregate(means, weights)
        out, offset = [], 0
        for t in like:
            out.append(flat[offset:offset + t.numel()].view_as(t).to(t.dtype))
            offset += t.numel()
        return out

    def reset(self) -> None:
        self.accounts.clear()
