"""hivemind's matchmaking, fixed: a group leader's answers delivered, and its lookups of the group paced."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace
from typing import AsyncIterator, Awaitable, Callable

from hivemind.p2p import P2PContext
from hivemind.proto import averaging_pb2

from swarm.net.transport import LINGER_S
from swarm.protocol import ProtocolError

LOOKUP_GAP = 0.1
"""Least time between two of matchmaking's lookups of the group's averagers in the DHT, as a fraction of
``matchmaking_time``. hivemind 1.1.12 looks again as soon as the last lookup answered while it waits for its
group (``PotentialLeaders``): 5341 of the demo swarm's 8000 DHT calls in 150 s were these lookups, measured. A
peer now learns of a group-mate at most a tenth of the window later."""
MIN_SHOWN_S = 30.0
"""Seconds at least that a member the recognition does not vouch for is waited for after it last showed."""


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


def uncounted_room(counted: int, joined: int) -> bool:
    """Whether a group expecting ``counted`` members the recognition counts, holding ``joined`` it does not, takes
    one more of those: at most ``max(counted - 1, 1)`` (:meth:`GroupMatchmaking._uncounted_room`)."""
    return joined + 1 <= max(counted - 1, 1)


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
        servers 5 s). (In a ticketed run a caller without a ticket is refused before: :mod:`~.admitted`.)"""
        async for message in super().rpc_join_group(request, context):
            yield message
        await asyncio.sleep(LINGER_S)


class GroupMatchmaking(DeliveredJoinAnswers):
    """Mixin of :class:`~swarm.averaging.averager.RobustAllReduceMixin`: hivemind's matchmaking told which group to
    expect (the stage's members, or a lane of bounded groups), refusing excluded peers, and paced."""

    def _expect_members(self) -> None:
        """Let matchmaking assemble the group as soon as every member of the stage not excluded joined it.

        hivemind 1.1.12 otherwise waits out the whole matchmaking window (it assembles early only at its
        ``target_group_size``, unset here): measured on the demo, an epoch's transition held a server's compute
        thread 0.5-5 s for an all-reduce of 0.2-0.4 s. A peer off the roster that joins this server's group (a
        server that joined the stage since the last roster read) turns the early start off for the round: the
        group then forms at the window's end, as before; with no roster, or this server not on it, the averager's
        own ``target_group_size`` holds. (A newcomer that asks to join after the roster's members are all in misses
        that round; the next roster read, every ``record_ttl_s / 15``, counts it.) A member the run key's
        recognition does not vouch for (``uncounted``, :func:`~swarm.averaging.membership.counted_members`) is
        waited for only once it showed in this server's matchmaking within a record TTL (:meth:`_shown`), or while
        its pushed count holds samples of this epoch (``MemberTable.working``): idle keys announced as servers
        cost no round its window (``bench/sybil.py``, one idle key on a stage of two servers: steps took 1.7-3.2 s
        instead of about 0.5 s, the trainer's rate fell to a third), and a newcomer that asks to join, or computes,
        is waited for."""
        mm = getattr(self, "_matchmaking", None)
        if mm is None:
            return
        me, self._gathering_all = str(self.peer_id), False
        mm.min_group_size = self.matchmaking_kwargs["min_group_size"]
        if self._lane is not None:  # bounded groups: this hop's lane (swarm.averaging.hops)
            mm.target_group_size, mm.min_group_size = len(self._lane.members), self._lane.quorum
            return
        uncounted, shown = self._member_table.uncounted, self._shown()
        recent = time.monotonic() - max(self._member_table.ttl_s, MIN_SHOWN_S)
        for p in [p for p, t in shown.items() if t < recent]:
            del shown[p]
        working = self._member_table.working  # (pushed samples of this epoch: computing, not an idle key)
        expected = [p for p in self._members if p == me or not self.exclusions.is_excluded(p) and (
            p not in uncounted or p in working or shown.get(p, float("-inf")) >= recent)]
        fixed = self.matchmaking_kwargs["target_group_size"]  # the averager's own (None for a stage's servers)
        mm.target_group_size = len(expected) if me in self._members and len(expected) >= 2 else fixed

    def _shown(self) -> dict[str, float]:
        """libp2p id -> ``time.monotonic()`` it last showed in this server's matchmaking: was accepted into a group
        this server led (hivemind's own checks passed), or was in a group with it."""
        if not hasattr(self, "_shown_at"):
            self._shown_at: dict[str, float] = {}
        return self._shown_at

    def _uncounted_room(self, followers) -> bool:
        """Whether a group this server leads, with ``followers`` (libp2p ids) in it, takes one more member the
        recognition does not vouch for: at most ``max(c - 1, 1)`` of them beside the ``c`` counted members expected,
        so the counted keep a strict majority of every group they average in (a lone counted server takes one
        newcomer at a time). Without it, 4 junk-sending keys beside a stage's 2 honest servers (``bench/sybil.py``
        lazy) filled its groups of 6, where the robust rule's bound does not hold: an honest server verified their
        parts, vouched for them, and the recognition then counted their rollback orders and manifests."""
        counted = [p for p in self._members - self._member_table.uncounted if not self.exclusions.is_excluded(p)]
        return uncounted_room(len(counted), sum(str(p) in self._member_table.uncounted for p in followers))

    # ---- matchmaking: keep excluded peers out of our groups -------------------------------------------
    def _wrap_matchmaking(self) -> None:
        mm = self._matchmaking
        check, request = mm._check_reasons_to_reject, mm._request_join_group

        def check_reasons_to_reject(req, context):
            peer = str(context.remote_id)
            if self.exclusions.is_excluded(peer):
                return averaging_pb2.MessageFromLeader(code=averaging_pb2.PROTOCOL_VIOLATION)
            if peer in self._member_table.uncounted and not self._uncounted_room(mm.current_followers):
                return averaging_pb2.MessageFromLeader(code=averaging_pb2.GROUP_IS_FULL)
            reason = check(req, context)
            known = self._lane.members if self._lane is not None else self._members
            if reason is None and known and peer not in known:
                mm.target_group_size = None  # a server the roster does not know yet: gather until the window ends
                self._gathering_all = True
            elif reason is None and peer in self._member_table.uncounted:  # accepted: it shows, waited for from
                self._shown()[peer] = time.monotonic()  # now on, this group included (hivemind refused a full
                if not getattr(self, "_gathering_all", False):  # group's joiner first); one gathering to the window's
                    self._expect_members()  # end stays so
            return reason

        async def request_join_group(leader):
            if self.exclusions.is_excluded(str(leader)) or str(leader) in self._member_table.uncounted:
                return None  # (a group led by an unvouched member: its followers might be all unvouched too)
            try:  # a ticketed run: no group led by a key without a ticket (it would receive this server's parts)
                await self._admit(SimpleNamespace(remote_id=leader))
            except ProtocolError:
                return None
            return await request(leader)

        async def keep_key(group_info):  # hivemind moves the key after a group; _plan_step sets every hop's
            self._shown().update({str(p): time.monotonic() for p in group_info.peer_ids})

        mm._check_reasons_to_reject, mm._request_join_group = check_reasons_to_reject, request_join_group
        mm.group_key_manager.update_key_on_group_assembled = keep_key
        mm.looking_for_group = self._keyed_search(mm.looking_for_group)
        mm.group_key_manager.get_averagers = paced(mm.group_key_manager.get_averagers,
                                                   mm.min_matchmaking_time * LOOKUP_GAP)
        self._mm_wrapped = True
