"""Signed statements behind the swarm's checks of computation: an averaging sender's commitment to its part, a
reducer's receipt of a partition, an auditor's accusation (:mod:`swarm.averaging.audit`), and a stage
server's receipt of a reply (:mod:`swarm.trust.spotcheck`). Records like the others (:mod:`swarm.protocol`: sealed,
versioned, opened by :func:`~swarm.protocol.open_record`); read them from ``swarm.protocol``."""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field

from swarm.protocol.schema import Record, open_record


class PartCommitment(Record):
    """A sender's signed statement of the part it sent a reducer (see :mod:`swarm.averaging.audit`)."""

    kind: Literal["commitment"] = "commitment"
    p2p_id: str = Field(min_length=1, max_length=128, description="libp2p id the part was sent from.")
    group: str = Field(min_length=1, max_length=128)
    partition: int = Field(ge=0)
    numel: int = Field(ge=0)
    codec: str = Field(max_length=32)
    digest: str = Field(max_length=64, description="SHA-256 of the encoded part.")
    weight: float = Field(description="Samples behind the part, as reported by the sender.")


class ReductionReceipt(Record):
    """A reducer's signed statement of how it reduced a partition: every commitment it received (the sealed
    :class:`PartCommitment` bytes) and the SHA-256 of the encoded aggregate it returned to every sender."""

    kind: Literal["receipt"] = "receipt"
    p2p_id: str = Field(min_length=1, max_length=128, description="libp2p id of the reducer.")
    group: str = Field(min_length=1, max_length=128)
    partition: int = Field(ge=0)
    numel: int = Field(ge=0)
    codec: str = Field(max_length=32)
    aggregator: str = Field(max_length=64)
    commitments: list[bytes] = Field(default_factory=list, max_length=256)
    output_digest: str = Field(max_length=64)


class StageReceipt(Record):
    """A stage server's signed statement of one reply (:mod:`swarm.trust.spotcheck`): for the request tensors with
    SHA-256 ``request_sha256`` (:func:`swarm.trust.spotcheck.tensors_digest` of their wire form) it answered, with its
    parameters of ``epoch``, the tensors with ``reply_sha256`` and ``loss``. Anyone holding both tensor lists can
    check the statement; three of them over one request are the evidence a trainer publishes against a liar."""

    kind: Literal["stage_receipt"] = "stage_receipt"
    p2p_id: str = Field(min_length=1, max_length=128, description="libp2p id of the server.")
    stage: int = Field(ge=0)
    epoch: int = Field(ge=0, description="The epoch of the parameters the reply was computed with.")
    synced: bool = Field(True, description="Whether those parameters are the stage's shared ones: False while "
                         "the server holds its own after a failed round (StageOptimizer.synced). Only synced "
                         "answers are compared by spot checks.")
    mb_id: str = Field(min_length=1, max_length=128)
    call: Literal["forward", "backward"]
    request_sha256: str = Field(min_length=64, max_length=64)
    reply_sha256: str = Field(min_length=64, max_length=64)
    loss: Optional[float] = Field(None, description="The loss it returned (last stage), or None.")


class Accusation(Record):
    """An auditor's signed claim that a reducer returned a wrong aggregate, stored under
    :func:`accusations_key`; the evidence (parts, aggregate) is served by the auditor (``rpc_audit_evidence``)
    so that every peer can recompute before it excludes anyone."""

    kind: Literal["accusation"] = "accusation"
    p2p_id: str = Field(min_length=1, max_length=128, description="libp2p id of the auditor (serves the evidence).")
    accused: str = Field(max_length=128, description="libp2p id of the reducer.")
    receipt: bytes = Field(max_length=32 * 1024, description="The reducer's sealed ReductionReceipt.")
    reason: str = Field("", max_length=512)

    def dht_subkey(self) -> str:
        """``<accuser's libp2p id>/<group>/<partition>`` of the receipt it accuses: one per audit, owned by the
        accuser (so nobody can take an auditor's sub-key first, or hide its accusation under a later expiration).

        :raises ProtocolError: the receipt does not open."""
        receipt, _ = open_record(self.receipt, ReductionReceipt, run_id=self.run_id)
        return f"{self.p2p_id}/{receipt.group}/{receipt.partition}"


def accusations_key(prefix: str) -> str:
    """Where the auditors of the averager ``prefix`` (hivemind's, e.g. ``<run>-stage0_grad_averager``) publish."""
    return f"{prefix}/accusations"


AVERAGERS = ("grad_averager", "state_averager")
"""hivemind's averagers of a stage (``<run>-stage<k>_<averager>``), each with its own accusations key."""
