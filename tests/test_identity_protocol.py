import json

import msgpack
import pytest
from hivemind.utils import get_dht_time

from swarm.config import PROTOCOL_VERSION
from swarm.identity import Identity, SignatureError, derive_run_id, peer_id_of, verify
from swarm.protocol import (
    MAX_RECORD_BYTES,
    CheckpointManifest,
    ForwardRequest,
    ProtocolError,
    ServerHistory,
    ServerInfo,
    ServerState,
    TrainerInfo,
    open_record,
    pack_message,
    seal,
    unpack_message,
)
from tests.conftest import endorsed


def _info(ident: Identity, run_id="r-aaaaaaaaaaaaaaaa", **kw) -> ServerInfo:
    fields = dict(run_id=run_id, peer_id=ident.peer_id, time=1.0, stage=0, state=ServerState.ONLINE,
                  throughput=3.5, p2p_id=ident.p2p_id)
    fields.update(kw)
    return ServerInfo(**fields)


def test_identity_persists(tmp_path):
    a = Identity.load_or_create(tmp_path / "k.pem")
    b = Identity.load_or_create(tmp_path / "k.pem")
    assert a.peer_id == b.peer_id == peer_id_of(a.public_key)
    assert (tmp_path / "k.pem").stat().st_mode & 0o777 == 0o600
    (tmp_path / "junk.pem").write_text("not a key")
    with pytest.raises(ValueError, match="move it away"):
        Identity.load_or_create(tmp_path / "junk.pem")


def test_sign_verify_and_tamper():
    ident = Identity.generate()
    sig = ident.sign(b"hello")
    verify(ident.public_key, sig, b"hello")
    with pytest.raises(SignatureError):
        verify(ident.public_key, sig, b"hellO")
    with pytest.raises(SignatureError):
        verify(Identity.generate().public_key, sig, b"hello")


def test_run_id_binds_key_and_spec():
    a, b = Identity.generate(), Identity.generate()
    h1, h2 = "00" * 32, "11" * 32
    rid = derive_run_id("demo", a.public_key, h1)
    assert rid.startswith("demo-") and len(rid) == len("demo-") + 16
    assert rid == derive_run_id("demo", a.public_key, h1)
    assert rid != derive_run_id("demo", b.public_key, h1)
    assert rid != derive_run_id("demo", a.public_key, h2)


def test_record_round_trip_and_unknown_fields_tolerated():
    ident = Identity.generate()
    rec, key = open_record(seal(_info(ident), ident), ServerInfo, run_id="r-aaaaaaaaaaaaaaaa", subkey=ident.peer_id)
    assert rec.throughput == 3.5 and key == ident.public_key
    # a newer peer adds a field: older peers ignore it
    payload = msgpack.packb({**_info(ident).model_dump(mode="json"), "new_field": [1, 2]}, use_bin_type=True)
    blob = msgpack.packb({"p": payload, "k": ident.public_key, "s": ident.sign(payload)}, use_bin_type=True)
    rec, _ = open_record(blob, ServerInfo, run_id="r-aaaaaaaaaaaaaaaa")
    assert rec.stage == 0


def test_a_record_read_again_is_not_verified_again_but_its_placement_and_time_are(monkeypatch):
    import swarm.protocol.schema as schema

    ident, other = Identity.generate(), Identity.generate()
    run = "r-aaaaaaaaaaaaaaaa"
    checked = []
    monkeypatch.setattr(schema, "verify", lambda *a: checked.append(a) or verify(*a))
    blob = seal(_info(ident, time=get_dht_time()), ident)
    for _ in range(3):
        rec, key = open_record(blob, ServerInfo, run_id=run, subkey=ident.peer_id)
    assert len(checked) == 1 and key == ident.public_key and rec.throughput == 3.5
    with pytest.raises(ProtocolError, match="not its own"):  # where it was found is checked at every read
        open_record(blob, ServerInfo, run_id=run, subkey=other.peer_id)
    with pytest.raises(ProtocolError, match="expected key"):
        open_record(blob, ServerInfo, run_id=run, signer=other.public_key)
    with pytest.raises(ProtocolError, match="not 'r-bbbbbbbbbbbbbbbb'"):  # remembered per run and kind
        open_record(blob, ServerInfo, run_id="r-bbbbbbbbbbbbbbbb")
    monkeypatch.setattr(schema, "get_dht_time", lambda: -1000.0)  # the reader's clock: checked at every read
    with pytest.raises(ProtocolError, match="in the future"):
        open_record(blob, ServerInfo, run_id=run, subkey=ident.peer_id)


