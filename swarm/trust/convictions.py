"""Convictions shared: a spot check's evidence, verified by every peer that acts on it.

A trainer whose spot check convicts a server (:mod:`swarm.trust.spotcheck`) pushes the evidence to the run's
servers (``rpc_push_evidence``, :func:`share_evidence`). Checking it needs no parameters
(:func:`~swarm.trust.evidence.verify_evidence`:
signatures, digests, distances), so any server can: one that verifies it keeps it (:class:`ConvictionBook`),
lists the accused in its :class:`~swarm.protocol.ServerInfo` (``convicted``) and, if the accused serves its own
stage, excludes it from its averaging groups. A trainer that sees a peer id listed there fetches the evidence
from the listing server (``rpc_get_evidence``), verifies it itself, and stops routing to the accused. No peer
takes another's word: each acts only on evidence it verified, and evidence that does not verify is refused with
its cause (one log line), costing the sender its request.

Wire: the evidence's wire form (:func:`~swarm.trust.evidence.pack_evidence`), within ``6 x`` a stage message's byte
budget.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from typing import AsyncIterator, Awaitable, Callable, Iterable, Optional

from hivemind.p2p import P2P, P2PContext, PeerID
from hivemind.proto import runtime_pb2

from swarm.net.quota import PeerQuota
from swarm.config import RunSpec
from swarm.net.stage_rpc import max_message_bytes
from swarm.net.transport import ProtocolServicer, gather, stream_out
from swarm.protocol import (EvidenceMessage, EvidenceRequest, ProtocolError, Refusal, ServerInfo, StageReceipt,
                            open_record, pack_message, unpack_message)
from swarm.trust.tickets import Gate, admit
from swarm.trust.evidence import MAX_GROUP_TENSORS, SpotEvidence, pack_evidence, unpack_evidence, verify_evidence

logger = logging.getLogger(__name__)
MAX_CONVICTIONS = 32
"""Convictions a peer keeps (and lists in its record); the oldest go first."""
EVIDENCE_TIMEOUT_S = 30.0
"""Seconds a push or fetch of evidence may take."""
PUSH_RETRY_S = (5.0, 20.0)
"""Seconds a trainer waits before pushing evidence again to the servers a push failed on (then gives up)."""


class EvidenceRefused(RuntimeError, Refusal):
    """A push or fetch of evidence this peer refuses (the cause named)."""


class ConvictionBook:
    """The convictions this peer verified: accused peer id -> (reason, evidence), at most :data:`MAX_CONVICTIONS`.

    :param me: this peer's id (evidence against it is refused, not listed).
    :param min_tolerance: the least tolerance evidence is verified at (the run's ``spot_checks.rtol``).
    :param accepts: False where servers' answers are not comparable (outer steps:
        :func:`~swarm.trust.evidence.answers_comparable`): then every piece of evidence is refused.
    :param serves: ``serves(peer_id, stage)``: whether this peer has seen ``peer_id`` announced as a server of
        ``stage`` (:meth:`~swarm.net.directory.RunDirectory.seen_serving`; it may read the stage's records, so
        :meth:`add` runs off the event loop). Evidence then convicts only when the two answers that agree are signed
        by such servers: a key costs nothing, and two keys that never served the stage could otherwise sign two
        agreeing answers and frame any server that signed one receipt. None (a trainer's own checks, whose
        witnesses are the servers it routed to): no such check.
    :param vouch: ``vouch(stage, p2p_id)``: this server's standing weight of a server of ``stage`` (the averaging
        work it verified, :mod:`swarm.trust.standing`), or None if it does not serve ``stage``. A server that
        serves the accused's stage and verified the accused or a witness requires both witnesses to have weight
        with it: two keys announced as servers without doing the stage's averaging work frame nobody to the
        servers that average with the accused (and so exclude it). Otherwise the recognition decides, then ``serves``.
    :param recognized: ``recognized(stage)``: the peer ids the run key's recognition names on ``stage``, or None
        (:meth:`~swarm.trust.recognition.RecognitionReader.recognized`). Where ``vouch`` gives no weight and the
        recognition names servers on the accused's stage, both agreeing answers must be signed by servers it names:
        two keys announced as servers (``serves``: free) frame nobody to a trainer or another stage's server.
    """

    def __init__(self, run_id: str, me: str, min_tolerance: float, accepts: bool = True,
                 serves: Optional[Callable[[str, int], bool]] = None,
                 vouch: Optional[Callable[[int, str], Optional[float]]] = None,
                 recognized: Optional[Callable[[int], Optional[frozenset[str]]]] = None):
        self.run_id, self.me, self.min_tolerance, self.accepts = run_id, me, min_tolerance, accepts
        self.serves, self.vouch, self.recognized = serves, vouch, recognized
        self._known: OrderedDict[str, tuple[str, SpotEvidence, StageReceipt]] = OrderedDict()

    def __contains__(self, peer_id: str) -> bool:
        return peer_id in self._known

    def listed(self) -> dict[str, str]:
        """Accused peer id -> reason (what this peer announces)."""
        return {peer: reason for peer, (reason, _, _) in self._known.items()}

    def of_stage(self, stage: Optional[int]) -> dict[str, str]:
        """libp2p id -> reason of the convicted servers that answered for ``stage`` (to exclude from its
        averaging)."""
        return {receipt.p2p_id: reason for reason, _, receipt in self._known.values() if receipt.stage == stage}

    def evidence(self, peer_id: str) -> Optional[SpotEvidence]:
        found = self._known.get(peer_id)
        return found[1] if found else None

    def add(self, evidence: SpotEvidence) -> tuple[StageReceipt, bool]:
        """Verify ``evidence`` and keep it. Returns the accused's receipt (its ``peer_id``, ``p2p_id``, ``stage``)
        and whether the conviction is new here.

        :raises ProtocolError: the evidence does not verify, is for another run, or accuses this peer.
        """
        if evidence.run_id != self.run_id:
            raise ProtocolError(f"evidence is for run {evidence.run_id!r}, not {self.run_id!r}")
        if not self.accepts:
            raise ProtocolError("this run averages with outer steps: the servers of a stage hold their own inner "
                                "parameters between outer steps, so their answers differ and prove nothing")
        accused = verify_evidence(evidence, self.min_tolerance)
        if accused == self.me:
            raise ProtocolError("evidence accuses this peer; it is not listed (check this server's hardware and code)")
        receipt, _ = open_record(evidence.answers[evidence.accused][0], StageReceipt, run_id=self.run_id)
        if accused in self._known:
            return receipt, False
        self._check_witnesses(evidence, receipt)
        reason = f"spot check: its stage {receipt.stage} {receipt.call} answer at epoch {receipt.epoch} is far from " \
                 f"two " \
                 f"agreeing servers' (verified evidence)"
        self._known[accused] = (reason, evidence, receipt)
        while len(self._known) > MAX_CONVICTIONS:
            self._known.popitem(last=False)
        return receipt, True

    def _check_witnesses(self, evidence: SpotEvidence, accused: StageReceipt) -> None:
        """:raises ProtocolError: an agreeing answer's signer has no standing with this server where it weighs
        them (see ``vouch``), is not named by the run key's recognition where it names servers of the stage (see
        ``recognized``), or was never seen serving the stage (see ``serves``)."""
        stage = accused.stage
        witnesses = [open_record(sealed, StageReceipt, run_id=self.run_id)[0]
                     for i, (sealed, _) in enumerate(evidence.answers) if i != evidence.accused]
        weights = {r.p2p_id: self.vouch(stage, r.p2p_id) for r in [accused, *witnesses]} if self.vouch else {}
        if any(w for w in weights.values()):
            weightless = [r.peer_id for r in witnesses if not weights[r.p2p_id]]
            if weightless:
                raise ProtocolError(f"the agreeing answers are signed by {', '.join(p[:64] for p in weightless)}, "
                                    f"whose averaging work this stage {stage} server never verified: keys that did "
                                    "not average with it convict nobody here")
            return
        named = self.recognized(stage) if self.recognized is not None else None
        if named:
            unnamed = [r.peer_id for r in witnesses if r.peer_id not in named]
            if unnamed:
                raise ProtocolError(f"the agreeing answers are signed by {', '.join(p[:64] for p in unnamed)}, which "
                                    f"the run key does not recognize on stage {stage}: keys that only announced "
                                    "themselves convict nobody")
            return
        if self.serves is None:
            return
        signers = [r.peer_id for r in witnesses]
        unknown = [p for p in signers if not self.serves(p, stage)]
        if unknown:
            raise ProtocolError(f"the agreeing answers are signed by {', '.join(p[:64] for p in unknown)}, never seen "
                                f"serving stage {stage}: evidence from keys that did not serve the stage convicts "
                                "nobody")


class EvidenceService(ProtocolServicer):
    """``rpc_push_evidence`` (a trainer hands over a conviction) and ``rpc_get_evidence`` (a peer asks for the
    evidence behind a listed conviction), on namespace ``run_id``.

    :param on_conviction: called with the accused's receipt after evidence verified (e.g. to exclude it).
    :param gate: in a run that admits only ticketed peers, awaited with each caller's libp2p id before its
        request is read (:class:`~swarm.trust.tickets.TicketGate`); None serves anyone.
    """

    wire_name = "EvidenceService"

    def __init__(self, spec: RunSpec, book: ConvictionBook,
                 on_conviction: Optional[Callable[[StageReceipt], None]] = None,
                 gate: Optional[Gate] = None):
        self.spec, self.book, self.on_conviction, self.gate = spec, book, on_conviction, gate
        self.max_bytes = 6 * max_message_bytes(spec)
        self.quota = PeerQuota(max_in_flight=4, rate_per_s=5.0)  # evidence is rare: one push per conviction

    async def rpc_push_evidence(self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
                                ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        with self.quota.hold(str(context.remote_id)):
            await admit(self.gate, str(context.remote_id), EvidenceRefused)
            meta, tensors = await gather(requests, self.max_bytes, max_tensors=6 * MAX_GROUP_TENSORS,
                                         deadline_s=EVIDENCE_TIMEOUT_S)
            msg = unpack_message(meta, EvidenceMessage)
            evidence = unpack_evidence(msg, tensors)
            receipt, new = await asyncio.get_running_loop().run_in_executor(None, self.book.add, evidence)
            if new:
                logger.warning("verified the evidence from %s: stage %d server %s lied to a trainer; listing it",
                               context.remote_id, receipt.stage, receipt.peer_id)
                if self.on_conviction is not None:
                    self.on_conviction(receipt)
            ack = EvidenceRequest(run_id=self.book.run_id, accused=receipt.peer_id)
            async for out in stream_out(runtime_pb2.ExpertResponse, pack_message(ack), []):
                yield out

    async def rpc_get_evidence(self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
                               ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        with self.quota.hold(str(context.remote_id)):
            await admit(self.gate, str(context.remote_id), EvidenceRefused)
            meta, _ = await gather(requests, max_tensors=0, deadline_s=EVIDENCE_TIMEOUT_S)
            req = unpack_message(meta, EvidenceRequest)
            evidence = self.book.evidence(req.accused) if req.run_id == self.book.run_id else None
            if evidence is None:
                raise EvidenceRefused(f"no evidence against {req.accused[:64]!r} here")
            msg, tensors = pack_evidence(evidence)
            async for out in stream_out(runtime_pb2.ExpertResponse, pack_message(msg), tensors):
                yield out


async def push_evidence(p2p: P2P, p2p_id: str, evidence: SpotEvidence) -> None:
    """Hand ``evidence`` to the peer ``p2p_id``. :raises Exception: refused or unreachable."""
    stub = EvidenceService.get_stub(p2p, PeerID.from_base58(p2p_id), namespace=evidence.run_id)
    msg, tensors = pack_evidence(evidence)

    async def call():
        return await gather(await stub.rpc_push_evidence(stream_out(runtime_pb2.ExpertRequest, pack_message(msg),
                                                                    tensors)), max_tensors=0)
    await asyncio.wait_for(call(), EVIDENCE_TIMEOUT_S)


async def share_evidence(p2p: P2P, servers: dict[str, ServerInfo], evidence: SpotEvidence, accused: str,
                         log: logging.Logger | logging.LoggerAdapter = logger) -> None:
    """Hand ``evidence`` against ``accused`` to every server in ``servers`` (peer id -> record) but the accused
    (they verify it before they list it). A push that fails (the server busy or unreachable for
    :data:`EVIDENCE_TIMEOUT_S`) is tried again after each of :data:`PUSH_RETRY_S`; a server missed for good still
    learns it from a stage-mate's listing (:class:`ConvictionFollower`)."""
    targets = [s for p, s in servers.items() if p != accused]
    handed = 0
    for delay in (*PUSH_RETRY_S, None):
        results = await asyncio.gather(*(push_evidence(p2p, s.p2p_id, evidence) for s in targets),
                                       return_exceptions=True)
        handed += sum(not isinstance(r, BaseException) for r in results)
        failed = [(s, r) for s, r in zip(targets, results) if isinstance(r, BaseException)]
        log.info("handed the spot-check evidence against %s to %d of %d servers%s", accused, handed,
                 len(servers) - (accused in servers), "".join(
                     f"; {s.peer_id} failed: {r!r}"[:160] for s, r in failed[:4]))
        if not failed or delay is None:
            return
        targets = [s for s, _ in failed]
        await asyncio.sleep(delay)


