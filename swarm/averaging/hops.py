"""The hops of a round in bounded groups, inside a hivemind averager (:mod:`swarm.averaging.groups`).

hivemind's matchmaking assembles each hop's group under the lane's key (``<prefix>.0b<key bits>``): hivemind's
first matchmaking of the step assembles the first lane, and :meth:`HopRounds._assemble_lane` runs its matchmaking
again for each later hop, inside the same step and its ``averaging_timeout``. Every hop's all-reduce is the
robust one of :class:`~swarm.averaging.averager.RobustAllReduceMixin`, under :class:`GroupRules`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Optional

from hivemind.averaging.allreduce import AveragingMode
from hivemind.averaging.group_info import GroupInfo
from hivemind.averaging.load_balancing import load_balance_peers

from swarm.averaging.allreduce import RoundFailed
from swarm.averaging.compression import Compressor
from swarm.averaging.groups import GroupPlan, Lane, round_seed

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GroupRules:
    """How one group's all-reduce runs.

    :param peers: the group's libp2p ids in partition order (hivemind's ``GroupInfo.peer_ids``).
    :param fractions: each peer's share of the vector to reduce (0: it reduces nothing).
    :param senders: the peers that send parts (not hivemind's auxiliary peers).
    :param weight: this peer's weight in the group (samples at the first hop; 1 for a voter, 0 for a listener
        after it).
    :param seed: equal on every member (PowerSGD's ``Q``).
    :param compressor: this peer's compressor at the first hop (error feedback); one without it after.
    :param rank: sender -> aggregation order (later hops: the same in every lane of a group), or None.
    :param scored: whether parts score their senders (first hop only: a later hop's part is its block's
        aggregate, and an honest sender of a block that a Byzantine majority corrupted would be blamed for it).
    """

    peers: list[str]
    fractions: list[float]
    senders: frozenset[str]
    weight: float
    seed: int
    compressor: Compressor
    rank: Optional[dict[str, int]] = None
    scored: bool = True


@dataclass(frozen=True)
class StepLanes:
    """One step's hivemind ``StepControl``, this server's lanes for it, hop by hop (empty: one group), and the
    stage's members whose majority its group must hold (empty: none known, or this server is no member;
    :meth:`~swarm.averaging.membership.MemberTable.counted_at`)."""

    step: object = None
    lanes: tuple[Lane, ...] = ()
    members: frozenset[str] = frozenset()

    def first(self) -> Optional[Lane]:
        return self.lanes[0] if self.lanes else None

    def after(self, lane: Optional[Lane]) -> Optional[Lane]:
        """The lane of the next hop this server takes part in after ``lane``, or None."""
        later = [x for x in self.lanes if lane is not None and x.hop > lane.hop]
        return later[0] if later else None


_STEP: ContextVar[StepLanes] = ContextVar("swarm_step_lanes", default=StepLanes())


class HopRounds:
    """Mixin of :class:`~swarm.averaging.averager.RobustAllReduceMixin`: plans each step's lanes and assembles them.

    A step runs in one group of the stage, as before, when ``group_size`` is 0, when the stage has at most
    ``group_size`` members, when the round names no epoch, or when this server is not on the roster it was given.
    The grid leaves out the members this server excluded (convicted or banned peers, which every honest server
    excludes alike; a lane holding one could never form).
    """

    def _init_hops(self, group_size: int, compressor: Compressor) -> None:
        self.group_size = group_size
        self._hop_compressor = compressor.stateless()
        self._lane: Optional[Lane] = None  # the lane matchmaking assembles now (its key and expected members)
        self._current_step = None  # the step planned last
        self._next_lane: dict[int, Optional[Lane]] = {}  # id(step) -> the lane its next matchmaking assembles

    def _plan_step(self, step) -> None:
        """(averager process, in the step's task) This step's lanes, from the members set last and the epoch in
        the step's gather data, kept in the task's context (hivemind starts a step while a round cancelled at its
        timeout may still run). The key moves to a step's lane only once that step holds matchmaking
        (:meth:`_keyed_search`): moved earlier, a search in progress would take in another lane's servers."""
        me, epoch, lanes = str(self.peer_id), self._round_epoch(step), []
        members = frozenset(p for p in self._members if p == me or not self.exclusions.is_excluded(p))
        if self.group_size >= 3 and epoch is not None and me in members and len(members) > self.group_size:
            lanes = GroupPlan(members, round_seed(self.prefix, epoch), self.group_size).lanes_of(me)
        counted = members - self._member_table.uncounted  # (the majority a one-group round must hold)
        _STEP.set(StepLanes(step, tuple(lanes), counted if me in members else frozenset()))
        self._current_step = step
        self._next_lane[id(step)] = lanes[0] if lanes else None

    def _end_step(self, step) -> None:
        self._next_lane.pop(id(step), None)

    def _round_epoch(self, step) -> Optional[int]:
        try:
            _, _, user = self.serializer.loads(step.data_for_gather)
            value = self.serializer.loads(user)
        except Exception:
            return None
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    def _keyed_search(self, looking_for_group):
        """hivemind's ``Matchmaking.looking_for_group`` (the lock a search holds), then the key of the searching
        step's lane (the stage's one key when it has none), for as long as the search lasts."""

        @contextlib.asynccontextmanager
        async def search(step_control):
            async with looking_for_group(step_control):
                self._enter_lane(self._next_lane.get(id(step_control)))
                yield

        return search

    def _enter_lane(self, lane: Optional[Lane]) -> None:
        self._lane = lane
        mm = getattr(self, "_matchmaking", None)
        if mm is not None:
            mm.group_key_manager.group_bits = lane.key_bits if lane is not None else ""
        self._expect_members()

    @staticmethod
    def _step_lanes() -> "StepLanes":
        """The lanes of the step whose task this is (none outside a planned step)."""
        return _STEP.get()

    def _back_to_first_lane(self) -> None:
        """After a round of this task's step ended: its next search (hivemind's retry) starts at the first hop."""
        plan = self._step_lanes()
        if plan.step is not None:
            self._next_lane[id(plan.step)] = plan.first()

    async def _assemble_lane(self, lane: Lane) -> GroupInfo:
        """(averager process) hivemind's matchmaking under ``lane``'s key, within the step's deadline.

        :raises RoundFailed: no group formed (a lane-mate is down, or sees other members), or a newer step began
            (this one timed out: its result would not be used)."""
        plan = self._step_lanes()
        if plan.step is not self._current_step:
            raise RoundFailed(f"hop {lane.hop}: a newer round began")
        self._next_lane[id(plan.step)] = lane
        group = await self._matchmaking.look_for_group(plan.step)
        if group is None:
            raise RoundFailed(f"hop {lane.hop}: no group formed with {len(lane.members) - 1} lane-mates")
        return group

    async def _group_rules(self, group_info: GroupInfo, lane: Optional[Lane], weight: float,
                           min_vector_size: int) -> GroupRules:
        """The rules of the group hivemind assembled: the first hop balances partitions by bandwidth (hivemind's
        ``load_balance_peers``); later hops split them evenly among voters, in every lane alike."""
        peers = [str(p) for p in group_info.peer_ids]
        bandwidths, mode_ids, _ = zip(*map(self.serializer.loads, group_info.gathered))
        modes = [AveragingMode(m) for m in mode_ids]
        senders = frozenset(p for p, m in zip(peers, modes) if m != AveragingMode.AUX)
        if lane is not None:
            whole_enough(lane, set(peers))
        else:
            a_majority(self._step_lanes().members, set(peers))
        if lane is None or lane.hop == 0:
            bandwidths = [b if m != AveragingMode.CLIENT else 0.0 for b, m in zip(bandwidths, modes)]
            fractions = await asyncio.get_running_loop().run_in_executor(
                None, load_balance_peers, self.total_size, bandwidths, min_vector_size)
            seed = int.from_bytes(group_info.group_id[:4], "big")
            return GroupRules(peers, list(fractions), senders, weight, seed, self.compressor)
        voters = set(lane.voters)
        fractions = [1.0 if p in voters else 0.0 for p in peers]
        mine = 1.0 if str(self.peer_id) in voters else 0.0
        return GroupRules(peers, fractions, frozenset(peers), mine, 0, self._hop_compressor, lane.rank, False)


def a_majority(members: frozenset[str], present: set[str]) -> None:
    """Check that a group of a stage averaging in one group holds a strict majority of the ``members`` it expects
    (none known: no check), so that no two groups formed apart in one round (some members late to the window, or
    keys that split the stage on purpose) both count: every server of the one that does ends with the same state,
    and a server of the other fails the round, steps on its own gradient and says it is out of sync. Measured before:
    two honest servers of a stage of eight completed one round in two groups 14 s apart, both "in sync", and a joiner
    then refused each one's state as contradicted by the other's (bench/sybil.py, lazy keys).

    :raises RoundFailed: the group holds at most half of ``members``."""
    if members and 2 * len(present & members) <= len(members):
        raise RoundFailed(f"the group holds {len(present & members)} of the stage's {len(members)} members, not a "
                          "majority (the others may have formed a group of their own): this server steps alone")


def whole_enough(lane: Lane, present: set[str]) -> None:
    """Check that a group formed under ``lane``'s key may average, so that no two servers leave a hop with different
    values for one block. At the first hop a strict majority of the lane (two groups under one key, formed apart
    when some members came late, cannot both hold one; the members of the smaller one fail the round); at later
    hops every voter (a lane without one block's voter would aggregate other inputs than its sister lanes).

    :raises RoundFailed: the group is not whole enough, or holds a server outside the lane (a 2^-32 key collision).
    """
    strangers = present - lane.members
    if strangers:
        raise RoundFailed(f"hop {lane.hop}: the group holds {len(strangers)} servers outside this server's lane "
                          f"({', '.join(sorted(strangers)[:3])})")
    if lane.hop == 0 and len(present) < lane.quorum:
        raise RoundFailed(f"hop 0: the group holds {len(present)} of the lane's {len(lane.members)} members, not a "
                          "majority (its other members may have formed a group of their own)")
    missing = set(lane.voters) - present
    if lane.hop > 0 and missing:
        raise RoundFailed(f"hop {lane.hop}: {len(missing)} of the lane's {len(lane.voters)} voters did not join "
                          "(they left, or their previous hop failed)")