def _forge(ident, fields):
    payload = msgpack.packb(fields, use_bin_type=True)
    return msgpack.packb({"p": payload, "k": ident.public_key, "s": ident.sign(payload)}, use_bin_type=True)


def test_record_rejections():
    ident, other = Identity.generate(), Identity.generate()
    good = seal(_info(ident), ident)
    run = "r-aaaaaaaaaaaaaaaa"
    env = msgpack.unpackb(good)
    tampered = msgpack.packb({**env, "p": env["p"].replace(b"online", b"joinin")}, use_bin_type=True)
    cases = {
        "bad signature": tampered,
        "malformed record envelope": b"\x93garbage",
        "exceeds": b"x" * (MAX_RECORD_BYTES + 1),
        "speaks protocol": _forge(ident, {**_info(ident).model_dump(mode="json"), "v": PROTOCOL_VERSION + 1}),
        "invalid ServerInfo": _forge(ident, {**_info(ident).model_dump(mode="json"), "throughput": -1}),
        "does not own": _forge(ident, _info(ident, peer_id=other.peer_id).model_dump(mode="json")),
    }
    for expected, blob in cases.items():
        with pytest.raises(ProtocolError, match=expected):
            open_record(blob, ServerInfo, run_id=run)
    with pytest.raises(ProtocolError, match="not 'r-bbbbbbbbbbbbbbbb'"):
        open_record(good, ServerInfo, run_id="r-bbbbbbbbbbbbbbbb")
    with pytest.raises(ProtocolError, match="not its own"):
        open_record(good, ServerInfo, run_id=run, subkey=other.peer_id)
    with pytest.raises(ProtocolError):
        open_record(good, TrainerInfo, run_id=run)
    with pytest.raises(ValueError, match="sealed by the peer it names"):
        seal(_info(ident, peer_id=other.peer_id), ident)


