"""Admission by invite (``[admission] policy = "invite"``): a peer gets its ticket itself, with a code.

An allowlist (:mod:`swarm.trust.tickets`) needs the operator to name every peer id; an invite lets them hand out
a code instead, as a closed beta does. ``swarm-coordinator invite <address> --uses N --expires 7d`` draws a secret
code (:func:`issue_invite`) and publishes only its SHA-256 in an :class:`~swarm.protocol.Invite` signed by the
run key, with its limits and its *redeemers* (the libp2p ids that redeem it: the run's coordinator, which speaks
with the run key). A peer started with ``--invite CODE`` (``SWARM_INVITE``) that holds no ticket reads the invite
by the code's hash and asks a redeemer for its ticket (``rpc_redeem``, :func:`redeem_invite`); the redeemer
checks the code, the limits and the ban list and issues a ticket naming the *caller's* peer id (its libp2p key's,
so a code admits whoever presents it, and nobody for someone else), marked with the invite
(:attr:`~swarm.protocol.Ticket.invite`). The invite's uses are the peers holding such tickets: a peer that
redeems again (a restart) gets its own renewed, not a second use. From there it is an admitted peer like any
other: renewed by the coordinator, revoked by ``swarm-coordinator revoke``.

Redemption needs a redeemer up: the coordinator, or a peer the run key delegated ticket issuing to
(:mod:`swarm.trust.delegates`), which every ticketed peer of an invite run is ready to be (it serves ``rpc_redeem``,
refusing while no live delegation names it); a joiner asks the invite's redeemers, then every live delegate. The
code is a bearer secret: whoever holds it may join, up to its uses.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import secrets
import time
from typing import AsyncIterator, Optional

from hivemind.p2p import P2P, P2PContext, PeerID
from hivemind.proto import runtime_pb2
from hivemind.utils import get_dht_time

from swarm.config import RunSpec
from swarm.identity import Identity
from swarm.net.directory import RunDirectory
from swarm.net.quota import Busy, PeerQuota, TooFast
from swarm.net.transport import ProtocolServicer, gather, stream_out
from swarm.protocol import (Delegation, Invite, InviteRedeem, InviteReply, ProtocolError, Refusal, Ticket, invites_key,
                            open_run_key_record, open_ticket, pack_message, seal, unpack_message)
from swarm.trust.authority import peer_of_p2p_id
from swarm.trust.delegates import DelegateDuty, live_delegations
from swarm.trust.tickets import READ_EVERY_S, NotAdmitted, RunTickets, all_tickets, issue_ticket, run_key_records

logger = logging.getLogger(__name__)

CODE_PREFIX = "swarm-invite-"
REDEEM_TIMEOUT_S = 30.0
"""Seconds a joining peer waits for a redeemer's answer."""


class InviteRefused(RuntimeError, Refusal):
    """A redeemer refuses a code (the cause named: unknown or expired, used up, banned)."""


def invite_hash(code: str) -> str:
    """SHA-256 (hex) of an invite code: what the DHT holds of it."""
    return hashlib.sha256(code.strip().encode()).hexdigest()


def issue_invite(directory: RunDirectory, run_key: Identity, spec: RunSpec, uses: int, ttl_s: float
                 ) -> tuple[str, Invite]:
    """Draw a code (128 random bits) admitting up to ``uses`` peers for ``ttl_s`` seconds, publish its signed
    :class:`~swarm.protocol.Invite` (blocking: ``swarm-coordinator invite`` runs it); returns the code and the invite.

    :raises ProtocolError: ``run_key`` is not this run's key, or ``uses`` out of range.
    :raises RuntimeError: the DHT did not take the invite."""
    code, now = CODE_PREFIX + secrets.token_urlsafe(16), get_dht_time()
    try:
        invite = Invite(run_id=directory.run_id, peer_id=run_key.peer_id, time=now, spec_name=spec.name,
                        spec_hash=spec.spec_hash(), code_hash=invite_hash(code), uses=uses, expires=now + ttl_s,
                        redeemers=[run_key.p2p_id])
    except ValueError as e:
        raise ProtocolError(f"not a valid invite: {e}") from None
    sealed = seal(invite, run_key)
    open_run_key_record(sealed, Invite, directory.run_id)  # a wrong key fails here, not at every joiner
    if not directory.store_sealed(invites_key(directory.run_id), invite.code_hash, sealed, invite.expires):
        raise RuntimeError("the DHT did not store the invite (no DHT peer answered); try again")
    return code, invite


