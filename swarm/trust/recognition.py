"""The run key's recognition: which servers earned standing, for decisions a peer cannot weigh by its own standing.

A server's standing (:mod:`swarm.trust.standing`) comes from the averaging work *it* verified: its stage-mates'.
Some decisions are about other stages' servers (a rollback order comes from the last stage; a joiner chooses a
stage by every stage's throughput; a restoring server reads a stage's checkpoints) or are made by a peer that
verified nobody yet (a fresh joiner). Counting those servers by head lets fresh keys that only announce win them:
measured with ``bench/sybil.py``, four idle keys per stage of a 2 x 2 swarm made every honest server apply 17
rollbacks in 90 s (learning-rate scale 7.6e-6).

The coordinator therefore keeps a :class:`RecognitionBook` and publishes it, signed by the run key, as a
:class:`~swarm.protocol.Recognition` (renewed every few seconds; void :data:`RECOGNITION_TTL_S` after the
coordinator stops):

* a stage's **founders** are the first servers the coordinator sees verifying each other (each names the other in
  ``ServerInfo.vouches``), of those it saw first: keys that announce themselves once a pair has formed found
  nothing (the servers a run's creator starts are the founders); a stage served by one server alone for
  :data:`FOUND_ALONE_S` is founded by that server (nobody can verify its work; it stays recognized while it stays
  alone, as nobody can vouch for it either), and a server that averages with it is then recognized by its vouch;
* a server is **recognized** once a recognized server of its stage vouches for it (it verified that server's
  averaging parts, accepted unflagged by robust aggregation), and stays so while it comes back within
  :data:`FORGET_S`; its exclusion or conviction by most of its recognized stage-mates ends it;
* keys vouched for only by unrecognized keys (Sybils vouching for one another) are never recognized, however many.

What a Sybil must spend to be recognized: averaging work a recognized server verified, i.e. an honest server's
compute for the stage, for as long as it wants to stay vouched for (a vouch needs half a unit of decayed standing:
one verified round keeps it an hour). The prices: an attacker alone on a stage before anyone else, for
:data:`FOUND_ALONE_S`, or with a second key paired with it first, founds the stage; a stage none of whose
recognized servers came back within :data:`RESEED_S` takes new founders (an attacker present then, alone, founds
it); keys that keep announcing on a stage of one server keep it from being founded (it then counts by head, as
without a recognition).

Peers read it with :class:`RecognitionReader` and weigh by it what their own standing cannot: on a stage it names
somebody on, a key it does not name has no voice. A stage it names nobody on, or every stage without a valid one
(the coordinator down longer than a recognition lives, or a run before its first servers verified each other),
counts as before, by head; a server says so in its log once.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Callable, Optional

from hivemind.utils import get_dht_time

from swarm.config import RunSpec
from swarm.identity import Identity
from swarm.protocol import (MAX_RECOGNIZED, ProtocolError, Recognition, ServerInfo, ServerState, open_run_key_record,
                            recognition_key, seal)

logger = logging.getLogger(__name__)

FORGET_S = 7 * 24 * 3600.0
"""Seconds a recognized server may stay away and still be recognized when it comes back."""
RESEED_S = 600.0
"""Seconds without any recognized server of a stage online after which the stage takes new founders."""
FOUND_ALONE_S = 60.0
"""Seconds a stage must be served by one and the same server alone (no other server online on it in any read)
before that server founds it."""
RECOGNITION_TTL_S = 300.0
"""Seconds a published recognition stays valid (the coordinator renews it every few seconds)."""
LAPSE_S = 2 * 3600.0
"""Seconds a recognized server stays so without a recognized server vouching for it (two standing half-lives)."""
MAX_LISTED = 2048
"""Peer ids a published recognition lists in all stages together (about 35 KiB sealed)."""
MAX_FIRST_SEEN = 1 << 16
"""Keys whose first sighting a :class:`RecognitionBook` remembers (later ones count as never seen: no founders)."""


class RecognitionBook:
    """The coordinator's view of which servers are recognized (module docstring), by stage and peer id.

    :param path: a JSON file to keep it across the coordinator's restarts (None: in memory only).
    :param clock: wall-clock seconds (tests pass their own).
    """

    def __init__(self, path: Optional[Path] = None, clock: Callable[[], float] = time.time):
        self.path, self.clock = path, clock
        self.seen: dict[int, dict[str, float]] = {}  # stage -> recognized peer id -> when last seen online
        self.vouched: dict[str, float] = {}  # recognized peer id -> when a recognized server last vouched for it
        self.last_online: dict[int, float] = {}  # stage -> when a recognized server of it was last seen online
        self.first_seen: dict[str, float] = {}  # peer id -> when this book first read a record of it
        self.alone: dict[int, tuple[str, float]] = {}  # stage -> its only online server, and since when (this run)
        if path is not None and path.exists():
            self._load(path)

    def update(self, servers: dict[int, list[ServerInfo]]) -> bool:
        """Read the stages' current server records; returns whether a server was recognized or dropped."""
        now, changed = self.clock(), False
        for records in servers.values():
            for s in records:
                if s.peer_id not in self.first_seen and len(self.first_seen) < MAX_FIRST_SEEN:
                    self.first_seen[s.peer_id] = now
        for stage in set(self.alone) - set(servers):
            del self.alone[stage]
        for stage, records in servers.items():
            online = {s.p2p_id: s for s in records if s.state == ServerState.ONLINE}
            known = self.seen.setdefault(stage, {})
            if any(s.peer_id in known for s in online.values()):
                self.last_online[stage] = now
            only = {s.peer_id for s in online.values()}
            lone = self._alone(stage, only, now)
            if now - self.last_online.get(stage, float("-inf")) > RESEED_S:
                changed |= self._found(stage, online, known, now) or self._found_alone(stage, lone, known, now)
            if len(only) == 1 and only <= known.keys():
                self.vouched[next(iter(only))] = now  # nobody can vouch for a stage's only server: no lapse alone
            changed |= self._grow(stage, online, known, now)
            changed |= self._remove(stage, online, known)
            for peer in [p for p, t in known.items() if now - t > FORGET_S or now - self.vouched.get(p, t) > LAPSE_S]:
                del known[peer]
                changed = True
        if changed:
            self.save()
        return changed

    def _found(self, stage: int, online: dict[str, ServerInfo], known: dict[str, float], now: float) -> bool:
        """Take the stage's founders (module docstring): of the servers paired by mutual vouches, those this book saw
        no later than the second server it saw of all those online now; a pair at least."""
        paired = [s.peer_id for p, s in online.items()
                  if any(v in online and online[v].vouches.get(p, 0) > 0 for v, w in s.vouches.items() if w > 0)]
        seen = sorted(self.first_seen.get(s.peer_id, float("inf")) for s in online.values())
        founders = [p for p in paired if len(seen) > 1 and self.first_seen.get(p, float("inf")) <= seen[1]]
        if len(founders) < 2:
            return False
        known.clear()
        for peer in sorted(founders):
            known[peer] = self.vouched[peer] = now
            logger.info("recognition: %s founds stage %d (it and a stage-mate verified each other)", peer, stage)
        self.last_online[stage] = now
        return True

    def _alone(self, stage: int, ids: set[str], now: float) -> Optional[str]:
        """The peer id of the stage's only online server (``ids``: the peer ids online now) if it has been so in
        every read for :data:`FOUND_ALONE_S`, else None."""
        if len(ids) != 1:
            self.alone.pop(stage, None)
            return None
        (peer,) = ids
        if self.alone.get(stage, ("", 0.0))[0] != peer:
            self.alone[stage] = (peer, now)
        return peer if now - self.alone[stage][1] >= FOUND_ALONE_S else None

    def _found_alone(self, stage: int, lone: Optional[str], known: dict[str, float], now: float) -> bool:
        """A stage served by ``lone`` alone for :data:`FOUND_ALONE_S`: it founds the stage."""
        if lone is None:
            return False
        known.clear()
        known[lone] = self.vouched[lone] = now
        self.last_online[stage] = now
        logger.info("recognition: %s founds stage %d (its only server for %.0f s)", lone, stage, FOUND_ALONE_S)
        return True

    def _grow(self, stage: int, online: dict[str, ServerInfo], known: dict[str, float], now: float) -> bool:
        """Add the servers a recognized one vouches for, until none is added. ``online``: libp2p id -> record;
        ``known``: peer id -> when last seen online."""
        changed, grew = False, True
        while grew:
            grew = False
            for s in [s for s in online.values() if s.peer_id in known]:
                known[s.peer_id] = now
                for vouched, weight in s.vouches.items():
                    mate = online.get(vouched)
                    if weight <= 0 or mate is None or mate.peer_id == s.peer_id:
                        continue
                    self.vouched[mate.peer_id] = now
                    if mate.peer_id not in known:
                        known[mate.peer_id], grew, changed = now, True, True
                        logger.info("recognition: %s joins stage %d's recognized servers (vouched for by %s)",
                                    mate.peer_id, stage, s.peer_id)
        return changed

    def _remove(self, stage: int, online: dict[str, ServerInfo], known: dict[str, float]) -> bool:
        """Drop, one at a time (the most listed first, the others counted again), a recognized server that at least
        two and a strict majority of its other recognized online stage-mates list as excluded or convicted."""
        changed = False
        while True:
            voters = [s for s in online.values() if s.peer_id in known]
            listings = {s.peer_id: [v.peer_id for v in voters if v is not s and
                                    (s.p2p_id in v.excluded or s.peer_id in v.convicted)] for s in voters}
            peer, by = max(listings.items(), key=lambda kv: (len(kv[1]), kv[0]), default=(None, []))
            if peer is None or len(by) < 2 or 2 * len(by) <= len(voters) - 1:
                return changed
            del known[peer]
            changed = True
            logger.info("recognition: %s leaves stage %d's recognized servers (listed by %s)", peer, stage,
                        ", ".join(by))

    def listed(self) -> dict[int, list[str]]:
        """Stage -> its recognized peer ids to publish, the most recently seen first: at most
        :data:`~swarm.protocol.MAX_RECOGNIZED` per stage and :data:`MAX_LISTED` in all (the record's size)."""
        out, left = {}, MAX_LISTED
        for stage in sorted(self.seen):
            ids = sorted(self.seen[stage], key=lambda p: (-self.seen[stage][p], p))[:min(MAX_RECOGNIZED, left)]
            if ids:
                out[stage], left = ids, left - len(ids)
        return out

    def record(self, run_key: Identity, spec: RunSpec, run_id: str) -> Recognition:
        """The recognition to publish now, signed by the run key (see :func:`publish_recognition`)."""
        now = get_dht_time()
        return Recognition(run_id=run_id, peer_id=run_key.peer_id, time=now, spec_name=spec.name,
                           spec_hash=spec.spec_hash(), expires=now + RECOGNITION_TTL_S, servers=self.listed())

    def save(self) -> None:
        """Write the book to :attr:`path` (a temporary file, then renamed); a failure is logged, not raised."""
        if self.path is None:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name(self.path.name + ".tmp")
            tmp.write_text(json.dumps({"version": 1, "seen": {str(k): v for k, v in self.seen.items()},
                                       "vouched": self.vouched, "first_seen": self.first_seen,
                                       "last_online": {str(k): v for k, v in self.last_online.items()}}))
            os.replace(tmp, self.path)
        except OSError as e:
            logger.warning("could not keep the recognition in %s (%s): a restart would found its stages anew",
                           self.path, e)

    def _load(self, path: Path) -> None:
        try:
            data = json.loads(path.read_text())
            if data.get("version") != 1:
                raise ValueError(f"version {data.get('version')!r}")
            seen = {int(k): {str(p): float(t) for p, t in dict(v).items()} for k, v in dict(data["seen"]).items()}
            first = list(dict(data.get("first_seen", {})).items())[:MAX_FIRST_SEEN]
            vouched = {str(p): float(t) for p, t in dict(data.get("vouched", {})).items()}
            last = {int(k): float(t) for k, t in dict(data.get("last_online", {})).items()}
            self.seen, self.first_seen = seen, {str(p): float(t) for p, t in first}
            self.vouched, self.last_online = vouched, last
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            logger.warning("ignored the recognition file %s (%s): its stages are founded anew", path, e)


