"""Trainers' routing and the swarm's throughput at one instant.

A sample of trainers route micro-batches with their own :class:`swarm.trainer.routing.Router` (kept across
ticks, on the simulator's clock) over the records their last read found fresh (:func:`swarm.net.directory.is_fresh`
when read; a read every ``record_ttl_s / 6`` seconds, or :func:`~swarm.net.directory.read_period_s` for a large
stage, of the stripes :func:`~swarm.net.directory.stripes_to_read` draws for it). A pick of a server that has left
fails (``FAIL_S`` seconds lost, the server backed off) and is retried.

Throughput is the least of (a) what each stage's servers that the trainers route to (fresh in their reads, alive)
compute together (a Router spreads micro-batches in proportion to throughput: ``tests/test_routing.py``), a
server's rate being its compute capped by its link (two activations per sample each way); and (b) what the trainers
can keep in flight: ``MOST_IN_FLIGHT`` micro-batches each, every micro-batch taking ``2S - 1`` calls, each its
server's compute plus a round trip plus the activation's transfer over the slower of the two links (SWARM
parallelism, Ryabinin et al. 2023, sec. 3; :mod:`swarm.trainer.inflight`).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable, Optional

from bench.sim.world import Peer, World
from swarm.trainer.inflight import MOST_IN_FLIGHT
from swarm.trainer.routing import NoServerError, Router

FAIL_S = 5.0
"""Seconds a micro-batch loses on a server that has left (a dial that fails, then the retry)."""


@dataclass
class Flow:
    samples_per_s: float = 0.0
    stage_limit: float = 0.0  # (a) above
    trainer_limit: float = 0.0  # (b) above
    picks: int = 0
    failed_picks: int = 0
    activation_bytes_per_sample: float = 0.0  # on the wire, every boundary, both directions


def link_rate(peer: Peer) -> float:
    """Bytes/s each way."""
    return peer.link.mbit * 1e6 / 8


def flow(world: World, t: float, *, routers: dict[str, Router], trainers: list[Peer], views: dict,
         micro_batch: int, activation_bytes: float, scale: float,
         view_of: Optional[Callable[[list], list]] = None) -> Flow:
    """The swarm's samples/s at ``t``. ``views``: stage -> the records trainers route over (read at their last
    read); ``view_of``: the part of them one trainer's read returned (its stripes of a large stage; default all);
    ``trainers``: the sampled trainers, ``scale`` = all trainers / sampled; ``activation_bytes``: one
    sample's activations at a stage boundary, as sent."""
    stages = len(world.demand)
    out, trainer_rate = Flow(), 0.0
    for trainer in trainers:
        router = routers.get(trainer.peer_id)
        if router is None:  # kept across ticks (its busy times and back-offs), built once
            router = routers[trainer.peer_id] = Router(rng=random.Random(trainer.peer_id))
        router.clock = lambda: t
        latency, lost = 0.0, 0.0
        for k in range(stages):
            view = views[k] if view_of is None else view_of(views[k])
            for _ in range(4):
                try:
                    chosen = router.choose(view, work=micro_batch)
                except NoServerError:
                    break
                out.picks += 1
                server = world.peers.get(chosen.peer_id)
                if server is None or server.left_s <= t or server.stage != k:
                    out.failed_picks += 1
                    lost += FAIL_S
                    router.report_failure(chosen.peer_id)
                    continue
                calls = 1 if k == stages - 1 else 2
                link = min(link_rate(server), link_rate(trainer))
                latency += calls * (micro_batch / world.throughput(server, k) + server.link.rtt_ms / 2e3
                                    + trainer.link.rtt_ms / 2e3 + micro_batch * activation_bytes / link)
                break
        trainer_rate += MOST_IN_FLIGHT * micro_batch / max(latency + lost, 1e-6)
    out.trainer_limit = trainer_rate * scale
    limits = []
    for k in range(stages):
        usable = {s.peer_id for s in views[k]}
        servers = [world.peers[p] for p in usable if p in world.peers and world.peers[p].alive(t)
                   and world.peers[p].stage == k]
        limits.append(sum(min(world.throughput(p, k), link_rate(p) / (2 * activation_bytes)) for p in servers))
    out.stage_limit = min(limits) if limits else 0.0
    out.samples_per_s = min(out.stage_limit, out.trainer_limit)
    out.activation_bytes_per_sample = 2 * (stages - 1) * activation_bytes
    return out
