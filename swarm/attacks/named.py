"""The named attacks of the literature, each a small :class:`Attack` (the package docstring lists them)."""

from __future__ import annotations

import math
from collections import deque
from typing import Optional

import torch


class Attack:
    """Honest by default: every hook returns its input unchanged."""

    name = "none"
    accuse_always = False
    claim: Optional[float] = None
    """Samples the attacker reports for its part (None: the samples it really has)."""

    def focus(self, reduced_by_attackers: Optional[torch.Tensor]) -> None:
        """Told, where the caller knows it, which coordinates (bool ``(numel,)``) the attackers reduce themselves."""

    def corrupt_part(self, vector: torch.Tensor, round: int, honest: Optional[torch.Tensor] = None) -> torch.Tensor:
        """What a Byzantine sender puts into the all-reduce instead of its float32 ``(numel,)`` ``vector``.
        ``honest``: float32 ``(h, numel)`` vectors of honest peers, when known."""
        return vector

    def corrupt_aggregate(self, aggregate: torch.Tensor) -> torch.Tensor:
        return aggregate

    def corrupt_batch(self, inputs: torch.Tensor, targets: torch.Tensor, vocab: int):
        return inputs, targets

    def corrupt_grad(self, grad: torch.Tensor) -> torch.Tensor:
        return grad


class SignFlip(Attack):
    name = "sign_flip"

    def __init__(self, k: float = 4.0):
        self.k = k

    def corrupt_part(self, vector, round, honest=None):
        return -self.k * vector


class Noise(Attack):
    name = "noise"

    def __init__(self, scale: float = 100.0, seed: int = 0):
        self.scale, self.gen = scale, torch.Generator().manual_seed(seed)

    def corrupt_part(self, vector, round, honest=None):
        rms = vector.pow(2).mean().sqrt().clamp_min(1e-12)
        return vector + self.scale * rms * torch.randn(vector.shape, generator=self.gen)


class ALIE(Attack):
    name = "alie"

    def __init__(self, n: int = 7, f: int = 2):
        s = math.floor(n / 2 + 1) - f
        self.z = float(torch.distributions.Normal(0.0, 1.0).icdf(torch.tensor((n - s) / n)))

    def corrupt_part(self, vector, round, honest=None):
        if honest is None or honest.shape[0] < 2:
            return vector
        return honest.mean(0) - self.z * honest.std(0)


class IPM(Attack):
    name = "ipm"

    def __init__(self, eps: float = 0.5):
        self.eps = eps

    def corrupt_part(self, vector, round, honest=None):
        mu = honest.mean(0) if honest is not None and honest.shape[0] else vector
        return -self.eps * mu


class Mimic(Attack):
    """Mimic (Karimireddy, He, Jaggi, ICLR 2022, sec. 5): every attacker sends the same honest peer's vector, so
    that peer's data counts ``f + 1`` times and duplicates form a block (it exploits heterogeneity and any rule
    that trusts agreement). The copied peer is the honest one farthest from the honest mean (the paper picks
    the one with the largest variance along the top principal direction); with no honest vectors known, its
    own."""

    name = "mimic"

    def corrupt_part(self, vector, round, honest=None):
        if honest is None or honest.shape[0] < 2:
            return vector
        return honest[int((honest - honest.mean(0)).norm(dim=1).argmax())].clone()


class MinMax(Attack):
    """Min-Max (Shejwalkar & Houmansadr, "Manipulating the Byzantine", NDSS 2021, sec. IV-B, AGR-agnostic):
    ``mu - gamma * sigma`` (coordinate-wise honest mean and standard deviation) with the largest ``gamma`` (binary
    search) whose distance to every honest vector stays within the largest distance between two honest
    vectors, so no distance-based check singles it out."""

    name = "minmax"

    def corrupt_part(self, vector, round, honest=None):
        if honest is None or honest.shape[0] < 2:
            return vector
        mu, direction = honest.mean(0), honest.std(0)
        limit = torch.cdist(honest[None], honest[None])[0].max()
        lo, hi = 0.0, 10.0
        for _ in range(30):
            gamma = (lo + hi) / 2
            if (honest - (mu - gamma * direction)).norm(dim=1).max() <= limit:
                lo = gamma
            else:
                hi = gamma
        return mu - lo * direction


class LabelFlip(Attack):
    name = "label_flip"

    def corrupt_batch(self, inputs, targets, vocab):
        return inputs, (vocab - 1) - targets


class GradFlip(Attack):
    name = "grad_flip"

    def __init__(self, k: float = 4.0):
        self.k = k

    def corrupt_grad(self, grad):
        return -self.k * grad


class Replay(Attack):
    name = "replay"

    def __init__(self, delay: int = 5):
        self.history: deque = deque(maxlen=delay + 1)

    def corrupt_part(self, vector, round, honest=None):
        self.history.append(vector.clone())
        stale = self.history[0]
        return stale if stale.shape == vector.shape else vector


class LyingReducer(Attack):
    name = "lying_reducer"

    def __init__(self, k: float = 4.0):
        self.k = k

    def corrupt_aggregate(self, aggregate):
        return -self.k * aggregate


class FalseAccuser(Attack):
    name = "false_accuser"
    accuse_always = True
