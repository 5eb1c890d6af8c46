"""Byzantine behaviours for tests and benchmarks, and the wrappers that install them from outside.

Production classes know nothing of attacks: a test or benchmark makes a peer Byzantine by building it with
one of the wrappers below (a compressor, reducer, averager or pipeline subclass), passed in where the library
takes a strategy: :func:`byzantine_optimizer` for :class:`~swarm.server.session.ServerSession` (``optimizer_factory``),
:func:`byzantine_pipeline` for :class:`~swarm.trainer.session.Trainer` (``pipeline_factory``), :func:`lying_server` for
:class:`~swarm.server.session.ServerSession` (``server_factory``: a stage server answering trainers wrongly),
:func:`lying_donor` for ``optimizer_factory`` (a state served wrongly to servers that load it);
``tests/byzantine_peer.py`` starts such a peer as its own process, and ``bench/harness.py`` calls the attacks'
hooks directly.

A server-side :class:`Attack` corrupts what the peer sends into the all-reduce (:meth:`Attack.corrupt_part`),
or, as a reducer, the aggregate it returns (:meth:`Attack.corrupt_aggregate`), or accuses honest reducers
(``accuse_always``); a trainer-side one corrupts its micro-batches (:meth:`Attack.corrupt_batch`) or the output
gradients it relays (:meth:`Attack.corrupt_grad`). Omniscient attacks (ALIE, IPM) use the honest peers' vectors
when the caller has them (the in-process harness); a real peer knows only its own, which then stands in for
the honest mean.

* ``sign_flip`` — sends ``-k x`` (k = 4).
* ``noise`` — sends ``x`` plus Gaussian noise of ``scale`` (100) times the RMS of ``x``.
* ``alie`` — "A Little Is Enough" (Baruch et al., NeurIPS 2019, sec. 3): ``mu - z sigma`` per coordinate,
  ``z`` from the group size and the number of attackers (their eq. for ``z_max``).
* ``ipm`` — inner-product manipulation (Xie et al., UAI 2019, sec. 3): ``-eps * mu`` (eps = 0.5).
* ``mimic`` — every attacker copies one honest peer's vector (Karimireddy et al., ICLR 2022, sec. 5).
* ``minmax`` — ``mu - gamma sigma`` as far as the honest vectors' own spread allows (Shejwalkar & Houmansadr,
  NDSS 2021, sec. IV-B).
* ``label_flip`` — trains on ``vocab - 1 - target`` instead of the target (trainer).
* ``grad_flip`` — relays output gradients times ``-k`` (trainer).
* ``replay`` — sends the vector of ``delay`` (5) rounds ago.
* ``lying_reducer`` — returns ``-k`` times the true aggregate of its partition.
* ``false_accuser`` — accuses every reducer it audits of a wrong aggregate (:mod:`swarm.averaging.audit`).

Adaptive attacks, which know the rule (:mod:`swarm.attacks.adaptive`; the in-process harness hands them the honest
vectors and a probe of the configured rule and checks):

* ``alie_tuned``, ``ipm_tuned`` — ALIE and IPM with the scale that moves the configured rule's aggregate farthest
  while no attacker is rejected or flagged, searched every round.
* ``own_partitions`` — a sign flip only in the partitions the attackers reduce themselves (honest elsewhere).
* ``sleeper`` — honest for 50 rounds, then ``alie_tuned``, all together.
* ``drift`` — against the honest mean, as far as the outlier flags allow, flagged one round in two: its
  exclusion score stays just under the threshold.
* ``inflated_claim`` — ``-9`` times the honest mean, reporting 1e6 samples.
* ``zeros`` — exact zeros from every attacker.
* ``slow_drift`` — drift that also knows the history check: its moving average held just inside the flag radius.
* ``near_copies`` — mimic, each copy moved by 0.05 times the honest parts' median distance: not bit-identical, and
  with the copied part a majority of near copies whenever ``f + 1 > n / 2``. The tuned attacks, sleeper, both
  drifts and inflated_claim move each attacker's vector 0.4 apart, so that near copies do not vote once.

:class:`LyingStageServer` answers a fraction of its training forwards and backwards with noise added to its
outputs or input gradients (caught by trainers' spot checks, :mod:`swarm.trust.spotcheck`).
:class:`LyingDonorAverager` hands servers that load the stage's state from it a corrupted one (caught by
:mod:`swarm.trust.statecheck`); :func:`lying_donor` installs it.
"""


