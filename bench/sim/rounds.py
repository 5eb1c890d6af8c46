"""One averaging round of one stage, as the servers' own code plans and checks it.

Every server of the stage plans the round's hops from *its* members (:class:`swarm.averaging.groups.GroupPlan`
over :meth:`swarm.averaging.membership.MemberTable.at` the round's start, the table holding the records it read),
its last read being a uniformly random time within its read period (:func:`swarm.net.directory.read_period_s` at
the roster's cadence) and its round's start up to ``START_SPREAD_S`` after the stage's first: servers whose
tables differ plan different grids. At each hop the servers that
computed the same lane key meet (matchmaking under that key), and each checks the group it got with the servers'
own :func:`swarm.averaging.hops.whole_enough`; a server that fails a hop fails the round and takes no part in
later hops, so its block's voters are missing there. A server that left before the round ended is absent.

Time: a lane gathers in ``GATHER_RTTS`` round trips of its slowest member (matchmaking's DHT lookups and
requests, docs of ``matchmaking_time``), starts when its last member finished the hop before, and moves its
bytes at its slowest member's link rate (every member's parts and aggregates go through its own link; the
butterfly waits for the last). A server whose hops end past ``averaging_timeout`` fails the round, as its
averager gives it up.

Byzantine servers: a lane's aggregate is *corrupted* when half or more of its voters are Byzantine or carry a
block whose earlier hop was corrupted (the robust rules hold below half, docs/averaging.md); every member leaves
the lane holding its aggregate.

What this leaves out: matchmaking's timing (two groups forming apart under one key when members arrive more than a
window apart: measured on real peers, ``docs/scaling.md``), CPU contention, and the all-reduce's own failures
(a member dying mid-transfer is counted only if it left before the round ended).
"""

from __future__ import annotations

import bisect
import math
import random
from collections import Counter, defaultdict
from dataclasses import dataclass, field

from bench.sim.world import Peer, World
from swarm.averaging.groups import GroupPlan, Lane
from swarm.averaging.hops import RoundFailed, whole_enough
from swarm.averaging.membership import QUANTUM, MemberTable

START_SPREAD_S = 0.5
"""Seconds between the first and the last server of a stage beginning one round (their epoch ends and clocks)."""
GATHER_RTTS = 10
"""Round trips a lane's matchmaking takes (DHT lookups and requests: the ``matchmaking_time`` field's doc)."""


@dataclass
class RoundResult:
    """One stage's round: who took part, who succeeded, why others failed, and what it moved."""

    members: int = 0
    succeeded: int = 0
    honest: int = 0  # honest servers that completed it
    corrupted: int = 0  # of which ended it holding a corrupted aggregate
    hops: int = 0
    causes: Counter = field(default_factory=Counter)
    bytes_per_server: float = 0.0  # averaging bytes sent + received, mean over members
    lanes: int = 0
    lane_sizes: list[int] = field(default_factory=list)
    round_s: list[float] = field(default_factory=list)  # each server that completed it: seconds from its start


def _views(world: World, stage: int, t: float, period: float, rng: random.Random, servers: list[Peer]):
    """Each server's members at its round's start: its :class:`MemberTable` holds the records it read (listed
    within the last ``2 ttl``, as of its last read, ``t`` minus a uniform draw from its read period). Servers whose
    last reads fall between the same record events (a first announcement, a last one) and whose starts round
    alike share a view. Returns (server -> view id, view id -> members)."""
    ttl = world.ttl
    seen = [p for p in world.by_stage.get(stage, {}).values()
            if p.online_s <= t and max(p.left_s, p.expires_s(ttl)) > t - 2 * ttl]
    events = sorted({p.online_s for p in seen} | {p.last_announce(p.left_s, ttl / 3) for p in seen
                                                   if math.isfinite(p.left_s)})
    q = QUANTUM * ttl
    view_of, first_read = {}, {}
    for p in servers:
        read, start = t - rng.uniform(0.0, period), t + rng.uniform(0.0, START_SPREAD_S)
        view = (bisect.bisect_right(events, read), math.floor(start / q))
        view_of[p.peer_id] = view
        first_read.setdefault(view, (read, start))
    members = {}
    for view, (read, start) in first_read.items():
        table = MemberTable(ttl)
        table.observe([world.record(p, read) for p in seen if p.online_s <= read], read)
        members[view] = sorted(table.at(start))
    return view_of, members


