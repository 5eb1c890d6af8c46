"""How a reducer combines the parts of its partition, behind one small interface.

The mean is the default and the only rule the current all-reduce (hivemind's ``GradientAverager``) runs;
robust rules need the reducer to buffer all parts of its partition and plug in through
:func:`swarm.averaging.optimizer.build_stage_optimizer`'s averager factory.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch


class Aggregator(ABC):
    """Combines ``n`` peers' parts of one partition into one."""

    name: str

    @abstractmethod
    def aggregate(self, parts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """``parts`` float32 ``(n, numel)``, ``weights`` float32 ``(n,)`` (samples) -> float32 ``(numel,)``."""


class MeanAggregator(Aggregator):
    """Sample-weighted mean: sum_i w_i x_i / sum_i w_i."""

    name = "mean"

    def aggregate(self, parts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        if parts.dim() != 2 or weights.shape != parts.shape[:1]:
            raise ValueError(f"parts must be (n, numel) and weights (n,), got {tuple(parts.shape)}, {tuple(weights.shape)}")
        total = weights.sum()
        if not total > 0:
            raise ValueError("weights must sum to a positive number of samples")
        return (weights[:, None] * parts).sum(0) / total


def make_aggregator(name: str) -> Aggregator:
    if name != "mean":
        raise ValueError(f"unknown aggregator {name!r}; this version supports 'mean'")
    return MeanAggregator()