def all_invites(directory: RunDirectory) -> dict[str, Invite]:
    """The run key's invites the DHT holds, by code hash (blocking; others are logged and skipped)."""
    return {i.code_hash: i for i, _ in run_key_records(directory, invites_key(directory.run_id), Invite)}


def find_invite(directory: RunDirectory, code: str) -> Optional[Invite]:
    """The run key's invite for ``code`` in the DHT, expired or not; None if there is none (blocking)."""
    return all_invites(directory).get(invite_hash(code))


NO_INVITE = ("no live invite of this run has this code (mistyped, expired, or of another run): ask the run's "
             "operator for a new one")
USED_UP = "the invite is used up"
BANNED = "is banned from this run"
NOT_REDEEMER = ("this peer redeems no invites of the run (the run key has not delegated to it): ask the run's "
                "coordinator or a delegate")


def redeem(directory: RunDirectory, run_key: Identity, spec: RunSpec, invite: Invite, subject: str,
           ledger: Optional[dict[str, set[str]]] = None) -> tuple[Ticket, bytes]:
    """The redeemer's part (blocking): a ticket for peer ``subject`` under ``invite`` (found by its code) if it
    is live with a use left (or one ``subject`` already used), and ``subject`` is not banned. ``ledger``: code hash
    -> the peers this redeemer admitted with it, counted with the tickets the DHT holds (a read that finds fewer
    does not give a use back) and updated here.

    :raises InviteRefused: the cause, and what to do.
    :raises RuntimeError: the DHT did not take the ticket."""
    now, ledger = get_dht_time(), ledger if ledger is not None else {}
    if invite.expires <= now:
        raise InviteRefused(NO_INVITE)
    bans, _ = directory.bans()
    if bans is not None and subject in bans.banned:
        raise InviteRefused(f"peer {subject} {BANNED} ({bans.banned[subject]})")
    holders = ledger.setdefault(invite.code_hash, set()) | {
        t.subject for t, _ in all_tickets(directory) if t.invite == invite.code_hash and t.expires > now}
    if subject not in holders and len(holders) >= invite.uses:
        raise InviteRefused(f"{USED_UP} ({len(holders)} of {invite.uses} peers admitted): ask the run's "
                            "operator for a new one")
    found = issue_ticket(directory, run_key, subject, spec, invite.code_hash)
    ledger[invite.code_hash].add(subject)
    return found


MAX_WAITING = 8
"""Redemptions an :class:`InviteService` lets wait for the one in progress; the next is refused at once ("busy")."""


