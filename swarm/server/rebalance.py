"""Which stage a server serves: the bottleneck when it joins, and a move to the stage that most lacks throughput
later (adaptive rebalancing, with hysteresis).

A joining server picks the stage whose servers together have the least throughput, the pipeline's bottleneck
(:func:`choose_stage`; Petals' block choice, Borzunov et al., "Distributed Inference and Fine-tuning of LLMs over
the Internet", 2023, sec. 3.2).

SWARM parallelism (Ryabinin et al., ICML 2023, sec. 3.3) moves peers from the fastest stages to the
pipeline's bottleneck; its public code never shipped it. Petals (Borzunov et al., 2023, sec. 3.2) uses the
same idea to choose blocks for inference servers. Here, every ``rebalance.period_s`` each movable server
evaluates :func:`plan_move` on the announced throughputs (samples/s) of the online and joining servers
(records announced within the last two re-announce periods: a dead server's record lingers until it expires,
and a busy live server's announcement may come a little late):

* the pipeline's throughput is its slowest stage's, ``min_k T_k`` with ``T_k`` the sum over stage ``k``'s
  servers;
* moving server ``i`` (throughput ``t_i``) from stage ``s`` to the bottleneck ``b`` gives
  ``T_s - t_i`` and ``T_b + t_i``; the move is made only if it raises the minimum and either the new minimum is
  at least ``(1 + min_gain)`` times the old one (a small stage, where one server is much of it) or the stage it
  leaves still has at least ``(1 + min_gain)`` times the bottleneck's throughput after it (a large stage: there
  one server's move never lifts the pipeline by ``min_gain``, and without this test a stage of 40 servers that
  lost 16 was never refilled, ``bench/simulate.py``); a server never leaves a stage it serves alone;
* only the stage's server whose move helps most (ties: lowest peer id) moves in a period, so a crowd does
  not stampede to the bottleneck and back.

The reverse move cannot also pass either test on the same figures. Throughputs are re-measured on every
join and a view of the DHT can be momentarily partial (a late announcement, a record just appeared, a dead
server's record not expired yet), so a server moves only when consecutive checks keep planning the same move
for at least the two re-announce periods a record counts (:class:`MovePlanner`), and ``min_dwell_s`` between
moves of one server bounds churn when throughputs are noisy. A moving server drains, restores the new
stage's state (from its live servers or its checkpoint) and only then announces itself online there. The
throughput of a stage is the sum of its servers' claims as counted (:func:`~swarm.server.served.counted_claims`),
each capped at the stage's upper median where three or more claim (:func:`capped_claims`).
"""

from __future__ import annotations

import random
import time
from typing import Callable, Optional

from swarm.config import ModelSpec
from swarm.protocol import ServerInfo, ServerState


def stage_demand(spec: ModelSpec) -> list[float]:
    """Relative compute per micro-batch of each stage (blocks, plus the LM head as ~1 block for the last)."""
    head = spec.vocab_size / (12 * spec.d_model)  # head matmul vs. a block's ~12 d^2 per token
    demand = [float(n) for n in spec.stage_layers]
    demand[-1] += head
    return demand


def choose_stage(spec: ModelSpec, servers: dict[int, list[ServerInfo]], rng: Optional[random.Random] = None) -> int:
    """The pipeline's bottleneck: the stage whose servers together announce the least throughput (samples/s).

    Ties (e.g. several empty stages) go to the stage with the most compute per micro-batch
    (:func:`stage_demand`), then at random. Joining servers count with the throughput they announce, so
    peers starting one after another spread over the stages; draining servers do not count.
    """
    rng = rng or random.Random()
    demand = stage_demand(spec)
    supply = [sum(s.throughput for s in servers.get(k, []) if s.state != ServerState.DRAINING)
              for k in range(spec.num_stages)]
    least = min(supply)
    tied = [k for k in range(spec.num_stages) if supply[k] <= least * (1 + 1e-9)]
    costliest = max(demand[k] for k in tied)
    return rng.choice([k for k in tied if demand[k] >= costliest * (1 - 1e-9)])


MIN_CAPPED = 3
"""Counted claims of a stage from which each is capped at their median (:func:`capped_claims`)."""


