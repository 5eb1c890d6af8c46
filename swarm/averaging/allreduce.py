"""Robust butterfly all-reduce: every peer reduces one partition with the run's aggregator, over compressed parts.

One *phase* (:class:`swarm.averaging.compression.Phase`) of an averaging round, in a group formed by
hivemind's matchmaking (peers ``0..n-1``, partition ``j`` owned by peer ``j``, cut by
:func:`~swarm.averaging.reducer.partition_bounds` at the codec's block size):

1. each sender encodes slice ``j`` of its vector with the phase's codec and streams it to peer ``j``
   (:class:`~swarm.protocol.AveragingPart`, with the SHA-256 of the encoded bytes);
2. peer ``j`` waits for the parts of all senders (at most ``timeout`` seconds), decodes and checks them and
   aggregates the survivors (:func:`~swarm.averaging.reducer.reduce_partition`), encodes the aggregate once
   with the same codec and streams the *same* encoded aggregate back to every sender
   (:class:`~swarm.protocol.AveragingReply`, with its verdict on that sender's part);
3. each sender decodes the ``n`` aggregates into the phase's result. Every honest peer therefore ends a
   phase with bit-identical results, whatever the codec.

Traffic per peer and phase: ``(n-1)/n`` of the encoded vector up and the same down as a sender, and the same
again as a reducer, so it stays proportional to the model size for any group size. Every byte of the parts
and replies is counted at the transport (:class:`WireStats`). A partition whose reducer fails makes the
phase fail (:class:`RoundFailed`): a peer never silently keeps its own values for some coordinates (the
"received X% of results" of hivemind 1.1.12).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Mapping, Optional, Sequence

import torch
from hivemind.proto import runtime_pb2

from swarm.averaging.aggregation import Aggregator
from swarm.averaging.compression import Phase, PhaseResult
from swarm.kernels.reference import all_finite
from swarm.averaging.reducer import NoValidParts, ReducePolicy, Reduction, Verdict, partition_bounds, reduce_partition
from swarm.net.codecs import WireCodec
from swarm.protocol import AveragingPart, AveragingReply, ProtocolError, pack_message, unpack_message
from swarm.net.transport import gather, stream_out

logger = logging.getLogger(__name__)


class RoundFailed(RuntimeError):
    """A phase could not produce every partition's aggregate (a reducer failed, timed out or had no valid part)."""


class WireStats:
    """Counters shared with the process that owns the averager (int64 shared memory, so the averager process
    can count while the main process reads): bytes sent/received, phases completed/failed, parts rejected and
    flagged by this peer as a reducer, rounds completed and their milliseconds in all (from the group's forming
    to this peer's averaged result: the all-reduce, not the matchmaking before it), and how many of those rounds
    found the group holding one state already (:mod:`swarm.averaging.agreement`: no phases ran); and the groups
    (one per hop of bounded groups, :mod:`swarm.averaging.groups`) this peer averaged in and their members in all
    (``group_members / groups``: the mean group size)."""

    FIELDS = ("sent", "received", "phases", "failed", "rejected", "flagged", "rounds", "round_ms", "agreed", "groups",
              "group_members")

    def __init__(self):
        self.values = torch.zeros(len(self.FIELDS), dtype=torch.int64).share_memory_()

    def __getattr__(self, name):
        if name in WireStats.FIELDS:
            return int(self.values[WireStats.FIELDS.index(name)])
        raise AttributeError(name)

    def __setattr__(self, name, value):
        if name in WireStats.FIELDS:
            self.values[WireStats.FIELDS.index(name)] = int(value)
        else:
            super().__setattr__(name, value)

    def snapshot(self) -> dict[str, int]:
        return dict(zip(self.FIELDS, self.values.tolist()))


def digest(tensors: Sequence[torch.Tensor]) -> str:
    """SHA-256 (hex) of the raw bytes of encoded tensors: a sender's commitment to a part or an aggregate."""
    h = hashlib.sha256()
    for t in tensors:
        if t.numel():
            h.update(memoryview(t.contiguous().view(-1).view(torch.uint8).numpy()))  # no copy of the bytes
    return h.hexdigest()


