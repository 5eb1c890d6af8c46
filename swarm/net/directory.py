"""The run directory: publishing and reading a run's signed records in its DHT.

The directory reads only records that verify (:func:`swarm.protocol.open_record`); bad ones are logged with
their cause and skipped, so a forged or malformed record never reaches routing or monitoring. It has two faces
over the same records, in the manner of httpx's ``Client`` and ``AsyncClient``: :class:`RunDirectory`, whose
calls block (observers, tests, code on a worker thread), and :class:`AsyncRunDirectory`, whose calls are awaited
(every peer's code on its event loop: ``await directory.servers(k)``). A DHT call blocks on hivemind's DHT
process and a record's signature check costs CPU, so the async face runs each call in the loop's default
executor. Joining a run (its address, the DHT node) is :mod:`swarm.net.dht`.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time
from concurrent.futures import CancelledError
from typing import Any, Callable, Iterable, Optional, Sequence, Type, TypeVar

import hivemind
from hivemind.utils import get_dht_time

from swarm.config import MAX_STAGE_STRIPE_BITS, RunSpec, SpecError
from swarm.identity import Identity, derive_run_id, peer_id_of
from swarm.protocol import (
    AnnouncedRecord,
    BanList,
    CheckpointManifest,
    Endorsement,
    ProtocolError,
    Record,
    RollbackOrder,
    ServerHistory,
    ServerInfo,
    ServerState,
    SpecRecord,
    StorageInfo,
    TrainerInfo,
    bans_key,
    checkpoints_key,
    history_key,
    open_record,
    open_spec,
    rollback_key,
    seal,
    spec_key,
    stage_stripe,
    stage_key,
    stage_keys,
    storage_key,
    trainers_key,
)

logger = logging.getLogger(__name__)
R = TypeVar("R", bound=Record)

ROSTER_READ_S = 2.0
"""Seconds between two reads of a stage's records made to look up a peer not seen serving it
(:meth:`RunDirectory.entitled`)."""
ROSTER_FIRST_READS = 3
"""Reads of a stage's records made at once, without waiting :data:`ROSTER_READ_S`, to look up a peer not seen
serving it: one DHT read may miss a record that is there (the records of a stage's servers are spread over the
nodes nearest the key), and a one-shot observer (``checkpoints``, ``export``) must not ignore every checkpoint
of a server its first read missed."""
RECORDS_READ_PER_S = 16.0
"""Server records a peer reads per second, on average, to follow a stage of many servers (:func:`read_period_s`):
~35 KB/s at ~2.2 KB a record, whatever the stage's size, until the stage is read only as often as its servers
re-announce."""


SMALL_STAGE = 32
"""Servers up to which a stage is read at its peer's own cadence (:func:`read_period_s`)."""


def read_period_s(records: int, shortest_s: float, longest_s: float) -> float:
    """Seconds between two reads of a stage whose last read returned ``records`` server records: its peer's own
    cadence (``shortest_s``) up to :data:`SMALL_STAGE` records, then ``records /`` :data:`RECORDS_READ_PER_S` if
    longer (a peer of a stage of n servers otherwise reads n records per period, and the stage's DHT nodes answer
    n readers: n² records per period), at most ``longest_s`` (the servers' re-announce period: reading less often
    would miss whole announcements).

    :raises ValueError: ``shortest_s`` exceeds ``longest_s``.
    """
    if shortest_s > longest_s:
        raise ValueError(f"shortest_s={shortest_s} exceeds longest_s={longest_s}")
    if records <= SMALL_STAGE:
        return shortest_s
    return min(longest_s, max(shortest_s, records / RECORDS_READ_PER_S))


ROUTING_SERVERS = 64
"""Server records of a stage a trainer reads at a time from a striped stage (:func:`stripes_to_read`): enough to
route over (a trainer keeps a few micro-batches in flight), few enough that its reads do not grow with the stage."""


