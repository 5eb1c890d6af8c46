"""An outsider's DHT stores hide nothing: junk or forged values under a run's keys are refused by the run's nodes
and dropped from lookups (three real hivemind DHT nodes on loopback; the attacker's runs no validator)."""

from __future__ import annotations

import hivemind
import msgpack
import pytest
from hivemind.utils import get_dht_time

from swarm.net.dht_validation import RunRecordValidator
from swarm.net.directory import RunDirectory
from swarm.identity import Identity
from swarm.protocol import (RollbackOrder, ServerHistory, ServerInfo, ServerState, history_key, rollback_key, seal,
                            spec_key, stage_stripe, stage_key, stage_keys)
from tests.conftest import TINY

pytestmark = pytest.mark.timeout(120)


def _node(initial_peers=(), validators=()):
    return hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=list(initial_peers),
                        use_relay=False, use_auto_relay=False, record_validators=list(validators))


def _forge(identity: Identity, fields: dict) -> bytes:
    """A record signed by ``identity`` with any fields (what an attacker's own code can make)."""
    payload = msgpack.packb(fields, use_bin_type=True)
    return msgpack.packb({"p": payload, "k": identity.public_key, "s": identity.sign(payload)}, use_bin_type=True)


def test_junk_and_forged_values_under_a_runs_keys_hide_nothing():
    coordinator, server, stranger = Identity.generate(), Identity.generate(), Identity.generate()
    run_id, sealed_spec = RunDirectory.seal_spec(TINY, coordinator)
    honest = _node(validators=[RunRecordValidator(run_id)])
    maddrs = [str(m) for m in honest.get_visible_maddrs()]
    reader = _node(maddrs, [RunRecordValidator(run_id)])
    attacker = _node(maddrs)
    nodes = [honest, reader, attacker]
    try:
        directory = RunDirectory(honest, run_id, ttl=60)
        assert directory.publish_spec(sealed_spec)
        info = ServerInfo(run_id=run_id, peer_id=server.peer_id, time=get_dht_time(), stage=1,
                          state=ServerState.ONLINE, throughput=5.0, p2p_id=server.p2p_id)
        assert directory.announce_server(info, server)
        later = get_dht_time() + 600  # hivemind keeps the value that expires last
        # a plain value where a dictionary of servers lives, and junk where the spec lives
        attacker.store(stage_key(run_id, 1), b"junk", later)
        attacker.store(spec_key(run_id), b"junk", later)
        # a record under the server's sub-key signed by someone else, and one that names the stranger itself
        forged = {**info.model_dump(mode="python"), "throughput": 1e9}
        attacker.store(stage_key(run_id, 1), _forge(stranger, forged), later, subkey=server.peer_id)

        # the run's own nodes refused to keep any of it: the attacker's stores reached only its own storage
        for node in (honest, reader):
            found = node.get(stage_key(run_id, 1), latest=True)
            assert isinstance(found.value, dict) and list(found.value) == [server.peer_id]
        mine = RunDirectory(reader, run_id)
        assert [(s.peer_id, s.throughput) for s in mine.servers(1)] == [(server.peer_id, 5.0)]
        spec, sealed = mine.fetch_spec(timeout=20)
        assert sealed == sealed_spec and spec.spec_hash() == TINY.spec_hash()
        # a sealed record of the right kind, signed by its sub-key's owner, is still taken from anyone
        other = Identity.generate()
        legit = seal(info.model_copy(update={"peer_id": other.peer_id, "p2p_id": other.p2p_id, "throughput": 7.0,
                                             "time": get_dht_time(), "ttl_s": 60.0}), other)
        assert attacker.store(stage_key(run_id, 1), legit, get_dht_time() + 60, subkey=other.peer_id)
        assert sorted(s.throughput for s in mine.servers(1)) == [5.0, 7.0]
    finally:
        for node in nodes:
            node.shutdown()


