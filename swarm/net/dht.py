"""A run's address and its DHT node: parsing the address, starting a hivemind DHT node (its own process and
p2pd, speaking as the peer's key), joining a run through its bootstrap peers, and how others reach this node.

A *run address* is ``<run_id>@<multiaddr>[,<multiaddr>...]``: the run id and the bootstrap peers.
:func:`connect_run` joins one and returns the run's :class:`~swarm.net.directory.RunDirectory` with its
verified spec.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import logging
import os
import re
import tempfile
import time
from typing import Optional, Sequence

import hivemind
from hivemind.p2p import P2P, P2PDaemonError

from swarm.config import RunSpec
from swarm.settings import PeerSettings
from swarm.identity import Identity, claim_identity
from swarm.net.dht_validation import RunRecordValidator, TicketValidator
from swarm.net.directory import RunDirectory

logger = logging.getLogger(__name__)

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


LOOKUP_BEAM = 5
"""Nodes a DHT lookup keeps in its beam: the replication, hivemind's ``num_replicas`` (each record is stored on the
5 nodes nearest its key), not hivemind's default of its bucket size (20)."""


class ReplicaLookupDHT(hivemind.DHT):
    """A hivemind DHT node whose reads and stores look for the :data:`LOOKUP_BEAM` nodes nearest a key, the nodes
    that hold its record, as Kademlia's lookups do (Maymounkov & Mazieres, "Kademlia", 2002, sections 2.3 and 2.5:
    a lookup finds the k closest nodes, k also being the replication).

    hivemind keeps a beam of its bucket size (20) for every ``latest=True`` read (all of ours and those of
    hivemind's optimizer and matchmaking) and for every store's search, so in a swarm of fewer than 20 nodes each
    one visits every node, and 20 in a larger one, though a record lives on 5. Each visit is an RPC that costs the
    two DHT processes and their p2pd ~1.7 ms of CPU (measured on loopback); a read with a beam of 5 cost 8.8 ms of
    CPU in a swarm of 9 nodes, against 13.9 ms with 20, and still read every replica's sub-keys. A replica that
    does not answer is passed over for the next nearest node, as before. An explicit ``beam_size`` wins.
    """

    lookup_beam = LOOKUP_BEAM

    def get(self, key, latest: bool = False, return_future: bool = False, **kwargs):
        kwargs.setdefault("beam_size", self.lookup_beam)
        return super().get(key, latest, return_future, **kwargs)

    def store(self, key, value, expiration_time, subkey=None, return_future: bool = False, **kwargs):
        kwargs.setdefault("beam_size", self.lookup_beam)
        return super().store(key, value, expiration_time, subkey, return_future, **kwargs)


async def close_dht(dht: hivemind.DHT, p2p: Optional[P2P] = None) -> None:
    """Shut down ``p2p``, this process's replica of ``dht``'s libp2p client (``await dht.replicate_p2p()``), then
    ``dht`` (its process and p2pd).

    hivemind 1.1.12's ``DHT.shutdown`` leaves the replicas that other processes made of its client open, and a
    replica removes its Unix socket (``/tmp/hivemind-p2pclient-*.sock``) only when shut down: every stopped server
    left one such file behind per process (its own, its averagers'), and a trainer one."""
    if p2p is not None:
        with contextlib.suppress(Exception):  # already closed, or its daemon gone: the file is what matters
            await p2p.shutdown()
    dht.shutdown()


def spawn_dht(identity: Optional[Identity], **kwargs) -> hivemind.DHT:
    """:class:`ReplicaLookupDHT` (``hivemind.DHT(**kwargs)``) whose p2pd speaks as ``identity`` (its libp2p id is
    ``identity.p2p_id``; see :mod:`swarm.identity`), or a random libp2p key when ``identity`` is None (a monitoring
    client that signs nothing). The key reaches p2pd through a file readable by this user only, deleted once the
    daemon runs.

    :raises IdentityInUse: another process on this machine runs as ``identity`` (:func:`claim_identity`).
    :raises RuntimeError: the daemon came up under another libp2p id (it did not take the key).
    """
    if identity is None:
        return ReplicaLookupDHT(**kwargs)
    claim_identity(identity)
    with tempfile.TemporaryDirectory(prefix="swarm-key-") as folder:
        path = os.path.join(folder, "p2p.key")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(identity.libp2p_private_key())
        # hivemind's own "identity taken" probe reads RSA keys only; claim_identity covers this machine
        dht = ReplicaLookupDHT(identity_path=path, check_if_identity_free=False, **kwargs)
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
        # every read here and in hivemind's optimizer is latest=True, which the node's cache never answers: its
        # caching only added traffic (a store to one more node after a read, and a re-read of every key read
        # before it expires)
        cache_nearest=0,
        cache_refresh_before_expiry=0,
    )
    if loopback:
        kwargs.update(nat_port_map=False, auto_nat=False)
    if settings.announce_host:
        kwargs["announce_maddrs"] = [f"/ip4/{settings.announce_host}/tcp/{settings.port}"]
    return spawn_dht(identity, **kwargs)


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


_ROUTINE_LEVELS = ("debug", "info", "warn")


def run_peers_unanswered(error: P2PDaemonError) -> bool:
    """Whether p2pd exited at start because none of its bootstrap peers answered, worth another try.

    hivemind reports the daemon's last output line. p2pd's fatal line (``log.Fatal``: ``<date> <time> <cause>``)
    is usually last, but a goroutine of its DHT can print a routine JSON log record after it and before the exit.
    Such a line names no cause, so it counts as worth another try: a local fault (a taken port) shows again as
    the last line of the next attempt, which then raises.
    """
    text = str(error)
    if "bootstrap" in text:
        return True
    last = text.removeprefix("Daemon failed to start: ")
    if not last.startswith("{"):
        return False
    try:
        record = json.loads(last)
    except ValueError:
        return False
    return isinstance(record, dict) and "logger" in record and record.get("level") in _ROUTINE_LEVELS


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
            if not run_peers_unanswered(e):  # a taken port, a broken daemon: say so
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
        if spec.admission.policy != "open":  # from now on this node stores and reads ticketed records only
            dht.add_validators([TicketValidator(run_id)])
        return dht, directory, spec, sealed
    except BaseException:
        dht.shutdown()
        raise
