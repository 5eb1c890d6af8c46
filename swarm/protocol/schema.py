"""The base of every schema of the protocol: records sealed and opened, wire messages parsed, and the limits on
both (the namespace is :mod:`swarm.protocol`, whose docstring explains sealing, versioning and shadowing)."""

from __future__ import annotations

import hashlib
import math
import os
import threading
from collections import OrderedDict
from typing import Annotated, ClassVar, Optional, Type, TypeVar

import msgpack
from hivemind.utils import get_dht_time
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError

from swarm.config import MAX_RECORD_TTL_S, PROTOCOL_VERSION
from swarm.identity import Identity, SignatureError, p2p_id_of, peer_id_of, verify

MAX_RECORD_BYTES = 64 * 1024
"""Largest sealed record accepted from the DHT (bytes)."""
MAX_ENDORSEMENTS = 8
"""Endorsements a manifest carries at most."""
MAX_METADATA_BYTES = 16 * 1024
"""Largest wire-message metadata accepted (bytes)."""
EXPIRY_SLACK_S = 5.0
"""Seconds a stored announcement may expire after ``time + ttl_s`` (its store is computed a moment later)."""
MAX_EPOCH = 10**8
"""Largest epoch a record may name (a stage stepping every second for three years)."""
MAX_COUNT = 2**53
"""Largest count (samples, tokens, bytes, rounds) a record may carry: exact in a float64."""
MIN_LR_SCALE = 1e-12
"""The smallest learning-rate scale a record may carry (``lr_factor ** generation`` after 39 rollbacks at the default
factor 0.5; a run past that is not training): one key's 1e-300 in a record froze training."""
MAX_SAMPLES_PER_S = 1e6
"""Largest throughput a record may announce (samples/s; a fast GPU on a small stage does thousands)."""
MAX_FLOPS = 1e18
"""Largest FLOP count or FLOP/s a record may announce (an exaFLOP: far above any one device)."""
MAX_ROUND_S = 86_400.0
"""Largest duration a record may report (seconds)."""
MAX_CLOCK_SKEW_S = 60.0
"""Seconds a record's ``time`` may lie ahead of the reader's clock (peers keep their clocks with NTP); a record
dated later is refused, so a forged one cannot stay "fresh" after its signer is gone."""


class Refusal(Exception):
    """Base of the errors that refuse a peer's request for a cause it can fix (bad input, wrong run, busy): an
    expected event, logged as one line without a traceback (:class:`swarm.logs.RefusalFilter`)."""


class ProtocolError(ValueError, Refusal):
    """A record or message that is malformed, oversized, forged, or from another run or protocol version."""




def _finite_or_none(value):
    """A loss that is NaN or infinite (a diverged run, or a forged record) reads as unknown (None)."""
    return None if isinstance(value, float) and not math.isfinite(value) else value


FiniteOrNone = Annotated[Optional[float], BeforeValidator(_finite_or_none)]
"""An optional float field (a loss) where NaN and infinities read as None: published and shown as unknown."""
Epoch = Annotated[int, Field(ge=0, le=MAX_EPOCH)]
"""An epoch number (:data:`MAX_EPOCH`)."""
Count = Annotated[int, Field(ge=0, le=MAX_COUNT)]
"""A count of samples, tokens, bytes or rounds (:data:`MAX_COUNT`)."""


class Schema(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)
    v: int = PROTOCOL_VERSION


class Record(Schema):
    """Base of DHT records: who published it, for which run, when (DHT time, seconds). Every float field of
    a record is finite (NaN and infinities are refused; losses read as None, :data:`FiniteOrNone`)."""

    model_config = ConfigDict(allow_inf_nan=False)
    kind: str
    run_id: str
    peer_id: str
    time: float = Field(ge=0)

    names_its_signer: ClassVar[bool] = True
    """The record's ``peer_id`` (and any ``p2p_id``) must be its signer's own, and it lives under its own sub-key
    (every kind but the spec, which the coordinator signs for the run)."""
    carries_ticket: ClassVar[bool] = True
    """Its envelope carries its signer's ticket (a ticketed run). Not the run key's own records (tickets, invites,
    delegations): a ticket sealed with its signer's ticket in the envelope nested the one before it at every renewal
    of the signer's own, growing by about 0.4 KB a renewal until it passed :data:`MAX_RECORD_BYTES`."""

    def dht_subkey(self) -> str:
        """The DHT sub-key this record lives under: its signer's peer id (versioned kinds add the version)."""
        return self.peer_id

    def check_contents(self, run_id: str) -> None:
        """Checks of what the record holds beyond its fields' ranges, run by :func:`open_record` once its envelope
        verified (a manifest's endorsements). :raises ProtocolError: the contents do not hold."""


