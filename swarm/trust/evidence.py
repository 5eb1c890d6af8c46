"""Spot-check evidence: what proves that a stage server lied to a trainer, checked by anyone without trusting
whoever shows it.

A trainer's spot check (:mod:`swarm.trust.spotcheck`) re-runs a sampled call on other servers of the stage;
when one answer is far from two that agree, the three signed answers (:mod:`swarm.trust.receipts`) with the
request and reply tensors are :class:`SpotEvidence`. :func:`verify_evidence` checks it from the signatures,
digests and distances alone, with no parameters, so every peer that acts on a conviction verifies it itself
(:mod:`swarm.trust.convictions`). Two answers agree when their relative L2 difference
(:func:`relative_difference`) is within the check's tolerance; the odd one out (:func:`odd_one_out`) is the
accused. Not with outer steps (:func:`answers_comparable`): the servers of a stage then hold their own inner
parameters between outer steps, so two honest servers' answers differ and prove nothing.

Wire form (:func:`pack_evidence`): :class:`~swarm.protocol.EvidenceMessage` with the evidence's tensors in six
groups (the check request, the three answers, the accused's own request and forward request when they differ),
at most :data:`MAX_GROUP_TENSORS` each.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from swarm.config import RunSpec
from swarm.net.codecs import agreement_floor, unpack_tensors
from swarm.protocol import MAX_STAGE_TENSORS, EvidenceMessage, ProtocolError, StageReceipt, open_record
from swarm.trust.receipts import tensors_digest

MAX_GROUP_TENSORS = MAX_STAGE_TENSORS
"""Wire tensors per evidence group (a stage message's most, :data:`~swarm.protocol.MAX_STAGE_TENSORS`)."""


@dataclass
class SpotEvidence:
    """A conviction anyone can check (:func:`verify_evidence`): the check request's wire tensors, every answer
    to it (the server's sealed receipt and reply wire tensors), and which answer lied. A backward's check
    request is ``[grad_outputs, inputs]``; the accused may have been sent ``[grad_outputs]`` alone
    (``accused_request_wire``), and then its forward's receipt and request (``forward_receipt``,
    ``forward_request_wire``) bind it to the inputs."""

    run_id: str
    stage: int
    call: str
    codec: str
    request_wire: list[torch.Tensor]
    answers: list[tuple[bytes, list[torch.Tensor]]]
    accused: int
    tolerance: float
    accused_request_wire: list[torch.Tensor] = field(default_factory=list)
    forward_receipt: bytes = b""
    forward_request_wire: list[torch.Tensor] = field(default_factory=list)


def relative_difference(a: Sequence[torch.Tensor], la: Optional[float], b: Sequence[torch.Tensor],
                        lb: Optional[float]) -> float:
    """Largest relative L2 difference ``||x - y|| / max(||x||, ||y||)`` over paired tensors and the losses;
    ``inf`` if the answers differ in kind (tensor count, shape, a loss on one side only)."""
    if len(a) != len(b) or (la is None) != (lb is None):
        return float("inf")
    worst = 0.0
    pairs = [(x.float(), y.float()) for x, y in zip(a, b)]
    if la is not None:
        pairs.append((torch.tensor([la]), torch.tensor([lb])))
    for x, y in pairs:
        if x.shape != y.shape:
            return float("inf")
        scale = max(float(x.norm()), float(y.norm()), 1e-12)
        worst = max(worst, float((x - y).norm()) / scale)
    return worst


def odd_one_out(diffs: dict[tuple[int, int], float], tolerance: float) -> Optional[int]:
    """Among three answers with pairwise ``diffs`` (keys ``(i, j)``, i < j), the one far from both others while
    those two agree; None if there is no such answer."""
    for accused in range(3):
        i, j = [k for k in range(3) if k != accused]
        far = all(diffs[tuple(sorted((accused, k)))] > tolerance for k in (i, j))
        if far and diffs[(i, j)] <= tolerance:
            return accused
    return None


def answers_comparable(spec: RunSpec) -> bool:
    """Whether two honest servers of a stage answer one call alike in this run: not with outer steps, where each
    holds its own inner parameters between outer steps (module docstring)."""
    return spec.averaging.mode != "outer"


def verify_evidence(evidence: SpotEvidence, min_tolerance: float = 0.0) -> str:
    """Check a conviction without trusting whoever shows it: the receipts' signatures, that every receipt
    states the request and reply tensors shown, that the answers are three servers' to one call of one stage
    and micro-batch at one epoch, and that the accused answer is far from two answers that agree, at the
    evidence's tolerance but never below ``min_tolerance`` (the verifier's ``spot_checks.rtol``: a tolerance
    chosen between three honest servers' small differences would otherwise single one of them out), nor below what
    the evidence's codec makes of small differences (:func:`~swarm.net.codecs.agreement_floor`).

    :returns: the accused server's peer id.
    :raises ProtocolError: the evidence does not prove what it claims (the cause named).
    """
    if len(evidence.answers) != 3 or not 0 <= evidence.accused < 3:
        raise ProtocolError("spot-check evidence needs three answers and the index of the accused one")
    receipts, replies = [], []
    for sealed, wire in evidence.answers:
        receipt, _ = open_record(sealed, StageReceipt, run_id=evidence.run_id)
        if receipt.reply_sha256 != tensors_digest(wire):
            raise ProtocolError(f"the reply shown for {receipt.peer_id} is not the one its receipt states")
        receipts.append(receipt)
        replies.append(_decode(wire, evidence.codec))
    if len({(r.stage, r.call, r.mb_id, r.epoch) for r in receipts}) != 1 or receipts[0].stage != evidence.stage \
            or receipts[0].call != evidence.call or len({r.peer_id for r in receipts}) != 3:
        raise ProtocolError("the receipts are not three servers' answers to one call of one stage at one epoch")
    unsynced = [r.peer_id for r in receipts if not r.synced]
    if unsynced:
        raise ProtocolError(f"{', '.join(unsynced)} signed that its parameters were out of sync with its stage "
                            "(after a failed round): answers of different parameters prove nothing")
    for i, receipt in enumerate(receipts):
        if receipt.request_sha256 != tensors_digest(evidence.request_wire) and \
                not (i == evidence.accused and _bound_by_forward(evidence, receipt)):
            raise ProtocolError(f"{receipt.peer_id}'s receipt states another request than the one shown")
    diffs = {(i, j): relative_difference(replies[i], receipts[i].loss, replies[j], receipts[j].loss)
             for i in range(3) for j in range(i + 1, 3)}
    tolerance = max(evidence.tolerance, min_tolerance, agreement_floor(evidence.codec))
    if odd_one_out(diffs, tolerance) != evidence.accused:
        raise ProtocolError(f"the answers do not single out the accused (differences "
                            f"{', '.join(f'{d:.3g}' for d in diffs.values())}, tolerance {tolerance:.3g})")
    return receipts[evidence.accused].peer_id


def _bound_by_forward(evidence: SpotEvidence, receipt: StageReceipt) -> bool:
    """A backward the accused got without the inputs (it had the forward cached): its request is the check's
    ``grad_outputs`` and its own signed forward took the check's ``inputs``."""
    if evidence.call != "backward" or not evidence.forward_receipt:
        return False
    forward, _ = open_record(evidence.forward_receipt, StageReceipt, run_id=evidence.run_id)
    if (forward.peer_id, forward.mb_id, forward.call) != (receipt.peer_id, receipt.mb_id, "forward") or \
            receipt.request_sha256 != tensors_digest(evidence.accused_request_wire) or \
            forward.request_sha256 != tensors_digest(evidence.forward_request_wire):
        return False
    check = _decode(evidence.request_wire, evidence.codec)
    sent = _decode(evidence.accused_request_wire, evidence.codec) + _decode(evidence.forward_request_wire,
                                                                           evidence.codec)
    return len(check) == len(sent) == 2 and all(torch.equal(a, b) for a, b in zip(check, sent))


def _decode(wire: list[torch.Tensor], codec: str) -> list[torch.Tensor]:
    try:
        return unpack_tensors(wire, codec)
    except Exception as e:
        raise ProtocolError(f"evidence tensors do not decode: {e}") from None


def pack_evidence(evidence: SpotEvidence) -> tuple[EvidenceMessage, list[torch.Tensor]]:
    groups = [evidence.request_wire, *(wire for _, wire in evidence.answers), evidence.accused_request_wire,
              evidence.forward_request_wire]
    msg = EvidenceMessage(run_id=evidence.run_id, stage=evidence.stage, call=evidence.call, codec=evidence.codec,
                          accused=evidence.accused, tolerance=evidence.tolerance,
                          receipts=[sealed for sealed, _ in evidence.answers],
                          forward_receipt=evidence.forward_receipt, groups=[len(g) for g in groups])
    return msg, [t for g in groups for t in g]


def unpack_evidence(msg: EvidenceMessage, tensors: list[torch.Tensor]) -> SpotEvidence:
    """:raises ProtocolError: the tensors do not follow the message's groups."""
    if len(msg.groups) != 6 or sum(msg.groups) != len(tensors) or len(msg.receipts) != 3:
        raise ProtocolError(f"evidence groups {msg.groups} do not match {len(tensors)} tensors and 3 receipts")
    groups, i = [], 0
    for n in msg.groups:
        groups.append(list(tensors[i:i + n]))
        i += n
    return SpotEvidence(run_id=msg.run_id, stage=msg.stage, call=msg.call, codec=msg.codec,
                        request_wire=groups[0], answers=list(zip(msg.receipts, groups[1:4])), accused=msg.accused,
                        tolerance=msg.tolerance, accused_request_wire=groups[4], forward_receipt=msg.forward_receipt,
                        forward_request_wire=groups[5])


__all__ = ["MAX_GROUP_TENSORS", "SpotEvidence", "answers_comparable", "odd_one_out", "pack_evidence",
           "relative_difference", "unpack_evidence", "verify_evidence"]
