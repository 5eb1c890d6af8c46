"""Admission by ticket (``[admission] policy = "allowlist"``, :mod:`swarm.trust.tickets`): only the run key admits,
a ticket covers its own peer only and only while it lives, and the run's DHT nodes neither store nor read a
record whose signer carries none (real hivemind DHT nodes on loopback; the stranger's node runs no validator)."""

from __future__ import annotations

import asyncio

import hivemind
import pytest
from hivemind.utils import get_dht_time

from swarm.identity import Identity
from swarm.net.dht_validation import RunRecordValidator, TicketValidator
from swarm.net.directory import RunDirectory
from swarm.protocol import (ProtocolError, ServerInfo, ServerState, Ticket, check_carried, seal, stage_key,
                            tickets_key)
from swarm.trust.banlist import update_bans
from swarm.trust.tickets import (READ_EVERY_S, NotAdmitted, RunTickets, TicketGate, all_tickets, fetch_ticket,
                                 issue_ticket, renew_tickets)
from tests.conftest import TINY

pytestmark = pytest.mark.timeout(120)
SPEC = TINY.updated(name="closed", admission={"policy": "allowlist", "ticket_ttl_s": 3600.0})


def _node(initial_peers=(), validators=()):
    return hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=list(initial_peers),
                        use_relay=False, use_auto_relay=False, record_validators=list(validators))


def _ticket(run_id: str, issuer: Identity, subject: str, *, at: float, life: float = 3600.0,
            spec=SPEC) -> bytes:
    return seal(Ticket(run_id=run_id, peer_id=issuer.peer_id, time=at, subject=subject, expires=at + life,
                       spec_name=spec.name, spec_hash=spec.spec_hash()), issuer)


def _server_record(run_id: str, server: Identity, at: float) -> bytes:
    info = ServerInfo(run_id=run_id, peer_id=server.peer_id, time=at, stage=0, state=ServerState.ONLINE,
                      throughput=5.0, p2p_id=server.p2p_id, ttl_s=60.0)
    return seal(info, server)


def test_a_ticket_counts_only_from_the_run_key_for_its_own_peer_while_it_lives():
    run_key, peer, other = Identity.generate(), Identity.generate(), Identity.generate()
    run_id, _ = RunDirectory.seal_spec(SPEC, run_key)
    now = get_dht_time()

    with pytest.raises(ProtocolError, match="carries no ticket.*swarm-coordinator admit"):
        check_carried(_server_record(run_id, peer, now), run_id, now)
    peer.ticket = _ticket(run_id, run_key, peer.peer_id, at=now)
    assert check_carried(_server_record(run_id, peer, now), run_id, now).subject == peer.peer_id

    # a key that is not the run's signs a ticket naming the run's spec: its key does not derive the run id
    forger = Identity.generate()
    peer.ticket = _ticket(run_id, forger, peer.peer_id, at=now)
    with pytest.raises(ProtocolError, match="not signed by the run key"):
        check_carried(_server_record(run_id, peer, now), run_id, now)
    # another peer's genuine ticket, copied into a stranger's envelope
    other.ticket = _ticket(run_id, run_key, peer.peer_id, at=now)
    with pytest.raises(ProtocolError, match="ticket of peer"):
        check_carried(_server_record(run_id, other, now), run_id, now)
    # a record signed after the ticket ran out (an announcement re-signed by a peer no longer admitted)
    peer.ticket = _ticket(run_id, run_key, peer.peer_id, at=now - 7200)
    with pytest.raises(ProtocolError, match="outside its signer's ticket.*expired"):
        check_carried(_server_record(run_id, peer, now), run_id, now)
    # one of another run's spec (same run key) is another run's ticket
    elsewhere = _ticket(run_id, run_key, peer.peer_id, at=now, spec=TINY)
    peer.ticket = elsewhere
    with pytest.raises(ProtocolError, match="not signed by the run key"):
        check_carried(_server_record(run_id, peer, now), run_id, now)


