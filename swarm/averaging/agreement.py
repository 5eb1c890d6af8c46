"""State rounds that move nothing when the group already holds one state.

Every ``average_state_every`` epochs the servers of a stage average their parameters and optimizer statistics
(:class:`~swarm.averaging.averager.RobustStateAverager`), which re-syncs a server that stepped on its own
gradient or missed a round. Between such events honest servers hold the same state bit for bit: they apply the
same averaged gradient with the same optimizer (their per-epoch state digests match; checkpoints are endorsed on
that). The round then sent and received about twice the state per server (the demo: 2 x 20 MB for each of
4 servers every ~15 s) and ran the aggregator over it, on the compute thread's critical path, to change nothing.

So before a state round's phases each member sends every other member the SHA-256 of the tensors it is about
to average (:class:`~swarm.protocol.StateAgreement`, ``rpc_state_agreement``), and gets theirs in the reply. If
all ``n`` digests are one, the round ends there: every member keeps its tensors, which is what the phases would
have returned (each partition's parts are ``n`` identical copies, and the run's aggregators return a value
that every part holds as is), and the round counts as completed. Otherwise (a digest differs, a member did not
answer in time or speaks an older protocol) the phases run as before.

Every honest member sees the same ``n`` digests, so they decide alike. A member that has not reached the round
within :data:`ANSWER_WAIT_S` fails the asker's round at once (its partition's reducer would not be there for the
phases either); when it arrives it may still agree with the members that answered it and skip, keeping the state
they hold, which is what the round would have left it with.
A Byzantine member gains nothing new: telling one member "equal" and another "different" splits the group's
decision, which fails the round, as withholding its part already does; and telling every member "equal" only
keeps its own state out of the honest members' average, which robust aggregation was there to do.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from typing import AsyncIterator, Optional, Sequence

import torch
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import runtime_pb2

from swarm.averaging.allreduce import RoundFailed, digest
from swarm.net.quota import Busy, TooFast
from swarm.net.transport import gather, stream_out
from swarm.protocol import ProtocolError, StateAgreement, pack_message, unpack_message

logger = logging.getLogger(__name__)

AGREEMENTS_KEPT = 16
"""Rounds whose digest a member keeps answering for (a member that decided may still be asked by slower ones)."""
ANSWER_WAIT_S = 5.0
"""Seconds a question may wait for this member to reach the round (members reach it unevenly; a part waits as
long for its phase, :data:`~swarm.averaging.averager.REGISTRATION_WAIT_S`)."""


class AgreedRounds:
    """Mixin of :class:`~swarm.averaging.averager.RobustStateAverager` (module docstring): call
    :meth:`_init_agreement` before the averager's process is forked; the mixin's ``_agreed`` replaces
    :meth:`~swarm.averaging.averager.RobustAllReduceMixin._agreed`. Uses the averager's ``rules.phase_timeout``,
    ``part_quota``, ``exclusions``, ``wire``, ``_p2p`` and ``prefix``."""

    def _init_agreement(self) -> None:
        self._agreements: OrderedDict[str, asyncio.Future] = OrderedDict()

    async def _agreed(self, tensors: Sequence[torch.Tensor], group: str, peers: Sequence[str]) -> bool:
        """Whether every member of the round ``group`` (libp2p ids ``peers``, this one among them) holds the bit-for-bit
        same ``tensors`` (any dtypes and shapes, the averaged tensors): then the round's phases are skipped."""
        me = str(self.peer_id)
        mine = await asyncio.get_running_loop().run_in_executor(None, digest, tensors)
        future = self._answer(group)
        if future.done():  # an outsider's question made it up and it was given up on: start it afresh
            del self._agreements[group]
            future = self._answer(group)
        future.set_result((mine, frozenset(peers)))
        others = [p for p in peers if p != me]
        theirs = dict(zip(others, await asyncio.gather(*(self._ask(p, group, mine) for p in others))))
        late = sorted(p for p, answer in theirs.items() if answer is None)
        if late:  # its partition's reducer would not be there either: fail now rather than after the phase's wait
            raise RoundFailed(f"members {late} did not reach the state round within {ANSWER_WAIT_S:.0f} s")
        agreed = all(d == mine for d in theirs.values())
        if agreed:
            self.wire.agreed += 1
        return agreed

    def _answer(self, group: str) -> asyncio.Future:
        """The future that holds ``(this member's digest, the group's members)`` for round ``group``."""
        future = self._agreements.get(group)
        if future is None:
            future = self._agreements[group] = asyncio.get_running_loop().create_future()
            while len(self._agreements) > AGREEMENTS_KEPT:
                _, old = self._agreements.popitem(last=False)
                old.cancel()
        return future

    async def _ask(self, peer: str, group: str, mine: str) -> Optional[str]:
        """``peer``'s digest for round ``group``: None if it did not reach the round in time or refused, "" if it
        could not be asked (an older peer without the RPC, a broken connection: the phases decide)."""
        try:
            stub = type(self).get_stub(self._p2p, PeerID.from_base58(peer), namespace=self.prefix)

            async def call() -> StateAgreement:
                request = StateAgreement(group=group, state_sha256=mine)
                stream = await stub.rpc_state_agreement(stream_out(runtime_pb2.ExpertRequest, pack_message(request),
                                                                   [], self.wire))
                metadata, _ = await gather(stream, max_bytes=0, max_tensors=0, counter=self.wire)
                return unpack_message(metadata, StateAgreement)
            reply = await asyncio.wait_for(call(), ANSWER_WAIT_S + self.rules.phase_timeout)
        except asyncio.TimeoutError:
            return None
        except Exception as e:
            logger.debug(f"no state digest from {peer} for round {group[:16]}: {e!r}")
            return ""
        if reply.error or reply.group != group:
            logger.debug(f"no state digest from {peer} for round {group[:16]}: {reply.error}")
            return None
        return reply.state_sha256

    async def rpc_state_agreement(self, stream: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
                                  ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        """This member's digest of the round the request names, once it reached that round (at most
        :data:`ANSWER_WAIT_S`); only to a member of that round, within the sender's quota."""
        sender, group = str(context.remote_id), ""
        try:
            with self.part_quota.hold(sender):
                await self._admit(context)
                if self.exclusions.is_excluded(sender):
                    raise ProtocolError("this peer excluded you from its averaging groups")
                metadata, _ = await gather(stream, max_bytes=0, max_tensors=0, counter=self.wire,
                                           deadline_s=self.rules.phase_timeout)
                group = unpack_message(metadata, StateAgreement).group
                reply = await self._own_digest(group, sender)
        except (ProtocolError, Busy, TooFast) as e:
            reply = StateAgreement(group=group or "-", error=f"bad request: {e}")
        async for msg in stream_out(runtime_pb2.ExpertResponse, pack_message(reply), [], self.wire):
            yield msg

    async def _own_digest(self, group: str, sender: str) -> StateAgreement:
        future = self._answer(group)
        try:
            mine, members = await asyncio.wait_for(asyncio.shield(future), ANSWER_WAIT_S)
        except asyncio.TimeoutError:
            if not future.done() and self._agreements.get(group) is future:
                del self._agreements[group]  # a round this member never reached (or an outsider's made-up id)
                future.cancel()
            return StateAgreement(group=group, error=f"no state round {group[:16]} here")
        except asyncio.CancelledError:
            if not future.cancelled():
                raise  # this handler was cancelled (the asker went away), not the round's answer
            return StateAgreement(group=group, error=f"no state round {group[:16]} here")  # evicted unanswered
        if sender not in members:
            return StateAgreement(group=group, error="you are not a member of this round")
        return StateAgreement(group=group, state_sha256=mine)


__all__ = ["AGREEMENTS_KEPT", "ANSWER_WAIT_S", "AgreedRounds"]
