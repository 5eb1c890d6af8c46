"""The simulated population: who is in the swarm when, how fast, on which link, and what the DHT holds.

Peers join and leave on a clock the simulator advances (seconds). A server's record is a real
:class:`~swarm.protocol.ServerInfo` (unsigned: a read's signature checks are measured on real nodes by
``bench/records.py``), announced every re-announce period (``record_ttl_s / 3``) from the moment it comes online
and listed until it expires, ``record_ttl_s`` after its last announcement, as in the real DHT; a peer that
leaves leaves its record behind until then.

Speeds: a server's ``speed`` is the model FLOP/s it delivers; its announced throughput on stage ``k`` is
``speed / demand[k]`` samples/s, ``demand[k]`` being the stage's training FLOPs per sample
(:func:`swarm.kernels.flops.stage_flops_per_token` x the sequence length). Speeds are drawn from :data:`GPU_MIX`,
dense fp16 tensor peak FLOP/s of the GPU classes volunteers bring (NVIDIA's datasheets: T4 65, RTX 3090 71,
RTX 4090 165, A100 312 TFLOP/s), times :data:`MFU` and a log-normal factor for how well each host keeps its GPU
fed (sigma 0.3). The shares of the mix and the MFU are this simulator's assumptions, not a trace.

Links are the WAN lab's :class:`bench.wanlab.lab.Profile`: a peer draws one of :data:`LINKS`.
"""

from __future__ import annotations

import hashlib
import math
import random
from dataclasses import dataclass, field
from typing import Optional

from bench.wanlab.lab import Profile
from swarm.protocol import ServerInfo, ServerState

GPU_MIX = {"T4": (65.0, 0.3), "RTX 3090": (71.0, 0.3), "RTX 4090": (165.0, 0.25), "A100": (312.0, 0.15)}
"""GPU class -> (dense fp16 tensor TFLOP/s, share of the volunteers)."""
MFU = 0.3
"""Model FLOPs utilisation a volunteer's server reaches (a well-fed GPU; DESIGN.md's MFU)."""

LINKS = [(Profile("datacenter", rtt_ms=20, mbit=1000), 0.2), (Profile("wan", rtt_ms=50, mbit=100), 0.5),
         (Profile("home", rtt_ms=150, mbit=20), 0.3)]
"""(link, share of peers): a cloud VM, the WAN scenario's link (tests/test_wan_swarm.py), a home link (20 Mbit/s)."""
LOOPBACK = [(Profile("loopback", rtt_ms=0.1, mbit=10_000), 1.0)]
"""One host's peers (what ``bench/scale.py`` runs): to compare the simulator with it."""


@dataclass
class Peer:
    """One simulated peer. Times are simulator seconds."""

    peer_id: str
    role: str  # "server" or "trainer"
    speed: float  # model FLOP/s (servers)
    link: Profile
    byzantine: bool
    joined_s: float
    stage: Optional[int] = None
    online_s: float = math.inf  # when its current stage's record first appears
    left_s: float = math.inf
    stage_since_s: float = 0.0
    record: Optional[ServerInfo] = field(default=None, repr=False)

    def alive(self, t: float) -> bool:
        return self.joined_s <= t < self.left_s

    def last_announce(self, t: float, period: float) -> float:
        """Its last announcement at or before ``t`` (its record's ``time``)."""
        end = min(t, self.left_s)
        return self.online_s + math.floor((end - self.online_s) / period) * period

    def expires_s(self, ttl: float) -> float:
        """When its record leaves the DHT once it left (``inf`` while it lives)."""
        if math.isinf(self.left_s):
            return math.inf
        if self.online_s > self.left_s:  # it left before it announced: no record
            return self.left_s
        return self.last_announce(self.left_s, ttl / 3) + ttl


