"""Bounded averaging groups: a stage's servers average in hops over a seeded grid (Moshpit All-Reduce).

A stage of ``n`` servers with ``[averaging] group_size`` = ``g`` averages in ``d = ceil(log_g n)`` *hops* instead
of one group of ``n`` (Ryabinin et al., "Moshpit SGD", NeurIPS 2021, sec. 3.1 and Algorithm 1: peers on a
virtual ``g^d`` grid, each hop groups them along one axis, so ``d`` hops average exactly over the grid and each
costs what one group of ``g`` costs). Here the grid is built so that every server ends the ``d`` hops with
**bit-identical** tensors even when ``n`` is not a power of ``g`` (the stage's state check and the equal-state
invariant need that; Moshpit's own grid tolerates approximate averages):

* **Hop 0** splits the ``n`` servers, in a seeded order, into ``ceil(n / g)`` groups of balanced size (sizes
  differ by one at most), or three where that makes two and three groups of at least 3 fit (:func:`split_blocks`: the
  next hop then has lanes of three voters, not two). Every group ends its all-reduce with one value held by all
  its members.
* **Hop k + 1** treats each group of hop k as one *block* (its members all hold its value) and splits the blocks
  the same way into groups of at most ``g`` blocks. A group of blocks runs as ``c`` *lanes*, ``c`` being its
  smallest block's size: lane ``j`` holds the ``j``-th member of every block (its *voters*, one per block) and,
  as *listeners*, the members of larger blocks beyond ``c`` (``index mod c == j``). Listeners send weight-0 parts
  (not counted, :func:`~swarm.averaging.reducer.reduce_partition` step 3) and receive the aggregate. Every lane
  of a group aggregates the same values, in the same order (:attr:`Lane.rank`), over the same partitions
  (uniform among voters), with a codec without error feedback, so every lane returns the same bytes.
* A group of one block skips its hop (its members already agree).

Which group a server lands in is a hash of its libp2p id and the round's *seed*, which the caller derives from
the run, the stage's averager and the epoch (:func:`round_seed`); a server cannot choose its place in a later
round's grid without choosing its id after that round's seed is known (see ``docs/scaling.md`` for what this
does and does not stop). Hop k + 1's robust rule then bounds what a group whose aggregate was corrupted at hop k
can do: it is one voter of ``g`` in every lane it reaches.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Iterable, Optional

KEY_BITS = 32
"""Bits of a lane's group key (hivemind's ``<prefix>.0b<bits>``; ``2^-32`` chance that two lanes share a key):
a hash of the seed, the hop and the lane's members (:func:`_key_bits`)."""


def round_seed(prefix: str, epoch: int) -> bytes:
    """The seed of the grid of one round: BLAKE2b-128 of the averager's prefix (run id and stage) and ``epoch``.

    :param prefix: the averager's hivemind prefix, e.g. ``"run_stage1_grad_averager"``.
    :param epoch: the epoch the round averages (gradient rounds) or begins (state rounds).
    """
    return hashlib.blake2b(f"{prefix}|{epoch}".encode(), digest_size=16).digest()


@dataclass(frozen=True)
class Lane:
    """One all-reduce group of one hop.

    :param hop: the hop (0 is the first).
    :param key_bits: the group's key, :data:`KEY_BITS` characters of ``0``/``1`` (hivemind's group bits).
    :param voters: libp2p ids whose parts count, one per block, in block order.
    :param listeners: libp2p ids that send weight-0 parts and receive the aggregate (their block's voter holds
        the same value); empty at hop 0.
    """

    hop: int
    key_bits: str
    voters: tuple[str, ...]
    listeners: tuple[str, ...] = ()

    @property
    def members(self) -> frozenset[str]:
        """Every libp2p id of the lane."""
        return frozenset(self.voters + self.listeners)

    @property
    def quorum(self) -> int:
        """Members the lane's group needs before it may average: a strict majority at hop 0 (two groups formed
        apart under one key cannot both hold one), every voter after (:func:`swarm.averaging.hops.whole_enough`).
        Matchmaking that has fewer when its window ends disbands and gathers again, until the round's deadline."""
        return len(self.voters) // 2 + 1 if self.hop == 0 else len(self.voters)

    @property
    def rank(self) -> dict[str, int]:
        """libp2p id -> the order its part is aggregated in (its block's index): the same in every lane."""
        return {p: i for i, p in enumerate(self.voters)}


