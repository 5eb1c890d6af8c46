"""Admission by ticket: a run that takes only the peers its operator admitted (``[admission] policy = "allowlist"``).

Keys are free, so an open run weighs what a key says by the work it did (:mod:`swarm.trust.standing`); a run
that wants no strangers at all admits peers by name instead, as INTELLECT-1 whitelisted its nodes. The run key
(the key that signed the spec, held by the coordinator) signs a :class:`~swarm.protocol.Ticket` per admitted
peer id (``swarm-coordinator admit <address> <peer id>``, :func:`issue_ticket`) and stores it in the DHT under
:func:`~swarm.protocol.tickets_key`; the peer reads its own at join (:func:`fetch_ticket`) and carries it in the
envelope of every record it seals (:attr:`swarm.identity.Identity.ticket`).

Every node of such a run adds :class:`~swarm.net.dht_validation.TicketValidator` to its DHT once it read the
spec: a record under the run's keys whose signer carries no valid ticket is neither stored nor read. A ticket
is valid for a record (:func:`~swarm.protocol.check_carried`) when the run key signed it (its ``spec_name`` and
``spec_hash`` with the signer's key derive the run id: no spec needed to check it), it names the record's
signer, and the record is dated inside the ticket's life. The check is a function of the bytes only, so every node agrees on
it at any time: a record stored while its ticket was valid stays readable until it expires, and an
announcement re-signed after the ticket expired is refused. So everything that is decided from records (stage
rosters and thus averaging groups and parts, routing, fragment placement, checkpoint manifests and their
endorsements, rollback orders, accusations, progress keys) leaves an unticketed key out, and every RPC a peer
serves (stage RPCs, fragments, evidence, the averagers') refuses such a caller before reading its request
(:class:`TicketGate`, :func:`ticket_gate`).

Tickets live ``ticket_ttl_s``; the coordinator renews those in their second half while it runs
(:func:`renew_tickets`), a delegate (:mod:`swarm.trust.delegates`) those in their last quarter while its delegation
lasts, and a peer re-reads its own as it nears expiry (:meth:`RunTickets.refresh`).
``swarm-coordinator revoke`` bans the peer (:mod:`swarm.trust.banlist`: effective at once) and so ends the
renewal.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Awaitable, Callable, Optional, TypeVar

from hivemind.utils import get_dht_time

from swarm.config import RunSpec
from swarm.identity import Identity
from swarm.net.directory import RunDirectory
from swarm.protocol import (Delegation, ProtocolError, RunKeyRecord, Ticket, open_run_key_record, open_ticket, seal,
                            tickets_key)
from swarm.trust.authority import peer_of_p2p_id

logger = logging.getLogger(__name__)
RK = TypeVar("RK", bound=RunKeyRecord)


class NotAdmitted(RuntimeError):
    """This peer holds no valid ticket of a run that admits only ticketed peers."""


def issue_ticket(directory: RunDirectory, run_key: Identity, subject: str, spec: RunSpec, invite: str = "",
                 origin: Optional[str] = None) -> tuple[Ticket, bytes]:
    """Sign a ticket for peer ``subject`` with the run key (or a delegate key carrying its
    :attr:`~swarm.identity.Identity.delegation`: the ticket embeds it and ends with it), valid
    ``spec.admission.ticket_ttl_s`` seconds, and store it in the DHT until it expires (blocking: ``swarm-coordinator
    admit`` runs it). Returns it, and sealed. ``invite``: the code hash of the invite it redeems
    (:mod:`swarm.trust.invites`); ``origin``: who first admitted ``subject`` (default: this key if a delegate's,
    else the run key's ""); both carried by its renewals.

    :raises ProtocolError: ``run_key`` is neither this run's key (the spec's signer) nor its live delegate.
    :raises RuntimeError: the DHT did not take the ticket."""
    now = get_dht_time()
    ticket = Ticket(run_id=directory.run_id, peer_id=run_key.peer_id, time=now, subject=subject,
                    expires=min(now + spec.admission.ticket_ttl_s, _delegated_until(directory, run_key)),
                    spec_name=spec.name, spec_hash=spec.spec_hash(), invite=invite, delegation=run_key.delegation,
                    origin=origin if origin is not None else run_key.peer_id if run_key.delegation else "")
    sealed = seal(ticket, run_key)
    open_ticket(sealed, directory.run_id)  # a wrong key fails here, not at every peer
    if not directory.store_sealed(tickets_key(directory.run_id), ticket.dht_subkey(), sealed, ticket.expires):
        raise RuntimeError("the DHT did not store the ticket (no DHT peer answered); try again")
    return ticket, sealed


def _delegated_until(directory: RunDirectory, key: Identity) -> float:
    """DHT time ``key``'s delegation ends (infinite for the run key itself).

    :raises ProtocolError: its delegation is not the run key's, or has ended."""
    if not key.delegation:
        return float("inf")
    delegation = open_run_key_record(key.delegation, Delegation, directory.run_id)
    if delegation.expires <= get_dht_time():
        raise ProtocolError(f"this key's delegation ended at {delegation.expires:.0f}: it issues no more tickets")
    return delegation.expires