@dataclass
class PartitionReducer:
    """The reducer side of one phase: collects the parts of this peer's partition and aggregates them once."""

    numel: int
    senders: frozenset
    codec: WireCodec
    aggregator: Aggregator
    policy: ReducePolicy
    timeout: float
    sign_receipt: Optional[Callable[[list[bytes], str], bytes]] = None
    rank: Optional[Mapping[str, int]] = None  # sender -> aggregation order (bounded groups' later hops), else arrival
    parts: dict = field(default_factory=dict)
    weights: dict = field(default_factory=dict)
    commitments: dict = field(default_factory=dict)
    reduction: Optional[Reduction] = None
    encoded: Optional[list[torch.Tensor]] = None
    encoded_digest: str = ""  # digest(encoded), once: every sender's reply names it
    receipt: bytes = b""
    error: str = ""

    def __post_init__(self):
        self._complete = asyncio.Event()
        self._deadline = time.monotonic() + self.timeout
        self._task: Optional[asyncio.Task] = None

    async def submit(self, sender: str, part, weight: float, commitment: bytes = b""
                     ) -> tuple[AveragingReply, list[torch.Tensor]]:
        """Add ``sender``'s part (decoded float32 tensor or the exception decoding raised) with its sealed
        commitment; wait for the aggregate; return the reply for that sender and the encoded aggregate
        (empty on error). Parts without a commitment are never listed in the receipt."""
        if sender not in self.senders:
            return AveragingReply(error=f"{sender} is not a sender of this group"), []
        if self.reduction is None and not self.error and sender not in self.parts:
            self.parts[sender], self.weights[sender] = part, weight
            if commitment:
                self.commitments[sender] = commitment
            if set(self.parts) >= self.senders:
                self._complete.set()
        if self._task is None:
            self._task = asyncio.create_task(self._reduce())
        await asyncio.shield(self._task)
        if self.error:
            return AveragingReply(error=self.error), []
        v = self.reduction.verdicts.get(sender, Verdict(False, "part arrived after the partition was reduced"))
        reply = AveragingReply(accepted=v.accepted, flagged=v.flagged, reason=v.reason[:512],
                               digest=self.encoded_digest, senders=len(self.reduction.used), receipt=self.receipt)
        return reply, self.encoded

    async def _reduce(self) -> None:
        try:
            await asyncio.wait_for(self._complete.wait(), max(0.0, self._deadline - time.monotonic()))
        except asyncio.TimeoutError:
            pass
        parts, weights = dict(self.parts), dict(self.weights)
        if self.rank is not None:  # every lane of a group aggregates its blocks in one order: the same bits
            parts = dict(sorted(parts.items(), key=lambda kv: self.rank.get(kv[0], len(self.rank))))
        try:
            self.reduction = await asyncio.get_running_loop().run_in_executor(None, self._aggregate, parts, weights)
            self.encoded = self.codec.encode(self.reduction.aggregate)
            self.encoded_digest = digest(self.encoded)
            if self.sign_receipt is not None:
                listed = [self.commitments[s] for s in parts if s in self.commitments]
                self.receipt = self.sign_receipt(listed, self.encoded_digest)
        except NoValidParts as e:
            self.error = str(e)
        except Exception as e:  # a bug or a hostile input we did not foresee: fail the partition, not the peer
            logger.exception("reducing a partition failed")
            self.error = f"reducer failed: {type(e).__name__}: {e}"


    def _aggregate(self, parts: dict, weights: dict) -> Reduction:
        """Check and aggregate the parts received (:func:`~swarm.averaging.reducer.reduce_partition`).

        :raises NoValidParts: no part survived the checks.
        """
        return reduce_partition(parts, weights, self.numel, self.aggregator, self.policy)


SendFn = Callable[[str, AveragingPart, list[torch.Tensor]], Awaitable[tuple[AveragingReply, list[torch.Tensor]]]]


class Accountant:
    """Signs this peer's commitments and receipts and checks the receipts it gets (:mod:`swarm.averaging.audit`).
    The base class does nothing (the in-process harness, unit tests)."""

    def commit(self, meta: AveragingPart) -> bytes:
        return b""

    def sign_receipt(self, meta: AveragingPart, commitments: list[bytes], output_digest: str) -> bytes:
        return b""

    def check_receipt(self, reducer: str, meta: AveragingPart, commitment: bytes, reply: AveragingReply):
        """Raise :class:`RoundFailed` if ``reply.receipt`` is not a valid receipt of ``reducer`` for this part;
        return the opened receipt (or None when receipts are not in use)."""
        return None


@dataclass
class PhaseOutcome:
    """A phase's :class:`PhaseResult` (None until it completes), what each reducer said about this peer's
    parts, the opened receipts and the encoded parts this peer sent and aggregates it received, per partition."""

    result: Optional[PhaseResult]
    replies: dict = field(default_factory=dict)
    receipts: dict = field(default_factory=dict)
    sent_parts: dict = field(default_factory=dict)
    aggregates: dict = field(default_factory=dict)


