"""hivemind's matchmaking, fixed: a group leader's answers delivered, and its lookups of the group paced."""

from __future__ import annotations

import asyncio
import time
from typing import AsyncIterator, Awaitable, Callable

from hivemind.p2p import P2PContext
from hivemind.proto import averaging_pb2

from swarm.net.transport import LINGER_S

LOOKUP_GAP = 0.1
"""Least time between two of matchmaking's lookups of the group's averagers in the DHT, as a fraction of
``matchmaking_time``. hivemind 1.1.12 looks again as soon as the last lookup answered while it waits for its
group (``PotentialLeaders``): 5341 of the demo swarm's 8000 DHT calls in 150 s were these lookups, measured. A
peer now learns of a group-mate at most a tenth of the window later."""


def paced(lookup: Callable[..., Awaitable], gap_s: float, *, clock: Callable[[], float] = time.monotonic,
          sleep: Callable[[float], Awaitable] = asyncio.sleep) -> Callable[..., Awaitable]:
    """``lookup`` (an async function) started at least ``gap_s`` seconds after its previous call ended."""
    ended = [float("-inf")]

    async def call(*args, **kwargs):
        wait = ended[0] + gap_s - clock()
        if wait > 0:
            await sleep(wait)
        try:
            return await lookup(*args, **kwargs)
        finally:
            ended[0] = clock()

    return call


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