class AnnouncedRecord(Record):
    """A record its signer re-announces, re-signed with a fresh ``time``, every ``ttl_s / 3`` seconds (module
    docstring, *Shadowing*): a value of it stored to expire later than ``time + ttl_s`` is refused."""

    ttl_s: float = Field(0.0, ge=0, le=MAX_RECORD_TTL_S,
                         description="Seconds the record lives (set by RunDirectory.announce from record_ttl_s).")




R = TypeVar("R", bound=Record)
S = TypeVar("S", bound=Schema)


def parse(data: bytes, cls: Type[S], what: str) -> S:
    """msgpack map -> ``cls``, checking the protocol version; raises :class:`ProtocolError`."""
    try:
        fields = msgpack.unpackb(data, raw=False, strict_map_key=False)
    except Exception as e:
        raise ProtocolError(f"malformed {what} ({type(e).__name__})") from None
    if not isinstance(fields, dict):
        raise ProtocolError(f"{what} is not a map")
    if fields.get("v") != PROTOCOL_VERSION:
        raise ProtocolError(
            f"{what} speaks protocol {fields.get('v')!r}, this peer speaks {PROTOCOL_VERSION}; upgrade the older peer"
        )
    try:
        return cls.model_validate(fields)
    except ValidationError as e:
        raise ProtocolError(f"invalid {cls.__name__}: {e.errors()[0]['loc']}: {e.errors()[0]['msg']}") from None


def seal(record: Record, identity: Identity) -> bytes:
    """Sign ``record`` with ``identity``; returns the sealed bytes to store in the DHT. The envelope carries
    ``identity.ticket`` (this peer's sealed :class:`~swarm.protocol.Ticket`) when it holds one and the record's kind
    carries it (:attr:`Record.carries_ticket`)."""
    if record.peer_id != identity.peer_id and record.kind != "spec":
        raise ValueError("a record must be sealed by the peer it names")
    payload = msgpack.packb(record.model_dump(mode="python"), use_bin_type=True)
    envelope = {"p": payload, "k": identity.public_key, "s": identity.sign(payload)}
    if identity.ticket and record.carries_ticket:
        envelope["t"] = identity.ticket
    blob = msgpack.packb(envelope, use_bin_type=True)
    if len(blob) > MAX_RECORD_BYTES:
        raise ValueError(f"sealed record is {len(blob)} bytes > {MAX_RECORD_BYTES}; keep records small")
    return blob


VERIFIED_KEPT = 4096
"""Records whose verification :func:`open_record` remembers (most recently read first; ~1 KiB each)."""


class _VerifiedRecords:
    """The outcome of the checks of a sealed record that depend on nothing but its bytes, its kind and the run
    (envelope, signature, fields, run id, its signer's ids, contents), by SHA-256 of the bytes: a peer reads the
    same announcement many times in its life (every roster read), and verifies its Ed25519 signature and parses
    it once. Only records that passed are kept; the checks that depend on the reader's clock or on where the
    record was found run at every read. Thread-safe (the DHT's callbacks and the event loop's executor read)."""

    def __init__(self, kept: int = VERIFIED_KEPT):
        self.kept, self._held = kept, OrderedDict()
        self._lock = threading.Lock()
        # a process forked while another thread held the lock (hivemind forks its averagers from a running peer)
        # would inherit it held and deadlock at its first read: the child starts with a fresh lock
        os.register_at_fork(after_in_child=self._after_fork)

    def _after_fork(self) -> None:
        self._lock = threading.Lock()

    def get(self, key: tuple):
        with self._lock:
            found = self._held.get(key)
            if found is not None:
                self._held.move_to_end(key)
            return found

    def put(self, key: tuple, value: tuple) -> None:
        with self._lock:
            self._held[key] = value
            while len(self._held) > self.kept:
                self._held.popitem(last=False)


_VERIFIED = _VerifiedRecords()