def stripes_to_read(found: int, stripes_read: int, bits: int, want: int = ROUTING_SERVERS,
                    rng: Optional[random.Random] = None) -> Optional[list[int]]:
    """The stripes of a stage (indices in ``range(2^bits)``, :func:`~swarm.protocol.stage_keys`) that a read
    should look up to find about ``want`` server records, the last read having found ``found`` in
    ``stripes_read`` stripes: every stripe (None) before a read found any, on an unstriped stage, or where
    ``want`` needs them all; else ``ceil(want / (found / stripes_read))`` of them drawn at random anew each read,
    so that a reader's view turns over the whole stage every few reads and its readers spread over every key.

    A trainer needs a few servers per stage, not all: this bounds its DHT traffic at ``~want`` records per read
    whatever the stage's size (the simulator's limit 1, docs/scaling.md).

    :raises ValueError: ``bits`` outside ``0..4`` or ``want`` below 1.
    """
    if not 0 <= bits <= MAX_STAGE_STRIPE_BITS or want < 1:
        raise ValueError(f"need 0 <= bits <= {MAX_STAGE_STRIPE_BITS} and want >= 1, got bits={bits}, want={want}")
    stripes = 2 ** bits
    if found <= 0 or stripes_read <= 0:
        return None
    count = math.ceil(want * stripes_read / found)
    if count >= stripes:
        return None
    return sorted((rng or random).sample(range(stripes), count))


def is_fresh(record: AnnouncedRecord, now: float, ttl: float, slack_s: float = 1.5) -> bool:
    """Was ``record`` announced within the last re-announce period (``ttl / 3``) plus ``slack_s`` seconds of
    ``now`` (DHT time, seconds)? An older record may be left by a peer that died: it stays listed until it
    expires, ``ttl`` seconds after its last announcement."""
    return record.time >= now - ttl / 3 - slack_s


ROSTER_KEEP_S = 3600.0
"""Seconds a peer stays in :attr:`RunDirectory.roster` after the last read that found its server record: long
enough to entitle the manifests it wrote (checkpoints are written every few epochs), short enough that a
long-lived peer's roster holds the servers of the last hour, not of the whole run."""
ROSTER_CAP = 4096
"""Most peers :attr:`RunDirectory.roster` keeps per stage (those seen longest ago go first): a stage flooded with
announcements by throwaway keys cannot grow a peer's memory without bound."""


def _alive(dht: hivemind.DHT) -> bool:
    """Whether ``dht``'s process runs; from another process than the one that started it (a server's averager
    process, which reads the run's tickets, :mod:`swarm.averaging.admitted`) it cannot be asked: assumed so, and a
    dead DHT's call then ends at :attr:`RunDirectory.call_timeout_s`."""
    try:
        return dht.is_alive()
    except AssertionError:  # multiprocessing: "can only test a child process"
        return True


