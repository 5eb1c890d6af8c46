"""The run directory: starting a DHT node from a run address, publishing and reading a run's signed records.

A *run address* is ``<run_id>@<multiaddr>[,<multiaddr>...]``: the run id and the bootstrap peers. The
directory reads only records that verify (:func:`swarm.protocol.open_record`); bad ones are logged with
their cause and skipped, so a forged or malformed record never reaches routing or monitoring.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
import re
import tempfile
import time
from concurrent.futures import CancelledError
from typing import Any, Optional, Sequence, Type, TypeVar

import hivemind
from hivemind.p2p import P2PDaemonError
from hivemind.utils import get_dht_time

from swarm.config import PeerSettings, RunSpec, SpecError
from swarm.net.dht_validation import RunRecordValidator
from swarm.identity import Identity, claim_identity, derive_run_id, peer_id_of
from swarm.protocol import (
    AnnouncedRecord,
    BanList,
    CheckpointManifest,
    Endorsement,
    ProtocolError,
    Record,
    RollbackOrder,
    ServerInfo,
    ServerState,
    SpecRecord,
    StorageInfo,
    TrainerInfo,
    bans_key,
    checkpoints_key,
    open_record,
    open_spec,
    rollback_key,
    seal,
    spec_key,
    stage_key,
    storage_key,
    trainers_key,
)

logger = logging.getLogger(__name__)
R = TypeVar("R", bound=Record)

_RUN_ID = re.compile(r"[a-z0-9][a-z0-9-]{0,31}-[a-z2-7]{16}")


class RunAddressError(ValueError):
    """A run address that cannot be parsed."""


def format_run_address(run_id: str, maddrs: Sequence[str]) -> str:
    return f"{run_id}@{','.join(str(m) for m in maddrs)}"


def parse_run_address(address: str) -> tuple[str, list[str]]:
    """``(run_id, bootstrap multiaddrs)`` of a run address; raises :class:`RunAddressError`."""
    run_id, sep, rest = address.strip().partition("@")
    maddrs = [m for m in rest.split(",") if m]
    if not sep or not _RUN_ID.fullmatch(run_id) or not maddrs or not all(m.startswith("/") for m in maddrs):
        raise RunAddressError(
            f"bad run address {address!r}; expected <run_id>@<multiaddr>[,<multiaddr>...] as printed by "
            "`swarm-coordinator serve`, e.g. demo-abcdefghijklmnop@/ip4/1.2.3.4/tcp/31337/p2p/12D3Koo..."
        )
    return run_id, maddrs


def relay_enabled(settings: PeerSettings) -> bool:
    """Circuit relays are on: ``SWARM_RELAY=auto`` and a non-loopback host (a loopback swarm needs none)."""
    return settings.relay == "auto" and settings.host not in ("127.0.0.1", "localhost")


def spawn_dht(identity: Optional[Identity], **kwargs) -> hivemind.DHT:
    """``hivemind.DHT(**kwargs)`` whose p2pd speaks as ``identity`` (its libp2p id is ``identity.p2p_id``; see
    :mod:`swarm.identity`), or a random libp2p key when ``identity`` is None (a monitoring client that signs
    nothing). The key reaches p2pd through a file readable by this user only, deleted once the daemon runs.

    :raises IdentityInUse: another process on this machine runs as ``identity`` (:func:`claim_identity`).
    :raises RuntimeError: the daemon came up under another libp2p id (it did not take the key).
    """
    if identity is None:
        return hivemind.DHT(**kwargs)
    claim_identity(identity)
    with tempfile.TemporaryDirectory(prefix="swarm-key-") as folder:
        path = os.path.join(folder, "p2p.key")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(identity.libp2p_private_key())
        # hivemind's own "identity taken" probe reads RSA keys only; claim_identity covers this machine
        dht = hivemind.DHT(identity_path=path, check_if_identity_free=False, **kwargs)
    if str(dht.peer_id) != identity.p2p_id:
        dht.shutdown()
        raise RuntimeError(f"p2pd came up as {dht.peer_id}, not as this peer's key {identity.p2p_id}")
    return dht


def start_dht(settings: PeerSettings, initial_peers: Sequence[str] = (), *, client_mode: bool = False,
              run_id: Optional[str] = None, identity: Optional[Identity] = None) -> hivemind.DHT:
    """Start a hivemind DHT node (its own process and p2pd) listening per ``settings``; with ``run_id``, it
    validates the run's records (:class:`~swarm.net.dht_validation.RunRecordValidator`); with ``identity``, its
    libp2p id is that key's (:func:`spawn_dht`): every peer that signs records passes its identity.

    With ``SWARM_RELAY=auto`` (default) on a non-loopback host, libp2p circuit relays are on: this node can
    reach relayed peers and relay for others, and, if AutoNAT finds it unreachable, it reserves a slot on a
    public peer's relay and announces that ``/p2p-circuit`` address instead (hivemind's ``use_auto_relay``).
    """
    loopback = settings.host in ("127.0.0.1", "localhost")
    relay = relay_enabled(settings)
    kwargs = dict(
        initial_peers=list(initial_peers),
        start=True,
        client_mode=client_mode,
        host_maddrs=[f"/ip4/{settings.host}/tcp/{settings.port}"],
        use_relay=relay,
        use_auto_relay=relay and not client_mode,
        record_validators=[RunRecordValidator(run_id)] if run_id else [],
    )
    if loopback:
        kwargs.update(nat_port_map=False, auto_nat=False)
    if settings.announce_host:
        kwargs["announce_maddrs"] = [f"/ip4/{settings.announce_host}/tcp/{settings.port}"]
    return spawn_dht(identity, **kwargs)


ROSTER_READ_S = 2.0
"""Seconds between two reads of a stage's records made to look up a peer not seen serving it
(:meth:`RunDirectory.entitled`)."""
ROSTER_FIRST_READS = 3
"""Reads of a stage's records made at once, without waiting :data:`ROSTER_READ_S`, to look up a peer not seen
serving it: one DHT read may miss a record that is there (the records of a stage's servers are spread over the
nodes nearest the key), and a one-shot observer (``checkpoints``, ``export``) must not ignore every checkpoint
of a server its first read missed."""


class RunDirectory:
    """Signed records of one run in the DHT: the spec, stage servers, trainers, fragment holders, checkpoint
    manifests and rollback orders.

    Every DHT call returns within ``call_timeout_s`` seconds, or at once when the DHT process has stopped: a
    call in flight when hivemind's DHT shuts down is otherwise never answered, and the thread making it (and
    with it the process's exit) waits forever. Such a call reads as "nothing found" / "not stored".
    """

    call_timeout_s = 60.0  # well above a lookup's worst case (hivemind retries each request for 3 s)
    _POLL_S = 1.0

    def __init__(self, dht: hivemind.DHT, run_id: str, ttl: float = 30.0):
        self.dht, self.run_id, self.ttl = dht, run_id, ttl
        self.run_key: Optional[bytes] = None  # the coordinator's public key, once a spec verified
        self.num_stages: Optional[int] = None  # the spec's, once verified
        self.roster: dict[int, set[str]] = {}  # stage -> peer ids this directory saw announced as its servers
        self._roster_read: dict[int, float] = {}  # stage -> time.monotonic() of its last read
        self._roster_reads: dict[int, int] = {}  # stage -> reads of its records so far
        self._refused_manifests: set[str] = set()  # (logged once each)

    # ---- bounded DHT calls -----------------------------------------------------------------------------
    def _get(self, key: str) -> Any:
        """``dht.get(key, latest=True)``, or None if the DHT stopped or did not answer in time."""
        return self._wait(lambda: self.dht.get(key, latest=True, return_future=True), f"get {key}", None)

    def _store(self, key: str, value: bytes, expiration: float, subkey: Optional[str] = None) -> bool:
        """``dht.store(...)``; False if the DHT stopped or did not answer in time."""
        return bool(self._wait(lambda: self.dht.store(key, value, expiration, subkey=subkey, return_future=True),
                               f"store {key}", False))

    def _wait(self, call, what: str, default: Any) -> Any:
        if not self.dht.is_alive():  # stopped or died: a request sent now would never be answered
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
            stopped = not self.dht.is_alive()
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
                raise SpecError(
                    f"could not fetch the spec of run {self.run_id}: {last_error}; check the run address and that "
                    "the coordinator or a peer of the run is reachable"
                )
            time.sleep(1.0)

    def verify_spec(self, sealed: bytes) -> RunSpec:
        """Check signature, hash and run id of a sealed spec (:func:`~swarm.protocol.open_spec`); raises
        ProtocolError or SpecError."""
        spec, self.run_key = open_spec(sealed, self.run_id)
        self.num_stages = spec.model.num_stages
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
        return self.announce(stage_key(self.run_id, info.stage), info, identity)

    def announce_trainer(self, info: TrainerInfo, identity: Identity) -> bool:
        return self.announce(trainers_key(self.run_id), info, identity)

    def read_sealed(self, key: str, cls: Type[R]) -> list[tuple[R, bytes]]:
        """Verified records under ``key`` with their sealed bytes (to re-publish verbatim); bad ones are logged
        with their cause and skipped."""
        found = self._get(key)
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
        return out

    def _read(self, key: str, cls: Type[R]) -> list[R]:
        return [rec for rec, _ in self.read_sealed(key, cls)]

    def store_sealed(self, key: str, subkey: str, sealed: bytes) -> bool:
        """Store sealed bytes (signed by anyone, e.g. a manifest's writer) for ``ttl`` seconds."""
        return self._store(key, sealed, get_dht_time() + self.ttl, subkey=subkey)

    def servers(self, stage: int) -> list[ServerInfo]:
        """Verified, unexpired ServerInfo records of ``stage``, any state (their signers join :attr:`roster`)."""
        found = [s for s in self._read(stage_key(self.run_id, stage), ServerInfo) if s.stage == stage]
        self.roster.setdefault(stage, set()).update(s.peer_id for s in found)
        self._roster_read[stage] = time.monotonic()
        self._roster_reads[stage] = self._roster_reads.get(stage, 0) + 1
        return found

    def _seen_serving(self, peer_id: str, stage: int) -> bool:
        """Was ``peer_id`` seen announced as a server of ``stage``? (Reads the stage's records again if it was
        not: at once for the stage's first :data:`ROSTER_FIRST_READS` reads, then at most every
        :data:`ROSTER_READ_S` seconds, so junk naming many unknown peers costs a few reads.)"""
        while peer_id not in self.roster.get(stage, ()) and (
                self._roster_reads.get(stage, 0) < ROSTER_FIRST_READS or
                time.monotonic() - self._roster_read.get(stage, float("-inf")) > ROSTER_READ_S):
            self.servers(stage)
        return peer_id in self.roster.get(stage, ())

    def fresh_servers(self, stage: int, slack_s: float = 1.5,
                      states: tuple[ServerState, ...] = (ServerState.ONLINE,)) -> list[ServerInfo]:
        """Servers of ``stage`` in one of ``states`` announced within the last re-announce period
        (``ttl / 3``) plus ``slack_s`` seconds: an older record may be left by a server that died (it stays
        listed until it expires, ``ttl`` seconds after its last announcement)."""
        oldest = get_dht_time() - self.ttl / 3 - slack_s
        return [s for s in self.servers(stage) if s.state in states and s.time >= oldest]

    def all_servers(self, num_stages: int) -> dict[int, list[ServerInfo]]:
        return {k: self.servers(k) for k in range(num_stages)}

    def trainers(self) -> list[TrainerInfo]:
        return self._read(trainers_key(self.run_id), TrainerInfo)

    def storage(self) -> list[StorageInfo]:
        """Verified StorageInfo records: the fragment holders alive now."""
        return self._read(storage_key(self.run_id), StorageInfo)

    def manifests(self, stage: int) -> list[tuple[CheckpointManifest, bytes]]:
        """Verified manifests of ``stage`` (newest epoch first) with their sealed bytes, from writers entitled to
        commit it (:meth:`entitled`; a refused one is logged once)."""
        found = []
        for m, b in self.read_sealed(checkpoints_key(self.run_id, stage), CheckpointManifest):
            refusal = self.entitled(m) if m.stage == stage else "stored under another stage"
            if refusal is None:
                found.append((m, b))
            elif m.dht_subkey() not in self._refused_manifests and len(self._refused_manifests) < 4096:
                self._refused_manifests.add(m.dht_subkey())
                logger.warning("ignored the manifest of stage %d epoch %d by %s: %s", m.stage, m.epoch, m.peer_id,
                               refusal)
        return sorted(found, key=lambda mb: (-mb[0].epoch, mb[0].peer_id))

    def entitled(self, manifest: CheckpointManifest) -> Optional[str]:
        """(blocking: may read the stage records) None if the manifest's writer and an endorser may commit it,
        else why not: the writer must be a server of the stage this directory has seen announced, and one
        endorser a server of the stage (``same_state``) or a witness (the run key, or a server of another
        stage). Until this directory has seen any server of the run (a swarm restarting after every peer died),
        the endorsements alone decide (:func:`~swarm.protocol.check_endorsements`, checked on read)."""
        writer_serves = self._seen_serving(manifest.peer_id, manifest.stage)
        if not any(self.roster.values()):
            return None
        if not writer_serves:
            return f"its writer was never seen announced as a server of stage {manifest.stage}"
        stages = range(self.num_stages) if self.num_stages is not None else list(self.roster)  # (spec unknown)
        for sealed in manifest.endorsements:
            e, _ = open_record(sealed, Endorsement, run_id=self.run_id)  # (checked on read: cannot fail here)
            if e.basis == "same_state" and self._seen_serving(e.peer_id, manifest.stage):
                return None
            if e.basis == "witness" and (self._is_run_key(e.peer_id) or
                                         any(self._seen_serving(e.peer_id, k) for k in stages if k != e.stage)):
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


def visible_maddrs(dht: hivemind.DHT) -> list[str]:
    """The node's multiaddrs that others can dial, loopback last; empty for a peer that cannot listen."""
    try:
        addrs = [str(m) for m in dht.get_visible_maddrs()]
    except ValueError:  # hivemind: "No multiaddrs found for peer ..."
        return []
    return sorted(addrs, key=lambda a: a.startswith("/ip4/127."))


def reachability(maddrs: Sequence[str], relay: bool = False) -> str:
    """How peers outside this peer's network reach it: ``relayed`` if it has a libp2p circuit address, or if
    relays are on (:func:`relay_enabled`) and none of its addresses is public (its inbound connections then come
    through a relay; p2pd does not always list circuit addresses); else ``direct``."""
    if any("/p2p-circuit" in m for m in maddrs):
        return "relayed"
    return "relayed" if relay and not any(_is_public(m) for m in maddrs) else "direct"


def _is_public(maddr: str) -> bool:
    parts = maddr.split("/")
    if len(parts) < 3:
        return False
    if parts[1].startswith("dns"):
        return True
    try:
        return parts[1] in ("ip4", "ip6") and ipaddress.ip_address(parts[2]).is_global
    except ValueError:
        return False


class RunUnreachable(ConnectionError):
    """None of a run address's peers answered: the run is not up yet, its peers left, or the network is down."""


JOIN_RETRY_S = (1.0, 2.0, 4.0, 8.0)
"""Seconds between attempts to reach a run's peers (the last one repeats)."""


def join_dht(settings: PeerSettings, maddrs: Sequence[str], *, client_mode: bool, join_timeout_s: float = 0.0,
             run_id: Optional[str] = None, identity: Optional[Identity] = None) -> hivemind.DHT:
    """:func:`start_dht` bootstrapped from ``maddrs``, trying again (:data:`JOIN_RETRY_S` apart) until one of
    them answers or ``join_timeout_s`` seconds have passed.

    :raises RunUnreachable: no peer of ``maddrs`` answered in time.
    """
    deadline, attempt = time.monotonic() + join_timeout_s, 0
    while True:
        try:
            return start_dht(settings, maddrs, client_mode=client_mode, run_id=run_id, identity=identity)
        except P2PDaemonError as e:
            if "bootstrap" not in str(e):  # not about the run's peers (a taken port, a broken daemon): say so
                raise
            wait = JOIN_RETRY_S[min(attempt, len(JOIN_RETRY_S) - 1)]
            if time.monotonic() + wait > deadline:
                raise RunUnreachable(
                    f"none of the run's peers {list(maddrs)} answered (tried for {join_timeout_s:.0f} s): check "
                    "that the run is up (`swarm-coordinator status <address>`), that this machine can reach that "
                    "address, or join through another peer's address; SWARM_JOIN_TIMEOUT_S waits longer") from None
            attempt += 1
            logger.info("none of the run's peers answered yet (attempt %d); trying again in %.0f s", attempt, wait)
            time.sleep(wait)


def connect_run(address: str, settings: Optional[PeerSettings] = None, *, client_mode: bool = True,
                timeout: float = 30.0, join_timeout_s: float = 0.0, identity: Optional[Identity] = None
                ) -> tuple[hivemind.DHT, RunDirectory, RunSpec, bytes]:
    """Join the DHT of a run address and fetch its verified spec: ``(dht, directory, spec, sealed_spec)``.

    :param identity: the peer's key, which becomes its libp2p identity (servers and trainers); None for a
        monitoring client.
    :param timeout: seconds to wait for the spec once joined.
    :param join_timeout_s: seconds to keep trying to reach the address's peers (:func:`join_dht`).
    :raises RunUnreachable: none of the address's peers answered within ``join_timeout_s``.
    :raises SpecError: the run's spec could not be fetched and verified.
    """
    run_id, maddrs = parse_run_address(address)
    dht = join_dht(settings or PeerSettings(host="127.0.0.1"), maddrs, client_mode=client_mode,
                   join_timeout_s=join_timeout_s, run_id=run_id, identity=identity)
    try:
        directory = RunDirectory(dht, run_id)
        spec, sealed = directory.fetch_spec(timeout)
        directory.ttl = spec.timeouts.record_ttl_s
        return dht, directory, spec, sealed
    except BaseException:
        dht.shutdown()
        raise
