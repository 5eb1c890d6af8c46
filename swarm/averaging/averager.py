"""hivemind's averagers with our all-reduce: compressed parts, robust reducers, exclusions, audits.

hivemind keeps what it is good at: matchmaking (groups over the DHT), the averager process, gradient
accumulation and its hand-off to ``hivemind.Optimizer`` (``grad_averager_factory``). The all-reduce itself
(``_aggregate_with_group``) is replaced by the phases of the peer's :class:`Compressor` run through
:func:`swarm.averaging.allreduce.run_phase`, with the RPC ``rpc_robust_part`` on the averager's libp2p
handlers. Excluded peers (:mod:`swarm.averaging.exclusion`) are refused as group members by matchmaking (as
leader and as follower) and their parts are never aggregated.

Everything here runs in the averager's own process (hivemind forks it); :class:`WireStats` and
:meth:`RobustGradientAverager.report` bring counters and exclusions back to the peer's main process.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import time
from concurrent import futures
from concurrent.futures import InvalidStateError
from dataclasses import dataclass, field, replace
from typing import AsyncIterator, Optional, Sequence

import torch
from hivemind.averaging.allreduce import AllreduceException
from hivemind.averaging.group_info import GroupInfo
from hivemind.compression import CompressionInfo, TensorRole
from hivemind.optim.grad_averager import GradientAverager
from hivemind.optim.state_averager import TrainingStateAverager, dump_optimizer_state
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.utils import get_dht_time
from hivemind.utils.asyncio import enter_asynchronously
from hivemind.utils.mpfuture import MPFuture

from swarm.aio import hold_current_task
from swarm.net.quota import Busy, PeerQuota, TooFast
from swarm.averaging.admitted import TicketedCallers
from swarm.averaging.agreement import AgreedRounds
from swarm.averaging.aggregation import Aggregator, CenteredClipAggregator, make_aggregator
from swarm.averaging.allreduce import PartitionReducer, RoundFailed, WireStats, decode_part, run_phase, send_part
from swarm.averaging.auditor import Auditor
from swarm.averaging.compression import Compressor, make_compressor
from swarm.averaging.contributions import TrainerContributions
from swarm.averaging.donors import DonorChoice
from swarm.averaging.exclusion import ExclusionBook, ExclusionPolicy, worst
from swarm.averaging.history import PartHistory
from swarm.averaging.membership import MemberTable
from swarm.averaging.groups import Lane
from swarm.averaging.hops import GroupRules, HopRounds
from swarm.averaging.matchmaking import GroupMatchmaking
from swarm.averaging.reducer import ReducePolicy, as_scored_by, partition_bounds
from swarm.config import AveragingSpec
from swarm.trust.tickets import Gate
from swarm.protocol import AveragingPart, AveragingReply, ProtocolError, pack_message, unpack_message
from swarm.net.transport import ProtocolServicer, gather, stream_out

logger = logging.getLogger(__name__)

PART_IN_FLIGHT = 4
"""Parts one group member may have in flight at a reducer (one per round; rounds of two averagers overlap)."""
PART_RATE_PER_S = 20.0
"""Parts one peer may send a reducer per second, on average (a round takes at least a matchmaking window)."""
DOWNLOAD_RATE_PER_S = 0.1
DOWNLOAD_BURST = 3
"""State downloads one peer may start at a server: 3 at once, then one per 10 s (a joining server needs one, and
one more after each failed check; each costs the server its whole state on the wire)."""
MAX_PART_TENSORS = 8
"""Tensors in one part (a codec sends one to three: values, or codes and scales, or PowerSGD's factors)."""
SNAPSHOT_WAIT_S = 30.0
"""Longest a donor waits for an epoch transition in flight before it copies its state for a download (seconds;
also at most half of ``next_chunk_timeout``, the joiner's wait for the download's first message)."""
REGISTRATION_WAIT_S = 5.0  # how long a part may wait for its phase to start here (peers run phases unevenly)


class TransitionInFlight(RuntimeError):
    """A donor was asked for its state while an epoch transition ran past :data:`SNAPSHOT_WAIT_S`; the joiner's
    download fails with this message and it tries another donor (:meth:`RobustStateAverager.get_current_state`)."""


@dataclass(frozen=True)
class AveragingRules:
    """How this peer's reducers and auditors judge parts; the same on every honest peer of a run.

    :param aggregator: the rule every reducer applies to its partition (default: CenteredClip, the spec's).
    :param policy: bounds on parts (norm ratio, weight ratio, outlier ratio).
    :param exclusion: scores that turn rejections and flags into exclusions.
    :param phase_timeout: seconds a reducer waits for the parts of a phase (a sender waits twice that).
    :param audit_probability: chance that a partition is audited in a phase (:mod:`swarm.averaging.audit`).
    :param history_outlier_ratio: the history check's flag radius (:class:`~swarm.averaging.history.PartHistory`).
    :param group_size: servers per averaging group; a larger stage averages in hops (:mod:`swarm.averaging.groups`;
        0: one group of the whole stage).
    """

    aggregator: Aggregator = field(default_factory=CenteredClipAggregator)
    policy: ReducePolicy = field(default_factory=ReducePolicy)
    exclusion: ExclusionPolicy = field(default_factory=ExclusionPolicy)
    phase_timeout: float = 10.0
    audit_probability: float = 0.5
    history_outlier_ratio: float = PartHistory.outlier_ratio
    group_size: int = 0

    @classmethod
    def from_spec(cls, avg: AveragingSpec) -> "AveragingRules":
        """The rules of the run spec's ``[averaging]`` section."""
        return cls(
            aggregator=make_aggregator(avg.aggregator, trim=avg.trim, tau_ratio=avg.clip_tau,
                                       iterations=avg.clip_iterations, pre=avg.pre_aggregation,
                                       byzantine_fraction=avg.byzantine_fraction, bucket_size=avg.bucket_size),
            policy=ReducePolicy(reject_norm_ratio=avg.reject_norm_ratio, outlier_ratio=avg.outlier_ratio,
                                max_weight_ratio=avg.max_weight_ratio),
            exclusion=ExclusionPolicy(threshold=avg.exclusion_threshold),
            phase_timeout=avg.next_chunk_timeout, audit_probability=avg.audit_probability,
            history_outlier_ratio=avg.history_outlier_ratio, group_size=avg.group_size)


class RobustAllReduceMixin(TicketedCallers, HopRounds, GroupMatchmaking, Auditor, ProtocolServicer):
    """Replaces a hivemind ``DecentralizedAverager``'s all-reduce with ours; call :meth:`_init_robust` before the
    averager's ``__init__`` (which forks the averager process).

    :param rules: how parts are judged (:class:`AveragingRules`).
    :param compressor: this peer's compressor (keeps the error-feedback residual), default identity fp32.
    :param identity: the peer's Ed25519 identity, which signs commitments, receipts and accusations
        (a fresh one if omitted); ``run_id`` namespaces them.
    :param gate: in a run that admits only ticketed peers, checks each caller of this averager's RPCs
        (:mod:`swarm.averaging.admitted`); None serves anyone.
    """

    def _init_robust(self, rules: AveragingRules, compressor: Optional[Compressor], identity, run_id: str,
                     dht, gate: Optional[Gate] = None) -> None:
        self.rules, self.gate = rules, gate
        self._init_audit(identity, run_id, rules.audit_probability, dht)
        self.compressor = compressor or make_compressor("none")
        self._init_hops(rules.group_size, self.compressor)
        self.exclusions = ExclusionBook(rules.exclusion)
        self.wire = WireStats()
        self._completed = mp.RawValue("q", 0)  # shared with the averager's process (forked after this)
        self._reducers: dict[str, asyncio.Future] = {}
        self._mm_wrapped = False
        self._member_table = MemberTable()  # the stage's counted servers (set_members): members at a time
        self.part_quota = PeerQuota(PART_IN_FLIGHT, rate_per_s=PART_RATE_PER_S)
        self.download_quota = PeerQuota(1, rate_per_s=DOWNLOAD_RATE_PER_S, burst=DOWNLOAD_BURST)

    @property
    def max_part_bytes(self) -> int:
        """The largest part a group member may send: 8 bytes per averaged element (fp32 is 4) plus 1 MiB."""
        return 8 * sum(t.numel() for t in self._averaged_tensors) + (1 << 20)

    # ---- main-process API ---------------------------------------------------------------------------
    @property
    def rounds_completed(self) -> int:
        """All-reduce rounds this averager completed with a group (its result written into the averaged
        tensors), counted in the averager's process and read here without a call to it."""
        return self._completed.value

    def report(self, timeout: float = 5.0) -> dict:
        """Exclusions, scores and verified rounds as seen by this peer's reducers and auditors:
        ``{"excluded": {libp2p id: reason}, "scores": {libp2p id: score}, "verified": {libp2p id: rounds}}``."""
        future = MPFuture()
        self._outer_pipe.send(("_report", [], dict(future=future)))
        return future.result(timeout)

    def exclude(self, peer: str, reason: str, timeout: float = 5.0) -> None:
        """Exclude ``peer`` (a libp2p id) from this peer's groups (e.g. it is on the run's ban list)."""
        future = MPFuture()
        self._outer_pipe.send(("_exclude", [], dict(peer=peer, reason=reason, future=future)))
        future.result(timeout)

    def set_members(self, table: MemberTable, timeout: float = 5.0) -> None:
        """The stage's servers whose progress counts (this one among them), as this server read them: a round's
        members are ``table.at(its start)`` (:mod:`swarm.averaging.membership`), a group that holds every one of
        them not excluded is complete, and its round begins at once (:meth:`_expect_members`)."""
        future = MPFuture()
        self._outer_pipe.send(("_set_members", [], dict(table=table, future=future)))
        future.result(timeout)

    @property
    def _members(self) -> frozenset[str]:
        """libp2p ids of the stage's averaging members now (DHT time)."""
        return self._member_table.at(get_dht_time())

    async def _shutdown(self, timeout: Optional[float]) -> None:
        """(averager process) hivemind's shutdown, then its replica of the DHT's client, which hivemind leaves open."""
        try:
            await super()._shutdown(timeout)
        finally:
            if getattr(self, "_p2p", None) is not None:
                await self._p2p.shutdown()  # removes its Unix socket file, /tmp/hivemind-p2pclient-*.sock

    async def _report(self, future: MPFuture) -> None:
        book = self.exclusions
        future.set_result({"excluded": {p: book.exclusions[p].reason for p in book.excluded()},
                           "scores": dict(book.scores), "verified": dict(book.verified)})

    async def _exclude(self, peer: str, reason: str, future: MPFuture) -> None:
        self.exclusions.exclude(peer, reason)
        self._expect_members()
        future.set_result(None)

    async def _set_members(self, table: MemberTable, future: MPFuture) -> None:
        self._member_table = table
        self._expect_members()
        future.set_result(None)

    async def _step(self, *, step, future_for_init):
        hold_current_task()  # hivemind keeps no reference to it; collected while it waited, its round never ran
        if not self._mm_wrapped:
            self._wrap_matchmaking()
            self.start_accusation_poller()
        self._plan_step(step)  # this step's lanes; and exclusions may have changed since the last round
        try:
            return await super()._step(step=step, future_for_init=future_for_init)
        except InvalidStateError:
            if step.cancelled():  # the optimizer dropped this round meanwhile; hivemind 1.1.12 still sets its result
                return None
            raise
        finally:
            self._end_step(step)

    # ---- the round --------------------------------------------------------------------------------------
    async def _aggregate_with_group(self, group_info: GroupInfo, min_vector_size: int, **kwargs):
        """The round: the group hivemind assembled, then each later hop's lane (:mod:`swarm.averaging.hops`); the
        averaged tensors are written back only once every hop succeeded."""
        began, peers = time.perf_counter(), [str(p) for p in group_info.peer_ids]
        try:
            user_gathered = {p: self.serializer.loads(g[2]) for p, g in
                             zip(group_info.peer_ids, map(self.serializer.loads, group_info.gathered))}
            running = self._running_groups.get(group_info.group_id)
            if running is not None and not running.done():
                running.set_result(None)  # hivemind's bookkeeping: the round runs here, not in its AllReduceRunner
            plan = self._step_lanes()
            lane = plan.first()
            async with enter_asynchronously(self.get_tensors()) as local_tensors:
                values = list(local_tensors)
                while True:
                    values = await self._average_in(group_info, lane, values, float(kwargs.get("weight", 1.0)),
                                                    min_vector_size)
                    lane = plan.after(lane)
                    if lane is None:
                        break
                    group_info = await self._assemble_lane(lane)
                    peers = [str(p) for p in group_info.peer_ids]
                for t, a in zip(local_tensors, values):
                    t.copy_(a)
            self.wire.rounds += 1
            self._completed.value += 1
            self.wire.round_ms += round((time.perf_counter() - began) * 1000)
            return user_gathered
        except BaseException as e:
            self.wire.failed += 1
            self._log_failure(e, peers, time.perf_counter() - began)
            raise AllreduceException(f"robust all-reduce failed: {e}") from e
        finally:
            self._back_to_first_lane()  # hivemind's retry starts at the first hop

    async def _average_in(self, group_info: GroupInfo, lane: Optional[Lane], values: list[torch.Tensor],
                          weight: float, min_vector_size: int) -> list[torch.Tensor]:
        """``values`` averaged with one group (one hop, ``lane``; None: one group of the stage): new tensors,
        ``values`` left as they are."""
        rules = await self._group_rules(group_info, lane, weight, min_vector_size)
        excluded = [p for p in rules.peers if self.exclusions.is_excluded(p)]
        if excluded:
            raise RoundFailed(f"group holds excluded peers {excluded}; looking for another group")
        self.wire.groups += 1
        self.wire.group_members += len(rules.peers)
        if await self._agreed(values, group_info.group_id.hex(), rules.peers):
            return values
        return await self._run_phases(values, group_info.group_id.hex(), rules)

    async def _agreed(self, tensors: Sequence[torch.Tensor], group: str, peers: Sequence[str]) -> bool:
        """Whether the round may skip its phases, every member holding these ``tensors`` already: never here (a
        gradient round's parts differ); state rounds ask the group (:mod:`swarm.averaging.agreement`)."""
        return False

    def _log_failure(self, e: BaseException, peers: list[str], seconds: float) -> None:
        """One line for a failed round: why, after how long, and, when it ran out of time (hivemind cancels it at
        ``averaging_timeout``), with whom and which setting to raise."""
        if isinstance(e, Exception):
            logger.warning(f"averaging round failed after {seconds:.1f} s: {type(e).__name__}: {e}")
        elif isinstance(e, asyncio.CancelledError) and seconds >= 0.9 * self._allreduce_timeout:
            others = [p for p in peers if p != str(self.peer_id)]
            logger.warning(f"averaging round with {others} ran out of time after {seconds:.1f} s ([averaging] "
                           f"averaging_timeout={self._allreduce_timeout:.0f} s): a link of the group is slow or down; "
                           "on slow links raise averaging_timeout")

    async def _run_phases(self, tensors, group: str, rules: GroupRules):
        me, peers, fractions = str(self.peer_id), rules.peers, rules.fractions
        gen = rules.compressor.phases(tensors, rules.seed)
        phase, index, verdicts = next(gen), 0, {}
        try:
            while True:
                key = f"{group}:{index}"
                reducer = None
                my_index = peers.index(me)
                if fractions[my_index] > 0:
                    numel = self._partition_size(phase, fractions, my_index)
                    mine = AveragingPart(group=key, partition=my_index, weight=0.0, numel=numel,
                                         codec=phase.codec.name, digest="")
                    reducer = self._new_reducer(
                        numel=numel, senders=rules.senders, codec=phase.codec, aggregator=self.rules.aggregator,
                        rank=rules.rank,
                        policy=self.rules.policy, timeout=self.rules.phase_timeout,
                        sign_receipt=lambda commitments, out, m=mine: self.accountant.sign_receipt(m, commitments, out))
                    self._future_for(key).set_result(reducer)
                outcome = self.begin_phase(key)
                await run_phase(phase, group=key, me=me, peers=peers, fractions=fractions, weight=rules.weight,
                                reducer=reducer, send=self._send, accountant=self.accountant, outcome=outcome)
                self.wire.phases += 1
                self.after_phase(key, outcome, peers, rules.senders, phase.codec)
                for peer, reply in outcome.replies.items():
                    if not reply.accepted:
                        logger.warning(f"reducer {peer} rejected this peer's part: {reply.reason}")
                if reducer is not None and reducer.reduction is not None and rules.scored:
                    self._observe(index, phase, fractions, my_index, reducer)
                    for sender, v in as_scored_by(reducer.reduction, me, reducer.parts,
                                                      self.rules.policy.copy_ratio).items():
                        verdicts.setdefault(sender, []).append(v)
                try:
                    phase = gen.send(outcome.result)
                    index += 1
                except StopIteration as stop:
                    return stop.value
        finally:
            for i in range(index + 1):
                self._reducers.pop(f"{group}:{i}", None)
            self._score(verdicts)

    def _new_reducer(self, **fields) -> PartitionReducer:
        """The reducer of this peer's partition in one phase (:class:`PartitionReducer` fields)."""
        return PartitionReducer(**fields)

    def _observe(self, index: int, phase, fractions, j: int, reducer: PartitionReducer) -> None:
        """After this peer reduced partition ``j`` of phase ``index``: a look at the senders' history (none here;
        the gradient averager's :class:`~swarm.averaging.history.PartHistory` flags lasting pushes)."""

    def _partition_size(self, phase, fractions, j) -> int:
        a, b = partition_bounds(phase.vector.numel(), fractions, phase.codec.block)[j]
        return b - a

    def _score(self, verdicts: dict) -> None:
        if not verdicts:
            return
        per_sender = {s: worst(vs) for s, vs in verdicts.items()}
        self.wire.rejected += sum(not v.accepted for v in per_sender.values())
        self.wire.flagged += sum(v.flagged for v in per_sender.values())
        for s, v in per_sender.items():
            if not v.accepted:
                logger.warning(f"rejected the part of {s}: {v.reason}")
        for new in self.exclusions.record_round({s: v for s, v in per_sender.items() if s != str(self.peer_id)}):
            logger.warning(f"excluded {new.peer} from averaging: {new.reason}")

    def _future_for(self, key: str) -> asyncio.Future:
        return self._reducers.setdefault(key, asyncio.get_running_loop().create_future())

    async def _send(self, peer: str, meta: AveragingPart, encoded):
        stub = type(self).get_stub(self._p2p, PeerID.from_base58(peer), namespace=self.prefix)
        return await send_part(stub, meta, encoded, self.wire, timeout=2 * self.rules.phase_timeout)

    async def rpc_robust_part(self, stream: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
                              ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        """A group member's part of the partition this peer reduces; replies with the partition's aggregate. An
        excluded sender is refused before its part is read, and a part is at most :attr:`max_part_bytes`."""
        sender = str(context.remote_id)
        try:
            with self.part_quota.hold(sender):
                await self._admit(context)
                if self.exclusions.is_excluded(sender):
                    raise ProtocolError("this peer excluded you from its averaging groups")
                metadata, tensors = await gather(stream, self.max_part_bytes, counter=self.wire,
                                                 max_tensors=MAX_PART_TENSORS, deadline_s=self.rules.phase_timeout)
                meta = unpack_message(metadata, AveragingPart)
                reply, out = await self._handle_part(sender, meta, tensors)
        except (ProtocolError, Busy, TooFast) as e:
            reply, out = AveragingReply(error=f"bad request: {e}"), []
        async for msg in stream_out(runtime_pb2.ExpertResponse, pack_message(reply), out, self.wire):
            yield msg

    async def rpc_download_state(self, request: averaging_pb2.DownloadRequest, context: P2PContext
                                 ) -> AsyncIterator[averaging_pb2.DownloadData]:
        """hivemind's state download (the whole state, to anyone who asks), one at a time per peer, a few per
        minute (:data:`DOWNLOAD_RATE_PER_S`), never to a peer this server excluded, nor in a ticketed run to a peer
        without a ticket.

        :raises ProtocolError: the peer is excluded or holds no ticket. :raises Busy, TooFast: past its quota."""
        peer = str(context.remote_id)
        with self.download_quota.hold(peer):
            await self._admit(context)
            if self.exclusions.is_excluded(peer):
                raise ProtocolError("this peer excluded you from its averaging; it shares no state with you")
            async for msg in super().rpc_download_state(request, context):
                yield msg

    async def _handle_part(self, sender: str, meta: AveragingPart, tensors):
        if self.exclusions.is_excluded(sender):
            return AveragingReply(error="this peer excluded you from its averaging groups"), []
        future = self._future_for(meta.group)
        try:
            reducer: PartitionReducer = await asyncio.wait_for(asyncio.shield(future), REGISTRATION_WAIT_S)
        except asyncio.TimeoutError:
            if not future.done():
                self._reducers.pop(meta.group, None)
            return AveragingReply(error=f"no averaging phase {meta.group} here"), []
        refused = self.open_commitment(sender, meta)
        part = ValueError(refused) if refused else decode_part(meta, tensors, reducer)
        return await reducer.submit(sender, part, meta.weight, b"" if refused else meta.commitment)



class RobustGradientAverager(RobustAllReduceMixin, GradientAverager):
    """GradientAverager with our all-reduce and bounded trainer contributions.

    The stage's optimizer hands it each micro-batch's gradients with the trainer they came from
    (:meth:`accumulate`); :class:`TrainerContributions` clips and accumulates per trainer and combines the
    trainers robustly when the round begins.

    :param rules: see :class:`AveragingRules`; ``compressor``, ``identity``, ``run_id``: see
        :class:`RobustAllReduceMixin`.
    :param clip_ratio: a micro-batch's gradient is clipped at this x the recent median norm (0: never).
    :param trainer_outlier_ratio: see :class:`TrainerContributions` ``outlier_ratio`` (0: never flag trainers).
    :param gate: see :class:`RobustAllReduceMixin`.
    :param kwargs: the rest go to hivemind's ``GradientAverager`` (``dht``, ``prefix``, matchmaking and timeouts).
    """

    wire_name = "RobustGradientAverager"

    def __init__(self, parameters, *, rules: AveragingRules = AveragingRules(), compressor=None, identity=None,
                 run_id: str = "local", clip_ratio: float = 5.0, trainer_outlier_ratio: float = 2.0,
                 gate: Optional[Gate] = None, **kwargs):
        self._init_robust(rules, compressor, identity, run_id, kwargs.get("dht"), gate)
        self.contributions = TrainerContributions(aggregator=rules.aggregator, clip_ratio=clip_ratio,
                                                  outlier_ratio=trainer_outlier_ratio,
                                                  exclusion=ExclusionBook(rules.exclusion))
        self._last_local: Optional[list[torch.Tensor]] = None
        self.histories: dict[int, PartHistory] = {}  # phase index -> the senders' history of my partition
        super().__init__(parameters, **kwargs)

    round_epoch: Optional[int] = None
    """The epoch of the next round (set by the optimizer in the main process): gathered with the round, it seeds
    the grid of bounded groups (:mod:`swarm.averaging.groups`)."""

    def schedule_step(self, scheduled_time=None, **kwargs):
        """hivemind's ``schedule_step``, gathering :attr:`round_epoch` unless the caller gathers something."""
        if kwargs.get("gather") is None:
            kwargs["gather"] = self.round_epoch
        return super().schedule_step(scheduled_time, **kwargs)

    def _observe(self, index, phase, fractions, j, reducer):
        a, b = partition_bounds(phase.vector.numel(), fractions, phase.codec.block)[j]
        history = self.histories.setdefault(index, PartHistory(outlier_ratio=self.rules.history_outlier_ratio,
                                                                copy_ratio=self.rules.policy.copy_ratio,
                                                                own=str(self.peer_id)))
        for sender in history.observe((phase.codec.name, a, b), reducer.parts, reducer.reduction):
            logger.info(f"flagged {sender}: {reducer.reduction.verdicts[sender].reason}")

    @torch.no_grad()
    def accumulate(self, contributor: str, gradients: Sequence[torch.Tensor], samples: int) -> float:
        """Add one micro-batch's ``gradients`` (one tensor per parameter, shaped like it) of ``samples`` samples
        from ``contributor`` (the trainer's libp2p id); returns the scale its clipping applied (1: none, 0: dropped
        for NaN/Inf, or a trainer this server excluded: its samples are not counted either)."""
        if self.contributions.exclusion.is_excluded(contributor):
            return 0.0
        self.local_samples_accumulated += samples
        self.local_times_accumulated += 1
        self._accumulators_used_in_step = False
        self._last_local = None
        return self.contributions.add(contributor, list(gradients), samples)

    @torch.no_grad()
    def accumulate_grads_(self, batch_size: int):
        """hivemind's entry point: the parameters' ``.grad`` as one contribution of an unnamed trainer."""
        self.accumulate("local", list(self._grads_from_parameters()), batch_size)

    @torch.no_grad()
    def load_accumulators_into_averager_(self):
        """Put this server's combined gradient into the averaged buffers. hivemind calls this again after a
        failed round, when the accumulators were already reset: the epoch's combined gradient is kept for that,
        so the server then steps on its own gradient (hivemind 1.1.12 would step on zeros)."""
        if self._last_local is not None:  # nothing accumulated since: combined (and the trainers scored) once
            combined = self._last_local
        else:
            combined = self._last_local = self.contributions.combine(self.parameters)
            for excluded in self.contributions.new_exclusions:
                logger.warning("excluded trainer %s's gradients for %.0f s (%s); raise "
                               "averaging.trainer_outlier_ratio if it is honest", excluded.peer,
                               excluded.until - time.time(), excluded.reason)
        with self.get_tensors() as averaged_grads:
            for avg, g in zip(averaged_grads, combined):
                avg.copy_(g)

    def use_local_gradient(self, tensors: Sequence[torch.Tensor]) -> None:
        """Average ``tensors`` (float32, one per parameter, shaped like it) in the next round as this server's
        gradient, instead of the combined accumulated ones (outer steps: the pseudo-gradient,
        :mod:`swarm.averaging.outer`); until the next :meth:`accumulate`."""
        self._last_local = [t.detach().float() for t in tensors]

    def load_state_from_peers(self, **kwargs) -> None:
        """Nothing: hivemind.Optimizer asks its gradient averager too, which would download a peer's gradient
        buffers (unchecked) only to drop them; the state comes through :class:`RobustStateAverager`."""
        return None

    @torch.no_grad()
    def reset_accumulated_grads_(self):
        self._accumulators_used_in_step = False
        self.local_samples_accumulated = self.local_times_accumulated = 0
        self.contributions.reset()


class RobustStateAverager(AgreedRounds, DonorChoice, RobustAllReduceMixin, TrainingStateAverager):
    """hivemind's TrainingStateAverager (parameters and optimizer statistics) with our all-reduce, uncompressed
    (fp32 without error feedback: parameters are not gradients), skipped when the group holds one state already
    (:mod:`swarm.averaging.agreement`), and our choice of donor when it loads the state from a live server
    (:mod:`swarm.averaging.donors`)."""

    wire_name = "RobustStateAverager"
    state_weight: float = 1.0
    """This server's weight in its state rounds (set by the optimizer before each epoch's transition): 0 while it
    is out of sync (:attr:`~swarm.averaging.StageOptimizer.synced`), so its round gives it the stage's state and moves
    no stage-mate's (the reducers keep a weight-0 part out of the vote, :mod:`~swarm.averaging.reducer`). With weight
    1 a state round of the members in sync and one out of sync moved theirs, the members that missed that round kept
    theirs, and both said "in sync", so spot checks could convict an honest server (the likely way two honest servers
    of ``tests/test_scale.py`` were convicted in CI, on answers at state-round epochs 4 and 6)."""

    def __init__(self, *, rules: AveragingRules = AveragingRules(), identity=None, run_id: str = "local",
                 gate: Optional[Gate] = None, **kwargs):
        # honest servers' parameters agree bit for bit: here copies are the honest majority, each keeps its vote
        rules = replace(rules, policy=rules.policy.model_copy(update={"copy_ratio": 0.0}))
        self._init_robust(rules, make_compressor("none"), identity, run_id, kwargs.get("dht"), gate)
        self._init_agreement()
        self._init_donors()
        super().__init__(**kwargs)

    def step(self, *args, averaging_round: bool = False, averaging_control=None, averaging_opts=None, **kwargs):
        """hivemind's ``TrainingStateAverager.step``; a state round (``averaging_round``) with :attr:`state_weight`
        (also on a round scheduled before: ``averaging_control``)."""
        if averaging_round:
            averaging_opts = {**(averaging_opts or {}), "weight": self.state_weight}
            if averaging_control is not None and not (averaging_control.triggered or averaging_control.done()):
                averaging_control.weight = self.state_weight
        return super().step(*args, averaging_round=averaging_round, averaging_control=averaging_control,
                            averaging_opts=averaging_opts, **kwargs)

    def get_current_state(self):
        """The state a joiner downloads, as hivemind's ``TrainingStateAverager.get_current_state`` builds it
        (parameters, extra tensors, optimizer statistics; the metadata with the epoch), but *copied*, under the
        tensor lock that the optimizer step also holds, and never in the middle of an epoch's transition.

        hivemind 1.1.12 hands out the live tensors (``.cpu()`` of a CPU tensor is the tensor itself) and streams
        them for as long as the download lasts; and it counts the new epoch before the transition's all-reduce and
        optimizer step ran. On a slow link the donor steps during the download (the demo's 20 MB state takes ~13 s
        at 20 Mbit/s and 150 ms: three epochs), or a download starts inside a transition (one to four seconds
        there), and the joiner gets a mix of epochs or the epoch number of the next one, which its state check
        refuses (seen in the WAN lab, ``bench/wan.py``). Here the copy waits for the transitions in flight, at most
        :data:`SNAPSHOT_WAIT_S` and half the joiner's wait for a message (``next_chunk_timeout``); if one is still
        in flight then (a round waiting on a slow or departed stage-mate), no state is shared: a copy then would
        carry the next epoch's number with the parameters and step count of the previous one, which nothing can
        contradict on a stage of two servers, and the joiner would hold an off-by-one step count for good. The
        joiner tries another donor, or this one again later. It costs one state's memory while a download runs.
        Executed in the host process.

        :raises TransitionInFlight: an epoch transition was still in flight at the deadline.
        """
        wait_s = min(SNAPSHOT_WAIT_S, (self.next_chunk_timeout or SNAPSHOT_WAIT_S) / 2)
        deadline = time.monotonic() + wait_s
        while True:
            with torch.no_grad(), self.lock_averaged_tensors:
                transitions = [f for f in list(self.pending_updates) if not f.done()]
                if transitions and time.monotonic() > deadline:
                    raise TransitionInFlight(
                        f"this server has been in an epoch transition for over {wait_s:.1f} s (a round waiting on "
                        f"its stage-mates); it shares no state in the middle of one: try another donor or again later")
                if not transitions:
                    params = [p.detach().clone() for group in self.optimizer.param_groups for p in group["params"]]
                    extra = [t.detach().clone() for t in self.extra_tensors]
                    opt_metadata, opt_tensors = dump_optimizer_state(self.optimizer)
                    opt_tensors = [t.clone() for t in opt_tensors]
                    epoch = self.local_epoch
                    break
            futures.wait(transitions, timeout=max(0.0, deadline - time.monotonic()))
        infos = [CompressionInfo.from_tensor(p, key=k, role=TensorRole.PARAMETER)
                 for p, k in zip(params, self.parameter_names)]
        infos += [CompressionInfo.from_tensor(t, key=i, role=TensorRole.UNSPECIFIED) for i, t in enumerate(extra)]
        infos += [CompressionInfo.from_tensor(t, key=i, role=TensorRole.OPTIMIZER) for i, t in enumerate(opt_tensors)]
        metadata = dict(epoch=epoch, group_bits=self.get_group_bits(), optimizer_metadata=opt_metadata)
        return metadata, [*params, *extra, *opt_tensors], infos