def _lane_s(world: World, formed: set[str], moved: dict[str, float]) -> float:
    peers = [world.peers[p] for p in formed]
    gather = GATHER_RTTS * max(p.link.rtt_ms for p in peers) / 1e3
    return gather + max(moved[p.peer_id] / 2 / (p.link.mbit * 1e6 / 8) for p in peers)


def run_round(world: World, stage: int, t: float, *, seed: bytes, group_size: int, period: float, timeout_s: float,
              vector_bytes: float, rng: random.Random) -> RoundResult:
    """Simulate stage ``stage``'s round that starts at ``t`` (seconds) and may last ``timeout_s``;
    ``vector_bytes`` is what one server's averaged tensors weigh on the wire."""
    servers = world.serving(stage, t)
    view_of, members = _views(world, stage, t, period, rng, servers)
    plans = {v: GroupPlan(m, seed, group_size) for v, m in members.items()}
    byz = {p.peer_id for p in servers if p.byzantine}
    alive = {p.peer_id for p in servers if p.left_s > t + timeout_s}
    sets = {v: set(m) for v, m in members.items()}
    plan_of = {p.peer_id: plans[view_of[p.peer_id]] for p in servers}
    listed = {p.peer_id for p in servers if p.peer_id in sets[view_of[p.peer_id]]}  # it read its own record
    inside = listed & alive
    out = RoundResult(members=len(listed))
    corrupted = {p: p in byz for p in inside}
    moved: Counter = Counter()
    finish: dict[str, float] = {}
    depth = max((plan.depth for plan in plans.values()), default=0)
    out.hops = max((plan_of[p].depth for p in inside), default=0)
    for hop in range(depth):
        by_key: dict[str, set[str]] = defaultdict(set)
        lanes: dict[str, Lane] = {}
        for p in inside:
            lane = plan_of[p].lane(p, hop)
            if lane is not None:
                by_key[lane.key_bits].add(p)
                lanes[p] = lane
        failed = set()
        for key, present in by_key.items():
            for p in present:
                try:
                    whole_enough(lanes[p], present)
                except RoundFailed as e:
                    failed.add(p)
                    out.causes[str(e).split(":")[1].split("(")[0].strip()[:60]] += 1
            formed = present - failed
            if not formed:
                continue
            lane = lanes[next(iter(formed))]
            voters = [v for v in lane.voters if v in formed]
            bad = sum(corrupted[v] for v in voters)
            out.lanes += 1
            out.lane_sizes.append(len(formed))
            v, m = len(voters), len(formed)
            hop_bytes = {p: (2 * vector_bytes * (v - 1) / v + 2 * vector_bytes * (m - 1) / v) if p in voters
                         else 2 * vector_bytes for p in formed}
            end = max(finish.get(p, 0.0) for p in formed) + _lane_s(world, formed, hop_bytes)
            for p in formed:
                corrupted[p] = 2 * bad >= len(voters) or p in byz  # a Byzantine voter lies at every hop
                moved[p] += hop_bytes[p]
                finish[p] = end
        late = {p for p in inside - failed if finish.get(p, 0.0) > timeout_s}
        out.causes["ran out of averaging_timeout"] += len(late)
        inside -= failed | late
    out.causes["left before the round ended"] += len(listed - alive)
    out.succeeded = len(inside)
    out.round_s = [finish.get(p, 0.0) for p in inside]
    out.honest = len(inside - byz)
    out.corrupted = sum(corrupted[p] for p in inside - byz)
    out.bytes_per_server = sum(moved.values()) / max(1, out.members)
    return out
