"""An outsider's DHT stores hide nothing: junk or forged values under a run's keys are refused by the run's nodes
and dropped from lookups (three real hivemind DHT nodes on loopback; the attacker's runs no validator)."""

from __future__ import annotations

import hivemind
import msgpack
import pytest
from hivemind.utils import get_dht_time

from swarm.dht_validation import RunRecordValidator
from swarm.directory import RunDirectory
from swarm.identity import Identity
from swarm.protocol import ServerInfo, ServerState, seal, spec_key, stage_key
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
                          state=ServerState.ONLINE, throughput=5.0, p2p_id="12D3KooWabc")
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
        legit = seal(info.model_copy(update={"peer_id": other.peer_id, "throughput": 7.0}), other)
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
