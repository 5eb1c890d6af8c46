"""Evidence against reducers: commitments, receipts, the audit plan, recomputation and verifiable accusations.

The pure, process-free half of the audit protocol; :mod:`swarm.averaging.auditor` runs it inside the averager.

A reducer sees every part of its partition and could return anything. The protocol (described with its
guarantees in ``docs/averaging.md``; a simplified form of BTARD's, Gorbunov et al. 2022, sec. 3.3, without
its MPRNG and with a fixed audit probability) makes a wrong aggregate detectable and provable:

1. **Commit.** With every part a sender sends a sealed :class:`~swarm.protocol.PartCommitment` (SHA-256 of
   the encoded part, its weight, the group and partition, its libp2p id), signed with its Ed25519 key.
2. **Receipt.** With the aggregate the reducer returns a sealed :class:`~swarm.protocol.ReductionReceipt`:
   every commitment it received and the SHA-256 of the encoded aggregate, the same for every sender. A sender
   checks the receipt came from the reducer (libp2p id), lists its own commitment, and matches the aggregate.
3. **Audit.** When a phase ends, every peer derives the same audit plan from the group and the receipts'
   output digests (:func:`audit_plan`; unknown to a reducer before it commits to its output): each partition
   is audited with probability ``p`` by a peer drawn from the other senders. The auditor fetches every
   committed part (checked against its digest), recomputes the reduction with the same checks and aggregator
   (:func:`recompute`) and compares (:func:`matches`).
4. **Accuse.** On a mismatch the auditor excludes the reducer, keeps the evidence and publishes a sealed
   :class:`~swarm.protocol.Accusation` in the DHT. Every other peer fetches the evidence from the auditor and
   re-runs the same check (:func:`verify_evidence`) before excluding: a confirmed accusation excludes the
   reducer, a refuted one excludes the accuser (it signed a false claim). An honest reducer's aggregate equals the
   recomputation (same code, same inputs), so honest auditors never accuse it and false accusations fail.

Limits: a reducer that refuses to reveal its own part makes its audit inconclusive (the auditor scores it,
without an accusation); an audit only checks what the receipt lists, so a reducer can drop parts (as if
they had been late), bounded by the aggregator's robustness.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Sequence

import torch

from swarm.averaging.aggregation import Aggregator
from swarm.averaging.allreduce import digest
from swarm.averaging.reducer import NoValidParts, ReducePolicy, reduce_partition
from swarm.net.codecs import WireCodec
from swarm.protocol import PartCommitment, ProtocolError, ReductionReceipt, open_record


def audit_plan(group: str, output_digests: dict[int, str], peers: Sequence[str], senders: Sequence[str],
               probability: float) -> dict[int, str]:
    """Partition index -> libp2p id of its auditor, the same on every peer that saw the same receipts.

    :param output_digests: partition -> the output digest its receipt signed (only partitions that exist).
    :param peers: the group in partition order; ``senders`` those that may audit (not auxiliary peers).
    """
    seed = hashlib.sha256((group + "|" + "|".join(f"{j}:{d}" for j, d in sorted(output_digests.items()))).encode())
    plan = {}
    for j in sorted(output_digests):
        h = hashlib.sha256(seed.digest() + j.to_bytes(4, "big")).digest()
        if int.from_bytes(h[:4], "big") / 2 ** 32 >= probability:
            continue
        candidates = sorted(s for s in senders if s != peers[j])
        if candidates:
            plan[j] = candidates[int.from_bytes(h[4:8], "big") % len(candidates)]
    return plan


@dataclass
class OpenedReceipt:
    receipt: ReductionReceipt
    signer: bytes  # Ed25519 public key of the reducer
    commitments: list[PartCommitment]
    raw: bytes = b""  # the sealed receipt as received


def open_receipt(blob: bytes, run_id: str) -> OpenedReceipt:
    """Verify a receipt and every commitment in it.

    :raises ProtocolError: a bad signature or a commitment for another group, partition, size or codec.
    """
    receipt, key = open_record(blob, ReductionReceipt, run_id=run_id)
    commitments = []
    for c_blob in receipt.commitments:
        c, _ = open_record(c_blob, PartCommitment, run_id=run_id)
        if (c.group, c.partition, c.numel, c.codec) != (receipt.group, receipt.partition, receipt.numel, receipt.codec):
            raise ProtocolError(f"receipt lists a commitment of {c.p2p_id} for another group, partition or codec")
        commitments.append(c)
    if len({c.p2p_id for c in commitments}) != len(commitments):
        raise ProtocolError("receipt lists two commitments from the same sender")
    return OpenedReceipt(receipt, key, commitments, bytes(blob))


def recompute(opened: OpenedReceipt, parts: Sequence[Sequence[torch.Tensor]], codec: WireCodec,
              aggregator: Aggregator, policy: ReducePolicy) -> torch.Tensor | None:
    """The aggregate the reducer should have returned, from the committed parts (in receipt order, encoded).

    Returns None when no committed part is valid (the reducer should have failed the partition).
    :raises ProtocolError: a part does not match its commitment's digest.
    """
    decoded, weights = {}, {}
    for c, tensors in zip(opened.commitments, parts, strict=True):
        if digest(tensors) != c.digest:
            raise ProtocolError(f"part of {c.p2p_id} does not match its commitment")
        try:
            decoded[c.p2p_id] = codec.decode(list(tensors), c.numel)
        except ValueError as e:
            decoded[c.p2p_id] = e
        weights[c.p2p_id] = c.weight
    try:
        return reduce_partition(decoded, weights, opened.receipt.numel, aggregator, policy).aggregate
    except NoValidParts:
        return None


def matches(received: torch.Tensor, recomputed: torch.Tensor | None, codec: WireCodec) -> tuple[bool, float]:
    """Whether a decoded aggregate equals the recomputation, up to float nondeterminism across machines.

    Tolerance: ``1e-3`` of the aggregate's norm plus twice the codec's rounding of it (an 8-bit code may round
    the other way when the last bits differ). Returns ``(ok, relative difference)``.
    """
    if recomputed is None:
        return False, float("inf")
    expected = codec.roundtrip(recomputed)
    scale = float(expected.norm())
    diff = float((received - expected).norm())
    tol = 1e-3 * scale + 2 * float((expected - recomputed).norm()) + 1e-6
    return diff <= tol, diff / max(scale, 1e-12)


def verify_evidence(opened: OpenedReceipt, aggregate: Sequence[torch.Tensor], parts: Sequence[Sequence[torch.Tensor]],
                    codec: WireCodec, aggregator: Aggregator, policy: ReducePolicy) -> tuple[bool, str]:
    """Re-run an audit from evidence: ``(True, why)`` if the reducer's aggregate is wrong, ``(False, why)`` if
    the evidence shows it right (the accusation is false).

    :raises ProtocolError: the evidence does not match the signed receipt (the accuser's fault).
    """
    if digest(aggregate) != opened.receipt.output_digest:
        raise ProtocolError("the aggregate in the evidence is not the one the receipt signed")
    try:
        received = codec.decode(list(aggregate), opened.receipt.numel)
    except ValueError as e:
        return True, f"the signed aggregate does not decode: {e}"
    ok, rel = matches(received, recompute(opened, parts, codec, aggregator, policy), codec)
    if ok:
        return False, f"the aggregate matches the recomputation (relative difference {rel:.2e})"
    return True, f"the aggregate differs from the recomputation by {rel:.3g} of its norm"
