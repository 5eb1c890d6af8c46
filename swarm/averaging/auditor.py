"""The averager's side of the audit protocol (:mod:`swarm.averaging.audit`): signing, audits, accusations.

:class:`Auditor` is mixed into the averagers and runs in the averager process. It signs this peer's commitments
and receipts with the peer's Ed25519 identity, which is also its libp2p identity (:mod:`swarm.identity`), so
a commitment, receipt or accusation naming a libp2p id verifies against the key that id inlines, here and on
every other peer (no key has to be learned first). It audits the partitions the audit plan assigns to it, serves its parts and its evidence
(``rpc_audit_part``, ``rpc_audit_evidence``), publishes accusations to the DHT and verifies everyone else's
before excluding.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections import OrderedDict
from typing import AsyncIterator, Optional

from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import runtime_pb2
from hivemind.utils import get_dht_time

from swarm.net.quota import Busy, PeerQuota, TooFast
from swarm.averaging.allreduce import Accountant, PhaseOutcome, RoundFailed, digest
from swarm.averaging.audit import OpenedReceipt, audit_plan, matches, open_receipt, recompute, verify_evidence
from swarm.net.codecs import make_codec
from swarm.identity import Identity
from swarm.protocol import (Accusation, AuditReply, AuditRequest, AveragingPart, AveragingReply, PartCommitment,
                            ProtocolError, ReductionReceipt, accusations_key, open_record, pack_message, seal,
                            unpack_message)
from swarm.net.transport import gather, stream_out

logger = logging.getLogger(__name__)

KEEP_PHASES = 8  # phases whose parts and evidence a peer keeps for audits
POLL_S = (3.0, 24.0)
"""Seconds between reads of the accusations in the DHT: the first after a new one was found, doubling up to the
second while none is (accusations are rare; each read is a DHT lookup)."""
AUDIT_IN_FLIGHT = 4
"""Audit requests (parts, evidence) of one peer served at once."""
AUDIT_RATE_PER_S = 5.0
"""Audit requests one peer may start per second, on average (an auditor asks each member of a group once)."""


class _SigningAccountant(Accountant):
    def __init__(self, owner: "Auditor"):
        self.owner = owner

    def _record(self, cls, **fields):
        o = self.owner
        return seal(cls(run_id=o.run_id, peer_id=o.identity.peer_id, time=get_dht_time(), p2p_id=str(o.peer_id),
                        **fields), o.identity)

    def commit(self, meta: AveragingPart) -> bytes:
        return self._record(PartCommitment, group=meta.group, partition=meta.partition, numel=meta.numel,
                            codec=meta.codec, digest=meta.digest, weight=meta.weight)

    def sign_receipt(self, meta: AveragingPart, commitments: list[bytes], output_digest: str) -> bytes:
        return self._record(ReductionReceipt, group=meta.group, partition=meta.partition, numel=meta.numel,
                            codec=meta.codec, aggregator=self.owner.rules.aggregator.name, commitments=commitments,
                            output_digest=output_digest)

    def check_receipt(self, reducer: str, meta: AveragingPart, commitment: bytes, reply: AveragingReply):
        try:
            opened = open_receipt(reply.receipt, self.owner.run_id)
        except ProtocolError as e:
            raise RoundFailed(f"reducer {reducer} sent an invalid receipt: {e}") from None
        r = opened.receipt
        if r.p2p_id != reducer or (r.group, r.partition) != (meta.group, meta.partition):
            raise RoundFailed(f"reducer {reducer} sent a receipt for another peer, group or partition")
        if r.output_digest != reply.digest:
            raise RoundFailed(f"reducer {reducer}'s receipt signs another aggregate than the one it sent")
        if reply.accepted and commitment not in r.commitments:
            raise RoundFailed(f"reducer {reducer}'s receipt leaves out this peer's accepted part")
        return opened


class Auditor:
    """Needs ``identity``, ``run_id``, ``audit_probability``, ``rules`` (aggregator, policy, phase timeout),
    ``exclusions`` and ``wire`` (set by :meth:`_init_audit` and the robust all-reduce mixin)."""

    def _init_audit(self, identity: Optional[Identity], run_id: str, audit_probability: float, dht) -> None:
        """:raises ValueError: no ``identity``, or not the key ``dht``'s libp2p daemon speaks as (start the DHT
            with :func:`swarm.net.dht.spawn_dht`)."""
        if identity is None or dht is None or str(dht.peer_id) != identity.p2p_id:
            raise ValueError("an averager signs as its peer: pass the Identity its DHT was started with "
                             "(swarm.net.dht.spawn_dht(identity, ...))")
        self.identity = identity
        self.run_id, self.audit_probability = run_id, audit_probability
        self.accountant = _SigningAccountant(self)
        self._phases: OrderedDict[str, PhaseOutcome] = OrderedDict()  # the last phases: parts sent, receipts, ...
        self._evidence: OrderedDict[tuple[str, int], tuple] = OrderedDict()
        self._seen_accusations: set[str] = set()
        self._poller: Optional[asyncio.Task] = None
        self.audits_done = 0
        self.audit_quota = PeerQuota(AUDIT_IN_FLIGHT, rate_per_s=AUDIT_RATE_PER_S)

    def open_commitment(self, sender: str, meta: AveragingPart) -> Optional[str]:
        """Check a received part's commitment; returns the reason to refuse it, or None."""
        try:
            c, key = open_record(meta.commitment, PartCommitment, run_id=self.run_id)
        except ProtocolError as e:
            return f"invalid commitment: {e}"
        if (c.p2p_id, c.group, c.partition, c.numel, c.codec, c.digest, c.weight) != (
                sender, meta.group, meta.partition, meta.numel, meta.codec, meta.digest, meta.weight):
            return "commitment does not match the part"
        return None

    # ---- each phase: keep what audits need, audit our share ------------------------------------------------
    def begin_phase(self, key: str) -> PhaseOutcome:
        """Register the phase before it runs, so that parts can be served to auditors as soon as they are sent
        (other peers may finish the phase and audit before this one does)."""
        outcome = self._phases[key] = PhaseOutcome(result=None)
        while len(self._phases) > KEEP_PHASES:
            self._phases.popitem(last=False)
        return outcome

    def after_phase(self, key: str, outcome: PhaseOutcome, peers: list[str], senders, codec) -> None:
        digests = {j: r.receipt.output_digest for j, r in outcome.receipts.items()}
        plan = audit_plan(key, digests, peers, sorted(senders), self.audit_probability)
        me = str(self.peer_id)
        for j, auditor in plan.items():
            if auditor == me:
                asyncio.create_task(self._audit_logged(key, j, peers[j], codec))

    async def _audit_logged(self, key: str, j: int, reducer: str, codec) -> None:
        try:
            await self._audit(key, j, reducer, codec)
        except Exception:  # an audit is a background check: it must never take the averager down
            logger.exception(f"auditing partition {j} of {key} ({reducer}) failed")

    async def _audit(self, key: str, j: int, reducer: str, codec) -> None:
        phase = self._phases.get(key)
        if phase is None or j not in phase.receipts:
            return  # evicted by newer phases before this task ran
        opened: OpenedReceipt = phase.receipts[j]
        me = str(self.peer_id)
        parts, missing = [], []
        for c in opened.commitments:
            if c.p2p_id == me:
                parts.append(phase.sent_parts[j])
                continue
            tensors = await self._fetch(c.p2p_id, "rpc_audit_part", AuditRequest(group=key, partition=j))
            if tensors is None or digest(tensors) != c.digest:
                missing.append(c.p2p_id)
            parts.append(tensors)
        self.audits_done += 1
        if missing:
            logger.warning(f"audit of partition {j} ({reducer}) inconclusive: {missing} did not reveal their parts")
            for p in missing:  # a flag's weight: a slow or restarting honest peer must not be excluded for it
                self.exclusions.penalize(p, self.exclusions.policy.flag_penalty, "did not reveal its part when audited")
            return
        aggregate = phase.aggregates[j]
        loop = asyncio.get_running_loop()
        received = codec.decode(aggregate, opened.receipt.numel)
        recomputed = await loop.run_in_executor(None, recompute, opened, parts, codec, self.rules.aggregator,
                                                self.rules.policy)
        ok, rel = self._judge_aggregate(received, recomputed, codec)
        if ok:
            return
        reason = f"aggregate of partition {j} differs from the recomputation by {rel:.3g} of its norm"
        logger.warning(f"audit: reducer {reducer} lied: {reason}")
        self.exclusions.exclude(reducer, f"audit: {reason}")
        self._evidence[(key, j)] = (aggregate, parts)
        while len(self._evidence) > 4 * KEEP_PHASES:
            self._evidence.popitem(last=False)
        accusation = seal(Accusation(run_id=self.run_id, peer_id=self.identity.peer_id, time=get_dht_time(),
                                     p2p_id=me, accused=reducer, receipt=opened.raw, reason=reason),
                          self.identity)
        # the sub-key is the accusation's own (Accusation.dht_subkey: the run's DHT validator checks it)
        await self.dht.store(accusations_key(self.prefix), subkey=f"{me}/{key}/{j}", value=accusation,
                             expiration_time=get_dht_time() + self.exclusions.policy.exclude_s, return_future=True)

    def _judge_aggregate(self, received, recomputed, codec) -> tuple[bool, float]:
        """Whether a reducer's decoded aggregate matches the recomputation: ``(ok, relative difference)``
        (:func:`~swarm.averaging.audit.matches`)."""
        return matches(received, recomputed, codec)

    async def _fetch(self, peer: str, method: str, request: AuditRequest, evidence: bool = False):
        """Call an audit RPC; returns the tensors (or ``(reply, tensors)`` with ``evidence``), None on failure."""
        try:
            stub = type(self).get_stub(self._p2p, PeerID.from_base58(peer), namespace=self.prefix)

            async def call():
                stream = await getattr(stub, method)(stream_out(runtime_pb2.ExpertRequest, pack_message(request), [],
                                                                self.wire))
                metadata, tensors = await gather(stream, counter=self.wire)
                return unpack_message(metadata, AuditReply), tensors
            reply, tensors = await asyncio.wait_for(call(), 2 * self.rules.phase_timeout)
        except Exception as e:
            logger.debug(f"{method} to {peer} failed: {e!r}")
            return None
        if reply.error:
            return None
        return (reply, tensors) if evidence else tensors

    async def _serve_audit(self, stream, context: P2PContext, lookup) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        """Answer an :class:`AuditRequest` with ``lookup(request) -> (AuditReply, tensors)``, within the asking
        peer's quota (:data:`AUDIT_RATE_PER_S`)."""
        try:
            with self.audit_quota.hold(str(context.remote_id)):
                await self._admit(context)
                metadata, _ = await gather(stream, max_bytes=0, max_tensors=0, counter=self.wire,
                                           deadline_s=self.rules.phase_timeout)
                reply, out = lookup(unpack_message(metadata, AuditRequest))
        except (ProtocolError, Busy, TooFast) as e:
            reply, out = AuditReply(error=f"bad request: {e}"), []
        async for msg in stream_out(runtime_pb2.ExpertResponse, pack_message(reply), out, self.wire):
            yield msg

    async def rpc_audit_part(self, stream: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
                             ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        """The encoded part this peer sent for an audited partition."""
        def lookup(req: AuditRequest):
            phase = self._phases.get(req.group)
            part = phase.sent_parts.get(req.partition) if phase is not None else None
            if part is None:
                return AuditReply(error="unknown phase or partition"), []
            return AuditReply(parts=1, tensors_per_part=len(part)), part

        async for msg in self._serve_audit(stream, context, lookup):
            yield msg

    async def rpc_audit_evidence(self, stream: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
                                 ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        """Evidence behind an accusation: the encoded aggregate, then every committed part in receipt order."""
        def lookup(req: AuditRequest):
            found = self._evidence.get((req.group, req.partition))
            if found is None:
                return AuditReply(error="no evidence for this partition"), []
            aggregate, parts = found
            return (AuditReply(parts=len(parts), tensors_per_part=len(aggregate)),
                    list(aggregate) + [t for p in parts for t in p])

        async for msg in self._serve_audit(stream, context, lookup):
            yield msg

    # ---- everybody else's accusations --------------------------------------------------------------------
    def start_accusation_poller(self) -> None:
        if self._poller is None:
            self._poller = asyncio.create_task(self._poll_accusations())

    async def _poll_accusations(self) -> None:
        tries: dict[str, int] = {}
        wait = POLL_S[0]
        while True:
            fresh = False
            try:
                found = await self.dht.get(accusations_key(self.prefix), latest=True, return_future=True)
                entries = found.value if found is not None and isinstance(found.value, dict) else {}
                for item in entries.values():
                    seen = hashlib.sha256(item.value if isinstance(item.value, bytes) else b"").hexdigest()
                    if seen in self._seen_accusations:  # (by content: junk under a sub-key hides no later value)
                        continue
                    fresh = True
                    verdict = await self._verify_accusation(item.value)
                    tries[seen] = tries.get(seen, 0) + 1
                    if verdict is not None or tries[seen] >= 3:
                        self._seen_accusations.add(seen)
                        tries.pop(seen, None)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                logger.debug(f"reading accusations failed: {e!r}")
            wait = POLL_S[0] if fresh else min(2 * wait, POLL_S[1])
            await asyncio.sleep(wait)

    async def _verify_accusation(self, blob) -> Optional[bool]:
        """Check one accusation; True: reducer excluded, False: settled otherwise (accuser excluded, or the
        accusation ignored), None: could not check (yet).

        The accuser's libp2p id (``p2p_id``) is the signer's own (:func:`~swarm.protocol.open_record` refuses any
        other), so a stranger cannot accuse in an honest peer's name, and every peer can attribute an
        accusation, whether or not it ever averaged with the accuser. The accuser must have sent a part to the
        accused in that round (its commitment is in the receipt): anyone else's accusation is ignored.
        """
        try:
            acc, _ = open_record(blob, Accusation, run_id=self.run_id)
        except ProtocolError as e:
            logger.debug(f"ignoring a malformed accusation: {e}")
            return False
        me = str(self.peer_id)
        if acc.p2p_id == me or acc.accused == me or self.exclusions.is_excluded(acc.accused):
            return True
        if not acc.p2p_id or self.exclusions.is_excluded(acc.p2p_id):
            return False  # (an excluded accuser's evidence is not fetched again)
        try:
            opened = open_receipt(acc.receipt, self.run_id)
        except ProtocolError as e:
            self.exclusions.exclude(acc.p2p_id, f"published an accusation with an invalid receipt: {e}")
            return False
        if opened.receipt.p2p_id != acc.accused:
            self.exclusions.exclude(acc.p2p_id, "accused a peer of a receipt it did not sign")
            return False
        if acc.p2p_id not in {c.p2p_id for c in opened.commitments}:
            return False  # not in the group of that round: it never audited it (nobody is excluded for a stranger)
        got = await self._fetch(acc.p2p_id, "rpc_audit_evidence",
                                AuditRequest(group=opened.receipt.group, partition=opened.receipt.partition),
                                evidence=True)
        if got is None:
            return None
        reply, tensors = got
        t = reply.tensors_per_part
        if t < 1 or len(tensors) != t * (reply.parts + 1) or reply.parts != len(opened.commitments):
            self.exclusions.exclude(acc.p2p_id, "served malformed evidence for its accusation")
            return False
        aggregate, parts = tensors[:t], [tensors[t * (i + 1):t * (i + 2)] for i in range(reply.parts)]
        try:
            codec = make_codec(opened.receipt.codec)
            guilty, why = await asyncio.get_running_loop().run_in_executor(
                None, verify_evidence, opened, aggregate, parts, codec, self.rules.aggregator, self.rules.policy)
        except (ProtocolError, ValueError) as e:
            self.exclusions.exclude(acc.p2p_id, f"its evidence does not match the signed receipt: {e}")
            return False
        if guilty:
            logger.warning(f"verified the accusation by {acc.p2p_id}: excluding {acc.accused}: {why}")
            self.exclusions.exclude(acc.accused, f"verified accusation: {why}")
            return True
        logger.warning(f"refuted the accusation by {acc.p2p_id} against {acc.accused}: {why}; excluding the accuser")
        self.exclusions.exclude(acc.p2p_id, f"false accusation: {why}")
        return False

