"""The hops of a round in bounded groups, inside a hivemind averager (:mod:`swarm.averaging.groups`).

hivemind's matchmaking assembles each hop's group under the lane's key (``<prefix>.0b<key bits>``): hivemind's
first matchmaking of the step assembles the first lane, and :meth:`HopRounds._assemble_lane` runs its matchmaking
again for each later hop, inside the same step and its ``averaging_timeout``. Every hop's all-reduce is the
robust one of :class:`~swarm.averaging.averager.RobustAllReduceMixin`, under :class:`GroupRules`.
"""

from __future__ import annotations

import asyncio
import logging
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
        self._lanes: list[Lane] = []  # this step's lanes, hop by hop
        self._lane: Optional[Lane] = None  # the lane being assembled or averaged
        self._step_control = None

    def _plan_step(self, step) -> None:
        """(averager process) This step's lanes, from the members set last and the epoch in the step's gather
        data; sets hivemind's group key to the first lane's (or to the stage's one key: no lanes)."""
        self._step_control, me = step, str(self.peer_id)
        epoch = self._round_epoch(step)
        self._lanes = []
        members = frozenset(p for p in self._members if p == me or not self.exclusions.is_excluded(p))
        if self.group_size >= 3 and epoch is not None and me in members and len(members) > self.group_size:
            plan = GroupPlan(members, round_seed(self.prefix, epoch), self.group_size)
            self._lanes = plan.lanes_of(me)
        self._enter_lane(self._lanes[0] if self._lanes else None)

    def _round_epoch(self, step) -> Optional[int]:
        try:
            _, _, user = self.serializer.loads(step.data_for_gather)
            value = self.serializer.loads(user)
        except Exception:
            return None
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    def _enter_lane(self, lane: Optional[Lane]) -> None:
        self._lane = lane
        mm = getattr(self, "_matchmaking", None)
        if mm is not None:
            mm.group_key_manager.group_bits = lane.key_bits if lane is not None else ""
        self._expect_members()

    def _next_lane(self) -> Optional[Lane]:
        later = [lane for lane in self._lanes if self._lane is not None and lane.hop > self._lane.hop]
        return later[0] if later else None

    async def _assemble_lane(self, lane: Lane) -> GroupInfo:
        """(averager process) hivemind's matchmaking under ``lane``'s key, within the step's deadline.

        :raises RoundFailed: no group formed (a lane-mate is down, or sees other members)."""
        self._enter_lane(lane)
        group = await self._matchmaking.look_for_group(self._step_control)
        if group is None:
            raise RoundFailed(f"hop {lane.hop}: no group formed with {len(lane.members) - 1} lane-mates")
        return group

    async def _group_rules(self, group_info: GroupInfo, weight: float, min_vector_size: int) -> GroupRules:
        """The rules of the group hivemind assembled: the first hop balances partitions by bandwidth (hivemind's
        ``load_balance_peers``); later hops split them evenly among voters, in every lane alike."""
        peers = [str(p) for p in group_info.peer_ids]
        bandwidths, mode_ids, _ = zip(*map(self.serializer.loads, group_info.gathered))
        modes = [AveragingMode(m) for m in mode_ids]
        senders = frozenset(p for p, m in zip(peers, modes) if m != AveragingMode.AUX)
        lane = self._lane
        if lane is not None:
            whole_enough(lane, set(peers))
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


def whole_enough(lane: Lane, present: set[str]) -> None:
    """Check that a group formed under ``lane``'s key may average, so that no two servers leave a hop with different
    values for one block. At the first hop a strict majority of the lane (two groups under one key, formed apart
    when some members came late, cannot both hold one; the members of the smaller one fail the round); at later
    hops every voter (a lane without one block's voter would aggregate other inputs than its sister lanes).

    :raises RoundFailed: the group is not whole enough, or holds a server outside the lane (a 2^-32 key collision).
    """
    strangers = present - lane.members
    if strangers:
        raise RoundFailed(f"hop {lane.hop}: the group holds {len(strangers)} servers outside this server's lane")
    if lane.hop == 0 and 2 * len(present) <= len(lane.members):
        raise RoundFailed(f"hop 0: the group holds {len(present)} of the lane's {len(lane.members)} members, not a "
                          "majority (its other members may have formed a group of their own)")
    missing = set(lane.voters) - present
    if lane.hop > 0 and missing:
        raise RoundFailed(f"hop {lane.hop}: {len(missing)} of the lane's {len(lane.voters)} voters did not join "
                          "(they left, or their previous hop failed)")
