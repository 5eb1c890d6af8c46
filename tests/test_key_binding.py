"""One key per peer: a peer's libp2p id is its Ed25519 signing key, so any record naming a libp2p id is checkable
by anyone, and two processes cannot run as one peer."""

import subprocess
import tempfile
import sys
from pathlib import Path

import pytest
from hivemind.utils import get_dht_time

from swarm.net.dht import spawn_dht
from swarm.identity import Identity, SignatureError, p2p_id_of, public_key_of_p2p_id
from swarm.protocol import ProtocolError, ServerInfo, ServerState, StorageInfo, open_record, seal
from tests.conftest import LOOPBACK_DHT

RUN = "tiny-aaaaaaaaaaaaaaaa"


def test_the_libp2p_id_inlines_the_key():
    ident = Identity.generate()
    assert ident.p2p_id.startswith("12D3KooW") and p2p_id_of(ident.public_key) == ident.p2p_id
    assert public_key_of_p2p_id(ident.p2p_id) == ident.public_key
    for bad in ("QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N", "not base58 0OIl", "", "12D3KooW"):
        with pytest.raises(SignatureError):
            public_key_of_p2p_id(bad)


def test_a_record_naming_someone_elses_libp2p_id_is_refused():
    me, victim = Identity.generate(), Identity.generate()

    def server(p2p_id):
        return seal(ServerInfo(run_id=RUN, peer_id=me.peer_id, time=get_dht_time(), stage=0,
                               state=ServerState.ONLINE, throughput=1.0, p2p_id=p2p_id), me)

    assert open_record(server(me.p2p_id), ServerInfo, run_id=RUN)[0].p2p_id == me.p2p_id
    for p2p_id in (victim.p2p_id, "12D3KooWabc"):
        with pytest.raises(ProtocolError, match="libp2p id its signer does not own"):
            open_record(server(p2p_id), ServerInfo, run_id=RUN)
    storage = seal(StorageInfo(run_id=RUN, peer_id=me.peer_id, time=get_dht_time(), p2p_id=victim.p2p_id,
                               free_bytes=0), me)
    with pytest.raises(ProtocolError, match="libp2p id its signer does not own"):
        open_record(storage, StorageInfo, run_id=RUN)


@pytest.mark.timeout(60)
def test_the_daemon_speaks_as_the_key_and_a_second_process_cannot_claim_it(tmp_path):
    ident = Identity.load_or_create(tmp_path / "identity.key")
    dht = spawn_dht(ident, **LOOPBACK_DHT)
    try:
        assert str(dht.peer_id) == ident.p2p_id
        assert not list(Path(tempfile.gettempdir()).glob("swarm-key-*")), "the key file for p2pd was left behind"
        other = subprocess.run(
            [sys.executable, "-c", "import sys; from swarm.identity import Identity, claim_identity; "
             "claim_identity(Identity.load(sys.argv[1]))", str(tmp_path / "identity.key")],
            capture_output=True, text=True, timeout=60)
        assert other.returncode != 0 and "two peers cannot share a key" in other.stderr
        assert "SWARM_IDENTITY_FILE" in other.stderr
    finally:
        dht.shutdown()
    # another key is free
    fresh = subprocess.run([sys.executable, "-c", "from swarm.identity import Identity, claim_identity; "
                            "claim_identity(Identity.generate())"], capture_output=True, text=True, timeout=60)
    assert fresh.returncode == 0, fresh.stderr
