"""Checkpoint shards across a churning swarm, through the peers' own placement and repair rules.

Every ``interval_epochs`` a stage's checkpoint is written by :func:`swarm.checkpoint.commit.writer_of` among its
online servers, cut into ``n`` fragments (``k`` restore it) and placed by :func:`swarm.checkpoint.catalog
.choose_holders` on the live peers' announced budgets. A peer that leaves takes its fragments with it (no
hand-off: the worst case, a crash). Each tick the keepers do what :meth:`swarm.checkpoint.keeper.FragmentKeeper.tick`
does: for each stage's ``keep`` newest checkpoints (:func:`~swarm.checkpoint.catalog.checkpoint_views`), one
older than a record TTL with fragments missing but still restorable is repaired onto new holders. A stage is
*restorable* while :func:`~swarm.checkpoint.catalog.newest_restorable` finds one of its checkpoints.
"""

from __future__ import annotations

import hashlib
import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Optional

from bench.sim.world import World
from swarm.checkpoint.catalog import checkpoint_views, choose_holders, holding, newest_restorable
from swarm.checkpoint.commit import writer_of
from swarm.config import CheckpointSpec
from swarm.protocol import CheckpointManifest, FragmentEntry, StorageInfo


@dataclass
class Shards:
    """Every stage's checkpoints and who holds which fragment."""

    world: World
    spec: CheckpointSpec
    fragment_bytes: list[float]  # per stage
    budget_bytes: float
    rng: random.Random
    manifests: dict[int, list[CheckpointManifest]] = field(default_factory=dict)
    created: dict[tuple[int, int], float] = field(default_factory=dict)
    held: dict[str, set[tuple]] = field(default_factory=dict)  # peer id -> holdings
    placed: int = 0
    repaired: int = 0
    writers: Counter = field(default_factory=Counter)

    def storage(self, t: float) -> list[StorageInfo]:
        out = []
        for p in self.world.alive(t):
            held = self.held.get(p.peer_id, set())
            used = sum(self.fragment_bytes[h[0]] for h in held)
            out.append(StorageInfo.model_construct(peer_id=p.peer_id, p2p_id=p.peer_id, stage=p.stage or -1,
                                                   free_bytes=int(max(0.0, self.budget_bytes - used)),
                                                   held=sorted(held), kind="storage"))
        return out

    def commit(self, stage: int, epoch: int, t: float) -> Optional[str]:
        """Write stage ``stage``'s checkpoint of ``epoch``; returns its writer (None: no online server)."""
        online = [p.peer_id for p in self.world.serving(stage, t)]
        if not online:
            return None
        writer = writer_of(self.world.run_id, stage, epoch, online)
        self.writers[writer] += 1
        k, n = self.spec.fragments_needed, self.spec.fragments_total
        entries = [FragmentEntry.model_construct(index=i, sha256=hashlib.sha256(f"{stage}/{epoch}/{i}".encode())
                                                 .hexdigest()) for i in range(n)]
        manifest = CheckpointManifest.model_construct(stage=stage, epoch=epoch, k=k, n=n, fragments=entries,
                                                      peer_id=writer, shard_sha256="0" * 64, time=t)
        holders = choose_holders(self.storage(t), n, int(self.fragment_bytes[stage]), avoid_stage=stage,
                                 rng=self.rng)
        for entry, holder in zip(entries, holders):
            self.held.setdefault(holder.peer_id, set()).add(holding(stage, epoch, entry.index, entry.sha256))
        self.placed += len(holders)
        kept = sorted(self.manifests.get(stage, []) + [manifest], key=lambda m: -m.epoch)
        self.manifests[stage] = kept[:self.spec.keep]
        for old in kept[self.spec.keep:]:  # collected: every holder drops an epoch no longer kept
            for held in self.held.values():
                held -= {h for h in held if h[0] == stage and h[1] == old.epoch}
        self.created[(stage, epoch)] = t
        return writer

    def forget(self, peer_id: str) -> None:
        """``peer_id`` left: its fragments are gone."""
        self.held.pop(peer_id, None)

    def repair(self, t: float) -> None:
        storage = self.storage(t)
        for stage, manifests in self.manifests.items():
            for view in checkpoint_views([(m, b"") for m in manifests], storage):
                age = t - self.created[(stage, view.manifest.epoch)]
                if not (view.missing and view.restorable and age > self.world.ttl):
                    continue
                missing = view.missing
                holders = choose_holders(storage, len(missing), int(self.fragment_bytes[stage]), avoid_stage=stage,
                                         exclude=view.holders, load=Counter({p: 1 for p in view.holders}),
                                         rng=self.rng)
                for index, holder in zip(missing, holders):
                    sha = view.manifest.fragments[index].sha256
                    self.held.setdefault(holder.peer_id, set()).add(holding(stage, view.manifest.epoch, index, sha))
                self.repaired += len(holders)

    def restorable(self, t: float) -> dict[int, Optional[int]]:
        """Stage -> the epoch of its newest restorable checkpoint (None: none is)."""
        storage = self.storage(t)
        out = {}
        for stage, manifests in self.manifests.items():
            view = newest_restorable(checkpoint_views([(m, b"") for m in manifests], storage))
            out[stage] = None if view is None else view.manifest.epoch
        return out
