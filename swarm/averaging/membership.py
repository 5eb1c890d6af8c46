"""Who averages in a round: the same servers on every server of the stage, however their reads of the DHT interleave.

The grid of bounded groups (:mod:`swarm.averaging.groups`) is a function of the round's member set: servers that
disagree on one member compute different lanes, and the lanes of every hop after it fail. Each server reads its
stage's records every few seconds, at its own moments, so "the servers I read last" differs between servers as
soon as one joins or leaves between two reads. Measured in ``bench/simulate.py`` with the rule that preceded this
one (the servers seen in any read of the last ``record_ttl_s``): at 30% churn an hour, 97% of rounds completed at
300 peers, 52% at 1,000 and 5% at 3,000; with this one, 87% at 1,000 and 68% at 3,000, the failures left being
servers that leave during a round (docs/scaling.md).

Here a member is decided from what the records themselves say, at a moment every server rounds alike:

* every server record carries ``online_since``, the DHT time of its server's first announcement ``online`` on
  its stage since it last (re)joined; a record's ``time`` is its last announcement. A server ``joining`` (loading
  the stage's state, or catching up with a stage it fell behind: it could join none of its rounds) is no member;
* at DHT time ``now`` a server evaluates the stage at ``ref = floor(now / Q) * Q``, ``Q = ttl / 6``;
* a server is a member at ``ref`` if ``online_since <= ref - ttl / 2`` (*settled*: every server has read the
  stage at least once since it appeared, reads being at most ``ttl / 3`` apart) and its newest announcement seen
  is ``>= ref - 5 ttl / 6`` (a live server re-announces every ``ttl / 3``, and every server has read that within
  ``ttl / 3``; a server gone for longer is out for everyone, its last ``time`` being the same in every view).

Two servers then disagree only when their rounds begin on both sides of a quantum's boundary (their clocks and
epoch ends a fraction of a second apart, against ``Q`` seconds) and a member settles or expires at that very
boundary; a record announcing a pause, a drain or a catch-up takes its server out at once (a rare leave). A
newcomer averages from at most ``ttl / 2 + Q = 2 ttl / 3`` seconds after its first announcement online.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Optional

from swarm.protocol import ServerInfo, ServerState

QUANTUM = 1 / 6
"""``Q``, the evaluation grid, as a fraction of ``record_ttl_s``."""
SETTLE = 1 / 2
"""How long after its first announcement a server becomes a member, as a fraction of ``record_ttl_s``."""
KEEP = 5 / 6
"""How long after its last announcement a server stays a member, as a fraction of ``record_ttl_s``."""


@dataclass
class MemberTable:
    """libp2p id -> ``(online_since, newest announcement)`` (DHT times, seconds) of the stage's counted servers, as
    this server has read them, kept ``2 ttl`` after their last announcement (a record expires ``ttl`` after it).
    Picklable: the server sends it to its averagers, which evaluate it when a round begins (:meth:`at`)."""

    ttl_s: float = 0.0
    entries: dict[str, tuple[float, float]] = field(default_factory=dict)
    uncounted: frozenset[str] = frozenset()
    """libp2p ids that are members (placed on the grid, waited for once they show in matchmaking) but not counted
    in the majority a group of the stage must hold (:func:`counted_members`)."""
    working: frozenset[str] = frozenset()
    """Those of :attr:`uncounted` whose last pushed count (:mod:`~swarm.averaging.progress`) holds samples of this
    server's epoch: waited for as if they had shown. A newcomer on a slow link otherwise lost the race to its
    stage-mates' group at every epoch's end (never in a round, never verified, never counted: seen on 20 Mbit/s at
    150 ms, two epochs in a row), while an idle key, which pushes nothing, still holds up no group."""

    def observe(self, servers: Iterable[ServerInfo], now: float, uncounted: Iterable[str] = ()) -> bool:
        """Note one read of the stage's records at DHT time ``now``; True if the table changed. A record without
        a progress key does not count (its server cannot be counted); one not online (joining, catching up,
        pausing, draining) leaves at once. The libp2p ids ``uncounted`` (:func:`counted_members`) stay members but
        count in no majority (:meth:`counted_at`)."""
        before = (dict(self.entries), self.uncounted)
        self.uncounted = frozenset(uncounted)
        for s in servers:
            if s.progress_key and s.state == ServerState.ONLINE:
                since, newest = self.entries.get(s.p2p_id, (s.online_since, s.time))
                self.entries[s.p2p_id] = (s.online_since, max(newest, s.time)) if since == s.online_since \
                    else (s.online_since, s.time)  # a new placement of the same peer starts over
            else:
                self.entries.pop(s.p2p_id, None)
        for p in [p for p, (_, newest) in self.entries.items() if newest < now - 2 * self.ttl_s]:
            del self.entries[p]
        return (self.entries, self.uncounted) != before

    def snapshot(self, progress_keys: dict[str, bytes], working: frozenset[bytes]) -> "MemberTable":
        """A copy to send to the averagers, its :attr:`working` the uncounted members whose progress sub-key
        (``progress_keys``: libp2p id -> sub-key) is in ``working`` (sub-keys whose pushed count holds samples of
        this server's epoch: :meth:`~swarm.averaging.progress.SampleCountTracker.pushed_working`)."""
        return MemberTable(self.ttl_s, dict(self.entries), self.uncounted,
                           frozenset(p for p in self.uncounted if progress_keys.get(p) in working))

    def at(self, now: float) -> frozenset[str]:
        """The members at DHT time ``now`` (module docstring); empty while the table is."""
        if not self.entries or self.ttl_s <= 0:
            return frozenset()
        q = QUANTUM * self.ttl_s
        ref = math.floor(now / q) * q
        settled, alive = ref - SETTLE * self.ttl_s, ref - KEEP * self.ttl_s
        return frozenset(p for p, (since, newest) in self.entries.items() if since <= settled and newest >= alive)

    def counted_at(self, now: float) -> frozenset[str]:
        """The members at DHT time ``now`` that count in a group's majority (:func:`counted_members`)."""
        return self.at(now) - self.uncounted


def counted_members(servers: list[ServerInfo], recognized: Optional[frozenset[str]],
                    group_size: int) -> tuple[list[ServerInfo], set[str]]:
    """``(counted, uncounted)``: of a stage's records, those whose servers count in the majority a group of the stage
    must hold (:func:`~swarm.averaging.hops.a_majority`), and the libp2p ids of the others (for
    :meth:`MemberTable.observe`: members still, waited for once they show, :mod:`~swarm.averaging.matchmaking`):
    where the run key's recognition (``recognized``: the peer ids it names on the stage) names some of its online
    servers, those it names and those a named online server vouches for (:attr:`~swarm.protocol.ServerInfo.vouches`:
    their averaging work verified), as long as they fit one group (at most ``group_size``; 0: no bound); else every
    record.

    A record costs nothing: counted in the majority, idle keys announced as online servers of a stage (as many as its
    honest servers) left every group of the honest servers short of it, and every gradient round failed
    (``bench/sybil.py`` idle keys at 2 a stage: 9 then 18 rounds failed in a minute, each server stepping alone).
    Now such keys cost the stage's groups nothing (an early start waits for an uncounted member only once it showed
    in matchmaking). An honest newcomer that asks to join is waited for and averages in their group, where the
    named servers verify it. Left as before: a stage
    of more vouched servers than ``group_size`` averages in bounded groups, whose lanes need every voter, so every
    record counts there (docs/threat-model.md)."""
    counted = recognized_members(servers, recognized, group_size)
    if counted is None:
        return servers, set()
    return counted, {s.p2p_id for s in servers} - {s.p2p_id for s in counted}


def recognized_members(servers: list[ServerInfo], recognized: Optional[frozenset[str]],
                       group_size: int) -> Optional[list[ServerInfo]]:
    """The records :func:`counted_members` counts where the run key's recognition decides (those it names and those
    a named online server vouches for), or None where every record counts (it names none of the stage's online
    servers, or those it counts do not fit one group)."""
    named = [s for s in servers if recognized and s.peer_id in recognized and s.state == ServerState.ONLINE]
    vouched = {p for s in named for p in s.vouches}
    counted = [s for s in servers if s.peer_id in (recognized or ()) or s.p2p_id in vouched]
    online = sum(s.state == ServerState.ONLINE for s in counted)
    return None if not named or (group_size and online > group_size) else counted


__all__ = ["KEEP", "MemberTable", "QUANTUM", "SETTLE", "counted_members", "recognized_members"]
