"""Property-based fuzzing (hypothesis) of every decoder, record validator and wire reader a stranger's bytes
reach: whatever comes in, the only outcome is the documented refusal (a :class:`~swarm.protocol.Refusal` or
the module's own error) or a value that satisfies the schema's invariants; nothing else escapes, nothing
hangs. Runs derandomized in CI (``tests/conftest.py`` registers the profiles); set
``HYPOTHESIS_PROFILE=explore`` for a longer random search. The live handlers are fuzzed in
``tests/test_handler_fuzz.py``."""

from __future__ import annotations

import asyncio
import hashlib
import json
import math

import msgpack
import pytest
import torch
from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord
from hivemind.proto import runtime_pb2
from hivemind.utils import get_dht_time
from hivemind.utils.serializer import MSGPackSerializer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save as st_save

from swarm import protocol
from swarm.averaging.audit import open_receipt
from swarm.checkpoint.erasure import Fragment, FragmentError, join_fragments, split_into_fragments
from swarm.checkpoint.shard import FORMAT as SHARD_FORMAT
from swarm.checkpoint.shard import ShardError, decode_shard
from swarm.net.codecs import CODECS, pack_tensors, unpack_tensors
from swarm.net.lowrank import CODECS as LOWRANK_CODECS
from swarm.config import PROTOCOL_VERSION, SpecError
from swarm.net.dht_validation import RunRecordValidator, run_keys
from swarm.identity import Identity, peer_id_of
from swarm.protocol import ProtocolError, Record, open_record, open_spec, unpack_message
from swarm.net.transport import WIRE_DTYPES, gather

pytestmark = pytest.mark.timeout(300)

RUN = "fuzz-aaaaaaaaaaaaaaaa"
SIGNER = Identity.generate()
RECORD_KINDS = [cls for cls in vars(protocol).values()
                if isinstance(cls, type) and issubclass(cls, Record) and cls not in (Record, protocol.AnnouncedRecord)]
MESSAGE_KINDS = [cls for cls in vars(protocol).values()
                 if isinstance(cls, type) and issubclass(cls, protocol.Schema) and not issubclass(cls, Record)]

scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**63, 2**64 - 1), st.floats(allow_nan=True),
                    st.text(max_size=40), st.binary(max_size=40))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                       st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                      max_leaves=12)


def _fields(cls) -> st.SearchStrategy[dict]:
    """Dicts shaped like ``cls``: its own field names (kept right some of the time) with any values."""
    names = sorted(cls.model_fields)
    fixed = {"v": st.sampled_from([PROTOCOL_VERSION, PROTOCOL_VERSION, 0, "4"]),
             "kind": st.sampled_from([cls.model_fields["kind"].default if "kind" in cls.model_fields else "x", "x"]),
             "run_id": st.sampled_from([RUN, RUN, "other"]),
             "peer_id": st.sampled_from([SIGNER.peer_id, SIGNER.peer_id, "someone"]),
             "p2p_id": st.sampled_from([SIGNER.p2p_id, "12D3KooWjunk", ""]),
             "time": st.one_of(st.just(get_dht_time()), st.floats(allow_nan=True))}
    return st.fixed_dictionaries({}, optional={n: fixed.get(n, values) for n in names + ["v"]})


def _envelope(payload: bytes, identity: Identity = SIGNER) -> bytes:
    return msgpack.packb({"p": payload, "k": identity.public_key, "s": identity.sign(payload)}, use_bin_type=True)


def _check_accepted(record: Record, key: bytes) -> None:
    """What an accepted record guarantees."""
    assert record.run_id == RUN and record.v == PROTOCOL_VERSION
    if not isinstance(record, protocol.SpecRecord):
        assert record.peer_id == peer_id_of(key)
    for name, value in record.model_dump().items():
        if isinstance(value, float):
            assert math.isfinite(value), f"{type(record).__name__}.{name} = {value}"


@settings(suppress_health_check=[HealthCheck.too_slow])
@given(blob=st.one_of(st.binary(max_size=300), values.map(lambda v: msgpack.packb(v, use_bin_type=True))),
       kind=st.sampled_from(RECORD_KINDS))
def test_open_record_refuses_junk_with_a_protocol_error(blob, kind):
    with pytest.raises(ProtocolError):
        open_record(blob, kind, run_id=RUN)