def fetch_ticket(directory: RunDirectory, peer_id: str) -> Optional[tuple[Ticket, bytes]]:
    """The newest valid ticket for ``peer_id`` in the DHT, with its sealed bytes; None if there is none."""
    now = get_dht_time()
    mine = [(t, sealed) for t, sealed in all_tickets(directory) if t.subject == peer_id and t.expires > now]
    return max(mine, key=lambda found: found[0].expires, default=None)


def all_tickets(directory: RunDirectory) -> list[tuple[Ticket, bytes]]:
    """Every ticket of the run the DHT holds that the run key (or its delegate) signed, with its sealed bytes
    (expired ones included while the DHT keeps them; others are logged and skipped)."""
    return run_key_records(directory, tickets_key(directory.run_id), Ticket, open_ticket)


def run_key_records(directory: RunDirectory, key: str, cls: type[RK],
                    opener: Optional[Callable[[bytes, str], RK]] = None) -> list[tuple[RK, bytes]]:
    """The records of kind ``cls`` under DHT ``key`` that ``opener`` (default: the run key's signature,
    :func:`~swarm.protocol.open_run_key_record`) accepts, with their sealed bytes (blocking; others are logged
    and skipped)."""
    out = []
    for _, sealed in directory.read_sealed(key, cls):
        try:
            out.append((opener(sealed, directory.run_id) if opener is not None
                        else open_run_key_record(sealed, cls, directory.run_id), sealed))
        except ProtocolError as e:
            logger.warning("dropped a %s under %s: %s", cls.__name__, key, e)
    return out


def renew_tickets(directory: RunDirectory, run_key: Identity, spec: RunSpec, due: float = 0.5) -> list[str]:
    """The coordinator's duty in a ticketed run (blocking, every few seconds): re-issue the tickets with at most
    ``due`` of their life left, but those of banned peers (``revoke``) and those a banned delegate first issued
    (:attr:`~swarm.protocol.Ticket.origin`: they lapse within a ticket's life), and carry its own. A delegate
    (:mod:`swarm.trust.delegates`) runs it with its own key and a smaller ``due`` (the coordinator, while up, renews
    first), and renews no ticket its delegation would end sooner. Returns the peer ids renewed.

    :raises RuntimeError: the DHT did not take a ticket.
    :raises ProtocolError: ``run_key`` is a delegate whose delegation ended."""
    bans, _ = directory.bans()
    banned = set(bans.banned) if bans is not None else set()
    now, renewed, ttl_s = get_dht_time(), [], spec.admission.ticket_ttl_s
    until = min(now + ttl_s, _delegated_until(directory, run_key))
    held = {t.subject: (t, sealed) for t, sealed in all_tickets(directory) if t.expires > now}
    if run_key.peer_id not in held:  # the coordinator's own: it stores and endorses like any keeper
        held[run_key.peer_id] = issue_ticket(directory, run_key, run_key.peer_id, spec)
    for subject, (ticket, sealed) in held.items():
        if subject not in banned and ticket.origin not in banned and ticket.expires - now <= ttl_s * due \
                and until > ticket.expires + 1.0:
            try:
                ticket, sealed = issue_ticket(directory, run_key, subject, spec, ticket.invite,
                                              ticket.origin)
                renewed.append(subject)
            except RuntimeError as e:  # this one is tried again at the next pass; the others go on
                logger.warning("could not renew the ticket of %s: %s", subject, e)
        if subject == run_key.peer_id and not run_key.delegation:  # (a delegate's own: RunTickets.refresh)
            run_key.ticket = sealed
    return renewed


class RunTickets:
    """This peer's admission to a run whose policy is ``allowlist``: its ticket, carried by ``identity``."""

    def __init__(self, directory: RunDirectory, identity: Identity, spec: RunSpec):
        self.directory, self.identity, self.spec, self.policy = directory, identity, spec, spec.admission.policy
        self.ticket: Optional[Ticket] = None
        self.duty: Optional[Callable[[], object]] = None
        """Called (blocking) at every :meth:`refresh`: a delegate's renewals (:mod:`swarm.trust.delegates`)."""

    def acquire(self) -> Optional[Ticket]:
        """Read this peer's ticket and carry it (blocking). None in an open run.

        :raises NotAdmitted: the run admits only ticketed peers and none is in the DHT for this peer."""
        if self.policy == "open":
            return None
        found = fetch_ticket(self.directory, self.identity.peer_id)
        if found is None:
            invite = (" or for an invite code (join with --invite CODE, or SWARM_INVITE)" if self.policy == "invite"
                      else "")
            raise NotAdmitted(
                f"run {self.directory.run_id} admits only the peers its operator admitted (policy "
                f"{self.policy!r}), and there is no valid ticket for this peer ({self.identity.peer_id}); ask the "
                f"operator to run `swarm-coordinator admit <run address> {self.identity.peer_id}`{invite}")
        return self.take(*found)

    def take(self, ticket: Ticket, sealed: bytes) -> Ticket:
        """Carry ``ticket`` (``sealed``: its bytes) from now on; returns it."""
        self.ticket, self.identity.ticket = ticket, sealed
        return ticket

    def gate(self) -> Optional["TicketGate"]:
        """A :class:`TicketGate` for this peer's RPC handlers in a ticketed run; None in an open one."""
        return None if self.policy == "open" else TicketGate(self.directory)

    def refresh(self) -> None:
        """Take a renewed ticket if one is in the DHT and this one is in its second half (blocking); logs a
        warning once the ticket is within a tenth of its life of expiring."""
        if self.duty is not None:
            self.duty()
        if self.ticket is None:
            return
        now, life = get_dht_time(), self.ticket.expires - self.ticket.time
        if self.ticket.expires - now > life / 2:
            return
        found = fetch_ticket(self.directory, self.identity.peer_id)
        if found is not None and found[0].expires > self.ticket.expires:
            self.ticket, self.identity.ticket = found
        elif self.ticket.expires - now < life / 10:
            logger.warning("this peer's ticket expires in %.0f s and was not renewed (is the run's coordinator or "
                           "a delegate up? was it revoked?)", self.ticket.expires - now)


