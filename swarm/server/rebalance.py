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
* the moves are planned for the whole pipeline at once (:func:`plan_moves`): the server whose move helps most
  (ties: from the stage it leaves with the most throughput, then the lower stage, then the lowest peer id), then
  the best move on the throughputs that leaves, and so on while one passes these tests, so a crowd does not
  stampede to the bottleneck and back (each step counts the moves before it), and a large loss is refilled in one
  period rather than one server per stage and period (at most a quarter of a stage's servers leave it in one
  plan, :data:`MAX_SHARE_MOVED`).

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

import math
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


MAX_SHARE_MOVED = 0.25
"""The most of a stage's live servers (rounded down, at least one) one rebalancing plan moves away from it."""


def _best_move(supply: dict[int, float], live: dict[int, list[ServerInfo]], min_gain: float
               ) -> Optional[tuple[ServerInfo, int, int]]:
    """``(server, its stage, stage to move to)`` of the one move that raises the pipeline's throughput most on
    ``supply`` (samples/s per stage) and passes the module docstring's tests, or None. Ties: the stage left with
    the most throughput, then the lower stage, then the lower peer id. O(servers)."""
    current, best, key = min(supply.values()), None, None
    for stage, group in sorted(live.items()):
        if len(group) < 2:
            continue  # a server never leaves a stage it serves alone
        bottleneck = min((k for k in supply if k != stage), key=lambda k: (supply[k], k), default=None)
        if bottleneck is None:
            return None
        rest = min((v for k, v in supply.items() if k not in (stage, bottleneck)), default=math.inf)
        gains = [(min(rest, supply[stage] - s.throughput, supply[bottleneck] + s.throughput), s) for s in group]
        top = max(g for g, _ in gains)
        mover = min((s for g, s in gains if g >= top * (1 - 1e-9)), key=lambda s: s.peer_id)
        left = supply[stage] - mover.throughput
        gains_enough = top >= (1 + min_gain) * current  # one move lifts the pipeline by min_gain (a small stage)
        stays_ahead = left >= (1 + min_gain) * (supply[bottleneck] + mover.throughput)  # a large stage
        if top > current and (gains_enough or stays_ahead) and (
                key is None or top > key[0] * (1 + 1e-9) or (top >= key[0] * (1 - 1e-9) and left > key[1])):
            best, key = (mover, stage, bottleneck), (top, left)
    return best


def plan_moves(servers: dict[int, list[ServerInfo]], min_gain: float) -> dict[str, int]:
    """Peer id -> the stage it should move to now, for the whole pipeline (see the module docstring): the best
    move (:func:`_best_move`), then the best move on the throughputs that move leaves, and so on while one passes.
    Every server computes the same plan from the same records; O(moves x servers).

    It ends where moving one server per stage and period would end (each step passes the same tests on the figures
    the steps before it leave), one period after a loss rather than one per server moved: when 10% of 10,000
    servers left one stage, one move per stage and period had not refilled it after 1,740 s, a plan did in 360 s
    (``bench/simulate.py``, docs/scaling.md); and several stages refilling the same bottleneck in one period each
    sent a server to it, on the same figures.
    A server planned to move is not moved again in the same plan, and a plan moves at most :data:`MAX_SHARE_MOVED`
    of a stage's servers (at least one): false claims where every claim counts (docs/threat-model.md) move that
    many of a stage's servers a period, not all.
    """
    supply = stage_supply(servers)
    if not supply:
        return {}
    live = {k: [s for s in group if s.state != ServerState.DRAINING] for k, group in servers.items()}
    quota = {k: max(1, math.floor(MAX_SHARE_MOVED * len(group))) for k, group in live.items()}
    moves: dict[str, int] = {}
    while (step := _best_move(supply, {k: g for k, g in live.items() if quota[k] > 0}, min_gain)) is not None:
        server, stage, target = step
        supply[stage] -= server.throughput
        supply[target] += server.throughput
        live[stage].remove(server)
        quota[stage] -= 1
        moves[server.peer_id] = target
    return moves


def plan_move(me: str, servers: dict[int, list[ServerInfo]], min_gain: float) -> Optional[int]:
    """The stage server ``me`` should move to now, or None (:func:`plan_moves`)."""
    return plan_moves(servers, min_gain).get(me)


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

    def check(self, me: str, servers: dict[int, list[ServerInfo]]) -> Optional[int]:
        """The stage to move to now: the one this check plans (:func:`plan_move`), if the checks before it planned
        it too, for at least ``confirm_s`` seconds and at least one earlier check."""
        return self.confirm(plan_move(me, servers, self.min_gain))

    def confirm(self, planned: Optional[int]) -> Optional[int]:
        """As :meth:`check`, on a stage this check planned (None: no move), e.g. from one :func:`plan_moves` shared by
        the planners of several servers (the simulator)."""
        now = self.clock()
        if planned is None or planned != self.pending:
            self.pending, self.since = planned, now
            return None
        if now - self.since < self.confirm_s:
            return None
        self.pending = None
        return planned


__all__ = ["MovePlanner", "capped_claims", "choose_stage", "plan_move", "plan_moves", "stage_demand", "stage_supply"]