class InviteService(ProtocolServicer):
    """``rpc_redeem`` on namespace ``run_id``, served by the holder of the run key (the coordinator) and by every
    ticketed peer of an invite run, which redeems while it is the run key's delegate (``run_key`` is then its own
    identity, carrying the delegation; :mod:`swarm.trust.delegates`) and refuses otherwise: each caller
    at most one in flight and a few a minute; a code is looked up among the run's invites (read from the DHT at
    most every :data:`~swarm.trust.tickets.READ_EVERY_S` seconds) before it waits for its turn, and then one
    redemption at a time, at most :data:`MAX_WAITING` waiting (fresh keys sending junk codes cost one lookup
    of a cached table each)."""

    wire_name = "InviteService"

    def __init__(self, directory: RunDirectory, run_key: Identity, spec: RunSpec, clock=time.monotonic):
        self.directory, self.run_key, self.spec, self.clock = directory, run_key, spec, clock
        self.quota = PeerQuota(max_in_flight=1, rate_per_s=0.1, burst=3)
        self.ledger: dict[str, set[str]] = {}  # code hash -> peers admitted with it here
        self._invites: dict[str, Invite] = {}  # code hash -> the run key's invite, as last read
        self._read_at = float("-inf")
        self._one_at_a_time: Optional[asyncio.Lock] = None
        self._waiting = 0

    async def _invite(self, code: str) -> Invite:
        """:raises InviteRefused: no live invite has ``code``."""
        wanted = invite_hash(code)
        if wanted not in self._invites and self.clock() - self._read_at >= READ_EVERY_S:
            self._read_at = self.clock()
            found = await asyncio.to_thread(all_invites, self.directory)
            self._invites = {i.code_hash: i for i in self._invites.values() if i.expires > get_dht_time()} | found
        invite = self._invites.get(wanted)
        if invite is None or invite.expires <= get_dht_time():
            raise InviteRefused(NO_INVITE)
        return invite

    def _redeems(self) -> bool:
        """Whether this peer redeems now: it holds the run key, or a live delegation of it."""
        if self.run_key.delegation:
            delegation = open_run_key_record(self.run_key.delegation, Delegation, self.directory.run_id)
            return delegation.expires > get_dht_time()
        return self.directory.run_key == self.run_key.public_key

    async def _redeem(self, code: str, subject: str) -> tuple[Ticket, bytes]:
        if not self._redeems():
            raise InviteRefused(NOT_REDEEMER)
        invite = await self._invite(code)
        if self._waiting >= MAX_WAITING:
            raise Busy("busy redeeming other invites; retry in a few seconds")
        self._one_at_a_time = self._one_at_a_time or asyncio.Lock()
        self._waiting += 1
        try:
            async with self._one_at_a_time:  # (two at once could both take an invite's last use)
                return await asyncio.to_thread(redeem, self.directory, self.run_key, self.spec, invite, subject,
                                               self.ledger)
        finally:
            self._waiting -= 1

    async def rpc_redeem(self, stream: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
                         ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        """A ticket for the caller, or an error naming why not."""
        try:
            with self.quota.hold(str(context.remote_id)):
                metadata, _ = await gather(stream, max_bytes=0, max_tensors=0, deadline_s=REDEEM_TIMEOUT_S)
                req = unpack_message(metadata, InviteRedeem)
                if req.run_id != self.directory.run_id:
                    raise ProtocolError(f"this peer redeems invites of run {self.directory.run_id}, not {req.run_id}")
                subject = peer_of_p2p_id(str(context.remote_id))
                ticket, sealed = await self._redeem(req.code, subject)
                logger.info("admitted %s by invite %s..", subject, ticket.invite[:12])
                reply = InviteReply(ticket=sealed)
        except (ProtocolError, InviteRefused, Busy, TooFast, RuntimeError) as e:
            reply = InviteReply(error=str(e)[:512])
        async for msg in stream_out(runtime_pb2.ExpertResponse, pack_message(reply), []):
            yield msg


async def redeem_invite(p2p: P2P, directory: RunDirectory, code: str) -> tuple[Ticket, bytes]:
    """The joining peer's part: read the invite of ``code`` and ask its redeemers, in turn, for this peer's
    ticket (the caller's libp2p key names it). Returns the ticket, verified, and sealed. A redeemer that does not
    know the invite yet (it reads the run's invites at most every :data:`READ_EVERY_S` seconds) is asked again
    once that passed; a busy one after a few seconds.

    :raises NotAdmitted: no live invite has this code, a redeemer refused it (its reason), or none answered."""
    invite = await asyncio.to_thread(find_invite, directory, code)
    if invite is None or invite.expires <= get_dht_time():
        raise NotAdmitted(NO_INVITE)
    delegates = [d.delegate_p2p_id for d, _ in (await asyncio.to_thread(live_delegations, directory)).values()]
    request, unreachable = pack_message(InviteRedeem(run_id=directory.run_id, code=code.strip())), []
    for redeemer in dict.fromkeys(invite.redeemers + delegates):
        for attempt in range(3):
            try:
                reply = await _ask(p2p, redeemer, directory.run_id, request)
            except Exception as e:  # unreachable, or not serving invites of this run
                unreachable.append(f"{redeemer}: {type(e).__name__}")
                break
            if reply.error and attempt < 2 and (reply.error == NO_INVITE or reply.error.startswith("busy")):
                await asyncio.sleep(READ_EVERY_S + 1 if reply.error == NO_INVITE else 3.0)
                continue
            if reply.error.startswith(USED_UP) or BANNED in reply.error:  # the answer of every redeemer
                raise NotAdmitted(f"the invite was refused: {reply.error}")
            if reply.error:  # this one cannot redeem now (no delegate, or its delegation ended, or its DHT failed)
                unreachable.append(f"{redeemer}: {reply.error[:160]}")
                break
            try:
                return open_ticket(reply.ticket, directory.run_id), reply.ticket
            except ProtocolError as e:
                unreachable.append(f"{redeemer}: a bad ticket ({e})")
                break
    raise NotAdmitted(f"no redeemer of the invite answered ({'; '.join(unreachable)}): is the run's coordinator "
                      "(or a delegate) up? Try again later")


async def _ask(p2p: P2P, redeemer: str, run_id: str, request: bytes) -> InviteReply:
    stub = InviteService.get_stub(p2p, PeerID.from_base58(redeemer), namespace=run_id)
    metadata, _ = await asyncio.wait_for(gather(await stub.rpc_redeem(
        stream_out(runtime_pb2.ExpertRequest, request, [])), max_tensors=0), REDEEM_TIMEOUT_S)
    return unpack_message(metadata, InviteReply)


async def acquire_ticket(tickets: RunTickets, p2p: P2P, code: Optional[str]) -> Optional[Ticket]:
    """This peer's ticket at join: the one in the DHT (:meth:`RunTickets.acquire`), else, in an invite run with
    ``code``, one redeemed for it. None in an open run.

    :raises NotAdmitted: none (the message says how to get one)."""
    try:
        return await asyncio.to_thread(tickets.acquire)
    except NotAdmitted:
        if tickets.policy != "invite" or not code:
            raise
    ticket, sealed = await redeem_invite(p2p, tickets.directory, code)
    if ticket.subject != tickets.identity.peer_id:
        raise NotAdmitted(f"the redeemer issued a ticket for {ticket.subject}, not this peer")
    return tickets.take(ticket, sealed)


async def join_admission(tickets: RunTickets, p2p: P2P, code: Optional[str]) -> Optional[Ticket]:
    """A peer's admission as it joins (once per process): its ticket (:func:`acquire_ticket`) and, in a ticketed
    run, its readiness to be the run key's delegate (:class:`~swarm.trust.delegates.DelegateDuty` at each refresh
    of its ticket; in an invite run, an :class:`InviteService` on ``p2p``, refusing while no delegation names it).

    :raises NotAdmitted: no ticket (the message says how to get one)."""
    found = await acquire_ticket(tickets, p2p, code)
    if tickets.policy != "open":
        tickets.duty = DelegateDuty(tickets.directory, tickets.identity, tickets.spec)
    if tickets.policy == "invite":
        service = InviteService(tickets.directory, tickets.identity, tickets.spec)
        await service.add_p2p_handlers(p2p, namespace=tickets.directory.run_id)
    return found


__all__ = ["CODE_PREFIX", "MAX_WAITING", "InviteRefused", "InviteService", "acquire_ticket", "all_invites",
           "join_admission", "NOT_REDEEMER",
           "find_invite", "invite_hash",
           "issue_invite", "redeem", "redeem_invite"]
