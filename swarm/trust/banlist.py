"""The run's ban list: peers its coordinator banned with ``swarm-coordinator ban``.

One :class:`~swarm.protocol.BanList` record, signed by the run key (the key that signed the spec, so no one
else can ban), lists peer ids and, where known, their libp2p ids. Every peer follows it
(:class:`RunBans`): trainers stop routing to banned servers, servers refuse stage RPCs from banned peers'
libp2p ids and exclude them from their averaging groups, fragment keepers neither place fragments on banned
holders nor fetch from them, and a banned peer stops itself with an error that names the reason. Keepers
re-publish the newest list they have, so bans outlive the coordinator process (records still expire if every
peer that knew the list is gone).
"""

from __future__ import annotations

import logging
from typing import Optional

from hivemind.utils import get_dht_time

from swarm.identity import Identity
from swarm.net.directory import AsyncRunDirectory, RunDirectory
from swarm.protocol import MAX_BANS, BanList, seal

logger = logging.getLogger(__name__)


class PeerBanned(RuntimeError):
    """This peer is on the run's ban list."""


class RunBans:
    """The run's ban list as this peer knows it: the newest list signed by the run key (a newer one always
    replaces it; an older one never does). One object per peer, shared by everything that honours bans: the
    trainer's routing, the stage RPCs, averaging (banned servers are excluded), fragment placement."""

    def __init__(self, directory: AsyncRunDirectory):
        self.directory = directory
        self.current: Optional[BanList] = None
        self.sealed: Optional[bytes] = None

    @property
    def banned(self) -> dict[str, str]:
        """Peer id -> reason."""
        return dict(self.current.banned) if self.current is not None else {}

    @property
    def banned_p2p_ids(self) -> dict[str, str]:
        """libp2p id -> reason, for the banned peers whose libp2p id the coordinator knew (to refuse their
        connections)."""
        if self.current is None:
            return {}
        return {p2p: self.current.banned.get(peer, "banned") for peer, p2p in self.current.p2p_ids.items()}

    def is_banned(self, peer_id: str) -> bool:
        return self.current is not None and peer_id in self.current.banned

    async def refresh(self, republish: bool = False) -> Optional[BanList]:
        """Read the list from the DHT; with ``republish``, store the newest one back verbatim."""
        found, sealed = await self.directory.bans()
        if found is not None and (self.current is None or found.time > self.current.time):
            added = set(found.banned) - set(self.banned)
            for peer in sorted(added):
                logger.warning("the run's coordinator banned peer %s: %s", peer, found.banned[peer])
            self.current, self.sealed = found, sealed
        if republish and self.current is not None:
            await self.directory.publish_bans(self.current, self.sealed)
        return self.current

    def check(self, me: str) -> None:
        """:raises PeerBanned: ``me`` is on the list; the message gives the reason and the way out."""
        if self.is_banned(me):
            raise PeerBanned(f"this peer ({me}) was banned from run {self.directory.run_id} by its coordinator: "
                             f"{self.current.banned[me]}; ask the run's operator to lift it "
                             "(swarm-coordinator unban) before joining again")


def update_bans(directory: RunDirectory, coordinator: Identity, *, ban: Optional[tuple[str, str, str]] = None,
                unban: Optional[str] = None) -> BanList:
    """Sign and publish a new list: the newest one in the DHT plus ``ban = (peer_id, reason, p2p_id)`` and/or
    minus ``unban`` (blocking: ``swarm-coordinator ban`` runs it). Its record lives ``7 x record_ttl_s``; keepers
    re-publish it after that.

    :raises PermissionError: ``coordinator`` is not the run's key (only the key that signed the spec may ban).
    :raises ValueError: the list already holds :data:`~swarm.protocol.MAX_BANS` peers.
    """
    if directory.run_key is None or coordinator.public_key != directory.run_key:
        raise PermissionError(f"this key did not create run {directory.run_id}: bans must be signed by the run key "
                              "(the --key given to `swarm-coordinator serve`, e.g. runs/demo.key)")
    old, _ = directory.bans()
    banned = dict(old.banned) if old else {}
    p2p_ids = dict(old.p2p_ids) if old else {}
    if ban is not None:
        peer, reason, p2p_id = ban
        if peer not in banned and len(banned) >= MAX_BANS:
            raise ValueError(f"the ban list is full ({MAX_BANS} peers); unban some first")
        banned[peer] = reason[:200]
        if p2p_id:
            p2p_ids[peer] = p2p_id
    if unban is not None:
        banned.pop(unban, None)
        p2p_ids.pop(unban, None)
    record = BanList(run_id=directory.run_id, peer_id=coordinator.peer_id, time=get_dht_time(), banned=banned,
                     p2p_ids=p2p_ids)
    sealed = seal(record, coordinator)
    if not directory.publish_bans(record, sealed, ttl=7 * directory.ttl):
        raise OSError("no DHT node accepted the ban list; check that the run is reachable and retry")
    return record
