"""Stochastic wiring and back-off from failing servers: how a trainer picks a server of each stage.

Routing follows SWARM parallelism (Ryabinin et al., "SWARM Parallelism", ICML 2023, sec. 3.2, "stochastic
wiring"): for every micro-batch a trainer picks, per stage, the online server with the least accumulated
expected busy time, where each assignment adds ``work / throughput`` (seconds) to the chosen server; ties are
broken at random. A server that fails is avoided (*backed off*) for ``backoff_s * 2**(failures-1)`` seconds
(capped at ``backoff_max_s``) and the micro-batch is retried on another server of the same stage. Servers
that most of their stage excluded from averaging (:func:`excluded_by_stage`) are not routed to either.

With a ``weight`` (the trainer's standing: :mod:`swarm.trust.standing`, or 1 for a server the run key's
recognition names: :meth:`~swarm.trust.spotcheck.SpotChecker.vote`), servers of weight 0 get only an ``explore``
share (10%) of its micro-batches once some server of the stage has weight: a record costs nothing, and 150 records
of servers that never answer took 186 of a trainer's 195 calls. An honest newcomer earns its place with its first
agreeing check (about ``1 / spot_checks.rate`` calls routed to it) or once the recognition names it.

A server's throughput is what it announces, a figure nobody checks; once a trainer has seen the server answer,
it uses the lower of the announced figure and the one it observed (a moving average of samples per second of
the server's answers, network and queueing included). A server announcing more than it delivers, a lie or an
overloaded machine, gets no more than the share its answers earn.

Which stage a joining server serves is the server's choice (:func:`swarm.server.rebalance.choose_stage`).
"""

from __future__ import annotations

import random
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

from swarm.protocol import ServerInfo, ServerState


class NoServerError(RuntimeError):
    """No online server that is not backed off or excluded is known for a stage."""


@dataclass
class _BackOff:
    failures: int = 0
    until: float = 0.0


@dataclass
class Router:
    """Per-trainer routing state: expected busy time per server and back-offs.

    ``clock`` returns seconds (monotonic); ``rng`` breaks ties.
    """

    backoff_s: float = 5.0
    backoff_max_s: float = 120.0
    rng: random.Random = field(default_factory=random.Random)
    clock: Callable[[], float] = time.monotonic
    busy: dict[str, float] = field(default_factory=dict)
    backoffs: dict[str, _BackOff] = field(default_factory=dict)
    observed: dict[str, float] = field(default_factory=dict)  # peer id -> samples/s of its answers (moving average)
    smoothing: float = 0.2  # weight of the newest answer in ``observed``
    weight: Optional[Callable[[str], float]] = None  # peer id -> its vote on exclusions (excluded_by_stage)
    explore: float = 0.1  # with ``weight``: the share of picks open to servers of weight 0 (module docstring)

    def rate(self, server: ServerInfo) -> float:
        """Samples/s used for ``server``: the lower of its announced throughput and the observed one."""
        seen = self.observed.get(server.peer_id)
        return server.throughput if seen is None else min(server.throughput, seen)

    def is_backed_off(self, peer_id: str) -> bool:
        found = self.backoffs.get(peer_id)
        return found is not None and found.until > self.clock()

    def choose(self, servers: Sequence[ServerInfo], work: float = 1.0, exclude: Sequence[str] = ()) -> ServerInfo:
        """Pick one online server that is neither backed off nor excluded by its stage (least busy time after
        this assignment) and charge it ``work``.

        :param work: samples in the micro-batch; the chosen server is charged ``work / throughput`` seconds.
        :param exclude: peer ids not to pick.
        :raises NoServerError: no candidate is left.
        """
        excluded = excluded_by_stage(servers, self.weight)
        candidates = [
            s for s in servers
            if s.state == ServerState.ONLINE and not self.is_backed_off(s.peer_id) and s.peer_id not in exclude
            and s.p2p_id not in excluded
        ]
        if not candidates:
            raise NoServerError(f"no online server available ({len(servers)} known, the others backed off, excluded "
                                "or not online)")
        if self.weight is not None:
            checked = {s.peer_id: self.weight(s.peer_id) > 0 for s in candidates}
            verified = [s for s in candidates if checked[s.peer_id]]
            unverified = [s for s in candidates if not checked[s.peer_id]]
            if verified and unverified:  # the unverified get the explore share of picks, the verified the rest
                candidates = unverified if self.rng.random() < self.explore else verified
        known = [self.busy[s.peer_id] for s in candidates if s.peer_id in self.busy]
        floor = min(known) if known else 0.0
        for s in candidates:  # a newcomer starts level with the least busy server, not far behind everyone
            self.busy.setdefault(s.peer_id, floor)

        def cost(s: ServerInfo) -> float:
            return self.busy[s.peer_id] + work / max(self.rate(s), 1e-6)

        best = min(cost(s) for s in candidates)
        chosen = self.rng.choice([s for s in candidates if cost(s) <= best * (1 + 1e-9)])
        self.busy[chosen.peer_id] = cost(chosen)
        return chosen

    def report_failure(self, peer_id: str) -> float:
        """Back off from ``peer_id``, exponentially in its failures in a row; returns the back-off (seconds)."""
        found = self.backoffs.setdefault(peer_id, _BackOff())
        found.failures += 1
        length = min(self.backoff_max_s, self.backoff_s * 2 ** (found.failures - 1))
        found.until = self.clock() + length
        return length

    def report_success(self, peer_id: str, work: float = 0.0, seconds: float = 0.0) -> None:
        """``peer_id`` answered: end its back-off and, given the answer's ``work`` (samples) and ``seconds``,
        update its observed throughput."""
        self.backoffs.pop(peer_id, None)
        if work > 0 and seconds > 0:
            now, seen = work / seconds, self.observed.get(peer_id)
            self.observed[peer_id] = now if seen is None else seen + self.smoothing * (now - seen)


def excluded_by_stage(servers: Sequence[ServerInfo], weight: Optional[Callable[[str], float]] = None) -> set[str]:
    """libp2p ids that more than half of the *other* online servers of a stage have excluded from averaging, the
    servers' records counted by ``weight`` (peer id -> vote, e.g. :meth:`swarm.trust.standing.Standing.weight`;
    None: one vote per record).

    A server that the honest majority of its stage caught sending bad parts is not routed to either; a
    minority (possibly the Byzantine servers themselves) cannot exclude an honest server this way. Counted per
    record, a majority is only a majority of keys, which cost nothing (five fresh keys announced as servers, each
    listing the stage's honest servers as excluded, stopped trainers routing to them); weighted by the work this
    trainer verified, keys it never checked have no vote.
    """
    online = [s for s in servers if s.state == ServerState.ONLINE]
    vote = {o.peer_id: 1.0 if weight is None else weight(o.peer_id) for o in online}
    records: Counter[str] = Counter()  # libp2p id -> its own records' votes
    votes: Counter[str] = Counter()  # libp2p id -> votes of online records that exclude it: O(n + exclusions)
    own: Counter[str] = Counter()  # libp2p id -> its own records' votes against it (they do not count)
    for o in online:
        records[o.p2p_id] += vote[o.peer_id]
        for p in set(o.excluded):
            votes[p] += vote[o.peer_id]
            own[p] += vote[o.peer_id] * (p == o.p2p_id)
    total = sum(vote.values())
    out = set()
    for s in online:
        others = total - records[s.p2p_id]
        if others > 0 and 2 * (votes[s.p2p_id] - own[s.p2p_id]) > others:
            out.add(s.p2p_id)
    return out


__all__ = ["NoServerError", "Router", "excluded_by_stage"]
