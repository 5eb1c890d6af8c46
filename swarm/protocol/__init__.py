"""Every DHT record and wire message of the protocol, as typed, versioned schemas (msgpack on the wire).

DHT records live under keys namespaced by run id (:func:`spec_key`, :func:`stage_key`,
:func:`trainers_key`, ...), under the sub-key :meth:`Record.dht_subkey` gives, and expire. Each value is a
*sealed* record: ``msgpack({"p": payload, "k": ed25519_public_key, "s": signature(payload)})``
where the payload is the msgpack of a :class:`Record` subclass (plus ``"t"``, the signer's sealed
:class:`Ticket`, where the run admits only ticketed peers). :func:`open_record` checks the size, the
signature, the protocol version, the run id, that the signer owns the sub-key and any libp2p id the record
names (:mod:`swarm.identity`: the id is the key), that the record is not dated
in the future (:data:`MAX_CLOCK_SKEW_S`) and that its numbers are finite and in range, before a record is
used; anything else raises :class:`ProtocolError` with the cause.

**Shadowing.** hivemind keeps, per sub-key, the value that expires last, so a value stored again with a later
expiration hides the newer ones under its sub-key. Two rules make that harmless. A peer's own announcements
(:class:`AnnouncedRecord`: servers, trainers, holders) are re-signed with a fresh ``time`` at every
announcement and carry the lifetime their signer gave them (``ttl_s``); a value stored to expire after
``time + ttl_s`` is refused (a replay of an old announcement cannot outlive the newer one). Records re-published
verbatim by others (manifests, rollback orders, ban lists) live one version per sub-key (``<epoch>:<peer id>``,
``<generation>:<peer id>``, ``<time>:<peer id>``), so an old version kept alive never hides a new one: readers
take the newest among them. Unknown fields are ignored so newer peers can
add fields without breaking older ones (same protocol version); a removed or retyped field needs a new
:data:`~swarm.config.PROTOCOL_VERSION`.

Wire messages are the ``metadata`` of hivemind's ``runtime_pb2.ExpertRequest``/``ExpertResponse`` streams;
the tensors travel in the same messages (see :mod:`swarm.server.stage`). They live in :mod:`swarm.protocol.wire`, the
records of audits and spot checks in :mod:`swarm.protocol.statements`; both are imported here: every schema is
read from this one namespace, ``swarm.protocol``.
"""

from swarm.protocol.schema import (  # noqa: F401
    MAX_RECORD_BYTES, MAX_ENDORSEMENTS, MAX_METADATA_BYTES, EXPIRY_SLACK_S, MAX_EPOCH, MAX_COUNT, MIN_LR_SCALE,
    MAX_SAMPLES_PER_S, MAX_FLOPS, MAX_ROUND_S, MAX_CLOCK_SKEW_S, Refusal, ProtocolError, FiniteOrNone, Epoch,
    Count, Schema, Record, AnnouncedRecord, parse, seal, open_record, envelope_ticket,
)

from swarm.protocol.records import (  # noqa: F401
    spec_key, stage_key, stage_keys, stage_stripe, stripe_names, trainers_key, history_key, ServerState, MAX_VOUCHES,
    Reachability, HISTORY_POINTS, add_history,
    SpecRecord, RestoreReport, ServerInfo, ServerHistory, FragmentEntry, CheckpointManifest, Endorsement,
    check_endorsements, checkpoints_key, manifest_subkey, StorageInfo, storage_key, RollbackOrder, rollback_key,
    MAX_BANS, BanList, bans_key, RunKeyRecord, open_run_key_record, Ticket, tickets_key, open_ticket, check_carried,
    Delegation, delegates_key,
    MAX_INVITE_USES, Invite, invites_key, MAX_RECOGNIZED, Recognition, recognition_key, TrainerInfo, open_spec,
)

from swarm.protocol.statements import (  # noqa: F401
    PartCommitment, ReductionReceipt, StageReceipt, Accusation, accusations_key, AVERAGERS,
)

from swarm.protocol.wire import (  # noqa: F401
    ForwardRequest, BackwardRequest, PingRequest, StateDigestRequest, ProgressPush, StageResponse, EvidenceMessage,
    EvidenceRequest, AveragingPart, AveragingReply, StateAgreement, AuditRequest, AuditReply, pack_message,
    unpack_message, MAX_STAGE_TENSORS, FragmentPut, FragmentGet, ManifestPut, EndorseRequest, FragmentReply,
    InviteRedeem, InviteReply, MAX_ECHO_BYTES,
)
