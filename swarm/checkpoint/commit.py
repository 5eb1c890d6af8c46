"""A stage server's checkpoint commits: every ``checkpoint.interval_epochs`` epochs, the stage's writer commits
its state.

Where an epoch ends (on the compute thread) the server checks :meth:`StageCommits.due`, captures a consistent
copy of the state between micro-batches (:meth:`StageCommits.capture`) and commits it in the background
(:meth:`StageCommits.commit`) if it is the stage's writer of that epoch (:func:`writer_of`: the online servers take
turns, so no one server encodes every checkpoint of a stage of hundreds, and no key ground to sort first writes
them all). The commit itself (endorsements, erasure coding, placement, the manifest) is
:func:`~swarm.checkpoint.writer.write_checkpoint`, with ``parent`` = the checkpoint the state descends from
(:class:`~swarm.checkpoint.restore.Lineage`), read once the fragments are placed and after a stage-mate's commit
of the previous checkpoint (:meth:`StageCommits._parent`). Every server of the stage records its state's digest at
each captured epoch, so it can endorse the writer's checkpoint (:class:`~swarm.trust.authority.CheckpointAuthority`).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from functools import partial
from typing import Callable, Iterable, Optional

from swarm.checkpoint.keeper import FragmentKeeper
from swarm.checkpoint.restore import Lineage
from swarm.checkpoint.shard import StageShard
from swarm.checkpoint.state import StateHolder, state_digest
from swarm.checkpoint.writer import CheckpointError, write_checkpoint
from swarm.trust.authority import CheckpointAuthority


PARENT_WAIT_TICKS = 3
"""Keeper ticks a writer waits for the stage's previous checkpoint, written by another server, before it names its
own checkpoint's parent without it (:meth:`StageCommits._parent`): commits took up to 5.4 s in the chaos bench, whose
tick is 3 s."""


def writer_of(run_id: str, stage: int, epoch: int, peer_ids: Iterable[str]) -> str:
    """The writer of stage ``stage``'s checkpoint of ``epoch`` among ``peer_ids`` (its online servers): the one
    whose BLAKE2b of (run, stage, epoch, peer id) is lowest. Servers that see the same servers agree; the turn moves
    with every epoch, uniformly over the servers, whatever their ids.

    :raises ValueError: ``peer_ids`` is empty.
    """
    def rank(peer_id: str) -> bytes:
        return hashlib.blake2b(f"{run_id}/{stage}/{epoch}/{peer_id}".encode(), digest_size=16).digest()

    return min(peer_ids, key=rank)


class StageCommits:
    """Checkpoint commits of stage ``stage``'s state in ``holder`` (module docstring), through this peer's
    ``keeper``; ``authority`` learns the digest of every state captured, to endorse the stage's checkpoints.

    :param lineage: the checkpoint the state descends from (each commit's parent; a commit becomes it).
    :param log: the stage's log.
    """

    def __init__(self, keeper: FragmentKeeper, authority: CheckpointAuthority, holder: StateHolder, *, stage: int,
                 lineage: Lineage, log: logging.Logger | logging.LoggerAdapter):
        self.keeper, self.authority, self.holder, self.stage = keeper, authority, holder, stage
        self.spec, self.directory, self.me = keeper.spec, keeper.directory, keeper.me
        self.lineage, self.log = lineage, log
        self._writing = False
        self._others: Optional[tuple[int, float]] = None  # (epoch, monotonic s) of the last one another server wrote

    def due(self, epoch: int) -> bool:
        """Is a checkpoint due at ``epoch`` (every ``interval_epochs``; not while the last one is still being
        committed)?"""
        return epoch > 0 and epoch % self.spec.checkpoint.interval_epochs == 0 and not self._writing

    def capture(self, epoch: int, meta: dict) -> StageShard:
        """(compute thread, right after the step of ``epoch``) A consistent copy of the stage's state, with
        ``meta`` (the rollback generation and learning-rate scale) and the samples so far in its metadata."""
        meta = {**meta, "samples": epoch * self.spec.training.target_batch_size}
        self._writing = True
        shard = StageShard(self.keeper.run_id, self.stage, epoch, self.holder.state(), meta)
        self.authority.record_state(self.stage, epoch, state_digest(shard.tensors))  # to endorse the writer
        return shard

    async def commit(self, shard: StageShard, loss: Callable[[], Optional[float]]) -> None:
        """Commit ``shard`` to the swarm if this server is the stage's writer (``loss()``: its training loss EMA when
        the manifest is written); a failure is logged, not raised."""
        try:
            if not await self._is_writer(shard.epoch):
                self._others = (shard.epoch, time.monotonic())
                return
            position = {t.share: t.position for t in await self.directory.trainers()}
            shard.meta["data_position"] = {str(k): v for k, v in sorted(position.items())}  # part of the state
            manifest, _ = await write_checkpoint(self.keeper, shard, parent=partial(self._parent, shard.epoch),
                                                 loss=loss(), data_position=position)
            self.lineage.current = (manifest.shard_sha256, manifest.epoch)
        except CheckpointError as e:
            self.log.warning("checkpoint of epoch %d not committed: %s", shard.epoch, e)
        except Exception:
            self.log.exception("writing the checkpoint of epoch %d failed", shard.epoch)
        finally:
            self._writing = False

    async def _parent(self, epoch: int) -> tuple[str, int]:
        """The parent of the checkpoint of ``epoch`` (:meth:`Lineage.parent`), read as its manifest is sealed. If
        another server was writing the stage's previous checkpoint, waits for its manifest up to
        :data:`PARENT_WAIT_TICKS` keeper ticks (``record_ttl_s / 3`` each) after that checkpoint's epoch ended: with
        epochs quicker than a commit the two commits overlap, and a parent read before the earlier one finished
        would skip it in the hash chain (the chaos bench counted it lost). A commit that failed costs the wait."""
        awaited = self._others if self._others is not None and self._others[0] < epoch else None
        wait_s = PARENT_WAIT_TICKS * self.directory.ttl / 3
        deadline = awaited[1] + wait_s if awaited else 0.0
        while True:
            manifests = await self.keeper.known_manifests(self.stage)
            if awaited is None or any(m.epoch >= awaited[0] for m in manifests):
                return self.lineage.parent(manifests, epoch)
            if time.monotonic() >= deadline:
                self.log.info("the checkpoint of epoch %d names its parent without epoch %d's: no manifest of it "
                              "appeared within %.0f s (its writer's commit failed or is slow)", epoch, awaited[0],
                              wait_s)
                return self.lineage.parent(manifests, epoch)
            await asyncio.sleep(0.5)

    async def _is_writer(self, epoch: int) -> bool:
        """Whether this server writes the checkpoint of ``epoch``: :func:`writer_of` its stage's live servers
        (stale records of dead servers do not count, or a killed writer would block checkpoints until its record
        expired)."""
        online = {s.peer_id for s in await self.directory.fresh_servers(self.stage)} | {self.me}
        return writer_of(self.keeper.run_id, self.stage, epoch, online) == self.me


__all__ = ["StageCommits", "writer_of"]