class RunDirectory:
    """Signed records of one run in the DHT: the spec, stage servers, trainers, fragment holders, checkpoint
    manifests and rollback orders.

    Every DHT call returns within ``call_timeout_s`` seconds, or at once when the DHT process has stopped: a
    call in flight when hivemind's DHT shuts down is otherwise never answered, and the thread making it (and
    with it the process's exit) waits forever. Such a call reads as "nothing found" / "not stored".
    """

    call_timeout_s = 60.0  # well above a lookup's worst case (hivemind retries each request for 3 s)
    _POLL_S = 1.0

    def __init__(self, dht: hivemind.DHT, run_id: str, ttl: float = 30.0, stage_stripe_bits: int = 0):
        self.dht, self.run_id, self.ttl = dht, run_id, ttl
        self.stage_stripe_bits = stage_stripe_bits  # the spec's [records], once verified: 2^bits keys per stage
        self.run_key: Optional[bytes] = None  # the coordinator's public key, once a spec verified
        self.num_stages: Optional[int] = None  # the spec's, once verified
        self.roster: dict[int, dict[str, float]] = {}  # stage -> peer ids seen announced as its servers -> when
        # (time.monotonic() of the last read that found them; kept ROSTER_KEEP_S, at most ROSTER_CAP per stage)
        self._roster_read: dict[int, float] = {}  # stage -> time.monotonic() of its last read
        self._roster_reads: dict[int, int] = {}  # stage -> reads of its records so far
        self._refused_manifests: set[str] = set()  # (logged once each)
        self._manifest_expiry: dict[int, dict[str, float]] = {}  # stage -> manifest sub-key -> DHT expiration
        self.recognized: Callable[[int], Optional[frozenset[str]]] = lambda stage: None  # (:meth:`entitled`)

    # ---- bounded DHT calls -----------------------------------------------------------------------------
    def _get(self, key: str) -> Any:
        """``dht.get(key, latest=True)``, or None if the DHT stopped or did not answer in time."""
        return self._wait(lambda: self.dht.get(key, latest=True, return_future=True), f"get {key}", None)

    def _get_many(self, keys: list[str]) -> list[Any]:
        """:meth:`_get` of every key, with the lookups in flight together (one lookup's time, not one per key)."""
        if len(keys) == 1 or not _alive(self.dht):
            return [self._get(key) for key in keys]
        try:
            futures = [self.dht.get(key, latest=True, return_future=True) for key in keys]
        except OSError:  # hivemind closed its pipe: the DHT was shut down
            return [None] * len(keys)
        return [self._wait(lambda f=f: f, f"get {key}", None) for key, f in zip(keys, futures)]

    def _store(self, key: str, value: bytes, expiration: float, subkey: Optional[str] = None) -> bool:
        """``dht.store(...)``; False if the DHT stopped or did not answer in time."""
        return bool(self._wait(lambda: self.dht.store(key, value, expiration, subkey=subkey, return_future=True),
                               f"store {key}", False))

    def _wait(self, call, what: str, default: Any) -> Any:
        if not _alive(self.dht):  # stopped or died: a request sent now would never be answered
            return default
        try:
            future = call()
        except OSError:  # hivemind closed its pipe: the DHT was shut down
            return default
        deadline = time.monotonic() + self.call_timeout_s
        while True:
            try:
                return future.result(timeout=self._POLL_S)
            except TimeoutError:
                pass
            except (CancelledError, asyncio.CancelledError):  # (hivemind may cancel it in its own loop)
                return default
            stopped = not _alive(self.dht)
            if stopped or time.monotonic() > deadline:
                future.cancel()
                if not stopped:
                    logger.warning("DHT %s: no answer within %.0f s; treated as not found (check the peer's "
                                   "network, or raise RunDirectory.call_timeout_s)", what, self.call_timeout_s)
                return default

    # ---- spec ------------------------------------------------------------------------------------------
    @staticmethod
    def seal_spec(spec: RunSpec, coordinator: Identity) -> tuple[str, bytes]:
        """``(run_id, sealed SpecRecord)`` for ``spec`` signed by the coordinator."""
        spec_hash = spec.spec_hash()
        run_id = derive_run_id(spec.name, coordinator.public_key, spec_hash)
        rec = SpecRecord(run_id=run_id, peer_id=coordinator.peer_id, time=get_dht_time(),
                         spec_json=spec.canonical_json(), spec_hash=spec_hash)
        return run_id, seal(rec, coordinator)

    def publish_spec(self, sealed: bytes) -> bool:
        return self._store(spec_key(self.run_id), sealed, get_dht_time() + self.ttl)

    def fetch_spec(self, timeout: float = 30.0) -> tuple[RunSpec, bytes]:
        """The run's verified spec and its sealed bytes (to re-publish). Polls until ``timeout`` (seconds).

        :raises SpecError: no valid spec found in time, or the spec does not match the run id.
        """
        deadline, last_error = time.monotonic() + timeout, "no spec record found in the DHT"
        while True:
            found = self._get(spec_key(self.run_id))
            if found is not None:
                try:
                    return self.verify_spec(found.value), found.value
                except (ProtocolError, SpecError) as e:
                    last_error = str(e)
            if time.monotonic() > deadline:
                raise SpecError(f"could not fetch the spec of run {self.run_id}: {last_error}; check the run address "
                                "and that the coordinator or a peer of the run is reachable")
            time.sleep(1.0)

    def verify_spec(self, sealed: bytes) -> RunSpec:
        """Check signature, hash and run id of a sealed spec (:func:`~swarm.protocol.open_spec`); raises
        ProtocolError or SpecError."""
        spec, self.run_key = open_spec(sealed, self.run_id)
        self.num_stages, self.stage_stripe_bits = spec.model.num_stages, spec.records.stage_stripe_bits
        return spec

    # ---- peers -----------------------------------------------------------------------------------------
    def announce(self, key: str, record: Record, identity: Identity) -> bool:
        """Sign ``record`` and store it under its own sub-key for ``ttl`` seconds (an announcement's lifetime
        is signed into it: :class:`~swarm.protocol.AnnouncedRecord`). False if no DHT node took it."""
        if isinstance(record, AnnouncedRecord):
            record = record.model_copy(update={"ttl_s": self.ttl})
            expiration = record.time + self.ttl
        else:
            expiration = get_dht_time() + self.ttl
        return self._store(key, seal(record, identity), expiration, subkey=record.dht_subkey())

    def announce_server(self, info: ServerInfo, identity: Identity) -> bool:
        """Announce ``info`` under its stage's key, in its peer's stripe (``[records] stage_stripe_bits``)."""
        stripe = stage_stripe(info.peer_id, self.stage_stripe_bits)
        return self.announce(stage_key(self.run_id, info.stage, stripe), info, identity)

    def announce_trainer(self, info: TrainerInfo, identity: Identity) -> bool:
        return self.announce(trainers_key(self.run_id), info, identity)

    def announce_history(self, history: ServerHistory, identity: Identity) -> bool:
        return self.announce(history_key(self.run_id, history.stage), history, identity)

    def read_sealed(self, key: str, cls: Type[R], expiry: Optional[dict[str, float]] = None
                    ) -> list[tuple[R, bytes]]:
        """Verified records under ``key`` with their sealed bytes (to re-publish verbatim); bad ones are logged
        with their cause and skipped. ``expiry``, if given, gets each verified record's sub-key -> DHT expiration
        time."""
        return self._open_found(key, self._get(key), cls, expiry)

    def _open_found(self, key: str, found: Any, cls: Type[R], expiry: Optional[dict[str, float]] = None
                    ) -> list[tuple[R, bytes]]:
        """:meth:`read_sealed` of what a lookup of ``key`` found."""
        if found is None or not isinstance(found.value, dict):
            return []
        out = []
        for subkey, item in found.value.items():
            try:
                rec, _ = open_record(item.value, cls, run_id=self.run_id, subkey=subkey,
                                     expiration=item.expiration_time)
            except ProtocolError as e:
                logger.warning("dropped a record under %s/%s: %s", key, subkey, e)
                continue
            out.append((rec, item.value))
            if expiry is not None:
                expiry[subkey] = item.expiration_time
        return out

    def _read(self, key: str, cls: Type[R]) -> list[R]:
        return [rec for rec, _ in self.read_sealed(key, cls)]

    def store_sealed(self, key: str, subkey: str, sealed: bytes, expiration: Optional[float] = None) -> bool:
        """Store sealed bytes (signed by anyone, e.g. a manifest's writer) for ``ttl`` seconds, or until
        ``expiration`` (DHT time)."""
        return self._store(key, sealed, expiration or get_dht_time() + self.ttl, subkey=subkey)

    def servers(self, stage: int, stripes: Optional[Sequence[int]] = None) -> list[ServerInfo]:
        """Verified, unexpired ServerInfo records of ``stage``, any state (their signers join :attr:`roster`): of
        every stripe, or of those listed (indices into :func:`~swarm.protocol.stage_keys`, see
        :func:`stripes_to_read`)."""
        keys = stage_keys(self.run_id, stage, self.stage_stripe_bits)
        if stripes is not None:
            keys = [keys[i] for i in stripes]
        found = [rec for key, value in zip(keys, self._get_many(keys))
                 for rec, _ in self._open_found(key, value, ServerInfo) if rec.stage == stage]
        self._remember(stage, [s.peer_id for s in found])
        self._roster_read[stage] = time.monotonic()
        self._roster_reads[stage] = self._roster_reads.get(stage, 0) + 1
        return found

    def _remember(self, stage: int, peer_ids: list[str]) -> None:
        """Note ``peer_ids`` as servers of ``stage`` seen now; forget those not seen for :data:`ROSTER_KEEP_S` and,
        past :data:`ROSTER_CAP`, those seen longest ago."""
        now = time.monotonic()
        seen = self.roster.setdefault(stage, {})
        seen.update(dict.fromkeys(peer_ids, now))
        for p in [p for p, when in seen.items() if now - when > ROSTER_KEEP_S]:
            del seen[p]
        if len(seen) > ROSTER_CAP:
            for p in sorted(seen, key=seen.__getitem__)[:len(seen) - ROSTER_CAP]:
                del seen[p]

    def seen_serving(self, peer_id: str, stage: int, read: bool = True) -> bool:
        """Was ``peer_id`` seen announced as a server of ``stage``? (With ``read``, reads the stage's records again if
        it was not: at once for the stage's first :data:`ROSTER_FIRST_READS` reads, then at most every
        :data:`ROSTER_READ_S` seconds, so junk naming many unknown peers costs a few reads; without, only the reads
        already made count: no DHT call, for an event loop whose peer reads every stage anyway, e.g. a trainer.)"""
        while read and peer_id not in self.roster.get(stage, ()) and (
                self._roster_reads.get(stage, 0) < ROSTER_FIRST_READS or
                time.monotonic() - self._roster_read.get(stage, float("-inf")) > ROSTER_READ_S):
            self.servers(stage)
        return peer_id in self.roster.get(stage, ())

    def fresh_servers(self, stage: int, slack_s: float = 1.5,
                      states: tuple[ServerState, ...] = (ServerState.ONLINE,)) -> list[ServerInfo]:
        """Servers of ``stage`` in one of ``states`` announced within the last re-announce period
        (``ttl / 3``) plus ``slack_s`` seconds: an older record may be left by a server that died (it stays
        listed until it expires, ``ttl`` seconds after its last announcement)."""
        now = get_dht_time()
        return [s for s in self.servers(stage) if s.state in states and is_fresh(s, now, self.ttl, slack_s)]

    def all_servers(self, num_stages: int) -> dict[int, list[ServerInfo]]:
        return {k: self.servers(k) for k in range(num_stages)}

    def trainers(self) -> list[TrainerInfo]:
        return self._read(trainers_key(self.run_id), TrainerInfo)

    def histories(self, stage: int) -> dict[str, list[tuple[int, float, Optional[float]]]]:
        """Peer id -> :attr:`~swarm.protocol.ServerHistory.history` of the servers of ``stage`` that announce one
        (monitors only: nothing a peer decides reads it)."""
        return {h.peer_id: h.history for h in self._read(history_key(self.run_id, stage), ServerHistory)
                if h.stage == stage}

    def storage(self) -> list[StorageInfo]:
        """Verified StorageInfo records: the fragment holders alive now."""
        return self._read(storage_key(self.run_id), StorageInfo)

    def manifests(self, stage: int) -> list[tuple[CheckpointManifest, bytes]]:
        """Verified manifests of ``stage`` (newest epoch first) with their sealed bytes, from writers entitled to
        commit it (:meth:`entitled`; a refused one is logged once)."""
        found, expiry = [], {}
        for m, b in self.read_sealed(checkpoints_key(self.run_id, stage), CheckpointManifest, expiry):
            refusal = self.entitled(m) if m.stage == stage else "stored under another stage"
            if refusal is None:
                found.append((m, b))
            elif m.dht_subkey() not in self._refused_manifests and len(self._refused_manifests) < 4096:
                self._refused_manifests.add(m.dht_subkey())
                logger.warning("ignored the manifest of stage %d epoch %d by %s: %s", m.stage, m.epoch, m.peer_id,
                               refusal)
        self._manifest_expiry[stage] = expiry
        return sorted(found, key=lambda mb: (-mb[0].epoch, mb[0].peer_id))

    def manifest_expires(self, manifest: CheckpointManifest) -> float:
        """DHT time when the DHT's copy of ``manifest`` expires, as of this directory's last read of its stage's
        manifests (:meth:`manifests`); 0 if that read did not find it."""
        return self._manifest_expiry.get(manifest.stage, {}).get(manifest.dht_subkey(), 0.0)

    def entitled(self, manifest: CheckpointManifest) -> Optional[str]:
        """(blocking: may read the stage records) None if the manifest's writer and an endorser may commit it, else
        why not: by the run key's recognition where :attr:`recognized` names peers of the stage (a server sets it:
        :func:`recognized_refusal`), else the writer must be a server of the stage seen announced and one endorser a
        server of the stage (``same_state``) or a witness (the run key, or another stage's server); a directory that
        has seen no server of the run (all died), the endorsements alone (checked on read)."""
        stages = range(self.num_stages) if self.num_stages is not None else list(self.roster)  # (spec unknown)
        if self.recognized(manifest.stage) is not None:
            return recognized_refusal(manifest, self.recognized, stages, self.run_id, self._is_run_key)
        writer_serves = self.seen_serving(manifest.peer_id, manifest.stage)
        if not any(self.roster.values()):
            return None
        if not writer_serves:
            return f"its writer was never seen announced as a server of stage {manifest.stage}"
        for sealed in manifest.endorsements:
            e, _ = open_record(sealed, Endorsement, run_id=self.run_id)  # (checked on read: cannot fail here)
            if e.basis == "same_state" and self.seen_serving(e.peer_id, manifest.stage):
                return None
            if e.basis == "witness" and (self._is_run_key(e.peer_id) or
                                         any(self.seen_serving(e.peer_id, k) for k in stages if k != e.stage)):
                return None
        return "no endorser is a known server of the stage, a server of another stage or the run key"

    def _is_run_key(self, peer_id: str) -> bool:
        return self.run_key is not None and peer_id_of(self.run_key) == peer_id

    def publish_manifest(self, manifest: CheckpointManifest, sealed: bytes) -> bool:
        return self.store_sealed(checkpoints_key(self.run_id, manifest.stage), manifest.dht_subkey(), sealed)

    def bans(self) -> tuple[Optional[BanList], Optional[bytes]]:
        """The newest ban list signed by the run key, with its sealed bytes; ``(None, None)`` if there is none
        (or the spec, hence the run key, was not fetched yet)."""
        if self.run_key is None:
            return None, None
        found = self._get(bans_key(self.run_id))
        best: tuple[Optional[BanList], Optional[bytes]] = (None, None)
        if found is None or not isinstance(found.value, dict):
            return best
        for subkey, item in found.value.items():
            try:
                rec, _ = open_record(item.value, BanList, run_id=self.run_id, subkey=subkey, signer=self.run_key)
            except ProtocolError as e:
                logger.warning("dropped a ban list under %s/%s: %s", bans_key(self.run_id), subkey, e)
                continue
            if best[0] is None or rec.time > best[0].time:
                best = (rec, item.value)
        return best

    def publish_bans(self, bans: BanList, sealed: bytes, ttl: Optional[float] = None) -> bool:
        """Store a sealed ban list (the coordinator's, re-published verbatim by peers)."""
        return self._store(bans_key(self.run_id), sealed, get_dht_time() + (ttl or self.ttl),
                           subkey=bans.dht_subkey())

    def rollback_orders(self) -> list[tuple[RollbackOrder, bytes]]:
        """Verified rollback orders, newest generation first."""
        return sorted(self.read_sealed(rollback_key(self.run_id), RollbackOrder),
                      key=lambda ob: (-ob[0].generation, -ob[0].time))


