"""Wire messages of the protocol: the ``metadata`` of the stage, averaging, fragment and evidence RPCs
(msgpack of :class:`~swarm.protocol.Schema` subclasses; see :mod:`swarm.protocol` for versioning)."""

from __future__ import annotations

from typing import Literal, Optional, Type

import msgpack
from pydantic import ConfigDict, Field, model_validator

from swarm.protocol.schema import MAX_METADATA_BYTES, MAX_SAMPLES_PER_S, Count, Epoch, ProtocolError, S, Schema, parse


MAX_STAGE_TENSORS = 16
"""Most wire tensors in a stage request or reply, and in each group of a spot check's evidence: two float tensors
(a backward's gradient and inputs) of the codec that sends the most per tensor (``lowrank_ternary``: 8;
:mod:`swarm.net.codecs`)."""


class ForwardRequest(Schema):
    """Run a micro-batch through a stage.

    Tensors: ``[inputs]`` — int64 token ids ``(B, T)`` for stage 0, else float32 hidden states ``(B, T, d)``;
    the last stage also gets int64 targets ``(B, T)`` and returns the loss (and, with ``mode="train"``, the
    input gradient, having accumulated its parameter gradients).
    """

    run_id: str
    stage: int = Field(ge=0)
    mb_id: str = Field(min_length=1, max_length=128)
    mode: Literal["train", "eval", "check"] = Field(
        "train", description="'train' caches the graph (middle stages) or accumulates gradients (last stage); "
        "'eval' returns outputs or the loss only; 'check' (a trainer's spot check, :mod:`swarm.trust.spotcheck`) "
        "returns "
        "what 'train' returns and keeps nothing.")
    codec: str = Field("float32", max_length=32, description="Wire codec of the float tensors.")


class BackwardRequest(Schema):
    """Backpropagate a micro-batch through a stage (not the last one).

    Tensors: ``[grad_outputs]`` float32 ``(B, T, d)``, followed by the forward ``inputs`` when
    ``with_inputs`` (a retry on a server that did not run the forward recomputes it from them).
    """

    run_id: str
    stage: int = Field(ge=0)
    mb_id: str = Field(min_length=1, max_length=128)
    with_inputs: bool = False
    check: bool = Field(False, description="A spot check (:mod:`swarm.trust.spotcheck`): recompute from the inputs "
                        "sent "
                        "along and return the input gradient without accumulating anything.")
    codec: str = Field("float32", max_length=32, description="Wire codec of the float tensors.")


MAX_ECHO_BYTES = 1 << 20
"""Most bytes a ping may ask the server to send back (:attr:`PingRequest.echo_bytes`): 1 MiB, a forward reply's
order of size, so a probe costs a server no more than a call it serves anyway."""


class PingRequest(Schema):
    """Is this stage server alive and serving (``rpc_ping``)? Answered with a StageResponse, tensor-less unless
    ``echo_bytes`` asks for a probe of the link's rate (:mod:`swarm.net.links`)."""

    run_id: str
    stage: int = Field(ge=0)
    echo_bytes: int = Field(0, ge=0, le=MAX_ECHO_BYTES, description="Bytes the server sends back as one uint8 "
                            "tensor of zeros, so the caller times the link's rate; 0: a bare ping (older servers "
                            "ignore the field and send none).")


class StateDigestRequest(Schema):
    """What is your state's digest at ``epoch`` (``rpc_state_digest``)? A server that loaded the stage's state
    from a live server asks the stage's other servers before it keeps that state (:mod:`swarm.trust.statecheck`).
    Answered with a tensor-less StageResponse: the server's ``epoch`` now and ``state_sha256`` at ``epoch``
    (empty if it has none: it had not reached that epoch, joined after it, or forgot it)."""

    run_id: str
    stage: int = Field(ge=0)
    epoch: int = Field(ge=0)


