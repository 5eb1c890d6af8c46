"""The simulator's clock: churn, joins, rebalancing, rounds, routing, checkpoints and DHT traffic, tick by tick.

Each tick (``tick_s`` simulated seconds) peers leave at random (``churn_per_h`` of them an hour, replaced by as
many newcomers: a steady population), joining servers pick their stage with
:func:`swarm.server.rebalance.choose_stage`, movable servers check :class:`~swarm.server.rebalance.MovePlanner`
every ``rebalance.period_s``, each stage runs one sampled averaging round (:mod:`bench.sim.rounds`) standing for
the tick's epochs, a sample of trainers route (:mod:`bench.sim.route`), and checkpoints are written and repaired
(:mod:`bench.sim.checkpoints`). DHT traffic is counted from the peers' read and announce cadences
(:func:`swarm.net.directory.read_period_s`, ``roster_period_s``, ``record_ttl_s / 3``) and the sealed size of a
real server record.
"""

from __future__ import annotations

import functools
import hashlib
import math
import random
import statistics
from collections import Counter
from dataclasses import dataclass, field
from typing import Optional

from bench.sim.checkpoints import Shards
from bench.sim.dht import Traffic
from bench.sim.rounds import RoundResult, run_round
from bench.sim.route import flow, link_rate
from bench.sim.world import LINKS, LOOPBACK, World
from swarm.averaging.groups import round_seed, split_blocks
from swarm.config import RunSpec
from swarm.net.directory import is_fresh, read_period_s, stripes_to_read
from swarm.protocol import stage_stripe, stripe_names
from swarm.server.rebalance import MovePlanner, choose_stage, plan_moves
from swarm.trainer.routing import Router

TARGET_EPOCH = 1000
"""The epoch grinding attackers aim at (``Options.grind``): its seed is known in advance (docs/scaling.md)."""
JOIN_S = 10.0
"""Seconds from a server's start to its first announcement besides downloading the stage's state (measured on
real peers: joins took 5-11 s, docs/scaling.md)."""