def test_the_validator_leaves_other_keys_alone_and_refuses_plain_values_under_the_runs():
    from hivemind.dht.protocol import DHTProtocol
    from hivemind.dht.routing import DHTID
    from hivemind.dht.validation import DHTRecord
    from hivemind.utils.serializer import MSGPackSerializer as S

    run_id, _ = RunDirectory.seal_spec(TINY, Identity.generate())
    validator = RunRecordValidator(run_id)

    def record(key: str, value, subkey=None):
        sub = DHTProtocol.IS_REGULAR_VALUE if subkey is None else S.dumps(subkey)
        return DHTRecord(DHTID.generate(source=key).to_bytes(), sub, S.dumps(value), get_dht_time() + 10)

    assert validator.validate(record("some-run_progress", b"anything"))  # hivemind's own keys pass
    assert not validator.validate(record(stage_key(run_id, 3), b"junk"))
    assert not validator.validate(record(stage_key(run_id, 3), b"\xc1\xc1", subkey="peer"))
    assert not validator.validate(record(spec_key(run_id), b"junk"))
    server = Identity.generate()
    info = ServerInfo(run_id=run_id, peer_id=server.peer_id, time=get_dht_time(), stage=3, state=ServerState.ONLINE,
                      throughput=5.0, p2p_id=server.p2p_id, ttl_s=10.0)
    assert validator.validate(record(stage_key(run_id, 3), seal(info, server), subkey=server.peer_id))
    replay = seal(info.model_copy(update={"time": get_dht_time() - 60}), server)  # stored to expire 70 s after it
    assert not validator.validate(record(stage_key(run_id, 3), replay, subkey=server.peer_id))
    # a server's history: its own sealed ServerHistory only (not its ServerInfo, not junk, not another's)
    curve = ServerHistory(run_id=run_id, peer_id=server.peer_id, time=get_dht_time(), stage=3, ttl_s=10.0,
                          history=[(1, get_dht_time(), 4.0)])
    assert validator.validate(record(history_key(run_id, 3), seal(curve, server), subkey=server.peer_id))
    assert not validator.validate(record(history_key(run_id, 3), seal(info, server), subkey=server.peer_id))
    assert not validator.validate(record(history_key(run_id, 3), b"junk"))
    stranger = Identity.generate().peer_id
    assert not validator.validate(record(history_key(run_id, 3), seal(curve, server), subkey=stranger))


def test_a_replayed_record_kept_alive_longer_hides_no_newer_one():
    """hivemind keeps, per sub-key, the value that expires last: an attacker who stores a peer's own old
    announcement (or an old rollback order) again with a later expiration must not freeze what readers see."""
    coordinator, server, issuer = Identity.generate(), Identity.generate(), Identity.generate()
    run_id, _ = RunDirectory.seal_spec(TINY, coordinator)
    honest = _node(validators=[RunRecordValidator(run_id)])
    maddrs = [str(m) for m in honest.get_visible_maddrs()]
    reader, attacker = _node(maddrs, [RunRecordValidator(run_id)]), _node(maddrs)
    try:
        directory, mine = RunDirectory(honest, run_id, ttl=30), RunDirectory(reader, run_id, ttl=30)
        online = ServerInfo(run_id=run_id, peer_id=server.peer_id, time=get_dht_time(), stage=0,
                            state=ServerState.ONLINE, throughput=5.0, p2p_id=server.p2p_id)
        assert directory.announce_server(online, server)
        old = honest.get(stage_key(run_id, 0), latest=True).value[server.peer_id].value
        attacker.store(stage_key(run_id, 0), old, get_dht_time() + 3600, subkey=server.peer_id)  # honest nodes refuse
        draining = online.model_copy(update={"time": get_dht_time(), "state": ServerState.DRAINING})
        directory.announce_server(draining, server)  # False if the attacker's node keeps the replay; others take it
        assert [s.state for s in mine.servers(0)] == [ServerState.DRAINING], "the newer announcement is what counts"
        for node in (honest, reader):  # the run's nodes refused the replay outright
            kept = node.get(stage_key(run_id, 0), latest=True).value[server.peer_id]
            assert kept.expiration_time < get_dht_time() + 60

        first = RollbackOrder(run_id=run_id, peer_id=issuer.peer_id, time=get_dht_time(), epoch=4, detected_epoch=5,
                              lr_scale=0.5, generation=1)
        assert attacker.store(rollback_key(run_id), seal(first, issuer), get_dht_time() + 3600,
                              subkey=first.dht_subkey())
        second = first.model_copy(update={"time": get_dht_time(), "generation": 2, "lr_scale": 0.25})
        assert directory.announce(rollback_key(run_id), second, issuer)
        assert [o.generation for o, _ in mine.rollback_orders()] == [2, 1], "each generation has its own sub-key"
    finally:
        for node in (honest, reader, attacker):
            node.shutdown()


