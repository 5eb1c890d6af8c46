"""Attacks that know the rule: tuned against the configured aggregator and checks, timed, or aimed at the gaps
around the rule (claimed weights, partitions the attackers reduce, exact zeros). The package docstring lists them.

They need what only the in-process harness (``bench/harness.py``) hands them: the honest peers' vectors, and the
coordinates the attackers reduce (:meth:`~swarm.attacks.named.Attack.focus`); a real peer knows only its own
vector, which then stands in for the honest mean (their lie then shrinks to what its own vector allows).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from swarm.averaging.history import PartHistory
from swarm.averaging.reducer import ReducePolicy
from swarm.attacks.named import ALIE, IPM, Attack, SignFlip

Probe = Callable[[torch.Tensor, torch.Tensor], tuple[float, bool]]
"""``probe(honest (h, numel), bad (numel,))`` -> (how far the aggregate lands from the honest mean, L2, when every
attacker sends ``bad``; whether any attacker's part would be rejected or flagged): the configured rule and the
reducer's checks, run by the attackers."""


class Tuned(Attack):
    """ALIE or IPM with its scale tuned every round against the configured rule (the "optimal" variants of ByzFL,
    Allouah et al. 2023, after Shejwalkar & Houmansadr, NDSS 2021): ``mu - z sigma`` (ALIE) or ``-z mu`` (IPM),
    ``z`` from a grid of ``evals`` scales, the one whose aggregate lands farthest from the honest mean while no
    attacker's part is rejected or flagged (flags lead to exclusion). Every attacker runs the same search, once a
    round, and sends the same vector. Without a probe or the honest vectors it is the untuned attack
    (:class:`~swarm.attacks.named.ALIE` for ``n``, ``f``, or :class:`~swarm.attacks.named.IPM`)."""

    def __init__(self, kind: str, probe: Optional[Probe], evals: int = 16, n: int = 7, f: int = 2):
        if kind not in ("alie", "ipm"):
            raise ValueError(f"kind must be 'alie' or 'ipm', got {kind!r}")
        self.kind, self.probe, self.name = kind, probe, f"{kind}_tuned"
        self.untuned = ALIE(n, f) if kind == "alie" else IPM()
        self.scales = torch.logspace(-1, 1.5, evals).tolist() if kind == "alie" else torch.linspace(
            -0.5, 4.0, evals).tolist()
        self._memo: tuple = (None, None)

    def _vector(self, mu: torch.Tensor, sigma: torch.Tensor, z: float) -> torch.Tensor:
        return mu - z * sigma if self.kind == "alie" else -z * mu

    def corrupt_part(self, vector, round, honest=None):
        if honest is None or honest.shape[0] < 2 or self.probe is None:
            return self.untuned.corrupt_part(vector, round, honest)
        key = (round, honest.data_ptr())
        if self._memo[0] == key:
            return self._memo[1]
        mu, sigma = honest.mean(0), honest.std(0)
        best, best_err = mu, -1.0
        for z in self.scales:
            bad = self._vector(mu, sigma, z)
            err, caught = self.probe(honest, bad)
            if not caught and err > best_err:
                best, best_err = bad, err
        self._memo = (key, best)
        return best


def apart(bad: torch.Tensor, honest: torch.Tensor, size: float, gen: torch.Generator) -> torch.Tensor:
    """``bad`` plus Gaussian noise of norm ``size`` times the median distance between two honest vectors ``honest``
    ``(h, numel)``: attackers who know that near copies vote once (:func:`swarm.averaging.reducer.copy_blocks`, at
    half that distance) keep their vectors that far apart (0.4: two attackers ~0.57 apart)."""
    h = honest.shape[0]
    if h < 2 or size <= 0:
        return bad
    dist = torch.cdist(honest[None].double(), honest[None].double())[0]
    typical = float(dist[torch.triu_indices(h, h, 1).unbind()].median())
    noise = torch.randn(bad.shape, generator=gen)
    return bad + (size * typical / float(noise.norm().clamp_min(1e-30))) * noise


class Apart(Attack):
    """``inner`` with each attacker's vector moved :func:`apart` from the others' (its own noise, ``size`` times
    the honest vectors' median distance): the same lie, not the same bytes."""

    def __init__(self, inner: Attack, seed: int, size: float = 0.4):
        self.inner, self.size, self.name = inner, size, inner.name
        self.claim, self.gen = inner.claim, torch.Generator().manual_seed(1_000_003 + seed)

    def focus(self, reduced_by_attackers):
        self.inner.focus(reduced_by_attackers)

    def corrupt_part(self, vector, round, honest=None):
        bad = self.inner.corrupt_part(vector, round, honest)
        if honest is None or bad is vector:
            return bad
        return apart(bad, honest, self.size, self.gen)


class Sleeper(Attack):
    """Honest for ``wake`` rounds, then ``inner`` every round: all sleepers turn together, with no score built up."""

    def __init__(self, inner: Attack, wake: int = 50):
        self.inner, self.wake, self.name = inner, wake, "sleeper"

    def corrupt_part(self, vector, round, honest=None):
        return vector if round < self.wake else self.inner.corrupt_part(vector, round, honest)


class OwnPartitions(Attack):
    """Lies (``inner``) only in the coordinates the attackers reduce themselves, honest everywhere else: no honest
    reducer ever sees a wrong part, so no honest book scores them, and their own reductions follow the rule (an
    audit finds nothing to refute); what is left is the rule's bound on the parts it was given. Untold (a real
    peer, or a compressor whose phases are not the gradient's coordinates: topk, powersgd), it lies everywhere."""

    def __init__(self, inner: Attack):
        self.inner, self.name, self.mask = inner, "own_partitions", None

    def focus(self, reduced_by_attackers):
        self.mask = reduced_by_attackers

    def corrupt_part(self, vector, round, honest=None):
        bad = self.inner.corrupt_part(vector, round, honest)
        return bad if self.mask is None else torch.where(self.mask, bad, vector)


class Drift(Attack):
    """Pushes against the honest mean as far as the outlier flags allow, every round: ``mu - d mu/|mu|`` at
    ``d = margin * outlier_ratio`` times the honest peers' median distance to their mean, one round in two far
    enough to be flagged (``2 * outlier_ratio``). With the default exclusion policy (+0.5 a flag, x0.9 a round,
    exclusion at 3) one flag every other round peaks at a score of 2.63: held just under the threshold."""

    def __init__(self, outlier_ratio: float = 3.0, margin: float = 0.9):
        self.outlier_ratio, self.margin, self.name = outlier_ratio, margin, "drift"

    def corrupt_part(self, vector, round, honest=None):
        mu = honest.mean(0) if honest is not None and honest.shape[0] >= 2 else vector
        spread = float((honest - mu).norm(dim=1).median()) if honest is not None and honest.shape[0] >= 2 else 0.0
        reach = (2.0 if round % 2 else self.margin) * self.outlier_ratio * spread
        return mu - reach * mu / mu.norm().clamp_min(1e-12)


class SlowDrift(Attack):
    """Drift that knows the history check (:class:`~swarm.averaging.history.PartHistory`): it keeps moving averages
    of the honest vectors and of its own parts, as the reducers do, and sends each round the part that brings its
    own average to ``margin * outlier_ratio`` times the honest averages' median distance from the mean of the
    others (as the reducers measure it), against the honest mean's direction; each part also stays within
    ``margin * round_ratio`` times the honest parts' median distance of the honest mean, under one round's flags.
    What is left is the push no check sees."""

    name = "slow_drift"

    def __init__(self, beta: float = PartHistory.beta, outlier_ratio: float = PartHistory.outlier_ratio,
                 margin: float = 0.9, round_ratio: float = ReducePolicy.model_fields["outlier_ratio"].default):
        self.beta, self.outlier_ratio, self.margin, self.round_ratio = beta, outlier_ratio, margin, round_ratio
        self.honest_avg: Optional[torch.Tensor] = None
        self.own_avg: Optional[torch.Tensor] = None
        self.rounds = 0

    def corrupt_part(self, vector, round, honest=None):
        if honest is None or honest.shape[0] < 2:
            return vector
        mu = honest.mean(0)
        fresh = self.honest_avg is None or self.honest_avg.shape != honest.shape
        self.rounds = 1 if fresh else self.rounds + 1
        b = min(self.beta, 1 - 1 / self.rounds)  # the reducers' averages: the plain mean of the first rounds
        self.honest_avg = honest.clone() if fresh else b * self.honest_avg + (1 - b) * honest
        own = mu if fresh or self.own_avg is None else self.own_avg
        center = self.honest_avg.mean(0)
        h = self.honest_avg.shape[0]  # the reducers measure each honest average from the mean of the others
        loo = h / (h - 1)
        reach = self.margin * self.outlier_ratio * loo * float((self.honest_avg - center).norm(dim=1).median())
        target = center - reach * center / center.norm().clamp_min(1e-12)
        part = (target - b * own) / (1 - b)
        limit = self.margin * self.round_ratio * float((honest - mu).norm(dim=1).median())
        step = part - mu
        if float(step.norm()) > limit:
            part = mu + step * (limit / float(step.norm()))
        self.own_avg = part.clone() if fresh or self.own_avg is None else b * own + (1 - b) * part
        return part


class InflatedClaim(Attack):
    """Sends ``-k`` times the honest mean and reports ``claim`` samples (1e6) for it: a weighted rule would hand
    it the weight it claims."""

    def __init__(self, k: float = 9.0, claim: float = 1e6):
        self.k, self.claim, self.name = k, claim, "inflated_claim"

    def corrupt_part(self, vector, round, honest=None):
        mu = honest.mean(0) if honest is not None and honest.shape[0] else vector
        return -self.k * mu


class Zeros(Attack):
    """Every attacker sends exact zeros: identical parts that all sit on one point (a duplicated block, and, where
    honest parts are zero too, a majority on the coordinate median), damping the step towards nothing."""

    name = "zeros"

    def corrupt_part(self, vector, round, honest=None):
        return torch.zeros_like(vector)


def own_partitions(inner: Optional[Attack] = None) -> OwnPartitions:
    """:class:`OwnPartitions` around ``inner`` (default: a sign flip, -4x)."""
    return OwnPartitions(inner or SignFlip())