def test_the_runs_nodes_keep_only_ticketed_records_and_a_peer_reads_its_renewed_ticket():
    run_key, admitted, stranger = Identity.generate(), Identity.generate(), Identity.generate()
    run_id, sealed_spec = RunDirectory.seal_spec(SPEC, run_key)
    guards = lambda: [RunRecordValidator(run_id), TicketValidator(run_id)]  # noqa: E731
    honest = _node(validators=guards())
    maddrs = [str(m) for m in honest.get_visible_maddrs()]
    reader = _node(maddrs, [RunRecordValidator(run_id)])
    reader.add_validators([TicketValidator(run_id)])  # as connect_run does once it read the spec
    outsider = _node(maddrs)  # the stranger's own node checks nothing
    try:
        directory = RunDirectory(honest, run_id, ttl=60)
        assert directory.publish_spec(sealed_spec)
        directory.verify_spec(sealed_spec)
        with pytest.raises(NotAdmitted, match=f"no valid ticket for this peer.*swarm-coordinator admit .*{admitted.peer_id}"):
            RunTickets(directory, admitted, SPEC).acquire()
        with pytest.raises(ProtocolError, match="not signed by the run key"):
            issue_ticket(directory, stranger, stranger.peer_id, SPEC)  # a stranger cannot admit itself

        issue_ticket(directory, run_key, admitted.peer_id, SPEC)
        mine = RunDirectory(reader, run_id, ttl=60)
        tickets = RunTickets(mine, admitted, SPEC)
        assert tickets.acquire().subject == admitted.peer_id and admitted.ticket
        now, later = get_dht_time(), get_dht_time() + 30  # within the announcements' own lifetime (60 s)
        assert mine.announce_server(ServerInfo(run_id=run_id, peer_id=admitted.peer_id, time=now, stage=0,
                                               state=ServerState.ONLINE, throughput=5.0, p2p_id=admitted.p2p_id),
                                    admitted)
        # the stranger's record, sealed well, stored from its own node, and again with a ticket forged by its own key
        outsider.store(stage_key(run_id, 0), _server_record(run_id, stranger, now), later, subkey=stranger.peer_id)
        stranger.ticket = _ticket(run_id, stranger, stranger.peer_id, at=now)
        outsider.store(stage_key(run_id, 0), _server_record(run_id, stranger, now), later, subkey=stranger.peer_id)
        outsider.store(tickets_key(run_id), stranger.ticket, later, subkey=stranger.peer_id)
        for node in (honest, reader):
            found = node.get(stage_key(run_id, 0), latest=True)
            assert isinstance(found.value, dict) and list(found.value) == [admitted.peer_id]
        assert [s.peer_id for s in mine.servers(0)] == [admitted.peer_id]
        assert [t.subject for t, _ in all_tickets(mine)] == [admitted.peer_id]

        # a ticketed run's RPC handlers ask the gate first: the stranger is refused, and looked up again only
        # after READ_EVERY_S (an admit then takes effect)
        clock = [0.0]
        gate = TicketGate(mine, clock=lambda: clock[0])
        asyncio.run(gate.check(admitted.p2p_id))
        for _ in range(2):
            with pytest.raises(NotAdmitted, match="hold no valid ticket.*swarm-coordinator admit"):
                asyncio.run(gate.check(stranger.p2p_id))
        issue_ticket(directory, run_key, stranger.peer_id, SPEC)
        with pytest.raises(NotAdmitted):
            asyncio.run(gate.check(stranger.p2p_id))
        clock[0] += READ_EVERY_S + 1
        asyncio.run(gate.check(stranger.p2p_id))
        with pytest.raises(NotAdmitted, match="does not inline an Ed25519 key"):
            asyncio.run(gate.check("not-a-libp2p-id"))

        # renewal: the coordinator re-issues the tickets in their second half (and carries its own), not those of
        # banned (revoked) peers; a peer takes its renewed ticket once its own is in its second half
        assert renew_tickets(directory, run_key, SPEC) == [] and run_key.ticket
        late, revoked = Identity.generate(), Identity.generate()
        for who in (late, revoked):
            assert directory.store_sealed(tickets_key(run_id), who.peer_id,
                                          _ticket(run_id, run_key, who.peer_id, at=now - 3000), now + 600)
        update_bans(directory, run_key, ban=(revoked.peer_id, "admission revoked", ""))
        assert renew_tickets(directory, run_key, SPEC) == [late.peer_id]
        late_tickets = RunTickets(mine, late, SPEC)
        late_tickets.ticket = Ticket(run_id=run_id, peer_id=run_key.peer_id, time=now - 3000, subject=late.peer_id,
                                     expires=now + 600, spec_name=SPEC.name, spec_hash=SPEC.spec_hash())
        late_tickets.refresh()
        assert late_tickets.ticket.expires > now + 3000 and late.ticket
        assert fetch_ticket(mine, revoked.peer_id)[0].expires < now + 700, "a revoked peer's ticket was renewed"
    finally:
        for node in (honest, reader, outsider):
            node.shutdown()


def test_every_run_node_keeps_only_the_run_keys_tickets_and_none_past_its_expiry():
    """Even before a node knows its run is ticketed (RunRecordValidator alone): a stranger's self-signed ticket
    under a victim's sub-key, or the victim's old genuine ticket stored to expire after its renewal, would be the
    value hivemind keeps (the one that expires last) and hide the real one."""
    from hivemind.dht.routing import DHTID
    from hivemind.dht.validation import DHTRecord
    from hivemind.utils.serializer import MSGPackSerializer

    run_key, peer, stranger = Identity.generate(), Identity.generate(), Identity.generate()
    run_id, _ = RunDirectory.seal_spec(SPEC, run_key)
    validator, now = RunRecordValidator(run_id), get_dht_time()

    def stored(sealed: bytes, expiration: float, subkey: str = peer.peer_id) -> bool:
        return validator.validate(DHTRecord(key=DHTID.generate(source=tickets_key(run_id)).to_bytes(),
                                            subkey=MSGPackSerializer.dumps(subkey),
                                            value=MSGPackSerializer.dumps(sealed), expiration_time=expiration))

    genuine = _ticket(run_id, run_key, peer.peer_id, at=now)
    assert stored(genuine, now + 3600)
    assert not stored(genuine, now + 10 * 3600), "kept past its expiry, it would hide the renewed ticket"
    assert not stored(_ticket(run_id, stranger, peer.peer_id, at=now), now + 3600)
    assert not stored(genuine, now + 3600, subkey=stranger.peer_id)
