"""Byzantine behaviours for tests and benchmarks. Never enabled by default: a peer runs one only when the
test or benchmark that starts it says so (``SWARM_BYZANTINE``, documented as a test-only setting).

A server-side :class:`Attack` corrupts what the peer sends into the all-reduce (:meth:`Attack.corrupt_part`)
or, as a reducer, the aggregate it returns (:meth:`Attack.corrupt_aggregate`); a trainer-side one corrupts its
micro-batches (:meth:`Attack.corrupt_batch`) or the output gradients it relays (:meth:`Attack.corrupt_grad`).
Omniscient attacks (ALIE, IPM) use the honest peers' vectors when the caller has them (the in-process
harness); a real peer knows only its own, which then stands in for the honest mean.

* ``sign_flip`` — sends ``-k x`` (k = 4).
* ``noise`` — sends ``x`` plus Gaussian noise of ``scale`` (100) times the RMS of ``x``.
* ``alie`` — "A Little Is Enough" (Baruch et al., NeurIPS 2019, sec. 3): ``mu - z sigma`` per coordinate,
  ``z`` from the group size and the number of attackers (their eq. for ``z_max``).
* ``ipm`` — inner-product manipulation (Xie et al., UAI 2019, sec. 3): ``-eps * mu`` (eps = 0.5).
* ``label_flip`` — trains on ``vocab - 1 - target`` instead of the target (trainer).
* ``grad_flip`` — relays output gradients times ``-k`` (trainer).
* ``replay`` — sends the vector of ``delay`` (5) rounds ago.
* ``lying_reducer`` — returns ``-k`` times the true aggregate of its partition.
* ``false_accuser`` — accuses every reducer it audits of a wrong aggregate (:mod:`swarm.averaging.audit`).
"""

from __future__ import annotations

import math
from collections import deque
from typing import Optional

import torch

ATTACKS = ("sign_flip", "noise", "alie", "ipm", "label_flip", "grad_flip", "replay", "lying_reducer", "false_accuser")
TRAINER_ATTACKS = ("label_flip", "grad_flip")


class Attack:
    """Honest by default: every hook returns its input unchanged."""

    name = "none"

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


def make_attack(name: Optional[str], *, n: int = 7, f: int = 2, seed: int = 0) -> Optional[Attack]:
    """The attack called ``name`` (see :data:`ATTACKS`), or None for ``None``/``""``/``"none"``.
    ``n``/``f``: group size and attackers (ALIE's z). Raises ValueError for an unknown name."""
    if not name or name == "none":
        return None
    table = {"sign_flip": SignFlip, "noise": lambda: Noise(seed=seed), "alie": lambda: ALIE(n, f), "ipm": IPM,
             "label_flip": LabelFlip, "grad_flip": GradFlip, "replay": Replay, "lying_reducer": LyingReducer,
             "false_accuser": FalseAccuser}
    if name not in table:
        raise ValueError(f"unknown attack {name!r}; choose one of {list(ATTACKS)}")
    return table[name]()