def test_records_with_absurd_numbers_are_refused_or_read_as_unknown():
    """Anyone may sign a record with any number in it: infinities and NaN are refused (a loss reads as unknown),
    a time far ahead of the reader's clock is refused, and so is a manifest that needs more fragments than it
    made or lists one twice."""
    ident, run, now = Identity.generate(), "r-aaaaaaaaaaaaaaaa", get_dht_time()
    info = _info(ident, time=now).model_dump(mode="json")
    for field, value, expected in [("throughput", float("inf"), "throughput"), ("round_s", float("nan"), "round_s"),
                                   ("lr_scale", float("inf"), "lr_scale"), ("lr_scale", 1e-300, "lr_scale"),
                                   ("lr_scale", 2.0, "lr_scale"), ("time", now + 1e6, "in the future")]:
        with pytest.raises(ProtocolError, match=expected):
            open_record(_forge(ident, {**info, field: value}), ServerInfo, run_id=run)
    rec, _ = open_record(_forge(ident, {**info, "time": now + 5.0}), ServerInfo, run_id=run)  # a little skew is fine
    assert rec.time == now + 5.0
    rec, _ = open_record(_forge(ident, {**info, "loss": float("nan")}), ServerInfo, run_id=run)
    assert rec.loss is None
    json.dumps(rec.model_dump(mode="json"), allow_nan=False)  # what `status --json` prints stays JSON
    curve = ServerHistory(run_id=run, peer_id=ident.peer_id, time=now, stage=0).model_dump(mode="json")
    rec, _ = open_record(_forge(ident, {**curve, "history": [[3, now, float("inf")]]}), ServerHistory, run_id=run)
    assert rec.history == [(3, now, None)]
    json.dumps(rec.model_dump(mode="json"), allow_nan=False)
    with pytest.raises(ProtocolError, match="history"):  # a point's time or epoch is no unknown loss
        open_record(_forge(ident, {**curve, "history": [[3, float("nan"), 1.0]]}), ServerHistory, run_id=run)
    honest = seal(_info(ident, time=now, loss=float("nan")), ident)  # a diverged server still announces itself
    assert open_record(honest, ServerInfo, run_id=run)[0].loss is None

    manifest = dict(kind="manifest", run_id=run, peer_id=ident.peer_id, time=now, stage=0, epoch=3,
                    shard_sha256="a" * 64, size=10, k=3, n=2, v=PROTOCOL_VERSION,
                    **endorsed(run, ident, stage=0, epoch=3))
    frag = [{"index": 0, "sha256": "b" * 64}, {"index": 0, "sha256": "c" * 64}]
    cases = [(manifest, "no restore is possible"), ({**manifest, "k": 1, "fragments": frag}, "repeated"),
             ({**manifest, "k": 1, "fragments": [{**frag[0], "index": 2}]}, "not below n=2")]
    for fields, expected in cases:
        with pytest.raises(ProtocolError, match=expected):
            open_record(_forge(ident, fields), CheckpointManifest, run_id=run)
    good = {**manifest, "k": 1, "fragments": [frag[0], {**frag[1], "index": 1}]}
    assert open_record(_forge(ident, good), CheckpointManifest, run_id=run)[0].n == 2


def test_wire_messages():
    msg = ForwardRequest(run_id="r", stage=1, mb_id="abc")
    assert unpack_message(pack_message(msg), ForwardRequest) == msg
    for data, expected in [(b"", "empty message"), (b"\xc1", "malformed"), (b"x" * 20000, "exceeds"),
                           (msgpack.packb({"v": 99}), "speaks protocol"),
                           (msgpack.packb({"v": PROTOCOL_VERSION, "stage": -1}), "invalid ForwardRequest")]:
        with pytest.raises(ProtocolError, match=expected):
            unpack_message(data, ForwardRequest)


def test_spec_verification(tiny_spec):
    import json

    from swarm.config import SpecError
    from swarm.net.directory import RunDirectory
    from swarm.protocol import SpecRecord

    coordinator = Identity.generate()
    run_id, sealed = RunDirectory.seal_spec(tiny_spec, coordinator)
    directory = RunDirectory(dht=None, run_id=run_id)
    assert directory.verify_spec(sealed) == tiny_spec

    def reseal(signer: Identity, **changes) -> bytes:
        rec, _ = open_record(sealed, SpecRecord, run_id=run_id)
        return seal(rec.model_copy(update=changes), signer)

    edited = json.loads(tiny_spec.canonical_json())
    edited["optim"]["lr"] = 1.0
    cases = {
        "does not match the spec's contents": reseal(coordinator, spec_json=json.dumps(edited)),
        "does not derive this run id": reseal(Identity.generate()),  # a valid signature by another key
    }
    for expected, blob in cases.items():
        with pytest.raises(ProtocolError, match=expected):
            directory.verify_spec(blob)
    # the hash matches the edited spec, but then the run id does not
    edited_spec = tiny_spec.from_dict(edited)
    with pytest.raises(ProtocolError, match="does not derive this run id"):
        directory.verify_spec(reseal(coordinator, spec_json=json.dumps(edited), spec_hash=edited_spec.spec_hash()))
    broken = reseal(coordinator, spec_json=json.dumps({**edited, "name": "NOT VALID"}))
    with pytest.raises(SpecError, match="name"):
        directory.verify_spec(broken)