@dataclass
class World:
    """The peers alive now or whose record is still listed, and what the DHT holds at any time."""

    demand: list[float]
    ttl: float
    rng: random.Random
    links: list = field(default_factory=lambda: LINKS)
    flops: Optional[float] = None  # every server's FLOP/s (a host of equal peers) instead of the GPU mix
    run_id: str = "sim"
    peers: dict[str, Peer] = field(default_factory=dict)  # alive, or gone with a record not expired yet
    by_stage: dict[int, dict[str, Peer]] = field(default_factory=dict)
    _ids: int = 0

    # ---- the population ---------------------------------------------------------------------------------
    def _speed(self) -> float:
        if self.flops is not None:
            return self.flops
        classes = list(GPU_MIX.values())
        tflops = self.rng.choices([c[0] for c in classes], weights=[c[1] for c in classes])[0]
        return tflops * 1e12 * MFU * math.exp(self.rng.gauss(0.0, 0.3))

    def _link(self) -> Profile:
        return self.rng.choices([p for p, _ in self.links], weights=[w for _, w in self.links])[0]

    def new_peer(self, role: str, t: float, byzantine: bool) -> Peer:
        self._ids += 1
        pid = hashlib.blake2b(f"{self.run_id}/{self._ids}".encode(), digest_size=20).hexdigest()
        peer = Peer(pid, role, self._speed(), self._link(), byzantine, joined_s=t)
        self.peers[pid] = peer
        return peer

    def rekey(self, peer: Peer, peer_id: str) -> None:
        """``peer`` uses another key (before it is placed: a key ground for a chosen round)."""
        del self.peers[peer.peer_id]
        peer.peer_id = peer_id
        self.peers[peer_id] = peer

    def place(self, peer: Peer, stage: int, t: float, join_s: float) -> None:
        """``peer`` serves ``stage``: its record appears ``join_s`` seconds after ``t`` (restore, then announce).
        A server that moves announces itself draining first: its old record stops counting at once."""
        if peer.stage is not None:
            self.by_stage[peer.stage].pop(peer.peer_id, None)
        peer.stage, peer.online_s, peer.stage_since_s = stage, t + join_s, t
        self.by_stage.setdefault(stage, {})[peer.peer_id] = peer

    def leave(self, peer: Peer, t: float) -> None:
        peer.left_s = t

    def prune(self, t: float) -> None:
        """Forget peers gone whose record expired by ``t``."""
        for p in [p for p in self.peers.values() if t >= max(p.left_s, p.expires_s(self.ttl))]:
            del self.peers[p.peer_id]
            if p.stage is not None:
                self.by_stage[p.stage].pop(p.peer_id, None)

    def alive(self, t: float, role: Optional[str] = None) -> list[Peer]:
        return [p for p in self.peers.values() if p.alive(t) and (role is None or p.role == role)]

    def serving(self, stage: int, t: float) -> list[Peer]:
        """Servers of ``stage`` alive and online at ``t``."""
        return [p for p in self.by_stage.get(stage, {}).values() if p.online_s <= t < p.left_s]

    # ---- the records ------------------------------------------------------------------------------------
    def throughput(self, peer: Peer, stage: int) -> float:
        return peer.speed / self.demand[stage]

    def listed(self, stage: int, t: float) -> list[Peer]:
        """Servers whose record of ``stage`` the DHT holds at ``t``: online ones, and those gone whose record has
        not expired."""
        return [p for p in self.by_stage.get(stage, {}).values()
                if p.online_s <= t and t < max(p.left_s, p.expires_s(self.ttl))]

    def record(self, peer: Peer, t: float) -> ServerInfo:
        """``peer``'s ServerInfo as read at ``t`` (its time is its last announcement; one object per
        announcement, as a peer's verified-record cache keeps it)."""
        when = peer.last_announce(t, self.ttl / 3)
        if peer.record is None or peer.record.stage != peer.stage:
            peer.record = ServerInfo.model_construct(
                run_id=self.run_id, peer_id=peer.peer_id, time=when, stage=peer.stage, state=ServerState.ONLINE,
                throughput=self.throughput(peer, peer.stage), p2p_id=peer.peer_id, excluded={}, progress_key="k",
                kind="server", ttl_s=self.ttl, online_since=peer.online_s)
        elif peer.record.time != when:
            peer.record = peer.record.model_copy(update={"time": when})
        return peer.record

    def records(self, stage: int, t: float) -> list[ServerInfo]:
        return [self.record(p, t) for p in self.listed(stage, t)]

    def ideal_samples_per_s(self, t: float) -> float:
        """Samples/s of the same hardware perfectly balanced, with free links: every online server's FLOP/s over
        one sample's FLOPs through every stage."""
        return sum(p.speed for group in self.by_stage.values() for p in group.values()
                   if p.online_s <= t < p.left_s) / sum(self.demand)
