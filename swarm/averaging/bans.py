"""Ban scores: peers whose parts are rejected or flagged again and again are excluded.

Each peer keeps its own :class:`BanBook`. Every averaging round adds ``reject_penalty`` for a rejected part
and ``flag_penalty`` for a flagged one (see :mod:`swarm.averaging.reducer`), then multiplies every score by
``decay``; a score at or above ``threshold`` bans the peer for ``ban_s`` seconds. A peer proven to have
returned a wrong aggregate (a verified accusation, :mod:`swarm.averaging.audit`) is banned at once.

With the defaults a peer rejected in every round is banned after 4 rounds, one flagged in every round after
9; an honest peer flagged by chance once in a while decays back towards zero.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict, Field

from swarm.averaging.reducer import Verdict


class BanPolicy(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    threshold: float = Field(3.0, gt=0, description="Score at which a peer is banned.")
    reject_penalty: float = Field(1.0, ge=0, description="Score added for a rejected part.")
    flag_penalty: float = Field(0.5, ge=0, description="Score added for a flagged (outlying) part.")
    decay: float = Field(0.9, gt=0, le=1, description="Factor applied to every score after each round.")
    ban_s: float = Field(3600.0, gt=0, description="Seconds a ban lasts.")


@dataclass
class Ban:
    peer: str
    reason: str
    until: float


@dataclass
class BanBook:
    """Scores and bans of the peers this peer has averaged with; keys are peer id strings."""

    policy: BanPolicy = field(default_factory=BanPolicy)
    scores: dict[str, float] = field(default_factory=dict)
    bans: dict[str, Ban] = field(default_factory=dict)
    rounds: int = 0

    def record_round(self, verdicts: dict[str, Verdict]) -> list[Ban]:
        """Score one round's verdicts (sender -> worst verdict it got); return the bans this round created."""
        new = []
        for peer, v in verdicts.items():
            if not v.accepted:
                self.scores[peer] = self.scores.get(peer, 0.0) + self.policy.reject_penalty
            elif v.flagged:
                self.scores[peer] = self.scores.get(peer, 0.0) + self.policy.flag_penalty
            if self.scores.get(peer, 0.0) >= self.policy.threshold and not self.is_banned(peer):
                reason = v.reason if not v.accepted else "parts repeatedly far from the aggregate"
                new.append(self.ban(peer, f"score {self.scores[peer]:.2f}: {reason}"))
        self.scores = {p: s * self.policy.decay for p, s in self.scores.items() if s * self.policy.decay > 1e-3}
        self.rounds += 1
        return new

    def penalize(self, peer: str, amount: float, reason: str) -> Ban | None:
        """Add ``amount`` to ``peer``'s score outside a round's verdicts; returns the ban if this created one."""
        self.scores[peer] = self.scores.get(peer, 0.0) + amount
        if self.scores[peer] >= self.policy.threshold and not self.is_banned(peer):
            return self.ban(peer, f"score {self.scores[peer]:.2f}: {reason}")
        return None

    def ban(self, peer: str, reason: str, now: float | None = None) -> Ban:
        now = time.time() if now is None else now
        self.bans[peer] = Ban(peer, reason, now + self.policy.ban_s)
        return self.bans[peer]

    def is_banned(self, peer: str, now: float | None = None) -> bool:
        ban = self.bans.get(peer)
        if ban is None:
            return False
        if ban.until <= (time.time() if now is None else now):
            del self.bans[peer]
            return False
        return True

    def banned(self) -> list[str]:
        return sorted(p for p in list(self.bans) if self.is_banned(p))


def worst(verdicts: list[Verdict]) -> Verdict:
    """The verdict that weighs most: a rejection beats a flag beats a clean part."""
    return min(verdicts, key=lambda v: (v.accepted, not v.flagged))