RECOGNIZED_SIGNERS = 2
"""Servers the run key recognizes on a stage that must vouch for a checkpoint's state there (writer and endorsers
with the same state): one recognized key (patient: its averaging was verified first) with a fresh key beside it
committed its own state as the stage's before (``bench/sybil.py``, patient keys at 1 a stage)."""


def recognized_refusal(manifest: CheckpointManifest, named: Callable[[int], Optional[frozenset[str]]],
                       stages: Iterable[int], run_id: str, is_run_key: Callable[[str], bool]) -> Optional[str]:
    """None if the run key's recognition entitles the manifest, else why not. ``named(k)``: the peer ids the
    recognition names on stage ``k`` (None: nobody, :mod:`swarm.trust.recognition`); ``stages``: the run's.

    Entitled: :data:`RECOGNIZED_SIGNERS` servers it names on the manifest's stage vouch for the state (its writer,
    and endorsers of basis ``same_state``: a server whose own state had that digest); or a witness (a peer that saw
    the writer as the stage's only online server) is the run key, or is named on another stage while the writer is
    the only server named on this one (a stage of one recognized server: the witness's basis is its own word). Keys
    that only announced, or one recognized key with fresh keys beside it, commit nothing."""
    mine = named(manifest.stage) or frozenset()
    vouching = {manifest.peer_id} & mine
    for sealed in manifest.endorsements:
        e, _ = open_record(sealed, Endorsement, run_id=run_id)  # (checked on read: cannot fail here)
        if e.basis == "same_state" and e.peer_id in mine:
            vouching.add(e.peer_id)
        elif e.basis == "witness" and (is_run_key(e.peer_id) or mine == {manifest.peer_id} and any(
                e.peer_id in (named(k) or ()) for k in stages if k != manifest.stage)):
            return None
    if len(vouching) >= RECOGNIZED_SIGNERS:
        return None
    return (f"{len(vouching)} server(s) the run key recognizes on stage {manifest.stage} vouch for its state "
            f"({RECOGNIZED_SIGNERS} needed: the writer and endorsers holding the same state), and no witness is the "
            "run key or a recognized server of another stage endorsing a recognized writer")


