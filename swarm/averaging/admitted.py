"""The averagers' callers in a run that admits only ticketed peers (``[admission] policy = "allowlist"``).

A server's averagers run in their own processes and serve RPCs of their own: matchmaking (``rpc_join_group``),
parts (``rpc_robust_part``), audits (``rpc_audit_part``, ``rpc_audit_evidence``), state digests
(``rpc_state_agreement``) and the state download (``rpc_download_state``). Records already keep an unticketed
key out of every roster (:class:`~swarm.net.dht_validation.TicketValidator`), and so out of the groups a roster
predicts, but a key may still call these RPCs directly: hivemind's matchmaking lets a peer the roster does not
know join a group (a server that joined since the last read), and the state download and the audits answer
anyone. :class:`TicketedCallers` checks each caller's ticket first, with the run's
:class:`~swarm.trust.tickets.TicketGate` (forked into the averager's process with it; it reads the run's tickets
from the DHT at most every ten seconds), before any of its request is read.

The averagers also sign (commitments, receipts, accusations) with the identity they were started with; a
ticket renewed since must be handed to them (:meth:`TicketedCallers.set_ticket`), or their accusations are
refused by every node once the old ticket expired.
"""

from __future__ import annotations

from typing import AsyncIterator, Optional

from hivemind.p2p import P2PContext
from hivemind.proto import averaging_pb2
from hivemind.utils.mpfuture import MPFuture

from swarm.protocol import ProtocolError
from swarm.trust.tickets import Gate, admit

class TicketedCallers:
    """Mixin of :class:`~swarm.averaging.averager.RobustAllReduceMixin`: refuses callers without a ticket (module
    docstring) and takes a renewed ticket."""

    gate: Optional[Gate] = None
    """None: every caller is served (an open run)."""

    async def _admit(self, context: P2PContext) -> None:
        """(averager process) :raises ProtocolError: a ticketed run, and the caller holds no valid ticket."""
        if self.gate is not None:
            await admit(self.gate, str(context.remote_id), ProtocolError)

    async def rpc_join_group(self, request: averaging_pb2.JoinRequest, context: P2PContext
                             ) -> AsyncIterator[averaging_pb2.MessageFromLeader]:
        """hivemind's matchmaking answer (:mod:`swarm.averaging.matchmaking`), to a caller with a ticket only."""
        refusal = averaging_pb2.MessageFromLeader(code=averaging_pb2.PROTOCOL_VIOLATION)
        async for message in self._if_admitted(context, refusal, super().rpc_join_group(request, context)):
            yield message

    async def rpc_aggregate_part(self, stream: AsyncIterator[averaging_pb2.AveragingData], context: P2PContext
                                 ) -> AsyncIterator[averaging_pb2.AveragingData]:
        """hivemind's part handler (its all-reduce; this project's parts go through ``rpc_robust_part``), still
        registered: a caller without a ticket is refused before its part is read."""
        refusal = averaging_pb2.AveragingData(code=averaging_pb2.PROTOCOL_VIOLATION)
        async for message in self._if_admitted(context, refusal, super().rpc_aggregate_part(stream, context)):
            yield message

    async def _if_admitted(self, context: P2PContext, refusal, answers: AsyncIterator) -> AsyncIterator:
        """``answers`` (a handler's, not started yet) if the caller is admitted, else ``refusal`` alone."""
        try:
            await self._admit(context)
        except ProtocolError:
            await answers.aclose()
            yield refusal
            return
        async for message in answers:
            yield message

    # ---- main-process API -------------------------------------------------------------------------------
    def set_ticket(self, sealed: bytes, timeout: float = 5.0) -> None:
        """Sign from now on with ``sealed`` (this peer's renewed ticket, :attr:`swarm.identity.Identity.ticket`)
        in the envelope. :raises Exception: the averager process did not answer within ``timeout`` seconds."""
        future = MPFuture()
        self._outer_pipe.send(("_set_ticket", [], dict(sealed=sealed, future=future)))
        future.result(timeout)

    async def _set_ticket(self, sealed: bytes, future: MPFuture) -> None:
        self.identity.ticket = sealed
        future.set_result(None)


__all__ = ["TicketedCallers"]