def publish_recognition(directory, run_key: Identity, spec: RunSpec, book: RecognitionBook) -> Optional[Recognition]:
    """Update ``book`` from the run's server records and store its recognition (blocking; the coordinator's duty).
    Returns the recognition stored, or None if the DHT took none."""
    book.update(directory.all_servers(spec.model.num_stages))
    recognition = book.record(run_key, spec, directory.run_id)
    sealed = seal(recognition, run_key)
    open_run_key_record(sealed, Recognition, directory.run_id)  # a wrong key fails here, not at every peer
    stored = directory.store_sealed(recognition_key(directory.run_id), recognition.dht_subkey(), sealed,
                                    recognition.expires)
    return recognition if stored else None


def read_recognition(directory) -> Optional[Recognition]:
    """The run key's valid recognition in the DHT (blocking), or None: none published, expired, or a stranger's."""
    now, valid = get_dht_time(), []
    for _, sealed in directory.read_sealed(recognition_key(directory.run_id), Recognition):
        try:
            found = open_run_key_record(sealed, Recognition, directory.run_id)
        except ProtocolError as e:  # a stranger's (honest DHT nodes refuse to store it already)
            logger.debug("dropped a recognition: %s", e)
            continue
        if found.expires > now:
            valid.append(found)
    return max(valid, key=lambda r: r.time, default=None)


