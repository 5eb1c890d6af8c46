"""Standing: the work a peer has itself verified each key doing for the run, as the weight of that key's word.

Keys cost nothing, so a decision that counts one vote per key is one an attacker wins by starting more keys (the
Sybil attack, ``docs/threat-model.md``). A peer therefore weighs what another key says by the work it has
*itself* seen that key do right, decaying with time:

    standing_k(t) = sum_i u_i * 2^(-(t - t_i) / H)          (units u_i of verified work at times t_i)
    weight_k(t)   = min(1, standing_k(t) / S), or 0 while standing_k(t) < 1/2

``H`` is the half-life (:data:`HALF_LIFE_S`, an hour) and ``S`` the standing of a full vote
(:data:`FULL_STANDING`). A unit is one check this peer made and the key passed: for a trainer, a spot-checked call
whose answer another server of the stage matched (:mod:`swarm.trust.spotcheck`; the trainer re-ran it, so the work
is real and right); for a server, a stage-mate's averaging round whose part its reducer accepted unflagged
(:attr:`swarm.averaging.exclusion.ExclusionBook.verified`: the part was within the robust aggregate's bounds in a
round this server took part in), keyed by the mate's libp2p id; an exclusion from averaging zeroes it
(:meth:`Standing.reset`). A new key has weight 0; a conviction sets its standing to 0 and keeps it there
(:meth:`Standing.revoke`).

What a Sybil must spend: to carry one full vote a key must pass ``S`` checks within about ``H``, i.e. answer about
``S / rate`` micro-batches correctly for a trainer that checks a fraction ``rate`` of its calls (160 at the
default 5% and ``S`` = 8): the compute an honest server of that stage spends, for as long as it wants the vote.
A peer that has verified nothing gives every key weight 0, so a fresh trainer honours no exclusion votes until
it has checked some servers (the safe side: at worst it routes micro-batches to a server its stage excluded from
averaging, whose gradients its stage-mates then leave out).

A server keeps its standing across restarts (:meth:`Standing.save`, :meth:`Standing.load`: a small JSON file per
run in its state folder, decayed by the wall-clock time it was down), so a restart is not a peer that has seen
nothing: it still weighs its stage-mates' progress, rollback orders and state by the work it verified before.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections import OrderedDict
from pathlib import Path
from typing import Callable, Iterable, Optional

logger = logging.getLogger(__name__)

HALF_LIFE_S = 3600.0
"""Seconds over which verified work loses half its standing."""
FULL_STANDING = 8.0
"""Units of (decayed) verified work that make a full vote."""
MIN_STANDING = 0.5
"""Units of (decayed) verified work below which a key weighs nothing: one verified check keeps a voice for one
half-life, not for ever."""
MAX_KEYS = 4096
"""Keys a :class:`Standing` remembers; past it, the one credited longest ago is forgotten (many keys: a Sybil)."""


class Standing:
    """Verified work per key (peer id), as this peer saw it (module docstring).

    :param half_life_s: ``H``, seconds.
    :param full: ``S``, the units of a full vote.
    :param clock: seconds, monotonic (tests pass their own).
    :param path: where the standing is kept across restarts (:meth:`keep`); loaded here if it exists (a file it
        cannot read is logged and the standing starts anew). None: in memory only.
    :raises ValueError: ``half_life_s`` or ``full`` not positive.
    """

    def __init__(self, half_life_s: float = HALF_LIFE_S, full: float = FULL_STANDING,
                 clock: Callable[[], float] = time.monotonic, path: Optional[Path] = None):
        if half_life_s <= 0 or full <= 0:
            raise ValueError(f"half_life_s and full must be positive, got {half_life_s}, {full}")
        self.half_life_s, self.full, self.clock, self.path = half_life_s, full, clock, path
        self._work: OrderedDict[str, tuple[float, float]] = OrderedDict()  # key -> (standing, at time)
        self._revoked: set[str] = set()
        self.changed = False  # credited, reset or revoked since the last save (or load)
        self._save_failed = False
        if path is not None:
            try:
                if self.load(path):
                    logger.info("kept the standing of %d keys from %s", len(self._work), path)
            except (ValueError, OSError) as e:
                logger.warning("this peer's standing starts anew: %s", e)

    def _decayed(self, key: str, now: float) -> float:
        standing, at = self._work.get(key, (0.0, now))
        return standing * math.pow(2.0, -(now - at) / self.half_life_s)

    def credit(self, key: str, units: float = 1.0) -> None:
        """``key`` passed ``units`` checks this peer made (nothing for a revoked key).

        :raises ValueError: ``units`` negative or not finite."""
        if not math.isfinite(units) or units < 0:
            raise ValueError(f"units must be finite and >= 0, got {units}")
        if key in self._revoked:
            return
        now = self.clock()
        self._work[key] = (self._decayed(key, now) + units, now)
        self._work.move_to_end(key)
        self.changed = True
        while len(self._work) > MAX_KEYS:
            self._work.popitem(last=False)

    def reset(self, key: str) -> None:
        """``key``'s standing to 0 (it was excluded: its work is judged anew from here; it can earn it back)."""
        self.changed = self._work.pop(key, None) is not None or self.changed

    def revoke(self, key: str) -> None:
        """``key`` was convicted (or excluded) on evidence this peer verified: standing 0, for good."""
        self._work.pop(key, None)
        self._revoked.add(key)
        self.changed = True

    def standing(self, key: str) -> float:
        """Decayed units of ``key``'s verified work now."""
        return self._decayed(key, self.clock()) if key in self._work else 0.0

    def heaviest(self, n: int, keys: Optional[Iterable[str]] = None) -> dict[str, float]:
        """The ``n`` keys (of ``keys``, if given) with the highest weight above 0 -> their weight."""
        weights = {k: self.weight(k) for k in (self._work if keys is None else keys) if k in self._work}
        return dict(sorted(((k, w) for k, w in weights.items() if w > 0), key=lambda kw: -kw[1])[:n])

    def weight(self, key: str) -> float:
        """``key``'s vote in ``[0, 1]``: its standing over :attr:`full`, at most 1; 0 below :data:`MIN_STANDING`
        (work verified long ago is no voice now: a key must keep working to keep one)."""
        standing = self.standing(key)
        return 0.0 if standing < MIN_STANDING else min(1.0, standing / self.full)

    # ---- across restarts ------------------------------------------------------------------------------------
    def save(self, path: Path) -> None:
        """Write every key's standing now, and the revoked keys (at most :data:`MAX_KEYS` of each), to ``path``
        (JSON, written to a temporary file then renamed: a crash leaves the previous file).

        :raises OSError: not written (a full disk, no permission); the standing in memory is unchanged."""
        now = self.clock()
        data = {"version": 1, "saved_at": time.time(), "half_life_s": self.half_life_s,
                "work": {k: self._decayed(k, now) for k in self._work},
                "revoked": sorted(self._revoked)[:MAX_KEYS]}
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(data))
        os.replace(tmp, path)
        self.changed = False

    def keep(self) -> None:
        """Save to :attr:`path` if the standing changed since (blocking: a small file). A failed save is logged
        once (and again once after a save succeeded): the standing in memory is unchanged."""
        if self.path is None or not self.changed:
            return
        try:
            self.save(self.path)
            self._save_failed = False
        except OSError as e:
            if not self._save_failed:
                logger.warning("could not keep this peer's standing in %s (%s): a restart would earn it anew; free "
                               "space or set SWARM_STATE_DIR to a writable folder", self.path, e)
            self._save_failed = True

    def load(self, path: Path) -> int:
        """Add the standing saved at ``path``, decayed by the wall-clock seconds since it was saved (none if the
        clock went back); returns the keys loaded (0 without a file).

        :raises ValueError: ``path`` holds no standing this version wrote (delete it: standing is earned anew).
        :raises OSError: unreadable."""
        if not path.exists():
            return 0
        try:
            data = json.loads(path.read_text())
            if data.get("version") != 1:
                raise ValueError(f"version {data.get('version')!r}, not 1")
            down_s = max(0.0, time.time() - float(data["saved_at"]))
            work = {str(k): float(v) for k, v in dict(data["work"]).items()}
            revoked = [str(k) for k in list(data["revoked"])[:MAX_KEYS]]
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{path} is not a standing file of this version ({e}); delete it") from None
        for key, standing in list(work.items())[-MAX_KEYS:]:
            if math.isfinite(standing) and standing > 0:
                self.credit(key, standing * math.pow(2.0, -down_s / self.half_life_s))
        for key in revoked:
            self.revoke(key)
        self.changed = False
        return len(work)


__all__ = ["FULL_STANDING", "HALF_LIFE_S", "MIN_STANDING", "Standing"]
