"""Delegate keys (:mod:`swarm.trust.delegates`): the run key delegates ticket issuing to a peer, which then redeems
invite codes while the coordinator does not and renews tickets in their last quarter; its tickets embed the
delegation and are taken by every reader and DHT node as the run key's, while a ticket signed by a key the run key
did not name, one outliving its delegation, or one issued after the delegation ended is refused. Real hivemind DHT
nodes and p2pd daemons on loopback, each running the run's record validators."""

from __future__ import annotations

import asyncio
import time

import pytest
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord
from hivemind.utils import get_dht_time
from hivemind.utils.serializer import MSGPackSerializer

from swarm.identity import Identity
from swarm.net.dht import spawn_dht
from swarm.net.dht_validation import RunRecordValidator, TicketValidator
from swarm.net.directory import RunDirectory
from swarm.protocol import (Delegation, ProtocolError, Ticket, check_carried, envelope_ticket, open_ticket, seal,
                            tickets_key)
from swarm.trust.banlist import update_bans
from swarm.trust.delegates import DUE, delegate, live_delegations
from swarm.trust.invites import InviteRefused, InviteService, acquire_ticket, issue_invite, join_admission
from swarm.trust.tickets import RunTickets, fetch_ticket, issue_ticket, renew_tickets
from tests.conftest import LOOPBACK_DHT, TINY, keyed_dhts
from tests.test_invites import _record

pytestmark = pytest.mark.timeout(180)
SPEC = TINY.updated(name="delegated", admission={"policy": "invite", "ticket_ttl_s": 3600.0})


def _ticket(run_id: str, signer: Identity, subject: str, at: float, life_s: float, origin: str = "") -> bytes:
    return seal(Ticket(run_id=run_id, peer_id=signer.peer_id, time=at, subject=subject, expires=at + life_s,
                       spec_name=SPEC.name, spec_hash=SPEC.spec_hash(), delegation=signer.delegation,
                       origin=origin), signer)


def test_a_delegate_redeems_codes_and_renews_tickets_while_the_coordinator_does_not():
    run_key = Identity.generate()
    run_id, sealed_spec = RunDirectory.seal_spec(SPEC, run_key)
    validators = dict(record_validators=[RunRecordValidator(run_id), TicketValidator(run_id)])
    coordinator = spawn_dht(run_key, **LOOPBACK_DHT, **validators)
    (deputy, deputy_dht), (joiner, joiner_dht), (other, other_dht) = keyed_dhts(
        3, initial_peers=[str(m) for m in coordinator.get_visible_maddrs()], **validators)
    try:
        directory = RunDirectory(coordinator, run_id)
        directory.verify_spec(sealed_spec)
        for peer in (deputy, other):
            issue_ticket(directory, run_key, peer.peer_id, SPEC)
        code, _ = issue_invite(directory, run_key, SPEC, uses=2, ttl_s=3600.0)  # redeemer: the run key, not serving
        record, sealed_delegation = delegate(directory, run_key, SPEC, deputy.p2p_id, ttl_s=3000.0)
        assert record.delegate == deputy.peer_id
        with pytest.raises(ProtocolError, match="not signed by the run key"):
            delegate(directory, other, SPEC, other.p2p_id, ttl_s=60.0)
        deputies = {}
        for identity, dht in ((deputy, deputy_dht), (other, other_dht)):
            deputies[identity.peer_id] = RunTickets(RunDirectory(dht, run_id), identity, SPEC)
            deputies[identity.peer_id].directory.verify_spec(sealed_spec)

        async def scenario():
            p2ps = [await d.replicate_p2p() for d in (deputy_dht, other_dht, joiner_dht)]
            for tickets, p2p in zip(deputies.values(), p2ps):
                await join_admission(tickets, p2p, None)  # held already; stands ready to be a delegate
                await asyncio.to_thread(tickets.refresh)  # its delegate duty reads the delegations, on its thread
                await asyncio.to_thread(tickets.duty.wait)
            joining = RunTickets(RunDirectory(joiner_dht, run_id), joiner, SPEC)
            try:
                with pytest.raises(InviteRefused, match="has not delegated to it"):
                    await InviteService(deputies[other.peer_id].directory, other, SPEC)._redeem(code, joiner.peer_id)
                return await acquire_ticket(joining, p2ps[2], code)
            finally:
                for p2p in p2ps:
                    await p2p.shutdown()

        assert set(live_delegations(RunDirectory(joiner_dht, run_id))) == {deputy.peer_id}
        ticket = asyncio.run(scenario())
        assert deputy.delegation == sealed_delegation and not other.delegation
        assert ticket.subject == joiner.peer_id and ticket.peer_id == deputy.peer_id, "redeemed by the delegate"
        assert ticket.delegation == sealed_delegation and ticket.expires <= record.expires
        assert ticket.origin == deputy.peer_id and envelope_ticket(_ticket(run_id, deputy, "x", 0.0, 1.0))[1] == b"", \
            "a ticket is sealed without its signer's own (which would nest one more at every renewal)"
        assert check_carried(_record(run_id, joiner), run_id, get_dht_time()).peer_id == deputy.peer_id
        assert fetch_ticket(directory, joiner.peer_id)[0].peer_id == deputy.peer_id, "the DHT nodes kept it"

        # the delegate renews a ticket in its last quarter (the coordinator did not), no sooner
        late, now = Identity.generate(), get_dht_time()
        assert directory.store_sealed(tickets_key(run_id), late.peer_id,
                                      _ticket(run_id, run_key, late.peer_id, now, 0.9 * DUE * 3600.0), now + 810.0)
        assert deputies[deputy.peer_id].duty.run_pass() == [late.peer_id]
        assert fetch_ticket(directory, late.peer_id)[0].peer_id == deputy.peer_id

        # the deputy is revoked: nobody renews what it first admitted (the run key's renewals carry the origin)
        minted, plain, minted_too = (Identity.generate().peer_id for _ in range(3))

        def store(subject: str, origin: str) -> None:
            at = get_dht_time()
            assert directory.store_sealed(tickets_key(run_id), subject,
                                          _ticket(run_id, run_key, subject, at, 100.0, origin), at + 100.0)

        store(minted, deputy.peer_id)
        assert minted in renew_tickets(directory, run_key, SPEC)
        assert fetch_ticket(directory, minted)[0].origin == deputy.peer_id
        update_bans(directory, run_key, ban=(deputy.peer_id, "its key was stolen", deputy.p2p_id))
        store(plain, "")
        store(minted_too, deputy.peer_id)
        renewed = renew_tickets(directory, run_key, SPEC)
        assert plain in renewed and minted_too not in renewed

        _refuses_forged_tickets(directory, run_key, deputy, other)
    finally:
        for dht in (deputy_dht, joiner_dht, other_dht, coordinator):
            dht.shutdown()