class RecognitionReader:
    """A peer's cached read of the run key's recognition (:func:`read_recognition`, at most every ``every_s``
    seconds), which logs once when decisions go without one and once when one is back. A read that finds nothing
    keeps the last one while it is valid (a DHT miss does not turn decisions back to counting heads). Safe to call
    from the event loop and from worker threads alike.

    ``await reader.current()`` reads it when due; :meth:`recognized` answers from the last read.
    """

    def __init__(self, directory, every_s: float = 10.0, clock: Callable[[], float] = time.monotonic):
        self.directory, self.every_s, self.clock = directory, every_s, clock
        self._recognition: Optional[Recognition] = None
        self._read_at = float("-inf")
        self._missing_logged: Optional[bool] = None
        self._lock = threading.Lock()
        self._sets: tuple[Optional[Recognition], dict[int, frozenset[str]]] = (None, {})

    async def current(self) -> Optional[Recognition]:
        """The recognition, read again if the last read is ``every_s`` old."""
        if self.clock() - self._read_at >= self.every_s:
            return await asyncio.to_thread(self.read)
        return self._valid()

    def read(self) -> Optional[Recognition]:
        """(blocking) :meth:`current`, read now."""
        self._read_at = self.clock()
        try:
            found = read_recognition(self.directory)
        except Exception as e:  # a DHT hiccup: keep the last one while it is valid
            logger.debug("could not read the recognition: %s", e)
            found = None
        with self._lock:
            if found is not None and (self._recognition is None or found.time >= self._recognition.time):
                self._recognition = found
        return self._valid()

    def read_recognized(self, stage: int) -> Optional[frozenset[str]]:
        """(blocking) :meth:`recognized`, read again first if the last read is ``every_s`` old (the directory's
        :attr:`~swarm.net.directory.RunDirectory.recognized`, called in its blocking reads)."""
        if self.clock() - self._read_at >= self.every_s:
            self.read()
        return self.recognized(stage)

    def recognized(self, stage: int) -> Optional[frozenset[str]]:
        """Peer ids the last read names on ``stage``; None without a valid recognition or if it names nobody there
        (the stage then counts by head)."""
        return self._indexed().get(stage)

    def _indexed(self) -> dict[int, frozenset[str]]:
        r = self._valid(log=False)
        if r is None:
            return {}
        with self._lock:
            if self._sets[0] is not r:
                self._sets = (r, {k: frozenset(v) for k, v in r.servers.items() if v})
            return self._sets[1]

    def _valid(self, log: bool = True) -> Optional[Recognition]:
        with self._lock:
            r = self._recognition
            if r is not None and r.expires <= get_dht_time():
                r = self._recognition = None
            missing, logged = r is None, self._missing_logged
            if log:
                self._missing_logged = missing
        if log and missing != logged:
            if missing:
                (logger.warning if logged is False else logger.info)(  # (it lost one it had: a warning)
                    "no recognition by the run key (the coordinator is down, or saw no stage's servers verify each "
                    "other yet): other stages' servers and checkpoints count by head until there is one")
            else:
                logger.info("the run key recognizes %d servers: other stages' servers and checkpoints count by it",
                            sum(len(v) for v in r.servers.values()))
        return r


def follow_recognition(directory) -> RecognitionReader:
    """A :class:`RecognitionReader` of ``directory`` (a blocking :class:`~swarm.net.directory.RunDirectory`), which
    the directory's reads of checkpoint manifests then follow (:attr:`~swarm.net.directory.RunDirectory.recognized`):
    a manifest counts only if two servers the run key recognizes vouch for its state, where it names servers of its
    stage (:func:`~swarm.net.directory.recognized_refusal`).
    Servers, trainers (whose data position resumes from the newest manifests) and the coordinator's checkpoint
    commands alike; without a recognition (no coordinator yet, or it is down) a manifest counts as before."""
    reader = RecognitionReader(directory)
    directory.recognized = reader.read_recognized
    return reader
