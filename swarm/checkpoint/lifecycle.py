"""A stage server's checkpoint duties: restore at start, commit every interval, follow rollback orders.

* **Restore** (:meth:`StageCheckpoints.restore_at_start`): with live servers of the stage the caller loads
  their state (:meth:`StageCheckpoints.load_from_peers`, hivemind ``load_state_from_peers``; a load that
  brought nothing falls through to the checkpoint); otherwise the stage's newest committed checkpoint is
  fetched from any ``k`` verified fragments, once the stage's newest visible checkpoint has stayed the same for
  one record TTL (holders restarting with it re-publish their manifests within that). If the swarm shows
  checkpoints but too few holders yet (every peer is restarting), the server waits up to
  ``checkpoint.restore_timeout_s`` for them; only then does it fall back to an older restorable checkpoint,
  logging the epochs lost. With no checkpoint anywhere (a new run) it starts from the spec's initial parameters.
* **Commit**: where an epoch ends (:class:`swarm.server.session.ServerSession`), every ``checkpoint.interval_epochs``
  epochs (:meth:`StageCheckpoints.due`) the state is captured on the compute thread (a consistent copy between
  micro-batches, :meth:`StageCheckpoints.capture`) and, if this server is the stage's writer (the online server
  with the lowest peer id), committed in the background (:meth:`StageCheckpoints.commit`, through
  :func:`~swarm.checkpoint.writer.write_checkpoint`) with ``parent`` = the checkpoint the state descends from.
* **Rollback**: a last-stage server judges each epoch's loss (:meth:`StageCheckpoints.is_spike`) and issues a
  signed order on a spike; every server follows orders (:meth:`StageCheckpoints.follow_orders`). See
  :mod:`swarm.checkpoint.rollback`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Coroutine, Optional

from hivemind.utils import get_dht_time

from swarm.checkpoint.catalog import CheckpointView, SettledView, newest_restorable
from swarm.checkpoint.erasure import FragmentError
from swarm.checkpoint.keeper import FragmentKeeper
from swarm.checkpoint.rollback import LossSpikeDetector, order_in_force
from swarm.checkpoint.shard import ShardError, StageShard, decode_shard, encode_shard
from swarm.checkpoint.state import state_digest
from swarm.checkpoint.writer import CheckpointError, write_checkpoint
from swarm.identity import peer_id_of
from swarm.logs import PeerLog
from swarm.protocol import RestoreReport, RollbackOrder, ServerState, rollback_key
from swarm.net.stage_rpc import is_serving
from swarm.server.stage import EpochEnd, StageServer

logger = logging.getLogger(__name__)


class RestoreError(RuntimeError):
    """No live server of the stage and no restorable checkpoint although the run has checkpoints."""


class StageCheckpoints:
    """Checkpoint duties of ``server`` (a :class:`~swarm.server.stage.StageServer` with its optimizer), whose peer holds
    fragments through ``keeper``. Create it on the event loop (background commits are scheduled there)."""

    def __init__(self, keeper: FragmentKeeper, server: StageServer, identity):
        self.keeper, self.server, self.identity = keeper, server, identity
        self.spec, self.directory, self.me = keeper.spec, keeper.directory, identity.peer_id
        self.stage = server.stage
        self.log = PeerLog(logger, self.me, stage=self.stage, epoch=lambda: server.epoch)
        self.lineage: tuple[str, int] = ("", -1)
        self._restored_lineage: Optional[tuple[str, int]] = None
        self._skipped: set[str] = set()  # shard hashes newer than the last restore (not ancestors of our state)
        self.restored: Optional[RestoreReport] = None
        self.generation, self.order_sealed = 0, None
        self._issued = (0, 0.0)  # (generation, time.monotonic()) of the last rollback order this server issued
        self._order_scale, self.order_issuer, self.order_subkey = 1.0, "", ""
        self.detector = LossSpikeDetector(self.spec.rollback)
        try:
            self.loop: Optional[asyncio.AbstractEventLoop] = asyncio.get_running_loop()
        except RuntimeError:  # built outside an event loop (unit tests): nothing can be submitted
            self.loop = None
        self.peer_epoch = 0  # the epoch the stage's live servers announced when restore_at_start chose them
        self._writing = False
        self._pending: set = set()  # futures of commits and rollback orders submitted from the compute thread
        keeper.authority.states.setdefault(self.stage, {})  # endorse this stage's checkpoints by state only

    @property
    def optimizer(self):
        return self.server.optimizer

    @property
    def lr_scale(self) -> float:
        return self.optimizer.lr_scale if self.optimizer is not None else 1.0

    # ---- restore ---------------------------------------------------------------------------------------
    async def _others_online(self) -> Optional[int]:
        """The lowest announced epoch of the stage's other servers that answer a ping, or None if none does.
        (Records alone may be stale: a peer killed a moment ago is still listed online, and a restarted one
        keeps its peer id.)"""
        servers = await self.keeper.io(self.directory.servers, self.stage)
        candidates = [s for s in servers if s.state == ServerState.ONLINE and s.peer_id != self.me]
        answers = await asyncio.gather(*(is_serving(self.keeper.p2p, s, self.keeper.run_id) for s in candidates))
        return min((s.epoch for s, ok in zip(candidates, answers) if ok), default=None)

    def load_from_peers(self) -> bool:
        """(blocking) Load the state of the stage's live servers (:meth:`StageOptimizer.load_state_from_peers`:
        a donor's state, kept only if the stage's other servers vouch for it, :mod:`swarm.trust.statecheck`). False if
        no donor gave one: the optimizer's epoch stayed more than one behind the epoch the live servers
        announced (their donor records may all be stale, every donor busy, or every donor refused), and the
        caller restores the checkpoint instead of serving the initial parameters."""
        before = self.optimizer.epoch
        loaded = self.optimizer.load_state_from_peers()
        if loaded < self.peer_epoch - 1:
            self.log.warning("no live server gave its state (epoch %d -> %d, servers at %d); restoring the stage's "
                             "checkpoint instead", before, loaded, self.peer_epoch)
            return False
        self.after_peer_load()
        return True

    def _evidence(self) -> bool:
        """Has this run ever committed a checkpoint (on our disk, or visible in the DHT)?"""
        return any(True for _ in self.keeper.store.committed(self.keeper.run_id)) or any(
            s.held for s in self.directory.storage())

    async def restore_at_start(self, ask_peers: bool = True) -> str:
        """Decide where the state comes from and restore it if from a checkpoint.

        :param ask_peers: look for live servers of the stage first (False after :meth:`load_from_peers` failed).
        :returns: ``"peers"`` (the caller loads from live servers with :meth:`load_from_peers`), ``"checkpoint"``
            or ``"fresh"``.
        :raises RestoreError: checkpoints exist but none became restorable within ``restore_timeout_s``.
        """
        order = await self._order_in_force()
        if order is not None:
            self._adopt_order(*order)
        started, evidence = time.monotonic(), await self.keeper.io(self._evidence)
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

    async def restore_from(self, view: CheckpointView, *, set_epoch: bool) -> RestoreReport:
        """Fetch ``view``'s shard and load it into the stage's module and optimizer (on the compute thread).

        :param set_epoch: also set the optimizer's epoch (and schedule) to the checkpoint's (at start-up; a
            rollback keeps the epoch counter).
        :raises FragmentError: fewer than ``k`` verified fragments could be fetched.
        :raises ShardError: the shard does not decode or is not the one its manifest names.
        """
        m = view.manifest
        started = time.monotonic()
        self.log.info("restoring from checkpoint epoch %d (sha256 %s, %d bytes, %d of %d fragments alive)", m.epoch,
                      m.shard_sha256[:16], m.size, view.fragments_alive, m.n)

        def progress(done: int, needed: int, received: int) -> None:
            self.log.info("restore: fragment %d/%d fetched, %.2f MB", done, needed, received / 1e6)

        blob, bad = await self.keeper.fetch(view, progress)
        shard = await self.keeper.io(decode_shard, blob, m.shard_sha256)
        if shard.run_id != self.keeper.run_id or shard.stage != self.stage or shard.epoch != m.epoch:
            raise ShardError(f"the shard is run {shard.run_id} stage {shard.stage} epoch {shard.epoch}, "
                             f"not what its manifest says")
        if await self.keeper.io(state_digest, shard.tensors) != m.state_sha256:
            raise ShardError(f"the state in the shard of epoch {m.epoch} is not the one its manifest's endorsers "
                             "agreed on")
        recaptured = await self.server.compute(self._load, shard, set_epoch)
        report = RestoreReport(epoch=m.epoch, shard_sha256=m.shard_sha256, bit_exact=recaptured == m.shard_sha256,
                               seconds=round(time.monotonic() - started, 3), fragments_bad=bad)
        self.restored = report
        self._restored_lineage = self.lineage = (m.shard_sha256, m.epoch)
        self._skipped = {k.shard_sha256 for k in await self.keeper.io(self.keeper.known_manifests, self.stage)
                         if k.epoch > m.epoch}
        self.log.info("restored checkpoint epoch %d in %.1f s (bit-exact: %s, corrupt fragments refused: %d)", m.epoch,
                      report.seconds, report.bit_exact, bad)
        return report

    def _load(self, shard: StageShard, set_epoch: bool) -> str:
        """(compute thread) Load ``shard``; returns the SHA-256 of the state captured right after."""
        self.optimizer.load_state(shard.tensors)
        if set_epoch:
            self.catch_up(shard.epoch)
            if self.generation == 0 and shard.meta.get("rollback_generation"):
                self.generation = int(shard.meta["rollback_generation"])
                self.optimizer.set_lr_scale(float(shard.meta.get("lr_scale", 1.0)))
        _, sha = encode_shard(StageShard(shard.run_id, shard.stage, shard.epoch, self.optimizer.state(), shard.meta))
        return sha

    def catch_up(self, epoch: int = 0) -> int:
        """(compute thread) Set the optimizer's epoch to ``epoch`` or, if later, the stage's collaborative epoch
        (:meth:`~swarm.averaging.optimizer.StageOptimizer.jump_to_epoch`). Epoch numbers are never reused: the
        epochs lost since the checkpoint are skipped, and the hash chain (``parent_epoch``) shows the jump.
        Returns the epoch set."""
        target = self.optimizer.jump_to_epoch(epoch)
        if target > epoch:
            self.log.info("skipping to the stage's epoch %d (the checkpoint is of epoch %d)", target, epoch)
        return target

    def after_peer_load(self) -> None:
        """After loading from live servers: the state descends from the stage's newest checkpoint."""
        newest = next(iter(self.directory.manifests(self.stage)), None)
        if newest is not None and newest[0].epoch <= self.server.epoch:
            self.lineage = (newest[0].shard_sha256, newest[0].epoch)
        if self.optimizer is not None and self.order_sealed is not None:
            self.optimizer.set_lr_scale(self._order_scale)

    # ---- commit ----------------------------------------------------------------------------------------
    def due(self, epoch: int) -> bool:
        """Is a checkpoint due at ``epoch`` (every ``interval_epochs``; not while the last one is still being
        committed)?"""
        return epoch > 0 and epoch % self.spec.checkpoint.interval_epochs == 0 and not self._writing

    def capture(self, epoch: int) -> StageShard:
        """(compute thread, right after the step of ``epoch``) A consistent copy of the stage's state, with the
        rollback generation, learning-rate scale and samples so far in its metadata."""
        meta = {"lr_scale": self.lr_scale, "rollback_generation": self.generation,
                "samples": epoch * self.spec.training.target_batch_size}
        self._writing = True
        shard = StageShard(self.keeper.run_id, self.stage, epoch, self.optimizer.state(), meta)
        self.keeper.authority.record_state(self.stage, epoch, state_digest(shard.tensors))  # to endorse the writer
        return shard

    async def commit(self, shard: StageShard) -> None:
        """Commit ``shard`` to the swarm if this server is the stage's writer; a failure is logged, not raised."""
        io = self.keeper.io
        try:
            if not await io(self._is_writer):
                return
            parent = await io(self._parent, shard.epoch)
            position = {t.shard: t.position for t in await io(self.directory.trainers)}
            shard.meta["data_position"] = {str(k): v for k, v in sorted(position.items())}  # part of the state
            manifest, _ = await write_checkpoint(self.keeper, shard, parent=parent, loss=self.server.loss_ema,
                                                 data_position=position)
            self.lineage = (manifest.shard_sha256, manifest.epoch)
        except CheckpointError as e:
            self.log.warning("checkpoint of epoch %d not committed: %s", shard.epoch, e)
        except Exception:
            self.log.exception("writing the checkpoint of epoch %d failed", shard.epoch)
        finally:
            self._writing = False

    def submit(self, work: Coroutine) -> None:
        """Run ``work`` (a commit or a rollback order) on the event loop, from any thread; :meth:`close` waits."""
        future = asyncio.run_coroutine_threadsafe(work, self.loop)
        self._pending.add(future)
        future.add_done_callback(self._pending.discard)

    async def close(self, timeout: float = 30.0) -> None:
        """Let a checkpoint being committed finish (bounded by ``timeout`` seconds), then cancel the rest; this
        server no longer endorses the stage's checkpoints."""
        self.keeper.authority.states.pop(self.stage, None)
        pending = [asyncio.wrap_future(f) for f in list(self._pending)]
        if pending:
            _, late = await asyncio.wait(pending, timeout=timeout)
            for f in late:
                f.cancel()
            await asyncio.gather(*late, return_exceptions=True)

    def _parent(self, epoch: int) -> tuple[str, int]:
        """The checkpoint the state at ``epoch`` descends from: the stage's newest committed one before
        ``epoch`` (the servers of a stage stay in sync, so a checkpoint another server committed counts),
        except those skipped by this server's last restore (newer than what it restored: a fallback to an
        older checkpoint, or a rollback), which the state does not descend from."""
        floor = self._restored_lineage[1] if self._restored_lineage is not None else -1
        candidates = [m for m in self.keeper.known_manifests(self.stage)
                      if floor <= m.epoch < epoch and m.shard_sha256 not in self._skipped]
        best = max(candidates, key=lambda m: (m.epoch, m.time), default=None)
        if best is not None:
            return best.shard_sha256, best.epoch
        return self._restored_lineage or ("", -1)

    def _is_writer(self) -> bool:
        """The stage's writer is its live server with the lowest peer id (stale records of dead servers do
        not count, or a killed writer would block checkpoints until its record expired)."""
        return min([s.peer_id for s in self.directory.fresh_servers(self.stage)] + [self.me]) == self.me

    # ---- rollback --------------------------------------------------------------------------------------
    def is_spike(self, end: EpochEnd) -> bool:
        """(compute thread) Judge the mean training loss of the epoch that ended (last stage, rollback enabled):
        True on a spike, which the caller answers with :meth:`issue_rollback`; False on the later spikes of a streak
        while this server's order is alive (a record TTL) and not yet applied: the first spike names the epoch to
        return to, a later one would name an epoch already trained on the bad data."""
        if not (self.spec.rollback.enabled and self.server.is_last and end.loss is not None):
            return False
        if not self.detector.update(end.loss):
            return False
        self.log.warning("loss spike: epoch mean %.4f > (1 + %.2f) x moving average %.4f", end.loss,
                         self.spec.rollback.margin, self.detector.average)
        generation, issued_at = self._issued
        if generation > self.generation and time.monotonic() - issued_at < self.directory.ttl:
            return False  # its order is out, alive and not yet applied: the first spike names the epoch to return to
        self._issued = (self.generation + 1, time.monotonic())
        return True

    def _adopt_order(self, order: RollbackOrder, sealed: bytes) -> None:
        self.generation, self.order_sealed = order.generation, sealed
        self._order_scale, self.order_issuer, self.order_subkey = order.lr_scale, order.peer_id, order.dht_subkey()
        if self.optimizer is not None:
            self.optimizer.set_lr_scale(order.lr_scale)

    async def issue_rollback(self, detected_epoch: int, loss: float) -> None:
        """Publish a signed order to return every stage to its checkpoint before ``detected_epoch``, with the
        learning rate scaled by ``rollback.lr_factor``."""
        order = RollbackOrder(run_id=self.keeper.run_id, peer_id=self.me, time=get_dht_time(),
                              epoch=max(0, detected_epoch - 1), detected_epoch=detected_epoch,
                              lr_scale=self.lr_scale * self.spec.rollback.lr_factor, generation=self.generation + 1,
                              reason=f"epoch {detected_epoch} mean loss {loss:.4f} > (1 + {self.spec.rollback.margin}) "
                                     f"x moving average {self.detector.average:.4f}")
        if not await self.keeper.io(self.directory.announce, rollback_key(self.keeper.run_id), order, self.identity):
            self._issued = (self.generation, 0.0)  # not stored: the next spike issues it again
            self.log.warning("could not store rollback #%d in the DHT; it is issued again at the next spike",
                             order.generation)
            return
        self.log.warning("issued rollback #%d to epoch <= %d, lr scale %.3g: %s", order.generation, order.epoch,
                         order.lr_scale, order.reason)

    async def follow_orders(self) -> None:
        """Apply a rollback order newer than the last one applied that is in force (:func:`order_in_force`), and
        keep the applied one published (one look; the session calls it periodically)."""
        io = self.keeper.io
        order = await self._order_in_force()
        if order is not None:
            await self.apply_rollback(*order)
        if self.order_sealed is not None:
            await io(self.directory.store_sealed, rollback_key(self.keeper.run_id), self.order_subkey,
                     self.order_sealed)

    async def _order_in_force(self) -> Optional[tuple[RollbackOrder, bytes]]:
        """The rollback order newer than the one applied that is in force (:func:`order_in_force`), or None."""
        io = self.keeper.io
        orders = await io(self.directory.rollback_orders)
        if not orders or orders[0][0].generation <= self.generation:
            return None
        online = {k: await io(self.directory.fresh_servers, k) for k in range(self.spec.model.num_stages)}
        run_key = self.directory.run_key
        return order_in_force(orders, online, applied=self.generation, lr_factor=self.spec.rollback.lr_factor,
                              authority=peer_id_of(run_key) if run_key is not None else None)

    async def apply_rollback(self, order: RollbackOrder, sealed: bytes) -> None:
        """Restore the newest checkpoint at or before ``order.epoch`` and scale the learning rate."""
        views = (await self.keeper.views())[self.stage]
        view = newest_restorable(views, max_epoch=order.epoch)
        self.log.warning("rollback #%d (%s): restoring %s, lr scale %.3g", order.generation, order.reason,
                         f"checkpoint epoch {view.manifest.epoch}" if view else "nothing (no checkpoint at or before "
                         "that epoch; lowering the learning rate only)", order.lr_scale)
        if view is not None:
            try:
                await self.restore_from(view, set_epoch=False)
            except (FragmentError, ShardError) as e:
                self.log.error("rollback restore failed (%s); lowering the learning rate only", e)
        await self.server.compute(self._adopt_order, order, sealed)
        self.detector.reset()
