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

from typing import Optional

from hivemind.p2p import P2PContext
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
        await admit(self.gate, str(context.remote_id), ProtocolError)

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
