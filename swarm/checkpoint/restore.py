"""Where a stage server's state comes from when it starts serving a stage: its live servers, else its newest
checkpoint, else the spec's initial parameters.

With live servers of the stage the server loads their state (:meth:`StageRestore.load_from_peers`, hivemind
``load_state_from_peers``; a load that brought nothing falls through to the checkpoint); otherwise the stage's
newest committed checkpoint is fetched from any ``k`` verified fragments, once the stage's newest visible
checkpoint has stayed the same for one record TTL (holders restarting with it re-publish their manifests within
that). If the swarm shows checkpoints but too few holders yet (every peer is restarting), the server waits up to
``checkpoint.restore_timeout_s`` for them; only then does it fall back to an older restorable checkpoint, logging
the epochs lost. With no checkpoint anywhere (a new run) it starts from the spec's initial parameters.

:class:`Lineage` records which committed checkpoint the state descends from: the parent of the next commit
(:mod:`swarm.checkpoint.commit`), so committed states form a hash chain.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

from swarm.checkpoint.catalog import CheckpointView, SettledView, newest_restorable
from swarm.checkpoint.erasure import FragmentError
from swarm.checkpoint.keeper import FragmentKeeper
from swarm.checkpoint.shard import ShardError, StageShard, decode_shard, encode_shard
from swarm.checkpoint.state import Compute, StateHolder, state_digest
from swarm.net.stage_rpc import is_serving
from swarm.protocol import CheckpointManifest, RestoreReport, ServerState

logger = logging.getLogger(__name__)


class RestoreError(RuntimeError):
    """No live server of the stage and no restorable checkpoint although the run has checkpoints."""


@dataclass
class Lineage:
    """Which committed checkpoint a server's state descends from.

    :param current: ``(shard sha256, epoch)`` of the newest checkpoint the state descends from: it wrote it,
        restored it, or it was the stage's newest when the state was loaded from live servers.
    :param restored: the checkpoint last restored (None before any restore).
    :param skipped: shard hashes newer than the last restore, which the state does not descend from (a fallback to
        an older checkpoint, or a rollback).
    """

    current: tuple[str, int] = ("", -1)
    restored: Optional[tuple[str, int]] = None
    skipped: set[str] = field(default_factory=set)

    def parent(self, manifests: Sequence[CheckpointManifest], epoch: int) -> tuple[str, int]:
        """The checkpoint the state at ``epoch`` descends from: the stage's newest committed one (of
        ``manifests``, or :attr:`current` if the read missed it) before ``epoch`` (the servers of a stage stay in
        sync, so a checkpoint another server committed counts), except those :attr:`skipped`."""
        floor = self.restored[1] if self.restored is not None else -1
        candidates = [(m.epoch, m.time, m.shard_sha256) for m in manifests
                      if floor <= m.epoch < epoch and m.shard_sha256 not in self.skipped]
        sha, known = self.current
        if sha and floor <= known < epoch and sha not in self.skipped:  # a DHT read may miss what was seen before
            candidates.append((known, float("-inf"), sha))
        if candidates:
            best_epoch, _, best_sha = max(candidates)
            return best_sha, best_epoch
        return self.restored or ("", -1)


class StageRestore:
    """Restores stage ``stage``'s state into ``holder`` (module docstring), through this peer's ``keeper`` and on
    the compute thread (``compute``).

    :param lineage: updated by every restore and load (shared with the stage's commits).
    :param log: the stage's log.
    """

    def __init__(self, keeper: FragmentKeeper, holder: StateHolder, compute: Compute, *, stage: int,
                 lineage: Lineage, log: logging.Logger | logging.LoggerAdapter):
        self.keeper, self.holder, self.compute, self.stage = keeper, holder, compute, stage
        self.spec, self.directory, self.me = keeper.spec, keeper.directory, keeper.me
        self.lineage, self.log = lineage, log
        self.restored: Optional[RestoreReport] = None
        self.restored_meta: dict = {}  # the metadata of the shard last restored (its rollback generation, lr scale)
        self.peer_epoch = 0  # the epoch the stage's live servers announced when source() chose them

    async def _others_online(self) -> Optional[int]:
        """The lowest announced epoch of the stage's other servers that answer a ping, or None if none does.
        (Records alone may be stale: a peer killed a moment ago is still listed online, and a restarted one
        keeps its peer id.)"""
        servers = await self.directory.servers(self.stage)
        candidates = [s for s in servers if s.state == ServerState.ONLINE and s.peer_id != self.me]
        answers = await asyncio.gather(*(is_serving(self.keeper.p2p, s, self.keeper.run_id) for s in candidates))
        return min((s.epoch for s, ok in zip(candidates, answers) if ok), default=None)

    async def load_from_peers(self) -> bool:
        """Load the state of the stage's live servers (:meth:`StageOptimizer.load_state_from_peers`: a donor's
        state, kept only if the stage's other servers vouch for it, :mod:`swarm.trust.statecheck`). False if no
        donor gave one: the epoch stayed more than one behind the epoch the live servers announced (their donor
        records may all be stale, every donor busy, or every donor refused), and the caller restores the
        checkpoint instead of serving the initial parameters. Where the stage stepped while the state downloaded
        (the donor's epoch is behind the stage's by the end), it loads once more, before serving: served, the
        stale state would be reloaded at the first micro-batch, on the compute thread, with the trainers' micro-batches
        waiting (8 s on 20 Mbit/s links) and their samples dropped."""
        before = self.holder.epoch
        loaded = await asyncio.to_thread(self.holder.load_state_from_peers)
        if before < loaded < (stage := self.holder.stage_epoch):  # (once: epochs may end faster than a download)
            self.log.info("the stage reached epoch %d while the state of epoch %d downloaded: loading its state again "
                          "before serving", stage, loaded)
            loaded = await asyncio.to_thread(self.holder.load_state_from_peers)
        if loaded < self.peer_epoch - 1:
            self.log.warning("no live server gave its state (epoch %d -> %d, servers at %d); restoring the stage's "
                             "checkpoint instead", before, loaded, self.peer_epoch)
            return False
        # the state descends from the newest checkpoint at or before its epoch (a newer one may be committed as
        # the state loads: it is not an ancestor, the one before it is)
        ancestors = [m for m, _ in await self.directory.manifests(self.stage) if m.epoch <= self.holder.epoch]
        if ancestors:
            newest = max(ancestors, key=lambda m: m.epoch)
            self.lineage.current = (newest.shard_sha256, newest.epoch)
        return True

    async def _has_checkpoints(self) -> bool:
        """Has this run ever committed a checkpoint (on our disk, or visible in the DHT)?"""
        on_disk = await asyncio.to_thread(lambda: any(True for _ in self.keeper.store.committed(self.keeper.run_id)))
        return on_disk or any(s.held for s in await self.directory.storage())

    async def source(self, ask_peers: bool = True) -> str:
        """Decide where the state comes from and restore it if from a checkpoint.

        :param ask_peers: look for live servers of the stage first (False after :meth:`load_from_peers` failed).
        :returns: ``"peers"`` (the caller loads from live servers with :meth:`load_from_peers`), ``"checkpoint"``
            or ``"fresh"``.
        :raises RestoreError: checkpoints exist but none became restorable within ``restore_timeout_s``.
        """
        started, evidence = time.monotonic(), await self._has_checkpoints()
        last_note, settling = 0.0, SettledView(self.directory.ttl, started)
        while True:
            if ask_peers and (epoch := await self._others_online()) is not None:
                self.peer_epoch = epoch
                return "peers"
            views = (await self.keeper.views())[self.stage]
            settled = settling.observe(views, time.monotonic())
            source = await self._restore_or_wait(views, time.monotonic() - started, evidence, settled)
            if source is not None:
                return source
            if time.monotonic() - last_note > 10:
                last_note = time.monotonic()
                newest = views[0] if views else None
                self.log.info("no live server of the stage; waiting for checkpoint holders (%s)",
                              f"epoch {newest.manifest.epoch}: {newest.fragments_alive}/{newest.manifest.k} "
                              "fragments alive" if newest else "no manifest yet")
            await asyncio.sleep(1.0)

    async def _restore_or_wait(self, views: list[CheckpointView], waited: float, evidence: bool,
                               settled: bool) -> Optional[str]:
        """One look at the stage's checkpoints: ``"checkpoint"`` (restored), ``"fresh"``, or None (wait more).

        :param settled: the stage's newest visible checkpoint has not changed for one record TTL
            (:class:`~swarm.checkpoint.catalog.SettledView`); nothing is restored before.
        :raises RestoreError: waited ``restore_timeout_s`` and nothing became restorable.
        """
        timeout = self.spec.checkpoint.restore_timeout_s
        best, newest = newest_restorable(views), (views[0] if views else None)
        if best is not None and settled and (best.manifest.epoch == newest.manifest.epoch or waited > timeout):
            if best.manifest.epoch != newest.manifest.epoch:
                self.log.error("checkpoint epoch %d has only %d of %d fragments alive after %.0f s; restoring epoch "
                               "%d instead: epochs %d..%d are lost", newest.manifest.epoch, newest.fragments_alive,
                               newest.manifest.k, waited, best.manifest.epoch, best.manifest.epoch + 1,
                               newest.manifest.epoch)
            try:
                await self.restore_from(best, set_epoch=True)
                return "checkpoint"
            except (FragmentError, ShardError) as e:
                self.log.warning("restoring epoch %d failed (%s); retrying", best.manifest.epoch, e)
                return None
        if newest is None and (not evidence or waited > min(timeout, 3 * self.directory.ttl)):
            if evidence:
                self.log.warning("the run has checkpoints but none of stage %d appeared within %.0f s; starting "
                                 "from the initial parameters", self.stage, waited)
            return "fresh"
        if newest is not None and best is None and waited > timeout:
            raise RestoreError(
                f"stage {self.stage} has no live server and its checkpoints have too few fragments alive "
                f"(newest: epoch {newest.manifest.epoch}, {newest.fragments_alive} of {newest.manifest.k} needed) "
                f"after {waited:.0f} s; start the peers that hold its fragments (their SWARM_FRAGMENT_DIR)")
        return None

    async def newest_checkpoint(self, max_epoch: Optional[int] = None) -> Optional[CheckpointView]:
        """The stage's newest restorable checkpoint (at or before ``max_epoch``), or None."""
        return newest_restorable((await self.keeper.views())[self.stage], max_epoch=max_epoch)

    async def restore_from(self, view: CheckpointView, *, set_epoch: bool) -> RestoreReport:
        """Fetch ``view``'s shard and load it into the stage's state (on the compute thread).

        :param set_epoch: also set the epoch (and schedule) to the checkpoint's (at start-up; a rollback keeps the
            epoch counter).
        :raises FragmentError: fewer than ``k`` verified fragments could be fetched.
        :raises ShardError: the shard does not decode or is not the one its manifest names.
        """
        m = view.manifest
        started = time.monotonic()
        self.log.info("restoring from checkpoint epoch %d (sha256 %s, %d bytes, %d of %d fragments alive)", m.epoch,
                      m.shard_sha256[:16], m.size, view.fragments_alive, m.n)

        def progress(done: int, needed: int, received: int) -> None:
            self.log.info("restore: fragment %d/%d fetched, %.2f MB", done, needed, received / 1e6)

        blob, bad = await self.keeper.transfers.fetch(view, progress)
        shard = await asyncio.to_thread(decode_shard, blob, m.shard_sha256)
        if shard.run_id != self.keeper.run_id or shard.stage != self.stage or shard.epoch != m.epoch:
            raise ShardError(f"the shard is run {shard.run_id} stage {shard.stage} epoch {shard.epoch}, "
                             f"not what its manifest says")
        if await asyncio.to_thread(state_digest, shard.tensors) != m.state_sha256:
            raise ShardError(f"the state in the shard of epoch {m.epoch} is not the one its manifest's endorsers "
                             "agreed on")
        recaptured = await self.compute(self._load, shard, set_epoch)
        report = RestoreReport(epoch=m.epoch, shard_sha256=m.shard_sha256, bit_exact=recaptured == m.shard_sha256,
                               seconds=round(time.monotonic() - started, 3), fragments_bad=bad)
        self.restored, self.restored_meta = report, dict(shard.meta)
        self.lineage.restored = self.lineage.current = (m.shard_sha256, m.epoch)
        self.lineage.skipped = {k.shard_sha256 for k in await self.keeper.known_manifests(self.stage)
                                if k.epoch > m.epoch}
        self.log.info("restored checkpoint epoch %d in %.1f s (bit-exact: %s, corrupt fragments refused: %d)", m.epoch,
                      report.seconds, report.bit_exact, bad)
        return report

    def _load(self, shard: StageShard, set_epoch: bool) -> str:
        """(compute thread) Load ``shard``; returns the SHA-256 of the state captured right after."""
        self.holder.load_state(shard.tensors)
        if set_epoch:
            self.catch_up(shard.epoch)
        _, sha = encode_shard(StageShard(shard.run_id, shard.stage, shard.epoch, self.holder.state(), shard.meta))
        return sha

    def catch_up(self, epoch: int = 0) -> int:
        """(compute thread) Set the epoch to ``epoch`` or, if later, the stage's collaborative epoch
        (:meth:`~swarm.averaging.optimizer.StageOptimizer.jump_to_epoch`). Epoch numbers are never reused: the
        epochs lost since the checkpoint are skipped, and the hash chain (``parent_epoch``) shows the jump.
        Returns the epoch set."""
        target = self.holder.jump_to_epoch(epoch)
        if target > epoch:
            self.log.info("skipping to the stage's epoch %d (the checkpoint is of epoch %d)", target, epoch)
        return target


__all__ = ["Lineage", "RestoreError", "StageRestore"]