@settings(suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), kind=st.sampled_from(RECORD_KINDS), stored_for=st.floats(-10, 1e5))
def test_signed_records_of_any_shape_are_refused_or_keep_the_schemas_promises(data, kind, stored_for):
    fields = data.draw(_fields(kind))
    try:
        payload = msgpack.packb(fields, use_bin_type=True)
    except (TypeError, ValueError, OverflowError):  # msgpack cannot carry it: nothing to send
        return
    try:
        record, key = open_record(_envelope(payload), kind, run_id=RUN, subkey=data.draw(
            st.sampled_from([None, SIGNER.peer_id, "x"])), expiration=get_dht_time() + stored_for)
    except ProtocolError:
        return
    _check_accepted(record, key)


@settings(suppress_health_check=[HealthCheck.too_slow])
@given(blob=st.one_of(st.binary(max_size=300), values.map(lambda v: msgpack.packb(v, use_bin_type=True))),
       kind=st.sampled_from(MESSAGE_KINDS))
def test_wire_metadata_of_any_shape_is_refused_with_a_protocol_error_or_parsed(blob, kind):
    try:
        msg = unpack_message(blob, kind)
    except ProtocolError:
        return
    assert isinstance(msg, kind) and msg.v == PROTOCOL_VERSION


@settings(suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), kind=st.sampled_from(MESSAGE_KINDS))
def test_wire_messages_shaped_like_the_schema_are_refused_or_parsed(data, kind):
    try:
        blob = msgpack.packb(data.draw(_fields(kind)), use_bin_type=True)
    except (TypeError, ValueError, OverflowError):
        return
    try:
        unpack_message(blob, kind)
    except ProtocolError:
        pass


@settings(suppress_health_check=[HealthCheck.too_slow])
@given(spec_json=st.one_of(st.text(max_size=200), values.map(lambda v: json.dumps(v, default=repr))),
       spec_hash=st.text(max_size=64))
def test_a_signed_spec_of_any_content_is_refused_with_a_named_cause(spec_json, spec_hash):
    fields = {"v": PROTOCOL_VERSION, "kind": "spec", "run_id": RUN, "peer_id": SIGNER.peer_id,
              "time": get_dht_time(), "spec_json": spec_json, "spec_hash": spec_hash}
    with pytest.raises((ProtocolError, SpecError)):
        open_spec(_envelope(msgpack.packb(fields, use_bin_type=True)), RUN)


@settings(suppress_health_check=[HealthCheck.too_slow])
@given(key=st.sampled_from(sorted(run_keys(RUN, max_stages=2)) + ["other/key"]),
       subkey=st.one_of(st.none(), st.sampled_from([DHTProtocol.IS_DICTIONARY]), values),
       value=values, expires_in=st.floats(-100, 1e6, allow_nan=False))
def test_the_dht_validator_answers_true_or_false_for_any_value(key, subkey, value, expires_in):
    validator = RunRecordValidator(RUN, max_stages=2)
    try:
        sub = DHTProtocol.IS_REGULAR_VALUE if subkey is None else (
            subkey if isinstance(subkey, bytes) else MSGPackSerializer.dumps(subkey))
        packed = MSGPackSerializer.dumps(value)
    except (TypeError, ValueError, OverflowError):
        return
    record = DHTRecord(DHTID.generate(source=key).to_bytes(), sub, packed, get_dht_time() + expires_in)
    assert validator.validate(record) in (True, False)
    if key != "other/key":
        assert not validator.validate(record) or isinstance(value, bytes), "only sealed bytes pass a run key"


def _stream(messages):
    async def run():
        for m in messages:
            yield m
    return run()


tensor_parts = st.builds(
    lambda dtype, size, buffer, compression: runtime_pb2.Tensor(dtype=dtype, size=size, buffer=buffer,
                                                                compression=compression, requires_grad=False),
    dtype=st.one_of(st.sampled_from(sorted(WIRE_DTYPES)), st.sampled_from(["", "U16777216", "object", "<f4"]),
                    st.text(max_size=12)),
    size=st.lists(st.integers(0, 2**32 - 1), max_size=10),  # the header's sizes are uint32
    buffer=st.binary(max_size=256),
    compression=st.sampled_from([runtime_pb2.CompressionType.NONE, runtime_pb2.CompressionType.NONE,
                                 runtime_pb2.CompressionType.FLOAT16, runtime_pb2.CompressionType.QUANTILE_8BIT]))


