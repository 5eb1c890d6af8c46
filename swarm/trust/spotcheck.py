"""Spot checks: a trainer re-runs a sample of its stage calls on other servers of the stage (issue 11, item 4).

A server can answer a forward or backward with wrong activations, gradients or loss; averaging never sees it.
So a trainer samples a fraction ``spot_checks.rate`` of its calls — forwards of every stage, backwards of the
middle stages (stage 0's backward returns nothing to the trainer) — and, beside training (never on the
micro-batch's critical path), sends the same request in *check* mode to a second server of the stage at the
same epoch (``ForwardRequest.mode="check"``, ``BackwardRequest.check``: recomputed, nothing kept). Two answers
whose relative L2 difference (:func:`relative_difference`) is within the stage's tolerance agree; otherwise a
third server breaks the tie: the one answer that is far from both others, while those two agree, convicts
its server. Every answer is signed (:mod:`swarm.trust.receipts`), so the three receipts with the request and reply
tensors are :class:`SpotEvidence` that anyone can check (:func:`verify_evidence`) without trusting the trainer.

The tolerance is ``max(rtol, spread_factor x median difference of the last 64 first pairs compared)``, at most
0.5: servers of a stage drift apart between state averagings (lossy all-reduce codecs), and the median of the
differences measures that drift from the answers themselves; a liar moves the median only if it is in most of
the comparisons. A convicted server is never routed to again by this trainer.
A sampled reply whose receipt is missing or states another request or reply than the one received convicts
its server too (an honest server always signs what it sends).

Detection: a server lying on a fraction ``f`` of its calls is caught after about ``1 / (rate x f)`` of them
(200 at rate 5% and f = 10%).

Not with outer steps (``[averaging] mode = "outer"``, :mod:`swarm.averaging.outer`): the servers of a stage then
hold their own inner parameters between outer steps, so two honest servers' answers differ and prove nothing
(:func:`answers_comparable`); trainers sample no checks and every peer refuses spot-check evidence.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Optional, Sequence

import torch
from swarm.net.codecs import unpack_tensors
from swarm.config import RunSpec
from swarm.protocol import BackwardRequest, ForwardRequest, ProtocolError, StageReceipt, StageResponse, open_record
from swarm.trust.receipts import check_receipt, tensors_digest

if TYPE_CHECKING:
    from swarm.trainer.pipeline import RemotePipeline
    from swarm.protocol import ServerInfo

logger = logging.getLogger(__name__)
SPREAD_WINDOW = 64
"""First-pair differences per (stage, call) the tolerance is measured from."""
MAX_TOLERANCE = 0.5
"""The tolerance never exceeds this relative difference, whatever the measured spread (an answer half wrong is
wrong)."""
EVIDENCE_KEPT = 16
"""Convictions whose evidence a trainer keeps."""


@dataclass
class StageReply:
    """One stage call as the trainer saw it: the reply, its tensors (decoded), and the wire form of what was
    sent and received (what the server's receipt states)."""

    server: "ServerInfo"
    msg: StageResponse
    tensors: list[torch.Tensor]
    request_wire: list[torch.Tensor]
    reply_wire: list[torch.Tensor]


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


class SpotChecker:
    """A trainer's spot checks (module docstring). Owned by its :class:`~swarm.trainer.pipeline.RemotePipeline`.

    :param rng: sampling and the choice of checking servers (seeded in tests).
    """

    def __init__(self, spec: RunSpec, pipeline: "RemotePipeline", *, rng: Optional[random.Random] = None,
                 log: Optional[logging.Logger] = None):
        self.spec, self.pipeline, self.cfg = spec, pipeline, spec.spot_checks
        self.rng = rng or random.Random()
        self.log = log if log is not None else logger
        self.convicted: dict[str, str] = {}  # peer id -> reason
        self.evidence: deque[SpotEvidence] = deque(maxlen=EVIDENCE_KEPT)
        self.counts = dict(sampled=0, agreed=0, convicted=0, inconclusive=0, unchecked=0, adopted=0)
        self._spread: dict[tuple[int, str], deque[float]] = {}
        self._tasks: set[asyncio.Task] = set()
        self.on_evidence: Optional[Callable[[SpotEvidence], None]] = None  # the pipeline shares convictions

    # ---- sampling ------------------------------------------------------------------------------------
    def sample(self) -> bool:
        """Whether to check the next call: with probability ``rate``, unless ``max_in_flight`` checks run."""
        if self.cfg.rate <= 0 or not answers_comparable(self.spec) or self.rng.random() >= self.cfg.rate:
            return False
        if len(self._tasks) >= self.cfg.max_in_flight:
            self.counts["unchecked"] += 1
            return False
        return True

    def check_forward(self, stage: int, request: ForwardRequest, tensors: list[torch.Tensor],
                      primary: StageReply) -> None:
        """Start checking ``primary``, the reply to a training forward of ``stage`` with ``tensors``."""
        check = request.model_copy(update={"mode": "check"})
        self._start(self._check(stage, "forward", "rpc_forward", check, tensors, primary))

    def check_backward(self, stage: int, mb_id: str, grad: torch.Tensor, inputs: torch.Tensor,
                       primary: StageReply, forward: Optional[StageReply]) -> None:
        """Start checking ``primary``, the reply to a backward of middle stage ``stage`` (``forward``: the same
        server's reply to the micro-batch's forward, whose receipt binds the inputs; None if another server ran
        the forward, and then ``primary`` was sent the inputs)."""
        check = BackwardRequest(run_id=self.pipeline.run_id, stage=stage, mb_id=mb_id, with_inputs=True, check=True)
        self._start(self._check(stage, "backward", "rpc_backward", check, [grad, inputs], primary, forward))

    def _start(self, coro) -> None:
        self.counts["sampled"] += 1
        self.spawn(coro)

    def spawn(self, coro) -> None:
        """Run ``coro`` beside training; :meth:`drain` waits for it."""
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def adopt(self, peer_id: str, reason: str) -> None:
        """Stop routing to ``peer_id``, convicted by evidence another peer found and this one verified."""
        if peer_id not in self.convicted:
            self.convicted[peer_id] = reason
            self.counts["adopted"] += 1
            self.log.warning("verified another peer's evidence against server %s: %s; not routing to it again",
                             peer_id, reason)

    async def drain(self) -> None:
        """Wait for the checks under way (a trainer that stops, a test)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    def tolerance(self, stage: int, call: str) -> float:
        """The relative difference above which two answers for ``stage``'s ``call`` disagree (module
        docstring), at most :data:`MAX_TOLERANCE`."""
        seen = self._spread.get((stage, call))
        spread = statistics.median(seen) if seen else 0.0
        return min(max(self.cfg.rtol, self.cfg.spread_factor * spread), MAX_TOLERANCE)

    # ---- one check -----------------------------------------------------------------------------------
    def _receipt(self, reply: StageReply, stage: int, call: str, mb_id: str) -> StageReceipt:
        return check_receipt(reply.msg.receipt, self.pipeline.run_id, p2p_id=reply.server.p2p_id, stage=stage,
                             mb_id=mb_id, call=call, request_sha256=tensors_digest(reply.request_wire),
                             reply_sha256=tensors_digest(reply.reply_wire), loss=reply.msg.loss)

    async def _check(self, stage: int, call: str, method: str, request, tensors: list[torch.Tensor],
                     primary: StageReply, forward: Optional[StageReply] = None) -> None:
        try:
            await self._run_check(stage, call, method, request, tensors, primary, forward)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a check never breaks training; it is logged and counted
            self.counts["inconclusive"] += 1
            self.log.warning("spot check of stage %d %s failed: %s: %s", stage, call, type(e).__name__, str(e)[:200])

    async def _run_check(self, stage, call, method, request, tensors, primary, forward) -> None:
        try:
            first = self._receipt(primary, stage, call, request.mb_id)
            if forward is not None:
                self._receipt(forward, stage, "forward", request.mb_id)
        except ProtocolError as e:
            self._convict(primary.server.peer_id, stage, f"its signed {call} reply does not verify: {e}")
            return
        answers = [(primary, first)]
        tolerance = self.tolerance(stage, call)
        for server in await self._witnesses(stage, primary.server.peer_id, first.epoch):
            try:
                timeout = self.spec.timeouts.forward_s + self.spec.timeouts.backward_s
                reply = await self.pipeline._rpc(server, method, request, tensors, timeout)
                receipt = self._receipt(reply, stage, call, request.mb_id)
            except Exception as e:
                self.log.info("spot check: stage %d server %s did not answer a check (%s)", stage, server.peer_id,
                              str(e)[:200])
                continue
            if receipt.epoch != first.epoch:
                continue  # other parameters: its answer says nothing about this one
            answers.append((reply, receipt))
            verdict = self._judge(stage, call, answers, tolerance)
            if verdict is not None:
                if verdict >= 0:
                    self._convicted_by(stage, call, answers, verdict, tolerance, tensors, forward)
                return
        self.counts["inconclusive"] += 1

    async def _witnesses(self, stage: int, exclude: str, epoch: int) -> list["ServerInfo"]:
        """Other servers of ``stage`` to re-run the call on (up to four tries for two answers), those announcing
        ``epoch`` first."""
        found = [s for s in await self.pipeline.servers(stage) if s.peer_id != exclude]
        found.sort(key=lambda s: (s.epoch != epoch, self.pipeline.router.is_backed_off(s.peer_id), self.rng.random()))
        return found[:4]

    def _judge(self, stage: int, call: str, answers: list, tolerance: float) -> Optional[int]:
        """None: ask another server; -1: settled without a conviction; i >= 0: answer i lied."""
        replies = [r for r, _ in answers]
        diffs = {(i, j): relative_difference(replies[i].tensors, replies[i].msg.loss, replies[j].tensors,
                                             replies[j].msg.loss)
                 for i in range(len(replies)) for j in range(i + 1, len(replies))}
        if len(replies) == 2:
            if math.isfinite(diffs[(0, 1)]):
                self._spread.setdefault((stage, call), deque(maxlen=SPREAD_WINDOW)).append(diffs[(0, 1)])
            if diffs[(0, 1)] <= tolerance:
                self.counts["agreed"] += 1
                return -1
            return None
        accused = odd_one_out(diffs, tolerance)
        if accused is None:
            self.counts["inconclusive"] += 1
            self.log.warning("spot check of stage %d %s inconclusive: three servers disagree (%s, tolerance %.3g)",
                             stage, call, ", ".join(f"{d:.3g}" for d in diffs.values()), tolerance)
            return -1
        return accused

    def _convicted_by(self, stage, call, answers, accused, tolerance, tensors, forward) -> None:
        reply = answers[accused][0]
        others = [answers[i][0] for i in range(3) if i != accused]
        far = min(relative_difference(reply.tensors, reply.msg.loss, o.tensors, o.msg.loss) for o in others)
        witnesses = ", ".join(o.server.peer_id for o in others)
        self._convict(reply.server.peer_id, stage, f"its {call} answer differs by {far:.3g} (tolerance "
                      f"{tolerance:.3g}) from those of {witnesses}, which agree")
        primary, check = answers[0][0], answers[1][0]
        rebound = call == "backward" and accused == 0 and \
            tensors_digest(primary.request_wire) != tensors_digest(check.request_wire)
        self.evidence.append(SpotEvidence(
            run_id=self.pipeline.run_id, stage=stage, call=call, codec=self.pipeline.codec,
            request_wire=check.request_wire, answers=[(r.msg.receipt, r.reply_wire) for r, _ in answers],
            accused=accused, tolerance=tolerance,
            accused_request_wire=primary.request_wire if rebound else [],
            forward_receipt=forward.msg.receipt if rebound else b"",
            forward_request_wire=forward.request_wire if rebound else []))
        if self.on_evidence is not None:
            self.on_evidence(self.evidence[-1])

    def _convict(self, peer_id: str, stage: int, reason: str) -> None:
        if peer_id in self.convicted:
            return
        self.convicted[peer_id] = reason
        self.counts["convicted"] += 1
        self.log.warning("spot check convicted stage %d server %s: %s; not routing to it again", stage, peer_id,
                         reason)


def verify_evidence(evidence: SpotEvidence, min_tolerance: float = 0.0) -> str:
    """Check a conviction without trusting whoever shows it: the receipts' signatures, that every receipt
    states the request and reply tensors shown, that the answers are three servers' to one call of one stage
    and micro-batch at one epoch, and that the accused answer is far from two answers that agree, at the
    evidence's tolerance but never below ``min_tolerance`` (the verifier's ``spot_checks.rtol``: a tolerance
    chosen between three honest servers' small differences would otherwise single one of them out).

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
    for i, receipt in enumerate(receipts):
        if receipt.request_sha256 != tensors_digest(evidence.request_wire) and \
                not (i == evidence.accused and _bound_by_forward(evidence, receipt)):
            raise ProtocolError(f"{receipt.peer_id}'s receipt states another request than the one shown")
    diffs = {(i, j): relative_difference(replies[i], receipts[i].loss, replies[j], receipts[j].loss)
             for i in range(3) for j in range(i + 1, 3)}
    tolerance = max(evidence.tolerance, min_tolerance)
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


__all__ = ["SpotChecker", "SpotEvidence", "StageReply", "answers_comparable", "relative_difference",
           "verify_evidence"]
