"""Bounded averaging groups in the in-process harness: one round as the hops of the stage's grid.

A round of :func:`harness.train` with ``groups`` set runs the way a stage of more than ``group_size`` servers
averages (:mod:`swarm.averaging.groups`, ``docs/scaling.md``): the grid is the project's own
:class:`~swarm.averaging.groups.GroupPlan` over the peers not excluded, under a round seed
(:func:`~swarm.averaging.groups.round_seed`); hop 0 is a robust all-reduce inside each group of at most
``group_size`` peers (scored, audited, with the peers' own compressors and part histories), and each later hop one
inside each lane: its voters send their block's value with the stateless compressor of later hops
(``Compressor.stateless``), their parts are not scored (a part there is a block's aggregate), the aggregate is still
audited, and listeners receive it. Attackers corrupt their parts at every hop they vote in and their partitions'
aggregates at every hop they reduce in.

``placement`` says where the attackers sit:

* ``"random"``: the grid of the round's seed, as every honest server computes it (attackers land by chance);
* ``"together"``: of ``tries`` seeds, the grid that puts the attackers closest together (the largest attacker share
  of a hop-0 group, then the most lanes with half their voters bad): what attackers who ground their keys for one
  known round get (``bench/simulate.py --grind``), here in *every* round, which key grinding cannot do (each round
  reshuffles the grid), so an upper bound on their harm.

Honest peers can end a round with different values (a lying voter sends another value in its lane than its block's
honest members send in theirs, and lanes then aggregate different inputs): the round's result is the first honest
peer's in the grid's order, and :class:`HopStats` counts such rounds (in a real stage the state check then
re-syncs the peers that differ).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from swarm.averaging.groups import GroupPlan, Lane, round_seed


@dataclass(frozen=True)
class Groups:
    """How a harness round groups its peers: ``size`` (``[averaging] group_size``, at least 3), the attackers'
    ``placement`` (``"random"`` or ``"together"``) and the seeds ``"together"`` tries each round."""

    size: int
    placement: str = "random"
    tries: int = 200

    def __post_init__(self):
        if self.size < 3:
            raise ValueError(f"group size must be at least 3, got {self.size}")
        if self.placement not in ("random", "together"):
            raise ValueError(f"placement must be 'random' or 'together', got {self.placement!r}")


@dataclass
class HopStats:
    """What the grouped rounds of one run did: hops per round, rounds whose honest peers ended with different
    values, and hop-0 groups / later lanes in which at least half the voters were attackers."""

    rounds: int = 0
    hops: int = 0
    divergent_rounds: int = 0
    bad_groups: int = 0
    bad_lanes: int = 0
    groups: int = 0
    lanes: int = 0
    sizes: list = field(default_factory=list)


def _bad_share(lane: Lane, bad: set[str]) -> float:
    return sum(v in bad for v in lane.voters) / len(lane.voters)


def _badness(plan: GroupPlan, attackers: set[str]) -> tuple[float, int]:
    """(the largest attacker share of a hop-0 group, lanes of later hops with at least half their voters bad),
    a voter counting as bad when it is an attacker or its hop-0 group has an attacker majority."""
    hop0 = plan.hops[0] if plan.hops else []
    worst = max((_bad_share(lane, attackers) for lane in hop0), default=0.0)
    bad = set(attackers) | {p for lane in hop0 if _bad_share(lane, attackers) >= 0.5 for p in lane.members}
    later = sum(_bad_share(lane, bad) >= 0.5 for lanes in plan.hops[1:] for lane in lanes)
    return worst, later


def grid(members: list[int], attackers: set[int], groups: Groups, r: int, seed: int) -> GroupPlan:
    """Round ``r``'s grid over ``members`` (peer indices) under ``groups.placement`` (module docstring)."""
    ids, bad = [str(i) for i in members], {str(i) for i in attackers if i in members}
    if groups.placement == "random" or not bad:
        return GroupPlan(ids, round_seed(f"bench{seed}", r), groups.size)
    plans = (GroupPlan(ids, round_seed(f"bench{seed}", r * groups.tries + k), groups.size)
             for k in range(groups.tries))
    return max(plans, key=lambda plan: _badness(plan, bad))


def hop_round(all_reduce, grads: dict, attackers: dict, compressors: list, plan: GroupPlan, stats: HopStats
              ) -> tuple[list[torch.Tensor], float]:
    """One round over ``plan``'s hops; returns (the round's result, encoded bytes a peer sent, averaged over the
    groups of each hop and summed over the hops).

    :param all_reduce: ``all_reduce(values, voters, compressors, hop, label) -> (peer -> tensors, bytes)``, one
        group's robust all-reduce (:func:`harness._all_reduce` with the run's rule, books and audits bound).
    :param grads: peer index -> its gradient tensors (its input to hop 0).
    """
    values, sent = dict(grads), 0.0
    stateless = [c.stateless() for c in compressors]
    bad = {str(i) for i in attackers}
    for hop, lanes in enumerate(plan.hops):
        hop_bytes = []
        for k, lane in enumerate(lanes):
            voters = [int(p) for p in lane.voters]
            outs, nbytes = all_reduce({i: values[i] for i in voters}, voters, compressors if hop == 0 else stateless,
                                      hop, f"{hop}.{k}")
            hop_bytes.append(nbytes)
            values.update(outs)
            values.update({int(p): outs[voters[0]] for p in lane.listeners})
            share = _bad_share(lane, bad)
            if hop == 0:
                stats.groups += 1
                stats.bad_groups += share >= 0.5
                stats.sizes.append(len(voters))
            else:
                stats.lanes += 1
                stats.bad_lanes += share >= 0.5
        sent += sum(hop_bytes) / max(1, len(hop_bytes))
    stats.rounds += 1
    stats.hops += plan.depth
    honest = [int(p) for p in plan.order if int(p) not in attackers] or [int(p) for p in plan.order]
    result = values[honest[0]]
    if any(not all(torch.equal(a, b) for a, b in zip(values[i], result)) for i in honest[1:]):
        stats.divergent_rounds += 1
    return result, sent
