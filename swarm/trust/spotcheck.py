"""Spot checks: a trainer re-runs a sample of its stage calls on other servers of the stage.

A server can answer a forward or backward with wrong activations, gradients or loss; averaging never sees it.
So a trainer samples a fraction ``spot_checks.rate`` of its calls — forwards of every stage, backwards of the
middle stages (stage 0's backward returns nothing to the trainer) — and, beside training (never on the
micro-batch's critical path), sends the same request in *check* mode to a second server of the stage at the
same epoch (``ForwardRequest.mode="check"``, ``BackwardRequest.check``: recomputed, nothing kept). Two answers
whose relative L2 difference (:func:`~swarm.trust.evidence.relative_difference`) is within the stage's tolerance
agree; otherwise a
third server breaks the tie: the one answer that is far from both others, while those two agree, convicts
its server. Every answer is signed (:mod:`swarm.trust.receipts`), so the three receipts with the request and reply
tensors are :class:`~swarm.trust.evidence.SpotEvidence` that anyone can check
(:func:`~swarm.trust.evidence.verify_evidence`) without trusting the trainer.

The tolerance is ``max(rtol, spread_factor x median difference of the last 64 first pairs compared)``, at most
0.5: servers of a stage drift apart between state averagings (lossy all-reduce codecs), and the median of the
differences measures that drift from the answers themselves; a liar moves the median only if it is in most of
the comparisons. A convicted server is never routed to again by this trainer, and the evidence goes to the
run's servers (:func:`~swarm.trust.convictions.share_evidence`); convictions other peers list are followed too
(:class:`~swarm.trust.convictions.ConvictionFollower`).

:class:`SpotChecker` watches a trainer's pipeline from outside: the pipeline
(:class:`~swarm.trainer.pipeline.RemotePipeline`) is given it as its listener, tells it every training call and
every batch of server records it read, and routes to no server it refuses; the checker re-runs a sampled call
through the same pipeline (:class:`StageCaller`).
A sampled reply whose receipt is missing or states another request or reply than the one received convicts
its server too (an honest server always signs what it sends).

Out of sync: a server whose gradient round failed steps on its own gradient while its stage-mates step on
their aggregate, and holds other parameters than theirs at the same epoch until the next state-averaging round
(:attr:`~swarm.averaging.StageOptimizer.synced`). Its receipts say so (``synced = false``); such an answer is
not compared (its difference is no lie) and evidence holding one is refused by every verifier. So that a liar
gains little by saying so, the excuse lasts :data:`EXCUSED_STATE_ROUNDS` state rounds of its stage (counted on
the other servers' epochs) per streak of such answers; after that its answers are compared as any, and a
disagreement convicts it for this trainer (the evidence is not shared: other peers refuse it). Routing does not
avoid such a server: one that gets no micro-batches joins no round, and its stage-mates' rounds fail in turn.

Detection: a server lying on a fraction ``f`` of its calls is caught after about ``1 / (rate x f)`` of them
(200 at rate 5% and f = 10%).

Not with outer steps (``[averaging] mode = "outer"``, :mod:`swarm.averaging.outer`): the servers of a stage then
hold their own inner parameters between outer steps, so two honest servers' answers differ and prove nothing
(:func:`~swarm.trust.evidence.answers_comparable`); trainers sample no checks and every peer refuses spot-check
evidence.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import statistics
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Callable, Optional, Protocol

import torch
from hivemind.p2p import P2P

from swarm.config import RunSpec, TimeoutSpec
from swarm.net.codecs import ACTIVATION_CODECS, agreement_floor
from swarm.protocol import (BackwardRequest, ForwardRequest, ProtocolError, ServerInfo, StageReceipt,
                            open_record)
from swarm.trust.convictions import ConvictionBook, ConvictionFollower, share_evidence
from swarm.trust.evidence import SpotEvidence, answers_comparable, odd_one_out, relative_difference
from swarm.trust.receipts import check_receipt, tensors_digest
from swarm.trust.standing import Standing

logger = logging.getLogger(__name__)
SPREAD_WINDOW = 64
"""First-pair differences per (stage, call) the tolerance is measured from."""
MAX_TOLERANCE = 0.5
"""The tolerance never exceeds this relative difference, whatever the measured spread (an answer half wrong is
wrong)."""
EVIDENCE_KEPT = 16
"""Convictions whose evidence a trainer keeps."""
MAX_UNSYNCED = 256
"""Servers a trainer remembers as out of sync (the oldest are forgotten first)."""
EXCUSED_STATE_ROUNDS = 2
"""State rounds of its stage for which a server's out-of-sync answers are not compared; an honest server is back
in sync at the first one that completes."""


class StageCaller(Protocol):
    """What a spot check needs of the trainer's pipeline (:class:`~swarm.trainer.pipeline.RemotePipeline`): a stage
    call to another server, the stage's servers, and which of them it backs off from. A reply
    (:class:`~swarm.trainer.pipeline.StageReply`) has ``server``, ``msg`` (the StageResponse), ``tensors`` (decoded)
    and the wire form of what was sent and received (``request_wire``, ``reply_wire``)."""

    codec: str
    timeouts: TimeoutSpec  # forward_s and backward_s as the pipeline derived them from its links

    async def call(self, server: ServerInfo, method: str, message, tensors: list[torch.Tensor], timeout: float): ...

    async def servers(self, stage: int) -> list[ServerInfo]: ...

    def is_backed_off(self, peer_id: str) -> bool: ...


@dataclass(frozen=True)
class SampledCall:
    """A training call being checked: the pipeline that made it (and re-runs it), the stage, ``call``
    (``forward`` or ``backward``), its request in check mode with the tensors to send, the reply it got and, for a
    backward, the same server's reply to the micro-batch's forward (whose receipt binds the inputs; None if another
    server ran the forward, and then the backward was sent the inputs)."""

    caller: StageCaller
    stage: int
    call: str
    request: ForwardRequest | BackwardRequest
    tensors: list[torch.Tensor]
    primary: object
    forward: Optional[object] = None

    @property
    def method(self) -> str:
        return f"rpc_{self.call}"


class SpotChecker:
    """A trainer's spot checks (module docstring): the listener its pipeline is given.

    :param p2p: the trainer's libp2p node (evidence is pushed and fetched through it).
    :param rng: sampling and the choice of checking servers (seeded in tests).
    :param recognized: stage -> the peer ids the run key's recognition names there, or None.
    :param serves: ``serves(peer_id, stage)``, no DHT read (``RunDirectory.seen_serving(..., read=False)``): the
        :class:`~swarm.trust.convictions.ConvictionBook`'s check of evidence signers where the recognition names none.
    """

    def __init__(self, spec: RunSpec, run_id: str, p2p: Optional[P2P], *, rng: Optional[random.Random] = None,
                 log: Optional[logging.Logger | logging.LoggerAdapter] = None,
                 recognized: Optional[Callable[[int], Optional[frozenset[str]]]] = None,
                 serves: Optional[Callable[[str, int], bool]] = None):
        self.spec, self.run_id, self.p2p, self.cfg = spec, run_id, p2p, spec.spot_checks
        self.recognized = recognized if recognized is not None else (lambda stage: None)
        self.rng = rng or random.Random()
        self.log = log if log is not None else logger
        self.convicted: dict[str, str] = {}  # peer id -> reason
        self.standing = Standing()  # the checks each server passed here: its vote on exclusions (routing)
        self.evidence: deque[SpotEvidence] = deque(maxlen=EVIDENCE_KEPT)
        self.counts = dict(sampled=0, agreed=0, convicted=0, inconclusive=0, unchecked=0, adopted=0, unsynced=0)
        self._unsynced: dict[str, int] = {}  # peer id -> its stage's epoch when its out-of-sync answers began
        self._spread: dict[tuple[int, str], deque[float]] = {}
        self._tasks: set[asyncio.Task] = set()
        self._seen: dict[int, list[ServerInfo]] = {}  # stage -> its records last read (who gets evidence)
        self._handed: OrderedDict[str, tuple[SpotEvidence, set[str]]] = OrderedDict()  # accused -> (its evidence,
        # the servers it was handed to): servers first seen later get it then (_hand)
        self.book = ConvictionBook(run_id, me="", min_tolerance=spec.spot_checks.rtol,
                                   accepts=answers_comparable(spec), recognized=self.recognized, serves=serves)
        self.follower = ConvictionFollower(self.book, p2p, spec, run_id, spawn=self.spawn, on_adopted=self.adopt,
                                           log=self.log)

    # ---- the pipeline's listener ----------------------------------------------------------------------
    def refuses(self, server: ServerInfo) -> bool:
        """Never route to a server convicted here (by a check of this trainer or verified evidence of another)."""
        return server.peer_id in self.convicted

    def vote(self, peer_id: str) -> float:
        """``peer_id``'s say in which servers its stage excluded, and whether routing counts it verified (the
        :class:`~swarm.trainer.routing.Router`'s ``weight``): the checks it passed here, or 1 where the run key's
        recognition names it (150 fake records then got only the explore share of a trainer that checked nobody)."""
        named = any(peer_id in (self.recognized(k) or ()) for k in range(self.spec.model.num_stages))
        return max(self.standing.weight(peer_id), 1.0 if named else 0.0)

    def _stage_epoch(self, stage: int, other_than: str) -> Optional[int]:
        """The lower median of the epochs in the last records read of ``stage``'s servers but ``other_than``."""
        epochs = sorted(s.epoch for s in self._seen.get(stage, []) if s.peer_id != other_than)
        return epochs[(len(epochs) - 1) // 2] if epochs else None

    def _note(self, reply, stage: int) -> None:
        """Follow a training reply's receipt (one parse of a small record; an unreadable one is left to the
        checks): an out-of-sync answer starts or continues its server's streak, a synced one ends it."""
        try:
            receipt, _ = open_record(reply.msg.receipt, StageReceipt, run_id=self.run_id)
        except Exception:
            return
        peer = reply.server.peer_id
        if receipt.peer_id != peer:
            return
        if receipt.synced:
            self._unsynced.pop(peer, None)
            return
        now = self._stage_epoch(stage, peer)
        self._unsynced.setdefault(peer, receipt.epoch if now is None else now)
        while len(self._unsynced) > MAX_UNSYNCED:
            del self._unsynced[next(iter(self._unsynced))]

    def _excused(self, peer: str, stage: int) -> bool:
        """Whether an out-of-sync answer of ``peer`` is left uncompared: while its streak of such answers is
        younger than :data:`EXCUSED_STATE_ROUNDS` state rounds of its stage (the lower median of the other
        servers' epochs, which neither its record nor its receipts move)."""
        start, now = self._unsynced.get(peer), self._stage_epoch(stage, peer)
        if start is None or now is None:
            return True
        return now - start < EXCUSED_STATE_ROUNDS * self.spec.averaging.average_state_every

    def saw(self, stage: int, servers: list[ServerInfo]) -> None:
        """The records of ``stage``'s servers just read: follow the convictions they list, and hand this trainer's
        evidence to those of them it has not reached yet."""
        self._seen[stage] = servers
        self.follower.follow(servers)
        for accused in list(self._handed):
            self._hand(accused)

    def forwarded(self, caller: StageCaller, stage: int, request: ForwardRequest, tensors: list[torch.Tensor],
                  reply) -> None:
        """A training forward of ``stage`` with ``tensors`` answered ``reply``: check it if sampled."""
        self._note(reply, stage)
        if self.sample():
            check = request.model_copy(update={"mode": "check"})
            self._start(SampledCall(caller, stage, "forward", check, tensors, reply))

    def backwarded(self, caller: StageCaller, stage: int, mb_id: str, grad: torch.Tensor, inputs: torch.Tensor,
                   reply, forward) -> None:
        """A backward of ``stage`` answered ``reply`` (``forward``: the reply to the micro-batch's forward there):
        check it if sampled; stage 0's backward returns nothing to check."""
        self._note(reply, stage)
        if stage > 0 and self.sample():
            check = BackwardRequest(run_id=self.run_id, stage=stage, mb_id=mb_id, with_inputs=True, check=True)
            same = forward.server.peer_id == reply.server.peer_id
            self._start(SampledCall(caller, stage, "backward", check, [grad, inputs], reply, forward if same else None))

    async def drain(self) -> None:
        """Wait for the checks under way (a trainer that stops, a test)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    # ---- sampling ------------------------------------------------------------------------------------
    def sample(self) -> bool:
        """Whether to check the next call: with probability ``rate``, unless ``max_in_flight`` checks run."""
        if self.cfg.rate <= 0 or not answers_comparable(self.spec) or self.rng.random() >= self.cfg.rate:
            return False
        if len(self._tasks) >= self.cfg.max_in_flight:
            self.counts["unchecked"] += 1
            return False
        return True

    def _start(self, sampled: SampledCall) -> None:
        self.counts["sampled"] += 1
        self.spawn(self._check(sampled))

    def spawn(self, coro) -> None:
        """Run ``coro`` beside training; :meth:`drain` waits for it."""
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def adopt(self, peer_id: str, reason: str) -> None:
        """Stop routing to ``peer_id``, convicted by evidence another peer found and this one verified."""
        self.standing.revoke(peer_id)
        if peer_id not in self.convicted:
            self.convicted[peer_id] = reason
            self.counts["adopted"] += 1
            self.log.warning("verified another peer's evidence against server %s: %s; not routing to it again",
                             peer_id, reason)

    def tolerance(self, stage: int, call: str) -> float:
        """The relative difference above which two answers for ``stage``'s ``call`` disagree (module
        docstring), at most :data:`MAX_TOLERANCE`."""
        seen = self._spread.get((stage, call))
        spread = statistics.median(seen) if seen else 0.0
        floor = agreement_floor(ACTIVATION_CODECS[self.spec.training.activation_compression])
        return min(max(self.cfg.rtol, floor, self.cfg.spread_factor * spread), MAX_TOLERANCE)

    # ---- one check -----------------------------------------------------------------------------------
    def _receipt(self, reply, stage: int, call: str, mb_id: str) -> StageReceipt:
        return check_receipt(reply.msg.receipt, self.run_id, p2p_id=reply.server.p2p_id, stage=stage,
                             mb_id=mb_id, call=call, request_sha256=tensors_digest(reply.request_wire),
                             reply_sha256=tensors_digest(reply.reply_wire), loss=reply.msg.loss)

    async def _check(self, sampled: SampledCall) -> None:
        try:
            await self._run_check(sampled)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a check never breaks training; it is logged and counted
            self.counts["inconclusive"] += 1
            self.log.warning("spot check of stage %d %s failed: %s: %s", sampled.stage, sampled.call,
                             type(e).__name__, str(e)[:200])

    async def _run_check(self, sampled: SampledCall) -> None:
        stage, call, mb_id = sampled.stage, sampled.call, sampled.request.mb_id
        try:
            first = self._receipt(sampled.primary, stage, call, mb_id)
            if sampled.forward is not None:
                self._receipt(sampled.forward, stage, "forward", mb_id)
        except ProtocolError as e:
            self._convict(sampled.primary.server.peer_id, stage, f"its signed {call} reply does not verify: {e}")
            return
        if not first.synced and self._excused(sampled.primary.server.peer_id, stage):
            self.counts["unsynced"] += 1  # by its own signed word its parameters are not the stage's
            return
        answers = [(sampled.primary, first)]
        tolerance = self.tolerance(stage, call)
        for server in await self._witnesses(sampled, first.epoch):
            try:
                timeout = sampled.caller.timeouts.forward_s + sampled.caller.timeouts.backward_s
                reply = await sampled.caller.call(server, sampled.method, sampled.request, sampled.tensors, timeout)
                receipt = self._receipt(reply, stage, call, mb_id)
            except Exception as e:
                self.log.info("spot check: stage %d server %s did not answer a check (%s)", stage, server.peer_id,
                              str(e)[:200])
                continue
            if receipt.epoch != first.epoch or (not receipt.synced and self._excused(server.peer_id, stage)):
                continue  # other parameters: its answer says nothing about this one
            answers.append((reply, receipt))
            verdict = self._judge(stage, call, answers, tolerance)
            if verdict is not None and verdict >= 0 and not self._named_witnesses(stage, answers, verdict):
                return
            if verdict is not None:
                if verdict >= 0:
                    self._convicted_by(sampled, answers, verdict, tolerance)
                self._credit(answers, verdict)
                return
        self.counts["inconclusive"] += 1

    async def _witnesses(self, sampled: SampledCall, epoch: int) -> list[ServerInfo]:
        """Other servers of the stage to re-run the call on (up to four tries for two answers), those the run key's
        recognition names first (where it names some on the stage), then those announcing ``epoch``."""
        exclude, caller, named = sampled.primary.server.peer_id, sampled.caller, self.recognized(sampled.stage)
        found = [s for s in await caller.servers(sampled.stage) if s.peer_id != exclude]
        found.sort(key=lambda s: (bool(named) and s.peer_id not in named, s.epoch != epoch,
                                  caller.is_backed_off(s.peer_id), self.rng.random()))
        return found[:4]

    def _named_witnesses(self, stage: int, answers: list, accused: int) -> bool:
        """Whether the two agreeing answers against answer ``accused`` may convict its server: where the run key's
        recognition names servers of ``stage``, only if it names both of theirs (two fresh keys announced as servers
        would otherwise frame any server they were asked beside); counted inconclusive and logged if not."""
        named = self.recognized(stage)
        unnamed = [r.server.peer_id for i, (r, _) in enumerate(answers) if i != accused and named
                   and r.server.peer_id not in named]
        if unnamed:
            self.counts["inconclusive"] += 1
            self.log.warning("spot check of stage %d: %s's answer differs from two that agree, but the run key does "
                             "not recognize %s: no conviction", stage, answers[accused][0].server.peer_id,
                             ", ".join(unnamed))
        return not unnamed

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

    def _convicted_by(self, sampled: SampledCall, answers: list, accused: int, tolerance: float) -> None:
        stage, call = sampled.stage, sampled.call
        reply = answers[accused][0]
        others = [answers[i][0] for i in range(3) if i != accused]
        far = min(relative_difference(reply.tensors, reply.msg.loss, o.tensors, o.msg.loss) for o in others)
        witnesses = ", ".join(o.server.peer_id for o in others)
        self._convict(reply.server.peer_id, stage, f"its {call} answer differs by {far:.3g} (tolerance "
                      f"{tolerance:.3g}) from those of {witnesses}, which agree")
        if not all(receipt.synced for _, receipt in answers):
            return  # an out-of-sync answer past its excuse: convicted here; other peers refuse such evidence
        primary, check, forward = answers[0][0], answers[1][0], sampled.forward
        rebound = call == "backward" and accused == 0 and \
            tensors_digest(primary.request_wire) != tensors_digest(check.request_wire)
        self.evidence.append(SpotEvidence(
            run_id=self.run_id, stage=stage, call=call, codec=sampled.caller.codec,
            request_wire=check.request_wire, answers=[(r.msg.receipt, r.reply_wire) for r, _ in answers],
            accused=accused, tolerance=tolerance,
            accused_request_wire=primary.request_wire if rebound else [],
            forward_receipt=forward.msg.receipt if rebound else b"",
            forward_request_wire=forward.request_wire if rebound else []))
        self._share(self.evidence[-1])

    def _share(self, evidence: SpotEvidence) -> None:
        """Keep this trainer's evidence and hand it to every server it knows
        (:func:`~swarm.trust.convictions.share_evidence`), and to those of stages it reads later: a check of the
        first micro-batch can convict before the pipeline read the next stages' records."""
        accused = self.book.add(evidence)[0].peer_id
        self._handed[accused] = (evidence, set())
        while len(self._handed) > EVIDENCE_KEPT:
            self._handed.popitem(last=False)
        self._hand(accused)

    def _hand(self, accused: str) -> None:
        evidence, handed = self._handed[accused]
        servers = {s.peer_id: s for found in self._seen.values() for s in found
                   if s.peer_id not in handed and s.peer_id != accused}
        if servers:
            handed.update(servers)
            self.spawn(share_evidence(self.p2p, servers, evidence, accused, self.log))

    def _credit(self, answers: list, verdict: int) -> None:
        """A settled check: the servers whose answers agreed (both of two; the two witnesses of a conviction)
        passed it, a unit of verified work each (:class:`~swarm.trust.standing.Standing`)."""
        if verdict == -1 and len(answers) == 3:
            return  # three answers and no odd one out: inconclusive, nobody passed
        for i, (reply, _) in enumerate(answers):
            if i != verdict:
                self.standing.credit(reply.server.peer_id)

    def _convict(self, peer_id: str, stage: int, reason: str) -> None:
        self.standing.revoke(peer_id)
        if peer_id in self.convicted:
            return
        self.convicted[peer_id] = reason
        self.counts["convicted"] += 1
        self.log.warning("spot check convicted stage %d server %s: %s; not routing to it again", stage, peer_id,
                         reason)


__all__ = ["SampledCall", "SpotChecker", "StageCaller"]