class ProgressPush(Schema):
    """A stage server's progress in the current epoch, pushed to the stage's other servers (``rpc_progress``) as it
    changes, so they need not read it from the DHT (:mod:`swarm.averaging.progress`). The receiver counts it only
    from a libp2p id that one of the stage's announced servers names, as the progress of the key that record
    announces, and clips it as it clips the DHT's entries (``trusted_progress``). Answered with a tensor-less
    StageResponse (the receiver's epoch)."""

    model_config = ConfigDict(allow_inf_nan=False)
    run_id: str
    stage: int = Field(ge=0)
    epoch: Epoch
    samples: Count = Field(description="Samples this server accumulated towards the epoch's target batch.")
    samples_per_s: float = Field(ge=0, le=MAX_SAMPLES_PER_S, description="This server's recent throughput "
                                 "(samples/s), for the stage's estimate of when the epoch ends.")
    client_mode: bool = False
    time: float = Field(ge=0, description="The sender's DHT time (seconds) when it counted ``samples``: its pushed "
                        "and its published progress are told apart by it, and the stage's estimate of the epoch's "
                        "end extrapolates from it (as from a DHT entry's).")


class StageResponse(Schema):
    """Reply to a stage RPC; tensors: outputs (forward) or input gradients (backward / last stage train)."""

    loss: Optional[float] = None
    epoch: int = 0
    codec: str = Field("float32", max_length=32, description="Wire codec of the float tensors.")
    receipt: bytes = Field(b"", max_length=4096, description="The server's sealed StageReceipt for this reply "
                           "(empty from a server without an identity, e.g. a bare StageServer in a test).")
    state_sha256: str = Field("", max_length=64, description="rpc_state_digest only: SHA-256 of the server's "
                              "whole state at the asked epoch (swarm.checkpoint.state.state_digest), or empty.")


class EvidenceMessage(Schema):
    """A spot check's evidence on the wire (:mod:`swarm.trust.convictions`): the three answers' sealed
    :class:`StageReceipt` s, which one lied, the tolerance, and how many tensors of each of the six groups follow
    (the check request, the three answers, the accused's own request and forward request when they differ)."""

    run_id: str
    stage: int = Field(ge=0)
    call: Literal["forward", "backward"]
    codec: str = Field(max_length=32)
    accused: int = Field(ge=0, le=2)
    tolerance: float = Field(gt=0, le=1)
    receipts: list[bytes] = Field(min_length=3, max_length=3)
    forward_receipt: bytes = Field(b"", max_length=4096)
    groups: list[int] = Field(min_length=6, max_length=6)

    @model_validator(mode="after")
    def _bounded(self) -> "EvidenceMessage":
        if any(len(r) > 4096 for r in self.receipts) or any(not 0 <= n <= MAX_STAGE_TENSORS for n in self.groups):
            raise ValueError(f"receipts of at most 4096 bytes and at most {MAX_STAGE_TENSORS} tensors per group")
        return self


class EvidenceRequest(Schema):
    """Ask a peer for the evidence behind a conviction it lists (``rpc_get_evidence``); also the answer to a
    push of evidence (``rpc_push_evidence``), naming the accused the evidence proved."""

    run_id: str
    accused: str = Field(min_length=1, max_length=64)


class AveragingPart(Schema):
    """One sender's part of one partition in an averaging round (:mod:`swarm.averaging.allreduce`).

    Tensors: the part encoded with ``codec`` (see :mod:`swarm.averaging.compression`). ``digest`` is the
    SHA-256 of the encoded tensors' bytes, the sender's commitment to what it sent.
    """

    group: str = Field(min_length=1, max_length=128)  # hex group id of the round, with the phase
    partition: int = Field(ge=0)
    weight: float  # samples behind the part, as the sender reports them (bounded by the reducer)
    numel: int = Field(ge=0)
    codec: str = Field(max_length=32)
    digest: str = Field(max_length=64)
    commitment: bytes = Field(b"", max_length=4096, description="The sender's sealed PartCommitment.")


class AveragingReply(Schema):
    """The reducer's answer: the partition's aggregate (tensors, encoded with the round's codec) and what it
    made of the sender's part. ``error`` set means there is no aggregate (tensors empty)."""

    accepted: bool = False
    flagged: bool = False
    reason: str = Field("", max_length=512)
    digest: str = Field("", max_length=64)  # SHA-256 of the encoded aggregate
    senders: int = 0  # parts the aggregate used
    error: str = Field("", max_length=512)
    receipt: bytes = Field(b"", max_length=32 * 1024, description="The reducer's sealed ReductionReceipt.")