Gate = Callable[[str], Awaitable[None]]
"""Awaited with a caller's libp2p id before its request is read; raises :class:`NotAdmitted` for a caller without a
valid ticket (:class:`TicketGate`)."""


async def admit(gate: Optional[Gate], p2p_id: str, refusal: type[Exception]) -> None:
    """Check caller ``p2p_id`` at ``gate`` (nothing to check without one: an open run).

    :raises refusal: the caller holds no valid ticket (with :class:`NotAdmitted`'s message, which says how to get
        one), as the service's own refusal type, so its handler answers it like any refusal."""
    if gate is not None:
        try:
            await gate(p2p_id)
        except NotAdmitted as e:
            raise refusal(str(e)) from None


def ticket_gate(spec: RunSpec, directory: RunDirectory) -> Optional["TicketGate"]:
    """A :class:`TicketGate` reading ``directory``'s tickets for a run that admits only ticketed peers; None for an
    open run (every caller is served)."""
    return None if spec.admission.policy == "open" else TicketGate(directory)


READ_EVERY_S = 10.0
"""Seconds between a :class:`TicketGate`'s reads of the run's tickets while callers it does not know call (an
admit takes effect this soon; a flood of fresh keys costs one DHT read per period, not one per key)."""


class TicketGate:
    """Whether a caller (a libp2p id, the key it speaks with) holds a valid ticket, for the RPC handlers of a
    ticketed run: its peer id is derived from the libp2p id and looked up among the run's tickets, read from the
    DHT whole (:func:`all_tickets`) at most every :data:`READ_EVERY_S` seconds, one read at a time, when a caller it
    does not know calls. Checked before a request's message is read, so an unticketed caller's tensors are never
    received. Called as ``await gate(p2p_id)`` (the same as :meth:`check`) by the stage RPCs, the fragment and
    evidence services and the averagers' RPCs (:mod:`swarm.averaging.admitted`)."""

    def __init__(self, directory: RunDirectory, clock=time.monotonic):
        self.directory, self.clock = directory, clock
        self._until: dict[str, float] = {}  # peer id -> DHT time its newest ticket expires
        self._next_read = float("-inf")  # clock time of the next read allowed
        self._reading: Optional[asyncio.Lock] = None

    async def check(self, p2p_id: str) -> None:
        """:raises NotAdmitted: the caller holds no valid ticket (the message says how to get one)."""
        try:
            peer = peer_of_p2p_id(p2p_id)
        except ProtocolError as e:
            raise NotAdmitted(f"refused: {e}") from None
        if self._until.get(peer, 0.0) > get_dht_time():
            return
        self._reading = self._reading or asyncio.Lock()
        async with self._reading:
            if self._until.get(peer, 0.0) <= get_dht_time() and self.clock() >= self._next_read:
                self._next_read = self.clock() + READ_EVERY_S
                now = get_dht_time()  # merged into what it knew (a read that failed or found less forgets nobody;
                until = {p: t for p, t in self._until.items() if t > now}  # a ticket ends only by expiring)
                for ticket, _ in await asyncio.to_thread(all_tickets, self.directory):
                    until[ticket.subject] = max(until.get(ticket.subject, 0.0), ticket.expires)
                self._until = until
        if self._until.get(peer, 0.0) <= get_dht_time():
            raise NotAdmitted("refused: this run admits only the peers its operator admitted, and you hold no valid "
                              "ticket (ask the operator to run `swarm-coordinator admit <run address> <your peer "
                              "id>`)")

    __call__ = check


__all__ = ["READ_EVERY_S", "Gate", "admit", "NotAdmitted", "RunTickets", "TicketGate", "all_tickets", "fetch_ticket", "issue_ticket",
           "renew_tickets", "run_key_records", "ticket_gate"]