def capped_claims(group: list[ServerInfo]) -> list[ServerInfo]:
    """``group`` with every throughput claim above the stage's upper median cut to it, where at least
    :data:`MIN_CAPPED` servers (not draining) claim a throughput above 0; else ``group`` as it is.

    A claim is a figure nobody checks (trainers route on what they observe, :mod:`swarm.trainer.routing`, but a
    stage's supply for rebalancing is the sum of its claims), so one key that did honest work and then claims 10^4
    samples/s (``bench/sybil.py``'s patient key, before its stage-mates notice it stopped:
    :func:`~swarm.server.served.still_working`; or one that keeps averaging and lies) made its stage look served.
    With fewer than half of the counted servers lying, the upper median is at most an honest claim, so each liar
    counts as at most an honest server does: the Byzantine fraction the aggregators assume, applied to the supply
    (coordinate-wise median, Yin et al. 2018). The price: on a stage of mixed hardware its fast servers count as its
    median one, so rebalancing sees that stage as weaker than it is (it may send it a joiner it did not need;
    trainers still route by what they observe)."""
    claims = sorted(s.throughput for s in group if s.state != ServerState.DRAINING and s.throughput > 0)
    if len(claims) < MIN_CAPPED:
        return group
    cap = claims[len(claims) // 2]
    return [s.model_copy(update={"throughput": cap}) if s.throughput > cap else s for s in group]


def stage_supply(servers: dict[int, list[ServerInfo]]) -> dict[int, float]:
    """Samples/s per stage from its online and joining servers."""
    return {k: sum(s.throughput for s in group if s.state != ServerState.DRAINING) for k, group in servers.items()}


def choose_mover(stage: int, servers: dict[int, list[ServerInfo]], min_gain: float) -> Optional[tuple[str, int]]:
    """``(peer id, stage to move to)`` of the one server of ``stage`` whose move helps the pipeline most now, or
    None (see the module docstring). Every server of the stage computes the same answer from the same records;
    O(n) in the stage's servers.
    """
    supply = stage_supply(servers)
    if not supply or stage not in supply:
        return None
    live = [s for s in servers[stage] if s.state != ServerState.DRAINING]
    if len(live) < 2:
        return None
    bottleneck = min((k for k in supply if k != stage), key=lambda k: (supply[k], k), default=None)
    if bottleneck is None:
        return None
    current = min(supply.values())

    def after(s: ServerInfo) -> float:
        moved = dict(supply)
        moved[stage] -= s.throughput
        moved[bottleneck] += s.throughput
        return min(moved.values())

    gains = {s.peer_id: after(s) for s in live}
    top = max(gains.values())
    chosen = min(pid for pid, g in gains.items() if g >= top * (1 - 1e-9))
    moved = next(s.throughput for s in live if s.peer_id == chosen)
    gains_enough = top >= (1 + min_gain) * current  # one move lifts the pipeline by min_gain (a small stage)
    stays_ahead = supply[stage] - moved >= (1 + min_gain) * (supply[bottleneck] + moved)  # a large stage
    if top <= current or not (gains_enough or stays_ahead):
        return None
    return chosen, bottleneck


def plan_move(me: str, stage: int, servers: dict[int, list[ServerInfo]], min_gain: float) -> Optional[int]:
    """The stage server ``me`` (serving ``stage``) should move to now, or None (see the module docstring)."""
    mover = choose_mover(stage, servers, min_gain)
    return mover[1] if mover is not None and mover[0] == me else None


class MovePlanner:
    """Debounces :func:`plan_move` for one server: a move is made only when every check plans it for at least
    ``confirm_s`` seconds (the window in which a dead server's record still counts: a move the record of a
    server killed a moment ago supports, such as leaving a stage it seems to share, is never confirmed).

    ``clock`` returns seconds (monotonic).
    """

    def __init__(self, min_gain: float, confirm_s: float = 0.0, clock: Callable[[], float] = time.monotonic):
        self.min_gain, self.confirm_s, self.clock = min_gain, confirm_s, clock
        self.pending: Optional[int] = None
        self.since = 0.0

    def check(self, me: str, stage: int, servers: dict[int, list[ServerInfo]]) -> Optional[int]:
        """The stage to move to now: the one this check plans, if the checks before it planned it too, for at
        least ``confirm_s`` seconds and at least one earlier check."""
        planned, now = plan_move(me, stage, servers, self.min_gain), self.clock()
        if planned is None or planned != self.pending:
            self.pending, self.since = planned, now
            return None
        if now - self.since < self.confirm_s:
            return None
        self.pending = None
        return planned


__all__ = ["MovePlanner", "choose_mover", "choose_stage", "plan_move", "stage_demand", "stage_supply"]