def _refuses_forged_tickets(directory: RunDirectory, run_key: Identity, deputy: Identity, other: Identity) -> None:
    """A ticket signed by a key the run key did not name (carrying another's delegation, or one it signed itself),
    one outliving its delegation: refused by readers and by every DHT node. A delegation that ended issues none."""
    run_id, validator, now = directory.run_id, RunRecordValidator(directory.run_id), get_dht_time()

    def stored(sealed: bytes, subject: str) -> bool:
        return validator.validate(DHTRecord(key=DHTID.generate(source=tickets_key(run_id)).to_bytes(),
                                            subkey=MSGPackSerializer.dumps(subject),
                                            value=MSGPackSerializer.dumps(sealed), expiration_time=now + 100))

    victim = Identity.generate().peer_id
    assert stored(_ticket(run_id, deputy, victim, now, 100.0), victim)
    other.delegation = deputy.delegation  # the deputy's delegation, carried by a key it does not name
    forged = {"names": _ticket(run_id, other, victim, now, 100.0),
              "outlives": _ticket(run_id, deputy, victim, now, 10 * 3600.0)}
    other.delegation = seal(Delegation(run_id=run_id, peer_id=other.peer_id, time=now, spec_name=SPEC.name,
                                       spec_hash=SPEC.spec_hash(), expires=now + 3600, delegate=other.peer_id,
                                       delegate_p2p_id=other.p2p_id), other)
    forged["not the run key"] = _ticket(run_id, other, victim, now, 100.0)
    for why, sealed in forged.items():
        with pytest.raises(ProtocolError, match=why):
            open_ticket(sealed, run_id)
        assert not stored(sealed, victim), why

    spent = Identity.generate()
    record, spent.delegation = delegate(directory, run_key, SPEC, spent.p2p_id, ttl_s=1.0)
    while get_dht_time() <= record.expires:
        time.sleep(0.1)
    with pytest.raises(ProtocolError, match="delegation ended"):
        issue_ticket(directory, spent, victim, SPEC)