MIN_LANE_VOTERS = 3
"""A hop that would leave exactly two blocks cuts three groups instead when each still gets this many items: a lane
of two voters is half Byzantine with one attacker, and no robust rule can tell which of two parts lies."""


def split_blocks(items: list, group_size: int) -> list[list]:
    """``items`` cut, in order, into ``ceil(len / group_size)`` runs whose lengths differ by one at most, or into
    three runs where that number is two and three runs of at least :data:`MIN_LANE_VOTERS` fit (``len >= 9``), so
    that the next hop's group has three blocks (lanes of three voters) rather than two. Never more hops: three
    blocks fit in one group of ``group_size >= 3``."""
    groups = max(1, math.ceil(len(items) / group_size))
    if groups == 2 and len(items) >= 3 * MIN_LANE_VOTERS:
        groups = 3
    base, extra = divmod(len(items), groups)
    out, at = [], 0
    for i in range(groups):
        size = base + (i < extra)
        out.append(items[at:at + size])
        at += size
    return out


def _key_bits(seed: bytes, hop: int, voters: tuple[str, ...], listeners: tuple[str, ...]) -> str:
    """The lane's key: its hop and members under the seed, so that two servers whose rosters differ never meet
    under one key with different ideas of who votes (they fail to form the lane instead)."""
    text = f"|{hop}|" + ",".join(voters) + "|" + ",".join(sorted(listeners))
    digest = hashlib.blake2b(seed + text.encode(), digest_size=KEY_BITS // 8).digest()
    return format(int.from_bytes(digest, "big"), f"0{KEY_BITS}b")


class GroupPlan:
    """The lanes of every hop of one round, computed alike by every server that sees the same members.

    :param members: the libp2p ids (base58 strings) of the stage's servers that average in this round.
    :param seed: the round's seed (:func:`round_seed`); it orders the members.
    :param group_size: ``g``, at least 3: voters per lane. A lane also holds listeners when blocks differ in
        size: fewer than ``2.5 g`` members in all (checked for every stage of 2 to 400 servers at ``g`` = 3, 4, 8
        and 16; at ``g`` = 2 a lone block of one server can meet a block of half the stage, hence the floor).
    :raises ValueError: ``group_size`` below 3.
    """

    def __init__(self, members: Iterable[str], seed: bytes, group_size: int):
        if group_size < 3:
            raise ValueError(f"group_size must be at least 3, got {group_size}")
        self.group_size = group_size
        self.order = sorted(set(members), key=lambda p: hashlib.blake2b(seed + p.encode(), digest_size=16).digest())
        self.hops: list[list[Lane]] = []
        blocks = [[p] for p in self.order]
        while len(blocks) > 1:
            hop, lanes, merged = len(self.hops), [], []
            for group in split_blocks(blocks, group_size):
                merged.append([p for block in group for p in block])
                if len(group) > 1:
                    lanes += self._lanes(seed, hop, group)
            self.hops.append(lanes)
            blocks = merged
        self._lane_of = {(lane.hop, p): lane for lanes in self.hops for lane in lanes for p in lane.members}

    @staticmethod
    def _lanes(seed: bytes, hop: int, group: list[list[str]]) -> list[Lane]:
        c, lanes = min(len(block) for block in group), []
        for j in range(c):
            voters = tuple(block[j] for block in group)
            listeners = tuple(p for block in group for k, p in enumerate(block) if k >= c and k % c == j)
            lanes.append(Lane(hop, _key_bits(seed, hop, voters, listeners), voters, listeners))
        return lanes

    @property
    def depth(self) -> int:
        """``d``: the number of hops (0 for a stage of one server)."""
        return len(self.hops)

    def lane(self, peer: str, hop: int) -> Optional[Lane]:
        """``peer``'s lane at ``hop``, or None (its group is one block there: it skips the hop, or it is unknown)."""
        return self._lane_of.get((hop, peer))

    def lanes_of(self, peer: str) -> list[Lane]:
        """``peer``'s lanes, hop by hop, leaving out the hops it skips."""
        return [lane for hop in range(self.depth) if (lane := self.lane(peer, hop)) is not None]