from __future__ import annotations

from functools import partial
from typing import Optional

import torch

from swarm.attacks.adaptive import Apart, Drift, InflatedClaim, Probe, Sleeper, SlowDrift, Tuned, Zeros, own_partitions
from swarm.attacks.named import (ALIE, IPM, Attack, FalseAccuser, GradFlip, LabelFlip, LyingReducer, Mimic, MinMax,
                                 Noise, Replay, SignFlip)
from swarm.averaging.allreduce import PartitionReducer
from swarm.averaging.averager import RobustGradientAverager, RobustStateAverager
from swarm.averaging.compression import Compressor, PhaseGenerator, flatten, make_compressor, unflatten
from swarm.averaging.optimizer import StageOptimizer
from swarm.averaging.reducer import Reduction
from swarm.trainer.pipeline import RemotePipeline
from swarm.server.stage import StageServer

ATTACKS = ("sign_flip", "noise", "alie", "ipm", "mimic", "minmax", "label_flip", "grad_flip", "replay", "lying_reducer",
           "false_accuser")
ADAPTIVE_ATTACKS = ("alie_tuned", "ipm_tuned", "own_partitions", "sleeper", "drift", "slow_drift", "inflated_claim",
                    "zeros", "near_copies")
"""Attacks that know the rule (:mod:`swarm.attacks.adaptive`); part of :data:`ATTACKS`."""
APART = ("alie_tuned", "ipm_tuned", "sleeper", "drift", "slow_drift", "inflated_claim", "near_copies")
"""Attacks whose attackers would all send one vector: each moves its own :func:`~swarm.attacks.adaptive.apart` (near
copies vote once)."""
ATTACKS = ATTACKS + ADAPTIVE_ATTACKS
TRAINER_ATTACKS = ("label_flip", "grad_flip")
SERVER_LIES = ("lying_server",)
"""Attacks on trainers by a stage server (:class:`LyingStageServer`), installed with :func:`lying_server`."""




def make_attack(name: Optional[str], *, n: int = 7, f: int = 2, seed: int = 0,
                probe: Optional[Probe] = None) -> Optional[Attack]:
    """The attack called ``name`` (see :data:`ATTACKS`), or None for ``None``/``""``/``"none"``.
    ``n``/``f``: group size and attackers (ALIE's z); ``probe``: the configured rule and checks, for the tuned
    attacks (without one they are plain ALIE and IPM). Raises ValueError for an unknown name."""
    if not name or name == "none":
        return None
    table = {"sign_flip": SignFlip, "noise": lambda: Noise(seed=seed), "alie": lambda: ALIE(n, f), "ipm": IPM,
             "mimic": Mimic, "minmax": MinMax,
             "label_flip": LabelFlip, "grad_flip": GradFlip, "replay": Replay, "lying_reducer": LyingReducer,
             "false_accuser": FalseAccuser, "alie_tuned": lambda: Tuned("alie", probe, n=n, f=f),
             "ipm_tuned": lambda: Tuned("ipm", probe), "own_partitions": own_partitions,
             "sleeper": lambda: Sleeper(Tuned("alie", probe, n=n, f=f)), "drift": Drift, "inflated_claim": InflatedClaim,
             "zeros": Zeros, "near_copies": Mimic, "slow_drift": SlowDrift}
    if name not in table:
        raise ValueError(f"unknown attack {name!r}; choose one of {list(ATTACKS)}")
    attack = table[name]()
    if name in APART:  # attackers who know that copies vote once keep their vectors apart
        attack = Apart(attack, seed, size=0.05 if name == "near_copies" else 0.4)
        attack.name = name
    return attack