@functools.lru_cache(maxsize=64)
def corrupting_positions(n: int, group_size: int) -> list[int]:
    """Positions in a grid's order of ``n`` servers (``GroupPlan``'s cut, :func:`split_blocks`) in the order key
    grinders fill them: first those that leave every lane of the last hop with half its voters bad (half, rounded
    up, of the blocks of the last hop's group, half of the blocks of each of those at the hop below, and so on down
    to half the members of each hop-0 group reached), then half of every other hop-0 group in turn (each such group
    a bad voter in the lanes above it), then the rest."""
    groups = split_blocks(list(range(n)), group_size)  # hop 0: lists of positions
    tree: list = groups
    while len(tree) > 1:
        tree = split_blocks(tree, group_size)

    def half(node) -> list[int]:
        if isinstance(node, int):
            return [node]
        return [p for child in node[:(len(node) + 1) // 2] for p in half(child)]

    order = half(tree[0]) if len(groups) > 1 else half(groups[0]) if groups else []
    taken = set(order)
    order += [p for group in groups for p in group[:(len(group) + 1) // 2] if p not in taken]
    taken = set(order)
    return order + [p for p in range(n) if p not in taken]


@dataclass
class Options:
    servers: int
    trainers: int
    hours: float = 1.0
    tick_s: float = 30.0
    churn_per_h: float = 0.3
    byzantine: float = 0.2
    leave_at_s: float = math.inf  # when 10% of the servers leave at once (from the first stages)
    route_sample: int = 32
    seed: int = 0
    links: str = "mix"  # or "loopback"
    server_flops: Optional[float] = None  # every server's FLOP/s, instead of the GPU mix
    grind: int = 0  # keys each Byzantine server tries, keeping the one that sorts first in TARGET_EPOCH's grid


@dataclass
class Tally:
    """What the run measured."""

    rounds: float = 0.0
    rounds_ok: float = 0.0
    rounds_corrupted: float = 0.0
    rounds_honest: float = 0.0
    targeted_honest: int = 0  # honest servers that completed a round of TARGET_EPOCH (Options.grind)
    targeted_corrupted: int = 0
    epochs: float = 0.0
    samples: float = 0.0
    ideal_samples: float = 0.0
    averaging_bytes: float = 0.0  # per server, summed over rounds
    hops: Counter = field(default_factory=Counter)
    round_s: list = field(default_factory=list)  # completed server-rounds, seconds
    epoch_s: list = field(default_factory=list)  # per tick
    lane_sizes: Counter = field(default_factory=Counter)
    causes: Counter = field(default_factory=Counter)
    restorable_ticks: int = 0
    stage_ticks: int = 0
    lag_epochs: list = field(default_factory=list)
    balance: list = field(default_factory=list)  # (t, pipeline / ideal)
    moves: int = 0
    picks: int = 0
    failed_picks: int = 0


class Simulation:
    def __init__(self, spec: RunSpec, opts: Options, *, demand: list[float], state_bytes: list[float],
                 vector_bytes: list[float], activation_bytes: float, record_bytes: float):
        self.spec, self.opts = spec, opts
        self.rng = random.Random(opts.seed)
        self._stripes: dict[str, str] = {}  # peer id -> its records' stripe (stage_stripe, cached)
        self.ttl = spec.timeouts.record_ttl_s
        self.world = World(demand, self.ttl, self.rng, links=LOOPBACK if opts.links == "loopback" else LINKS,
                           flops=opts.server_flops)
        self.state_bytes, self.vector_bytes, self.activation_bytes = state_bytes, vector_bytes, activation_bytes
        k = spec.checkpoint.fragments_needed
        self.shards = Shards(self.world, spec.checkpoint, [b / k for b in state_bytes], 2 << 30, self.rng)
        self.traffic = Traffic(record_bytes)
        self.tally = Tally()
        self.routers: dict[str, Router] = {}
        self.planners: dict[str, MovePlanner] = {}  # peer id -> the planner of a server planned to move
        self._ground: dict[int, int] = {}  # stage -> attackers that ground a key for it so far
        self.epoch, self.t = 0.0, 0.0
        avg = spec.averaging
        self.batch = spec.training.target_batch_size * (avg.inner_steps if avg.mode == "outer" else 1)  # samples

    # ---- joins and leaves -------------------------------------------------------------------------------
    def join_s(self, peer, stage: int) -> float:
        return JOIN_S + self.state_bytes[stage] / link_rate(peer)

    def seed(self, stage: int, epoch: int) -> bytes:
        return round_seed(f"{self.world.run_id}_stage{stage}_grad_averager", epoch)

    def ground_key(self, peer, stage: int) -> str:
        """The key, of ``grind`` tried, that puts this attacker where the attackers of the stage corrupt the targeted
        round's aggregate with the fewest of them (:func:`corrupting_positions` of the stage's expected size: half
        of each hop-0 group they aim at, under half the blocks of each group above, up to the last hop's)."""
        demand = self.world.demand  # stages fill in proportion to their compute (choose_stage)
        per_stage = max(1, round(self.opts.servers * demand[stage] / sum(demand)))
        g = max(3, self.spec.averaging.group_size)
        count = self._ground.get(stage, 0)
        self._ground[stage] = count + 1
        positions = corrupting_positions(per_stage, g)
        target = min(1.0, (positions[count % len(positions)] + 0.5) / per_stage)  # as a quantile of the order
        seed = self.seed(stage, TARGET_EPOCH)

        def quantile(key: str) -> float:  # GroupPlan's order (the attacker knows the code)
            return int.from_bytes(hashlib.blake2b(seed + key.encode(), digest_size=16).digest(), "big") / 2 ** 128

        return min((f"{peer.peer_id}-{j}" for j in range(self.opts.grind)), key=lambda k: abs(quantile(k) - target))

    def add(self, role: str, t: float, views: dict) -> None:
        peer = self.world.new_peer(role, t, self.rng.random() < self.opts.byzantine and role == "server")
        if role == "server":
            stage = choose_stage(self.spec.model, views, self.rng)
            if peer.byzantine and self.opts.grind > 1:
                self.world.rekey(peer, self.ground_key(peer, stage))
            self.world.place(peer, stage, t, self.join_s(peer, stage))
            views[stage].append(self.world.record(peer, t))

    def fresh_views(self, t: float) -> dict:
        return {k: [r for r in self.world.records(k, t) if is_fresh(r, t, self.ttl)]
                for k in range(self.spec.model.num_stages)}

    def populate(self) -> None:
        views = {k: [] for k in range(self.spec.model.num_stages)}
        for _ in range(self.opts.servers):
            self.add("server", 0.0, views)
        for _ in range(self.opts.trainers):
            self.add("trainer", 0.0, views)

    def churn(self, t: float) -> None:
        q = self.opts.churn_per_h * self.opts.tick_s / 3600
        gone = [p for p in self.world.alive(t) if self.rng.random() < q]
        if t - self.opts.tick_s < self.opts.leave_at_s <= t:
            servers = sorted(self.world.alive(t, "server"), key=lambda p: (p.stage, self.rng.random()))
            gone += servers[:len(servers) // 10]
        views = self.fresh_views(t)
        gone = list({p.peer_id: p for p in gone}.values())
        for p in gone:
            self.world.leave(p, t)
            self.shards.forget(p.peer_id)
        for p in gone if q else ():
            self.add(p.role, t, views)

    def rebalance(self, t: float, views: dict) -> None:
        period = self.spec.rebalance.period_s
        if not self.spec.rebalance.enabled or math.floor(t / period) == math.floor((t - self.opts.tick_s) / period):
            return
        plan = plan_moves(views, self.spec.rebalance.min_gain)
        for pid in [pid for pid in self.planners if pid not in plan]:
            del self.planners[pid]  # (its next check plans nothing: the plan it held is forgotten)
        for pid, stage in plan.items():
            planner = self.planners.setdefault(pid, MovePlanner(self.spec.rebalance.min_gain,
                                                                confirm_s=2 * self.ttl / 3, clock=lambda: self.t))
            target = planner.confirm(stage)  # each mover's own check, once a period as its session
            peer = self.world.peers.get(pid)
            if target is not None and peer is not None and t - peer.stage_since_s >= self.spec.rebalance.min_dwell_s:
                self.world.place(peer, target, t, self.join_s(peer, target))
                del self.planners[pid]
                self.tally.moves += 1

    # ---- one tick ---------------------------------------------------------------------------------------
    def tick(self, t: float) -> None:
        self.t = t
        self.churn(t)
        self.world.prune(t)
        views = self.fresh_views(t)
        self.rebalance(t, views)
        stages = self.spec.model.num_stages
        trainers = self.world.alive(t, "trainer")
        sample = self.rng.sample(trainers, min(len(trainers), self.opts.route_sample))
        lag = {k: self.rng.uniform(0.0, self._trainer_period(self._trainer_read(len(views[k]))[1]))
               for k in range(stages)}
        routed = {k: [r for r in self.world.records(k, t - lag[k]) if is_fresh(r, t - lag[k], self.ttl)]
                  for k in range(stages)}  # what each stage's last read returned, fresh when read
        f = flow(self.world, t, routers=self.routers, trainers=sample, views=routed, view_of=self._trainer_view,
                 micro_batch=self.spec.training.micro_batch_size, activation_bytes=self.activation_bytes,
                 scale=len(trainers) / max(1, len(sample)))
        dt, ideal = self.opts.tick_s, self.world.ideal_samples_per_s(t)
        self.tally.ideal_samples += ideal * dt
        self.tally.picks += f.picks
        self.tally.failed_picks += f.failed_picks
        supply = [sum(self.world.throughput(p, k) for p in self.world.serving(k, t)) for k in range(stages)]
        self.tally.balance.append((t, min(supply) / ideal if ideal else 0.0))
        results = self.rounds(t, views)
        if self.opts.grind > 1:
            self.targeted(t, views)
        epoch_s, round_s = self.epoch_s(f.samples_per_s, results)
        epochs = dt / epoch_s
        self.tally.samples += epochs * self.batch  # what the epochs trained (the round's wait counted)
        self.tally.epoch_s.append(epoch_s)
        self.tally_rounds(results, epochs)
        self.dht(dt, views, epochs, len(trainers))
        self.checkpoints(t, epochs)
        self.epoch += epochs
        self.tally.epochs += epochs

    def _trainer_period(self, records: int) -> float:
        return read_period_s(records, self.ttl / 6, self.ttl / 3)

    def _trainer_stripes(self, n: int) -> Optional[list[int]]:
        """The stripes one trainer's read of a stage of ``n`` servers looks up, None for all
        (:func:`~swarm.net.directory.stripes_to_read` after a read that found them all)."""
        bits = self.spec.records.stage_stripe_bits
        return stripes_to_read(n, 2 ** bits, bits, rng=self.rng)

    def _trainer_read(self, n: int) -> tuple[int, float]:
        """(stripes a trainer's read of a stage of ``n`` servers looks up, records it returns)."""
        stripes, picked = 2 ** self.spec.records.stage_stripe_bits, self._trainer_stripes(n)
        count = stripes if picked is None else len(picked)
        return count, n * count / stripes

    def _trainer_view(self, records: list) -> list:
        """The part of a stage's ``records`` one trainer's last read returned: its stripes (all of them on a small
        or unstriped stage)."""
        picked = self._trainer_stripes(len(records))
        if picked is None:
            return records
        names = stripe_names(self.spec.records.stage_stripe_bits)
        chosen = {names[i] for i in picked}
        return [r for r in records if self._stripe_of(r.peer_id) in chosen]

    def _stripe_of(self, peer_id: str) -> str:
        stripe = self._stripes.get(peer_id)
        if stripe is None:
            stripe = self._stripes[peer_id] = stage_stripe(peer_id, self.spec.records.stage_stripe_bits)
        return stripe

    def _roster_period(self, records: int) -> float:
        return read_period_s(records, self.ttl / 15, self.ttl / 3)

    def rounds(self, t: float, views: dict) -> list[RoundResult]:
        """Each stage's round starting at ``t``."""
        g, out = self.spec.averaging.group_size, []
        for k in range(self.spec.model.num_stages):
            n = len(views[k])
            seed = self.seed(k, int(self.epoch))
            out.append(run_round(self.world, k, t, seed=seed, group_size=g or max(3, n),
                                 period=self._roster_period(n), timeout_s=self.spec.averaging.averaging_timeout,
                                 vector_bytes=self.vector_bytes[k], rng=self.rng))
        return out

    def targeted(self, t: float, views: dict) -> None:
        """The round of :data:`TARGET_EPOCH` as the stage stands now: what grinding attackers get."""
        g = self.spec.averaging.group_size
        for k in range(self.spec.model.num_stages):
            n = len(views[k])
            r = run_round(self.world, k, t, seed=self.seed(k, TARGET_EPOCH), group_size=g or max(3, n),
                          period=self._roster_period(n), timeout_s=self.spec.averaging.averaging_timeout,
                          vector_bytes=self.vector_bytes[k], rng=self.rng)
            self.tally.targeted_honest += r.honest
            self.tally.targeted_corrupted += r.corrupted

    def epoch_s(self, samples_per_s: float, results: list[RoundResult]) -> tuple[float, float]:
        """(seconds an epoch takes, of which its round): the batch (``inner_steps`` of them in outer mode) at the
        swarm's rate, then the round (its median server's time, the slowest stage's), or the longer of the two
        with ``overlap_rounds``."""
        avg = self.spec.averaging
        batch_s = self.batch / samples_per_s if samples_per_s > 0 else math.inf
        round_s = max((statistics.median(r.round_s) for r in results if r.round_s), default=0.0)
        return (max(batch_s, round_s) if avg.overlap_rounds else batch_s + round_s), round_s

    def tally_rounds(self, results: list[RoundResult], epochs: float) -> None:
        for r in results:
            if not r.members:
                continue
            self.tally.rounds += epochs * r.members
            self.tally.rounds_ok += epochs * r.succeeded
            self.tally.rounds_corrupted += epochs * r.corrupted
            self.tally.rounds_honest += epochs * r.honest
            self.tally.averaging_bytes += epochs * r.bytes_per_server * r.members
            self.tally.hops[r.hops] += 1
            self.tally.lane_sizes.update(r.lane_sizes)
            self.tally.round_s.extend(r.round_s)
            self.tally.causes.update({c: n * epochs for c, n in r.causes.items()})

    def dht(self, dt: float, views: dict, epochs: float, trainers: int) -> None:
        nodes = sum(len(v) for v in views.values()) + trainers  # every peer runs a DHT node
        stripes = 2 ** self.spec.records.stage_stripe_bits  # a read is one lookup per stripe, of n / stripes records
        for k, records in views.items():
            n = len(records)
            if not n:
                continue
            hot = self.traffic.read("server", stripes * n * dt / self._roster_period(n), n / stripes, nodes)
            count, got = self._trainer_read(n)  # a trainer reads a few stripes of a large stage
            hot += self.traffic.read("trainer", count * trainers * dt / self._trainer_period(got), n / stripes, nodes)
            self.traffic.key_bytes[k] += hot / stripes  # the hottest key: one stripe's (peer id hashes spread evenly)
            self.traffic.store("server", n * dt / (self.ttl / 3), self.traffic.record_bytes, nodes)
            hops = max(1, math.ceil(math.log(max(n, 2), self.spec.averaging.group_size or max(3, n))))
            self.traffic.matchmaking("server", n * epochs * hops, nodes)
        self.traffic.store("trainer", trainers * dt / (self.ttl / 3), self.traffic.record_bytes, nodes)

    def checkpoints(self, t: float, epochs: float) -> None:
        every = self.spec.checkpoint.interval_epochs
        due = math.floor((self.epoch + epochs) / every) * every
        if due > self.epoch:
            for k in range(self.spec.model.num_stages):
                self.shards.commit(k, int(due), t)
        self.shards.repair(t)
        for k, newest in self.shards.restorable(t).items():
            self.tally.stage_ticks += 1
            self.tally.restorable_ticks += newest is not None
            if newest is not None:
                self.tally.lag_epochs.append(self.epoch + epochs - newest)

    def run(self) -> Tally:
        self.populate()
        steps = int(self.opts.hours * 3600 / self.opts.tick_s)
        for i in range(1, steps + 1):
            self.tick(i * self.opts.tick_s)
        return self.tally


def rebalance_s(balance: list[tuple[float, float]], leave_at_s: float) -> dict:
    """Pipeline balance (slowest stage / ideal) before ``leave_at_s``, right after, where the moves left it (the
    best it reached after), and the seconds until it first came within 1% of that (rebalancing stops at
    ``min_gain``'s hysteresis, not at perfect balance)."""
    before = [b for t, b in balance if t < leave_at_s]
    after = [(t, b) for t, b in balance if t >= leave_at_s]
    if not before or not after:
        return {}
    settled = max(b for _, b in after)
    back = next(t - leave_at_s for t, b in after if b >= 0.99 * settled)
    return {"balance_before": round(statistics.median(before[-10:]), 3), "balance_after_leave": round(after[0][1], 3),
            "balance_settled": round(settled, 3), "rebalance_s": back}