def open_record(
    blob: bytes, cls: Type[R], *, run_id: str, subkey: Optional[str] = None, signer: Optional[bytes] = None,
    expiration: Optional[float] = None,
) -> tuple[R, bytes]:
    """Verify and parse a sealed record; returns ``(record, signer_public_key)``. A record read before is not
    verified again (:class:`_VerifiedRecords`); its time and placement are.

    :param subkey: the DHT sub-key it was stored under; must be the record's :meth:`~Record.dht_subkey`.
    :param signer: if given, the only public key allowed to have signed it (e.g. the run's coordinator key).
    :param expiration: the DHT expiration it was stored with (DHT time, seconds); an :class:`AnnouncedRecord`
        must expire by ``time + ttl_s`` (module docstring, *Shadowing*).
    :raises ProtocolError: oversized, malformed, bad signature, wrong kind, run or protocol version, a sub-key
        or libp2p id its signer does not own, a replayed announcement.
    """
    if not isinstance(blob, (bytes, bytearray)):
        raise ProtocolError(f"record is {type(blob).__name__}, expected bytes")
    if len(blob) > MAX_RECORD_BYTES:
        raise ProtocolError(f"record of {len(blob)} bytes exceeds {MAX_RECORD_BYTES}")
    memo = (hashlib.sha256(blob).digest(), cls, run_id)
    verified = _VERIFIED.get(memo)
    if verified is None:
        verified = _verify(blob, cls, run_id)
        _VERIFIED.put(memo, verified)
    record, key = verified
    if signer is not None and key != signer:
        raise ProtocolError("record is not signed by the expected key (the run's coordinator)")
    ahead = record.time - get_dht_time()
    if ahead > MAX_CLOCK_SKEW_S:
        raise ProtocolError(f"record is dated {ahead:.0f} s in the future (more than {MAX_CLOCK_SKEW_S:.0f} s "
                            "of clock skew): its signer's clock is wrong; sync it with NTP")
    if cls.names_its_signer:
        _check_placement(record, subkey, expiration)
    return record, key


def _verify(blob: bytes, cls: Type[R], run_id: str) -> tuple[R, bytes]:
    """The checks of :func:`open_record` that depend only on ``blob``, ``cls`` and ``run_id``."""
    try:
        env = msgpack.unpackb(blob, raw=False)
        payload, key, sig = env["p"], env["k"], env["s"]
        if not all(isinstance(x, bytes) for x in (payload, key, sig)):
            raise TypeError("envelope fields must be bytes")
    except Exception as e:
        raise ProtocolError(f"malformed record envelope ({type(e).__name__}: {e})") from None
    try:
        verify(key, sig, payload)
    except SignatureError as e:
        raise ProtocolError(str(e)) from None
    record = parse(payload, cls, "record")
    if record.run_id != run_id:
        raise ProtocolError(f"record is for run {record.run_id!r}, not {run_id!r}")
    if cls.names_its_signer:
        if record.peer_id != peer_id_of(key):
            raise ProtocolError("record names a peer id its signer does not own")
        record.check_contents(run_id)
        if getattr(record, "p2p_id", "") and record.p2p_id != p2p_id_of(key):
            raise ProtocolError("record names a libp2p id its signer does not own (a peer's libp2p id is its "
                                "signing key's, swarm.identity)")
    return record, key


def envelope_ticket(blob: bytes) -> tuple[bytes, bytes]:
    """``(signer's public key, the sealed ticket it carries or b"")`` of a sealed record, unverified (the record's
    own checks are :func:`open_record`'s). :raises ProtocolError: not a sealed record's envelope."""
    try:
        env = msgpack.unpackb(blob, raw=False)
        key, ticket = env["k"], env.get("t", b"")
        if not isinstance(key, bytes) or not isinstance(ticket, bytes):
            raise TypeError("envelope fields must be bytes")
    except Exception as e:
        raise ProtocolError(f"malformed record envelope ({type(e).__name__}: {e})") from None
    return key, ticket


def _check_placement(record: Record, subkey: Optional[str], expiration: Optional[float]) -> None:
    """:raises ProtocolError: ``record`` was stored under another sub-key than its own, or (an announcement)
    to expire later than its signer allowed."""
    if subkey is not None and subkey != record.dht_subkey():
        raise ProtocolError(f"record is stored under sub-key {subkey[:80]!r}, not its own {record.dht_subkey()!r} "
                            "(its kind, version and signer's peer id)")
    if expiration is not None and isinstance(record, AnnouncedRecord):
        late = expiration - (record.time + record.ttl_s)
        if late > EXPIRY_SLACK_S:
            raise ProtocolError(f"announcement stored to expire {late:.0f} s after the lifetime its signer gave it "
                                f"({record.ttl_s:.0f} s): a replay kept alive to hide the signer's newer ones")