class AsyncRunDirectory:
    """:class:`RunDirectory`'s calls, awaited (module docstring): what a peer's event-loop code reads and publishes
    the run's records through. :attr:`blocking` is the blocking face over the same records and caches, for code on
    another thread."""

    def __init__(self, blocking: RunDirectory):
        self.blocking = blocking

    @property
    def run_id(self) -> str:
        return self.blocking.run_id

    @property
    def ttl(self) -> float:
        """Seconds an announcement lives (the spec's ``record_ttl_s`` once joined)."""
        return self.blocking.ttl

    @property
    def run_key(self) -> Optional[bytes]:
        """The coordinator's public key, once a spec verified."""
        return self.blocking.run_key

    @property
    def num_stages(self) -> Optional[int]:
        """The spec's stages, once a spec verified (or set by a peer that got the spec otherwise)."""
        return self.blocking.num_stages

    @num_stages.setter
    def num_stages(self, value: int) -> None:
        self.blocking.num_stages = value

    async def _call(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(None, fn, *args)

    # ---- reads ---------------------------------------------------------------------------------------------
    @property
    def stage_stripe_bits(self) -> int:
        """The spec's ``[records] stage_stripe_bits`` once verified: each stage's records lie under ``2^bits`` keys."""
        return self.blocking.stage_stripe_bits

    async def servers(self, stage: int, stripes: Optional[Sequence[int]] = None) -> list[ServerInfo]:
        """:meth:`RunDirectory.servers`: verified, unexpired server records of ``stage`` (of ``stripes`` only, if
        given), any state."""
        return await self._call(self.blocking.servers, stage, stripes)

    async def fresh_servers(self, stage: int, slack_s: float = 1.5,
                            states: tuple[ServerState, ...] = (ServerState.ONLINE,)) -> list[ServerInfo]:
        """:meth:`RunDirectory.fresh_servers`: servers of ``stage`` in ``states`` announced within ``ttl / 3 +
        slack_s`` seconds."""
        return await self._call(self.blocking.fresh_servers, stage, slack_s, states)

    async def all_servers(self, num_stages: int) -> dict[int, list[ServerInfo]]:
        return await self._call(self.blocking.all_servers, num_stages)

    async def trainers(self) -> list[TrainerInfo]:
        return await self._call(self.blocking.trainers)

    async def storage(self) -> list[StorageInfo]:
        """Verified StorageInfo records: the fragment holders alive now."""
        return await self._call(self.blocking.storage)

    async def manifests(self, stage: int) -> list[tuple[CheckpointManifest, bytes]]:
        """:meth:`RunDirectory.manifests`: verified manifests of ``stage`` from entitled writers, newest first."""
        return await self._call(self.blocking.manifests, stage)

    def manifest_expires(self, manifest: CheckpointManifest) -> float:
        """:meth:`RunDirectory.manifest_expires` (no DHT call)."""
        return self.blocking.manifest_expires(manifest)

    async def rollback_orders(self) -> list[tuple[RollbackOrder, bytes]]:
        return await self._call(self.blocking.rollback_orders)

    async def bans(self) -> tuple[Optional[BanList], Optional[bytes]]:
        return await self._call(self.blocking.bans)

    async def entitled(self, manifest: CheckpointManifest) -> Optional[str]:
        """:meth:`RunDirectory.entitled`: None if the manifest's writer and an endorser may commit it, else why."""
        return await self._call(self.blocking.entitled, manifest)

    # ---- writes --------------------------------------------------------------------------------------------
    async def announce(self, key: str, record: Record, identity: Identity) -> bool:
        return await self._call(self.blocking.announce, key, record, identity)

    async def announce_server(self, info: ServerInfo, identity: Identity) -> bool:
        return await self._call(self.blocking.announce_server, info, identity)

    async def announce_trainer(self, info: TrainerInfo, identity: Identity) -> bool:
        return await self._call(self.blocking.announce_trainer, info, identity)

    async def announce_history(self, history: ServerHistory, identity: Identity) -> bool:
        return await self._call(self.blocking.announce_history, history, identity)

    async def publish_spec(self, sealed: bytes) -> bool:
        return await self._call(self.blocking.publish_spec, sealed)

    async def publish_manifest(self, manifest: CheckpointManifest, sealed: bytes) -> bool:
        return await self._call(self.blocking.publish_manifest, manifest, sealed)

    async def publish_bans(self, bans: BanList, sealed: bytes, ttl: Optional[float] = None) -> bool:
        return await self._call(self.blocking.publish_bans, bans, sealed, ttl)

    async def store_sealed(self, key: str, subkey: str, sealed: bytes) -> bool:
        return await self._call(self.blocking.store_sealed, key, subkey, sealed)


__all__ = ["AsyncRunDirectory", "RunDirectory", "is_fresh", "read_period_s", "stripes_to_read"]