async def fetch_evidence(p2p: P2P, p2p_id: str, spec: RunSpec, run_id: str, accused: str) -> SpotEvidence:
    """The evidence against ``accused`` kept by peer ``p2p_id`` (not yet verified: see :class:`ConvictionBook`).

    :raises Exception: refused, unreachable, or malformed (:class:`~swarm.protocol.ProtocolError`).
    """
    stub = EvidenceService.get_stub(p2p, PeerID.from_base58(p2p_id), namespace=run_id)
    request = pack_message(EvidenceRequest(run_id=run_id, accused=accused))

    async def call():
        meta, tensors = await gather(await stub.rpc_get_evidence(stream_out(runtime_pb2.ExpertRequest, request, [])),
                                     6 * max_message_bytes(spec), max_tensors=6 * MAX_GROUP_TENSORS)
        return unpack_evidence(unpack_message(meta, EvidenceMessage), tensors)
    return await asyncio.wait_for(call(), EVIDENCE_TIMEOUT_S)


MAX_ASKED = 1024
"""(lister, accused) pairs a follower remembers having asked about (older ones are forgotten first)."""
PER_LISTER = 32
"""Accused one listing server can have a follower fetch evidence for (a record lists at most the book's 32)."""
RETRY_S = 60.0
"""Seconds before a follower asks the same listing server about the same accused again (after a failure)."""


