"""Exclusion from averaging: peers whose parts are rejected or flagged again and again are left out; and what a
server reports of it (:class:`AveragingReport`).

Each server keeps its own :class:`ExclusionBook` (in its averager process). Every averaging round adds
``reject_penalty`` to a sender's score for a rejected part and ``flag_penalty`` for a flagged one (see
:mod:`swarm.averaging.reducer`), then multiplies the score of every peer that took part by ``decay`` (a peer's
score decays with its own rounds, not the server's: one that joins a round now and then is judged on its parts
alone); a score at or above ``threshold``
excludes the peer for ``exclude_s`` seconds: matchmaking refuses it as a group member and its parts are
never aggregated. A peer proven to have returned a wrong aggregate (a verified accusation,
:mod:`swarm.averaging.audit`) is excluded at once, and so is a peer on the run's ban list
(:mod:`swarm.trust.banlist`), which the server passes on.

With the defaults a peer rejected in every round is excluded after 4 rounds, one flagged in every round after
9; an honest peer flagged by chance once in a while decays back towards zero.

(Other words for other things: a *ban* is the run coordinator's signed list, a *back-off* is a trainer's
pause before retrying a failing server, *distrust* is a fragment keeper's of a holder that served corrupt
bytes; see ``docs/glossary.md``.)
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict, Field

from swarm.averaging.reducer import Verdict


VERIFIED_KEPT = 1024
"""Peers whose verified rounds an :class:`ExclusionBook` keeps."""


class ExclusionPolicy(BaseModel):
    """When misbehaviour in rounds excludes a peer (``threshold`` comes from ``averaging.exclusion_threshold``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    threshold: float = Field(3.0, gt=0, description="Score at which a peer is excluded.")
    reject_penalty: float = Field(1.0, ge=0, description="Score added for a rejected part.")
    flag_penalty: float = Field(0.5, ge=0, description="Score added for a flagged (outlying) part.")
    decay: float = Field(0.9, gt=0, le=1, description="Factor applied to a peer's score after each round it "
                         "took part in.")
    exclude_s: float = Field(3600.0, gt=0, description="Seconds an exclusion lasts.")


@dataclass
class Exclusion:
    peer: str
    reason: str
    until: float


@dataclass
class ExclusionBook:
    """Scores and exclusions of the peers this server has averaged with; keys are libp2p id strings."""

    policy: ExclusionPolicy = field(default_factory=ExclusionPolicy)
    scores: dict[str, float] = field(default_factory=dict)
    exclusions: dict[str, Exclusion] = field(default_factory=dict)
    rounds: int = 0
    verified: dict[str, int] = field(default_factory=dict)
    """Rounds in which each peer's part was counted and accepted unflagged by this server's reducer, since it was
    last excluded: the averaging work this server verified it doing (:mod:`swarm.trust.standing`). At most
    :data:`VERIFIED_KEPT` peers (the fewest rounds are forgotten first)."""

    def record_round(self, verdicts: dict[str, Verdict]) -> list[Exclusion]:
        """Score one round's verdicts (sender -> worst verdict it got); return the exclusions it created. A part that
        was not counted (no samples claimed, or set aside beside a majority of zero parts) is not scored."""
        verdicts = {peer: v for peer, v in verdicts.items() if v.counted}
        new = []
        for peer, v in verdicts.items():
            if v.accepted and not v.flagged:
                self.verified[peer] = self.verified.get(peer, 0) + 1
            if not v.accepted:
                self.scores[peer] = self.scores.get(peer, 0.0) + self.policy.reject_penalty
            elif v.flagged:
                self.scores[peer] = self.scores.get(peer, 0.0) + self.policy.flag_penalty
            if self.scores.get(peer, 0.0) >= self.policy.threshold and not self.is_excluded(peer):
                reason = v.reason if not v.accepted else "parts repeatedly far from the aggregate"
                new.append(self.exclude(peer, f"score {self.scores[peer]:.2f}: {reason}"))
        # a score decays with the rounds its peer took part in: one that joins a round now and then (a slow or
        # lagging attacker) is excluded after as many bad parts as one that joins every round
        self.scores = {p: s * (self.policy.decay if p in verdicts else 1.0) for p, s in self.scores.items()}
        self.scores = {p: s for p, s in self.scores.items() if s > 1e-3}
        if len(self.verified) > VERIFIED_KEPT:
            self.verified = dict(sorted(self.verified.items(), key=lambda kv: -kv[1])[:VERIFIED_KEPT])
        self.rounds += 1
        return new

    def penalize(self, peer: str, amount: float, reason: str) -> Exclusion | None:
        """Add ``amount`` to ``peer``'s score outside a round's verdicts; returns the exclusion if this made one."""
        self.scores[peer] = self.scores.get(peer, 0.0) + amount
        if self.scores[peer] >= self.policy.threshold and not self.is_excluded(peer):
            return self.exclude(peer, f"score {self.scores[peer]:.2f}: {reason}")
        return None

    def exclude(self, peer: str, reason: str, now: float | None = None) -> Exclusion:
        now = time.time() if now is None else now
        self.verified.pop(peer, None)
        self.exclusions[peer] = Exclusion(peer, reason, now + self.policy.exclude_s)
        return self.exclusions[peer]

    def is_excluded(self, peer: str, now: float | None = None) -> bool:
        found = self.exclusions.get(peer)
        if found is None:
            return False
        if found.until <= (time.time() if now is None else now):
            self.exclusions.pop(peer, None)  # (another thread may have dropped it already)
            return False
        return True

    def excluded(self) -> list[str]:
        return sorted(p for p in list(self.exclusions) if self.is_excluded(p))


MAX_EXCLUSIONS_REPORTED = 32
"""Exclusions a server's record lists (:attr:`AveragingReport.excluded`)."""


@dataclass
class AveragingReport:
    """What a server publishes about its averaging (:class:`~swarm.protocol.ServerInfo`).

    :param peers: servers of the stage its progress tracker counts (the last round's group, roughly).
    :param wire: counters of the gradient averager: bytes ``sent``/``received`` on the wire, ``phases``,
        ``failed`` rounds, parts ``rejected`` and ``flagged`` as a reducer.
    :param excluded: libp2p id -> reason, the peers it excluded from averaging (at most 32, reasons cut to 200
        characters); empty when the averager process did not answer in time.
    :param verified: libp2p id -> rounds whose part from it this server's reducer accepted, unflagged, since it
        was last excluded (cumulative in this averager's life; ``swarm.averaging.exclusion.ExclusionBook``).
    :param answered: the averager process answered (else ``excluded`` and ``verified`` are empty, not zero).
    """

    peers: int = 0
    wire: dict[str, int] = field(default_factory=dict)
    excluded: dict[str, str] = field(default_factory=dict)
    verified: dict[str, int] = field(default_factory=dict)
    answered: bool = False

    @classmethod
    def of(cls, peers: int, wire: dict[str, int], found: dict) -> "AveragingReport":
        """From what the averager process reported (``RobustAllReduceMixin.report``; empty if it did not answer)."""
        excluded = {p: r[:200] for p, r in sorted(found.get("excluded", {}).items())[:MAX_EXCLUSIONS_REPORTED]}
        return cls(peers=peers, wire=wire, excluded=excluded, verified=found.get("verified", {}), answered=bool(found))


def worst(verdicts: list[Verdict]) -> Verdict:
    """The verdict that weighs most: a rejection beats a flag beats a clean part beats one not counted."""
    return min(verdicts, key=lambda v: (v.accepted, not v.flagged, not v.counted))
