"""Admission by invite (``[admission] policy = "invite"``, :mod:`swarm.trust.invites`): a code drawn with the run key
admits up to its uses, each peer for itself; a peer that redeems again keeps its use; wrong, used-up and expired
codes and banned peers are refused with their cause. Real hivemind DHT nodes and p2pd daemons on loopback; the
redeemer speaks with the run key, as the coordinator does."""

from __future__ import annotations

import asyncio

import pytest
from hivemind.utils import get_dht_time

from swarm.identity import Identity
from swarm.net.dht import spawn_dht
from swarm.net.directory import RunDirectory
from swarm.protocol import ProtocolError, check_carried
from swarm.trust.banlist import update_bans
from swarm.trust.invites import InviteService, acquire_ticket, invite_hash, issue_invite
from swarm.trust.tickets import NotAdmitted, RunTickets
from tests.conftest import LOOPBACK_DHT, TINY, keyed_dhts

pytestmark = pytest.mark.timeout(180)
SPEC = TINY.updated(name="invited", admission={"policy": "invite", "ticket_ttl_s": 3600.0})


def test_an_invite_admits_up_to_its_uses_each_peer_for_itself():
    run_key = Identity.generate()
    coordinator = spawn_dht(run_key, **LOOPBACK_DHT)
    joiners = keyed_dhts(4, initial_peers=[str(m) for m in coordinator.get_visible_maddrs()])
    try:
        run_id, sealed_spec = RunDirectory.seal_spec(SPEC, run_key)
        directory = RunDirectory(coordinator, run_id)
        directory.verify_spec(sealed_spec)  # (the redeemer reads the run key's ban list)
        code, invite = issue_invite(directory, run_key, SPEC, uses=2, ttl_s=3600.0)
        assert code.startswith("swarm-invite-") and invite.code_hash == invite_hash(code)
        assert invite.redeemers == [run_key.p2p_id] and code not in str(invite.model_dump())
        with pytest.raises(ProtocolError, match="not signed by the run key"):
            issue_invite(directory, Identity.generate(), SPEC, uses=1, ttl_s=60.0)
        short, short_invite = issue_invite(directory, run_key, SPEC, uses=5, ttl_s=2.0)
        (a, a_dht), (b, b_dht), (c, c_dht), (banned, banned_dht) = joiners
        update_bans(directory, run_key, ban=(banned.peer_id, "spam", ""))

        async def join(identity, dht, with_code):
            p2p = await dht.replicate_p2p()
            try:
                tickets = RunTickets(RunDirectory(dht, run_id), identity, SPEC)
                return await acquire_ticket(tickets, p2p, with_code)
            finally:
                await p2p.shutdown()

        async def scenario():
            p2p = await coordinator.replicate_p2p()
            await InviteService(directory, run_key, SPEC).add_p2p_handlers(p2p, namespace=run_id)
            outcomes = {}
            for name, (identity, dht), with_code in (("a", (a, a_dht), code), ("a again", (a, a_dht), code),
                                                     ("b", (b, b_dht), code), ("c", (c, c_dht), code),
                                                     ("c wrong", (c, c_dht), code + "x"), ("c none", (c, c_dht), None),
                                                     ("banned", (banned, banned_dht), short)):
                try:
                    outcomes[name] = await join(identity, dht, with_code)
                except NotAdmitted as e:
                    outcomes[name] = str(e)
            while get_dht_time() <= short_invite.expires:
                await asyncio.sleep(0.2)
            try:
                outcomes["c expired"] = await join(c, c_dht, short)
            except NotAdmitted as e:
                outcomes["c expired"] = str(e)
            await p2p.shutdown()
            return outcomes

        out = asyncio.run(scenario())
        assert out["a"].subject == a.peer_id and out["a"].invite == invite.code_hash
        assert out["a again"].subject == a.peer_id, "a peer that redeems again keeps its own use"
        assert out["b"].subject == b.peer_id
        assert "used up (2 of 2 peers admitted)" in out["c"], out["c"]
        assert "no live invite" in out["c wrong"] and "--invite CODE" in out["c none"], out
        assert "banned" in out["banned"] and "no live invite" in out["c expired"], out
        # the ticket is the run key's for its holder: records it carries are kept by every node of the run
        a.ticket = None
        sealed = RunTickets(RunDirectory(a_dht, run_id), a, SPEC).acquire()
        assert sealed.subject == a.peer_id and a.ticket is not None
        assert check_carried(_record(run_id, a), run_id, get_dht_time()).invite == invite.code_hash
    finally:
        for _, dht in joiners:
            dht.shutdown()
        coordinator.shutdown()


def _record(run_id: str, identity: Identity) -> bytes:
    from swarm.protocol import ServerInfo, ServerState, seal

    return seal(ServerInfo(run_id=run_id, peer_id=identity.peer_id, time=get_dht_time(), stage=0,
                           state=ServerState.ONLINE, throughput=1.0, p2p_id=identity.p2p_id, ttl_s=60.0), identity)


def test_a_duration_reads_as_seconds():
    from coordinator.cli import _duration_s

    assert [_duration_s(t) for t in ("7d", "12h", "30m", "90s", "3600")] == [604800.0, 43200.0, 1800.0, 90.0, 3600.0]
    for bad in ("", "7w", "-1d", "0"):
        with pytest.raises(Exception, match="not a duration"):
            _duration_s(bad)