def test_a_stage_spread_over_stripes_is_read_whole_and_a_record_in_another_stripe_is_refused():
    """``[records] stage_stripe_bits = 2``: each server's record lives under the key of its peer id's stripe (4 keys
    for the stage, each answered by its own nodes), a reader that verified the spec reads all four, and a server's
    own record stored under another stripe's key is refused by the run's nodes."""
    coordinator = Identity.generate()
    spec = TINY.updated(records={"stage_stripe_bits": 2})
    run_id, sealed_spec = RunDirectory.seal_spec(spec, coordinator)
    honest = _node(validators=[RunRecordValidator(run_id)])
    reader = _node([str(m) for m in honest.get_visible_maddrs()], [RunRecordValidator(run_id)])
    try:
        directory = RunDirectory(honest, run_id, ttl=60)
        assert directory.publish_spec(sealed_spec)
        directory.verify_spec(sealed_spec)
        assert directory.stage_stripe_bits == 2
        servers = [Identity.generate() for _ in range(12)]
        for i, server in enumerate(servers):
            info = ServerInfo(run_id=run_id, peer_id=server.peer_id, time=get_dht_time(), stage=1,
                              state=ServerState.ONLINE, throughput=float(i + 1), p2p_id=server.p2p_id)
            assert directory.announce_server(info, server)
        by_key = {}
        for key in stage_keys(run_id, 1, 2):
            found = reader.get(key, latest=True)
            by_key[key] = sorted(found.value) if found is not None else []
        assert reader.get(stage_key(run_id, 1), latest=True) is None  # nothing under the stage's one key
        assert sorted(p for peers in by_key.values() for p in peers) == sorted(s.peer_id for s in servers)
        for key, peers in by_key.items():
            assert all(stage_key(run_id, 1, stage_stripe(p, 2)) == key for p in peers), (key, peers)

        mine = RunDirectory(reader, run_id)
        mine.fetch_spec(timeout=20)  # the reader learns the stripes from the spec
        assert sorted(s.throughput for s in mine.servers(1)) == [float(i + 1) for i in range(12)]
        # a partial read (a trainer's, stripes_to_read): only the records of the stripes it names
        for i, key in enumerate(stage_keys(run_id, 1, 2)):
            assert sorted(s.peer_id for s in mine.servers(1, [i])) == by_key[key], key
        # a valid record of the server's own, under another stripe's key: refused (a reader of one stripe would miss it)
        server = servers[0]
        wrong = next(b for b in ("00", "01", "10", "11") if b != stage_stripe(server.peer_id, 2))
        info = ServerInfo(run_id=run_id, peer_id=server.peer_id, time=get_dht_time(), stage=1, ttl_s=60.0,
                          state=ServerState.ONLINE, throughput=99.0, p2p_id=server.p2p_id)
        assert not honest.store(stage_key(run_id, 1, wrong), seal(info, server), get_dht_time() + 60,
                                subkey=server.peer_id)
        assert 99.0 not in [s.throughput for s in mine.servers(1)]
    finally:
        for node in (honest, reader):
            node.shutdown()