class ConvictionFollower:
    """Learns the convictions other servers list (``ServerInfo.convicted``): fetches the evidence from a listing
    server, verifies it into ``book`` and calls ``on_adopted(peer_id, reason)``. Nobody is convicted on another's
    word: evidence that does not verify is logged (one line) and dropped. One fetch per accused at a time; after
    a failure the next lister is tried, the same one again after :data:`RETRY_S`; each lister gets at most
    :data:`PER_LISTER` fetches remembered, so one record listing many made-up convictions cannot use up the
    follower. A trainer follows the servers it routes to; a server follows its stage-mates, so one that joins
    after a conviction learns it from their records (before, only from the next conviction).

    :param spawn: runs a coroutine beside the caller's work (the caller cancels or drains it).
    """

    def __init__(self, book: ConvictionBook, p2p: P2P, spec: RunSpec, run_id: str,
                 spawn: Callable[[Awaitable], None], on_adopted: Callable[[str, str], None],
                 log: logging.Logger | logging.LoggerAdapter = logger):
        self.book, self.p2p, self.spec, self.run_id = book, p2p, spec, run_id
        self.spawn, self.on_adopted, self.log = spawn, on_adopted, log
        self._asked: OrderedDict[tuple[str, str], float] = OrderedDict()  # (lister, accused) -> monotonic time
        self._fetching: set[str] = set()

    def follow(self, found: Iterable[ServerInfo]) -> None:
        """Start fetching the evidence behind convictions listed in ``found`` not known here yet."""
        now = time.monotonic()
        for server in found:
            for accused in server.convicted:
                if accused in self.book or accused == self.book.me or accused in self._fetching:
                    continue
                asked = (server.peer_id, accused)
                if now - self._asked.get(asked, -RETRY_S) < RETRY_S or self._count(server.peer_id) >= PER_LISTER:
                    continue
                self._asked[asked] = now
                self._asked.move_to_end(asked)
                while len(self._asked) > MAX_ASKED:
                    self._asked.popitem(last=False)
                self._fetching.add(accused)
                self.spawn(self._adopt(server, accused))

    def _count(self, lister: str) -> int:
        return sum(who == lister for who, _ in self._asked)

    async def _adopt(self, server: ServerInfo, accused: str) -> None:
        try:
            evidence = await fetch_evidence(self.p2p, server.p2p_id, self.spec, self.run_id, accused)
            receipt, _ = await asyncio.get_running_loop().run_in_executor(None, self.book.add, evidence)
            reason = self.book.listed().get(receipt.peer_id)
        except Exception as e:
            self.log.info("the evidence %s lists against %s does not hold: %s", server.peer_id, accused, str(e)[:200])
            return
        finally:
            self._fetching.discard(accused)
        if reason is not None:
            self.on_adopted(receipt.peer_id, reason)


__all__ = ["ConvictionBook", "ConvictionFollower", "EvidenceService", "fetch_evidence", "push_evidence",
           "share_evidence"]