# ---- installing an attack from outside ------------------------------------------------------------------
class CorruptingCompressor(Compressor):
    """Wraps a peer's compressor: the vector it is asked to average is replaced by :meth:`Attack.corrupt_part`
    first, then compressed as usual (with the wrapped compressor's error feedback)."""

    def __init__(self, inner: Compressor, attack: Attack):
        self.inner, self.attack, self.name, self.rounds = inner, attack, inner.name, 0

    def phases(self, tensors, seed: int) -> PhaseGenerator:
        self.rounds += 1
        corrupted = unflatten(self.attack.corrupt_part(flatten(tensors), self.rounds), tensors)
        return (yield from self.inner.phases(corrupted, seed))

    def reset(self) -> None:
        self.inner.reset()

    def stateless(self) -> Compressor:
        return CorruptingCompressor(self.inner.stateless(), self.attack)


class LyingPartitionReducer(PartitionReducer):
    """A reducer that returns :meth:`Attack.corrupt_aggregate` of the true aggregate of its partition (and signs
    the receipt over what it returned)."""

    def __init__(self, *, attack: Attack, **fields):
        super().__init__(**fields)
        self.attack = attack

    def _aggregate(self, parts: dict, weights: dict) -> Reduction:
        honest = super()._aggregate(parts, weights)
        return Reduction(self.attack.corrupt_aggregate(honest.aggregate), honest.verdicts)


class ByzantineGradientAverager(RobustGradientAverager):
    """A gradient averager that runs ``attack`` in every role: as a sender (:class:`CorruptingCompressor`), as a
    reducer (:class:`LyingPartitionReducer`) and as an auditor (``accuse_always``: every audited reducer is accused)."""

    def __init__(self, parameters, *, attack: Attack, compressor: Optional[Compressor] = None, **kwargs):
        self.attack = attack
        super().__init__(parameters, compressor=CorruptingCompressor(compressor or make_compressor("none"), attack),
                         **kwargs)

    def _new_reducer(self, **fields) -> PartitionReducer:
        return LyingPartitionReducer(attack=self.attack, **fields)

    def _judge_aggregate(self, received, recomputed, codec) -> tuple[bool, float]:
        ok, rel = super()._judge_aggregate(received, recomputed, codec)
        return (False, rel) if self.attack.accuse_always else (ok, rel)


class AttackingPipeline(RemotePipeline):
    """A trainer's pipeline that corrupts its micro-batches (:meth:`Attack.corrupt_batch`) and the output
    gradients it relays between stages (:meth:`Attack.corrupt_grad`)."""

    def __init__(self, *args, attack: Attack, **kwargs):
        super().__init__(*args, **kwargs)
        self.attack = attack

    async def run(self, inputs: torch.Tensor, targets: torch.Tensor, *, train: bool) -> float:
        if train:
            inputs, targets = self.attack.corrupt_batch(inputs, targets, self.spec.model.vocab_size)
        return await super().run(inputs, targets, train=train)

    async def backward(self, stage, mb_id, grad, inputs, forward_server):
        if grad is not None:
            grad = self.attack.corrupt_grad(grad)
        return await super().backward(stage, mb_id, grad, inputs, forward_server)


def byzantine_optimizer(name: str, **attack_kwargs):
    """A :data:`~swarm.server.session.OptimizerFactory` whose stage optimizer's gradient averager runs attack ``name``.

    :raises ValueError: unknown attack name, or a trainer-side one (:data:`TRAINER_ATTACKS`).
    """
    if name in TRAINER_ATTACKS:
        raise ValueError(f"{name!r} is a trainer attack; use byzantine_pipeline")
    attack = make_attack(name, **attack_kwargs)
    return partial(StageOptimizer, averager_factory=partial(ByzantineGradientAverager, attack=attack))