async def run_phase(phase: Phase, *, group: str, me: str, peers: Sequence[str], fractions: Sequence[float],
                    weight: float, reducer: Optional[PartitionReducer], send: SendFn,
                    accountant: Accountant = Accountant(), outcome: Optional[PhaseOutcome] = None) -> PhaseOutcome:
    """Run one phase as sender (and as reducer through ``reducer``, registered by the caller).

    :param peers: the group's peer ids in partition order; ``fractions`` their shares (0 for client peers).
    :param send: streams a part to a remote reducer and returns its reply and encoded aggregate.
    :param outcome: filled as the phase goes (the caller may serve the parts it holds to auditors meanwhile).
    :raises RoundFailed: some partition has no aggregate, or its reducer's receipt is invalid.
    """
    vector, codec = phase.vector.detach().float().contiguous(), phase.codec
    bounds = partition_bounds(vector.numel(), fractions, codec.block)
    aggregate = torch.empty_like(vector)
    sent = torch.empty_like(vector)
    if outcome is None:
        outcome = PhaseOutcome(PhaseResult(aggregate=aggregate, sent=sent))
    outcome.result = PhaseResult(aggregate=aggregate, sent=sent)

    async def one(j: int, a: int, b: int) -> None:
        encoded = codec.encode(vector[a:b])
        sent[a:b] = codec.decode(encoded, b - a)
        outcome.sent_parts[j] = encoded
        meta = AveragingPart(group=group, partition=j, weight=float(weight), numel=b - a, codec=codec.name,
                             digest=digest(encoded))
        commitment = accountant.commit(meta)
        meta = meta.model_copy(update={"commitment": commitment})
        if peers[j] == me:
            reply, out = await reducer.submit(me, sent[a:b].clone(), float(weight), commitment)
        else:
            reply, out = await send(peers[j], meta, encoded)
        outcome.replies[peers[j]] = reply
        if reply.error:
            raise RoundFailed(f"reducer {peers[j]} of partition {j} failed: {reply.error}")
        try:
            part = codec.decode(out, b - a)
        except ValueError as e:
            raise RoundFailed(f"reducer {peers[j]} sent a malformed aggregate: {e}") from None
        if not all_finite(part):
            raise RoundFailed(f"reducer {peers[j]} sent a non-finite aggregate")
        if digest(out) != reply.digest:
            raise RoundFailed(f"reducer {peers[j]}'s aggregate does not match the digest it signed off")
        opened = accountant.check_receipt(peers[j], meta, commitment, reply)
        if opened is not None:
            outcome.receipts[j] = opened
        outcome.aggregates[j] = out
        aggregate[a:b] = part

    tasks = [asyncio.create_task(one(j, a, b)) for j, (a, b) in enumerate(bounds) if b > a]
    try:
        await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        raise
    return outcome


async def send_part(stub, meta: AveragingPart, encoded: list[torch.Tensor], counter, timeout: float
                    ) -> tuple[AveragingReply, list[torch.Tensor]]:
    """Client side of ``rpc_robust_part``: one request stream, one reply stream, bytes counted in ``counter``."""
    async def call():
        stream = await stub.rpc_robust_part(stream_out(runtime_pb2.ExpertRequest, pack_message(meta), encoded, counter))
        metadata, tensors = await gather(stream, max_bytes=8 * meta.numel + (1 << 20), counter=counter)
        return unpack_message(metadata, AveragingReply), tensors
    try:
        return await asyncio.wait_for(call(), timeout)
    except asyncio.TimeoutError:
        return AveragingReply(error=f"no reply within {timeout:.0f} s (twice [averaging] next_chunk_timeout): the "
                              "link to it is slow or down, or it is overloaded; on slow links raise "
                              "next_chunk_timeout"), []
    except (ProtocolError, ConnectionError, OSError) as e:
        return AveragingReply(error=f"{type(e).__name__}: {e}"), []
    except Exception as e:  # P2P handler and daemon errors: the reducer is unreachable or crashed
        return AveragingReply(error=f"{type(e).__name__}: {e}"), []


def decode_part(meta: AveragingPart, tensors: list[torch.Tensor], expected: PartitionReducer):
    """Decode a received part for ``expected``; returns the float32 tensor or the error to reject it with."""
    if meta.codec != expected.codec.name:
        return ValueError(f"codec {meta.codec!r}, this round uses {expected.codec.name!r}")
    if meta.numel != expected.numel:
        return ValueError(f"{meta.numel} values, the partition has {expected.numel}")
    if digest(tensors) != meta.digest:
        return ValueError("part does not match its digest")
    try:
        return expected.codec.decode(tensors, expected.numel)
    except ValueError as e:
        return e