class StateAgreement(Schema):
    """A state round's member's SHA-256 of the tensors it is about to average (``rpc_state_agreement``), sent to
    every other member of the group before any part; the reply is the receiver's own, or ``error``. A group
    whose members all hold one state skips the round's phases (:mod:`swarm.averaging.agreement`)."""

    group: str = Field(min_length=1, max_length=128)  # hex group id of the round
    state_sha256: str = Field("", max_length=64)
    error: str = Field("", max_length=512)


class AuditRequest(Schema):
    """Ask a sender for its part of an audited partition (``rpc_audit_part``) or an auditor for the evidence
    behind an accusation (``rpc_audit_evidence``)."""

    group: str = Field(min_length=1, max_length=128)
    partition: int = Field(ge=0)


class AuditReply(Schema):
    """Tensors: the encoded part (``rpc_audit_part``), or the encoded aggregate followed by every committed
    part in receipt order (``rpc_audit_evidence``). ``error`` set: nothing follows."""

    error: str = Field("", max_length=512)
    parts: int = 0
    tensors_per_part: int = 0


def pack_message(msg: Schema) -> bytes:
    return msgpack.packb(msg.model_dump(mode="python"), use_bin_type=True)


def unpack_message(data: bytes, cls: Type[S]) -> S:
    """Parse wire metadata; raises :class:`ProtocolError` (oversized, malformed, version mismatch)."""
    if not data:
        raise ProtocolError("empty message: the peer closed the stream without a reply (it may be shutting down, "
                            "or it refused the request at its first chunk: check the request's size and tensors)")
    if len(data) > MAX_METADATA_BYTES:
        raise ProtocolError(f"message metadata of {len(data)} bytes exceeds {MAX_METADATA_BYTES}")
    return parse(data, cls, "message")


class FragmentPut(Schema):
    """Ask a peer to hold a checkpoint fragment (``rpc_put_fragment``); tensors: the bytes as uint8 ``(size,)``."""

    run_id: str
    stage: int = Field(ge=0)
    epoch: int = Field(ge=0)
    index: int = Field(ge=0, lt=256)
    sha256: str = Field(min_length=64, max_length=64)


class FragmentGet(Schema):
    """Ask a holder for a fragment (``rpc_get_fragment``); ``sha256`` names the one the manifest lists."""

    run_id: str
    stage: int = Field(ge=0)
    epoch: int = Field(ge=0)
    index: int = Field(ge=0, lt=256)
    sha256: str = Field("", max_length=64)


class ManifestPut(Schema):
    """Hand a holder the sealed manifest of a checkpoint it holds fragments of (``rpc_put_manifest``), so it
    can re-publish the manifest after every other peer is gone; tensors: the sealed bytes as uint8 ``(size,)``."""

    run_id: str


class EndorseRequest(Schema):
    """A checkpoint's writer asks a peer to endorse it (``rpc_endorse``); the reply carries the sealed
    :class:`Endorsement` as uint8 bytes, or an error naming why not."""

    run_id: str
    stage: int = Field(ge=0)
    epoch: int = Field(ge=0)
    state_sha256: str = Field(min_length=64, max_length=64)


class FragmentReply(Schema):
    """``error`` empty: done (for a get, the fragment's bytes follow as uint8 and ``sha256`` names them)."""

    error: str = Field("", max_length=512)
    sha256: str = Field("", max_length=64)


class InviteRedeem(Schema):
    """A peer redeems an invite code for its own ticket (``rpc_redeem``, :mod:`swarm.trust.invites`): the ticket
    names the caller's peer id (its libp2p key's)."""

    run_id: str
    code: str = Field(min_length=1, max_length=128)


class InviteReply(Schema):
    """``error`` empty: ``ticket`` holds the sealed :class:`~swarm.protocol.Ticket`."""

    error: str = Field("", max_length=512)
    ticket: bytes = Field(b"", max_length=4096)
