"""What checkpoints exist and how alive they are, and where new fragments should go.

A checkpoint is a signed :class:`~swarm.protocol.CheckpointManifest` (what the shard is: its hash, size,
``k``/``n`` and the hash of every fragment) plus the fragment holders' own signed
:class:`~swarm.protocol.StorageInfo` records (who holds which fragment *now*; they expire with the holder).
A fragment is *alive* if a live holder lists it (stage, epoch, index and hash prefix); a checkpoint is
*restorable* while at least ``k`` of its fragments are alive, and *fully replicated* while all ``n`` are.

Placement (:func:`choose_holders`) spreads a checkpoint's fragments over distinct peers, preferring peers
that do not serve the checkpoint's stage (so losing every server of a stage loses none of its fragments),
then the least loaded; a peer holds two fragments of one checkpoint only when there are fewer peers than
fragments.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Iterable, Optional

from hivemind.utils import get_dht_time

from swarm.protocol import CheckpointManifest, StorageInfo

HASH_PREFIX = 16
"""Hex digits of a fragment's SHA-256 that a holder lists in its StorageInfo."""


def holding(stage: int, epoch: int, index: int, sha256: str) -> tuple[int, int, int, str]:
    """The StorageInfo entry for a held fragment."""
    return (stage, epoch, index, sha256[:HASH_PREFIX])


@dataclass
class CheckpointView:
    """A manifest with the live holders of each of its fragments (``alive``: index -> peer ids)."""

    manifest: CheckpointManifest
    sealed: bytes
    alive: dict[int, list[str]] = field(default_factory=dict)

    @property
    def fragments_alive(self) -> int:
        return sum(1 for holders in self.alive.values() if holders)

    @property
    def replicas(self) -> int:
        """Live (holder, fragment) pairs; equals ``n`` when every fragment sits on one live peer."""
        return sum(len(holders) for holders in self.alive.values())

    @property
    def missing(self) -> list[int]:
        return [f.index for f in self.manifest.fragments if not self.alive.get(f.index)]

    @property
    def restorable(self) -> bool:
        return self.fragments_alive >= self.manifest.k

    @property
    def holders(self) -> set[str]:
        return {p for holders in self.alive.values() for p in holders}

    @property
    def age_s(self) -> float:
        return max(0.0, get_dht_time() - self.manifest.time)


def checkpoint_views(manifests: Iterable[tuple[CheckpointManifest, bytes]],
                     storage: Iterable[StorageInfo]) -> list[CheckpointView]:
    """Join manifests with live holdings; newest epoch first."""
    holders_of: dict[tuple[int, int, int, str], list[str]] = {}
    for info in storage:
        for entry in info.held:
            holders_of.setdefault(tuple(entry), []).append(info.peer_id)
    views = []
    for manifest, sealed in manifests:
        alive = {f.index: sorted(holders_of.get(holding(manifest.stage, manifest.epoch, f.index, f.sha256), []))
                 for f in manifest.fragments}
        views.append(CheckpointView(manifest, sealed, alive))
    return sorted(views, key=lambda v: (-v.manifest.epoch, -v.fragments_alive, v.manifest.peer_id))


def newest_restorable(views: Iterable[CheckpointView], max_epoch: Optional[int] = None) -> Optional[CheckpointView]:
    """The restorable checkpoint with the highest epoch (at most ``max_epoch``), or None."""
    for view in sorted(views, key=lambda v: (-v.manifest.epoch, -v.fragments_alive)):
        if view.restorable and (max_epoch is None or view.manifest.epoch <= max_epoch):
            return view
    return None


class SettledView:
    """Whether a stage's newest visible checkpoint has stayed the same for ``window_s`` seconds.

    Peers that restart together (every peer of the run died) re-publish their manifests as their keepers come
    up, one after the other: the first restorable checkpoint a restarting server sees may be older than one
    whose holders are a few seconds slower. Restoring only a settled view (every live keeper re-announces within
    one record TTL) keeps that newer checkpoint.
    """

    def __init__(self, window_s: float, now: float):
        self.window_s, self.newest, self.changed_at = window_s, None, now

    def observe(self, views: list[CheckpointView], now: float) -> bool:
        """Note the stage's views (newest first) seen at ``now`` (seconds, monotonic); True once settled."""
        if views and (views[0].manifest.epoch, views[0].manifest.shard_sha256) != self.newest:
            self.newest, self.changed_at = (views[0].manifest.epoch, views[0].manifest.shard_sha256), now
        return now - self.changed_at >= self.window_s


def choose_holders(candidates: Iterable[StorageInfo], count: int, size: int, *, avoid_stage: int,
                   exclude: Iterable[str] = (), load: Optional[Counter] = None,
                   rng: Optional[random.Random] = None) -> list[StorageInfo]:
    """Pick a holder for each of ``count`` fragments of ``size`` bytes (see the module docstring).

    :param exclude: peer ids never chosen (distrusted or banned peers, holders of the checkpoint's other fragments).
    :param load: fragments each peer id already takes (this placement counts on top); updated in place.
    :returns: up to ``count`` records (fewer only if no candidate has room); a peer appears more than once
        only when fewer peers than fragments have room.
    """
    rng = rng or random.Random()
    excluded = set(exclude)
    pool = [c for c in candidates if c.peer_id not in excluded]
    rng.shuffle(pool)
    load = load if load is not None else Counter()
    room = {c.peer_id: c.free_bytes for c in pool}
    chosen: list[StorageInfo] = []
    for _ in range(count):
        fits = [c for c in pool if room[c.peer_id] >= size]
        if not fits:
            break
        best = min(fits, key=lambda c: (load[c.peer_id], c.stage == avoid_stage, -room[c.peer_id]))
        chosen.append(best)
        load[best.peer_id] += 1
        room[best.peer_id] -= size
    return chosen