def byzantine_pipeline(name: str, **attack_kwargs):
    """A :data:`~swarm.trainer.session.PipelineFactory` whose pipeline runs trainer attack ``name``.

    :raises ValueError: unknown attack name, or a server-side one.
    """
    if name not in TRAINER_ATTACKS:
        raise ValueError(f"{name!r} is a server attack; use byzantine_optimizer")
    return partial(AttackingPipeline, attack=make_attack(name, **attack_kwargs))


class LyingStageServer(StageServer):
    """A stage server that answers a ``fraction`` of its training ``calls`` (forwards, backwards) wrongly: its
    outputs, or its input gradient, plus Gaussian noise of ``scale`` times their own standard deviation. Its check-mode
    answers (:mod:`swarm.trust.spotcheck`) are honest, so it is never the odd one out when it checks others."""

    def __init__(self, *args, fraction: float = 0.1, scale: float = 1.0, seed: int = 0,
                 calls: tuple[str, ...] = ("forward", "backward"), **kwargs):
        super().__init__(*args, **kwargs)
        self.fraction, self.scale, self.calls = fraction, scale, calls
        self.lies = 0
        self._rng = torch.Generator().manual_seed(seed)

    def _lie(self, t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        if t is None or float(torch.rand((), generator=self._rng)) >= self.fraction:
            return t
        self.lies += 1
        noise = torch.randn(t.shape, generator=self._rng, dtype=t.dtype)
        return t + noise * self.scale * t.float().std().clamp_min(1e-6)

    def forward(self, key, x, targets, train):
        out, loss = super().forward(key, x, targets, train)
        return (self._lie(out), loss) if train and "forward" in self.calls else (out, loss)

    def backward(self, key, grad_out, x):
        grad = super().backward(key, grad_out, x)
        return self._lie(grad) if "backward" in self.calls else grad


def lying_server(fraction: float = 0.1, **kwargs):
    """A :data:`~swarm.server.session.StageServerFactory` building :class:`LyingStageServer` (lying on ``fraction``)."""
    return partial(LyingStageServer, fraction=fraction, **kwargs)


class LyingDonorAverager(RobustStateAverager):
    """A stage state averager that hands servers loading the stage's state (:mod:`swarm.averaging.donors`) its
    parameters plus Gaussian noise of ``scale`` times each one's standard deviation, and declares a donor
    priority ``boost`` epochs above its own so that it is asked first. Caught by :mod:`swarm.trust.statecheck`."""

    def __init__(self, *, scale: float = 1.0, boost: float = 1000.0, seed: int = 0, **kwargs):
        self.scale, self.boost, self.seed, self.lies = scale, boost, seed, 0
        super().__init__(**kwargs)

    @property
    def state_sharing_priority(self) -> float:
        return RobustStateAverager.state_sharing_priority.fget(self) + self.boost

    @state_sharing_priority.setter
    def state_sharing_priority(self, value: float) -> None:
        RobustStateAverager.state_sharing_priority.fset(self, value)

    def get_current_state(self):
        metadata, tensors, infos = super().get_current_state()
        params = sum(len(group["params"]) for group in self.optimizer.param_groups)
        gen = torch.Generator().manual_seed(self.seed + self.lies)
        self.lies += 1
        lied = [t + self.scale * t.std().clamp_min(1e-6) * torch.randn(t.shape, generator=gen) if i < params else t
                for i, t in enumerate(tensors)]
        return metadata, lied, infos


def lying_donor(**kwargs):
    """An :data:`~swarm.server.session.OptimizerFactory` whose stage optimizer serves a corrupted state to servers that
    load it (:class:`LyingDonorAverager`)."""
    return partial(StageOptimizer, state_averager_factory=partial(LyingDonorAverager, **kwargs))

