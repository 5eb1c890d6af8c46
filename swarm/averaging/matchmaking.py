"""hivemind's matchmaking answers, delivered: a group leader's answer to a peer that asks to join its group."""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

from hivemind.p2p import P2PContext
from hivemind.proto import averaging_pb2

from swarm.net.transport import LINGER_S


class DeliveredJoinAnswers:
    """Mixin of :class:`~swarm.averaging.averager.RobustAllReduceMixin`, before hivemind's averager in the MRO."""

    async def rpc_join_group(self, request: averaging_pb2.JoinRequest, context: P2PContext
                             ) -> AsyncIterator[averaging_pb2.MessageFromLeader]:
        """hivemind's matchmaking answer to a peer that asks this one to lead its group, whose stream then stays
        open until the asker closes it (at most :data:`~swarm.net.transport.LINGER_S`; the asker closes it as
        soon as it read the acceptance and the group, or the refusal).

        hivemind closes the stream right after its last answer, and p2pd then sometimes resets it with the
        answers still unread (:func:`~swarm.net.transport.delivering_refusals`). The asker sees the stream end
        with no answer and looks for another leader, while this leader has counted it into the group: the
        group's round then waits :data:`~swarm.averaging.averager.REGISTRATION_WAIT_S` for the asker's phase,
        fails, and is tried again (2 of 260 matchmakings in one run of ``bench/efficiency.py``, each costing both
        servers 5 s)."""
        async for message in super().rpc_join_group(request, context):
            yield message
        await asyncio.sleep(LINGER_S)