@settings(suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(messages=st.lists(st.builds(lambda meta, parts: runtime_pb2.ExpertRequest(metadata=meta, tensors=parts),
                                   meta=st.binary(max_size=64), parts=st.lists(tensor_parts, max_size=3)),
                         max_size=4),
       max_tensors=st.one_of(st.none(), st.integers(0, 3)))
def test_the_stream_reader_refuses_or_returns_tensors_within_its_limits(messages, max_tensors):
    limit = 4096
    try:
        metadata, tensors = asyncio.run(gather(_stream(messages), max_bytes=limit, max_tensors=max_tensors,
                                               deadline_s=10))
    except ProtocolError:
        return
    assert max_tensors is None or len(tensors) <= max_tensors
    assert sum(t.numel() * t.element_size() for t in tensors) <= 2 * limit  # bfloat16 arrives as 4-byte floats
    assert all(str(t.dtype).removeprefix("torch.") in WIRE_DTYPES for t in tensors)


@settings(suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(codec=st.sampled_from(sorted([*CODECS, *LOWRANK_CODECS])),
       tensors=st.lists(st.tuples(st.sampled_from([torch.float32, torch.float16, torch.int8, torch.int64,
                                                   torch.uint8, torch.bfloat16]),
                                  st.lists(st.integers(0, 5), max_size=3)), max_size=4))
def test_codec_unpacking_refuses_any_layout_it_cannot_read(codec, tensors):
    made = [torch.zeros(shape, dtype=dtype) for dtype, shape in tensors]
    try:
        out = unpack_tensors(made, codec)
    except ProtocolError:
        return
    assert all(t.dtype in (torch.float32, torch.int8, torch.int64, torch.uint8) for t in out)


@settings(suppress_health_check=[HealthCheck.too_slow], deadline=None, max_examples=200)
@given(codec=st.sampled_from(sorted(LOWRANK_CODECS)), which=st.integers(0, 7),
       how=st.sampled_from(["bytes", "dtype", "shorter", "longer", "nan", "huge"]),
       position=st.integers(0, 10 ** 6), value=st.integers(0, 255))
def test_a_mutated_lowrank_message_is_refused_or_decodes_to_finite_values_of_its_shape(codec, which, how, position,
                                                                                        value):
    """Every way one of a low-rank tensor's eight wire tensors can be wrong: refused with a ProtocolError, or (a
    changed code or value that is still well-formed) a finite float32 tensor of the shape."""
    wire = pack_tensors([torch.randn(3, 5, 12)], codec)
    t = wire[which]
    if how == "bytes":
        raw = t.view(torch.uint8).clone()
        raw[position % raw.numel()] = value
        t = raw.view(t.dtype)
    elif how == "dtype":
        t = t.to(torch.float64 if t.dtype != torch.float64 else torch.int64)
    elif how in ("shorter", "longer"):
        t = t[:-1] if how == "shorter" else torch.cat([t, t[:1]])
    elif t.is_floating_point():
        t = t.clone()
        t[position % t.numel()] = float("nan") if how == "nan" else 1e38 if t.dtype == torch.float32 else 6e4
    wire[which] = t
    try:
        (out,) = unpack_tensors(wire, codec)
    except ProtocolError:
        return
    assert out.dtype == torch.float32 and out.shape == (3, 5, 12) and bool(torch.isfinite(out).all())


def _safetensors(header: dict) -> bytes:
    """A well-formed safetensors file whose swarm header is ``header`` with the shard format's name."""
    return st_save({"w": torch.zeros(2)}, metadata={"swarm": json.dumps({"format": SHARD_FORMAT, **header},
                                                                       default=repr)})


shard_headers = st.fixed_dictionaries({}, optional={"run_id": st.sampled_from([RUN, "other"]) | values,
                                                    "stage": st.sampled_from([0, 1]) | values,
                                                    "epoch": st.integers(-1, 9) | values, "meta": values})


@settings(suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(blob=st.one_of(
    st.binary(max_size=200),
    st.builds(lambda header, tail: len(header).to_bytes(8, "little") + header + tail,
              header=values.map(lambda v: json.dumps({"__metadata__": {"swarm": json.dumps(v, default=repr)}}).encode()),
              tail=st.binary(max_size=16)),
    shard_headers.map(_safetensors)))
def test_a_shard_whose_hash_matches_is_refused_with_a_shard_error_or_keeps_its_promises(blob):
    try:
        shard = decode_shard(blob, hashlib.sha256(blob).hexdigest(), run_id=RUN, stage=0)
    except ShardError:
        return
    assert (shard.run_id, shard.stage) == (RUN, 0) and isinstance(shard.epoch, int) and isinstance(shard.meta, dict)


@settings(suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(data=st.binary(min_size=1, max_size=300), k=st.integers(1, 4), extra=st.integers(0, 3),
       tamper=st.lists(st.tuples(st.integers(0, 7), st.binary(max_size=80)), max_size=3),
       claimed=st.integers(-5, 400))
def test_fragments_that_do_not_add_up_are_refused_with_a_fragment_error(data, k, extra, tamper, claimed):
    n = k + extra
    fragments = split_into_fragments(data, k, n)
    for index, junk in tamper:  # a holder's junk under a (possibly valid) index, hashed to pass its own check
        fragments.append(Fragment(index, junk, hashlib.sha256(junk).hexdigest()))
    sha = hashlib.sha256(data).hexdigest()
    try:
        out = join_fragments(fragments, k, n, claimed, sha)
    except FragmentError:
        return
    assert out == data


@settings(suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(data=st.data())
def test_a_receipt_of_any_shape_is_refused_with_a_protocol_error_or_fully_checked(data):
    fields = data.draw(_fields(protocol.ReductionReceipt))
    if data.draw(st.booleans()):
        fields["commitments"] = [_envelope(msgpack.packb(data.draw(_fields(protocol.PartCommitment)),
                                                         use_bin_type=True, default=repr))]
    try:
        blob = _envelope(msgpack.packb(fields, use_bin_type=True))
    except (TypeError, ValueError, OverflowError):
        return
    try:
        opened = open_receipt(blob, RUN)
    except ProtocolError:
        return
    assert all(c.group == opened.receipt.group for c in opened.commitments)


progress_entries = st.dictionaries(
    st.sampled_from([b"own", b"a", b"b", b"c", b"d", b"e"]),
    st.tuples(st.integers(0, 10**9), st.integers(0, 10**12), st.floats(0, 1e15), st.booleans()), max_size=6)


@settings(suppress_health_check=[HealthCheck.too_slow], max_examples=200)
@given(entries=progress_entries, own_epoch=st.integers(0, 10**6), roster=st.one_of(
    st.none(), st.frozensets(st.sampled_from([b"a", b"b", b"c"]))))
def test_progress_from_any_entries_counts_the_roster_at_most_one_epoch_ahead_with_capped_samples(entries, own_epoch,
                                                                                                 roster):
    """(swarm.averaging.progress) Whatever entries strangers and stage-mates store, what counts comes from the
    roster or this server, lies at most one epoch past the lower median of the others' epochs (or this server's
    own epoch) and carries at most ``target`` samples."""
    from hivemind.utils import ValueWithExpiration

    from swarm.averaging.progress import trusted_progress

    wrapped = {k: ValueWithExpiration(dict(peer_id=b"x", epoch=e, samples_accumulated=n, samples_per_second=r,
                                           time=0.0, client_mode=c), 1e12) for k, (e, n, r, c) in entries.items()}
    kept = trusted_progress(wrapped, b"own", own_epoch, target=64, roster=roster)
    assert set(kept) <= set(entries) and (roster is None or set(kept) <= roster | {b"own"})
    counted = [k for k in entries if k != b"own" and (roster is None or k in roster)]
    others = sorted(entries[k][0] for k in counted if not entries[k][3])
    ceiling = max(own_epoch, others[(len(others) - 1) // 2] if others else own_epoch) + 1
    for k, item in kept.items():
        assert item.value["epoch"] <= ceiling and item.value["samples_accumulated"] <= 64
        assert item.value["samples_per_second"] <= protocol.MAX_SAMPLES_PER_S
    assert all(k in kept for k in counted if entries[k][0] <= ceiling)


@settings(suppress_health_check=[HealthCheck.too_slow], max_examples=200)
@given(entries=progress_entries, own_epoch=st.integers(0, 10**6),
       trusted=st.frozensets(st.sampled_from([b"a", b"b", b"c"]), min_size=1), follower=st.booleans())
def test_unverified_progress_never_pulls_nor_counts_past_its_share(entries, own_epoch, trusted, follower):
    """(swarm.averaging.progress, Standing) With any entries, a server that verified some stage-mates (or follows
    those its stage-mates vouch for) counts no other entry past its own epoch, the others at its epoch at most
    UNVERIFIED_SHARE of the target together and with no throughput, whatever client_mode they claim."""
    from hivemind.utils import ValueWithExpiration

    from swarm.averaging.progress import UNVERIFIED_SHARE, ProgressTrust, trusted_progress

    wrapped = {k: ValueWithExpiration(dict(peer_id=b"x", epoch=e, samples_accumulated=n, samples_per_second=r,
                                           time=0.0, client_mode=c), 1e12) for k, (e, n, r, c) in entries.items()}
    trust = ProgressTrust(vouched=trusted, follower=True) if follower else ProgressTrust(trusted)
    kept = trusted_progress(wrapped, b"own", own_epoch, 64, None, trust)
    others = [v.value for k, v in kept.items() if k != b"own" and k not in trusted]
    assert all(u["epoch"] <= own_epoch and not u["client_mode"] and u["samples_per_second"] == 0 for u in others)
    assert sum(u["samples_accumulated"] for u in others if u["epoch"] == own_epoch) <= UNVERIFIED_SHARE * 64
