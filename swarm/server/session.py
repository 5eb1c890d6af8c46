"""A stage server's life in one process: join, hold fragments, pick a stage, restore, serve, rebalance, drain.

:class:`ServerSession` is what ``swarm-peer join`` runs (the app only parses settings, configures logging and
turns signals and ``swarm-peer pause|resume|drain`` into :meth:`ServerSession.stop`, :meth:`~ServerSession.pause`
and :meth:`~ServerSession.resume`); a test starts one in-process the same way::

    session = ServerSession(address, PeerSettings(host="127.0.0.1"), stage=0)
    await session.run()            # until session.stop()

1. Join the run's DHT and fetch the verified spec (:func:`swarm.net.dht.connect_run`); start the fragment
   keeper (:mod:`swarm.checkpoint.keeper`), which serves and re-announces the fragments on this peer's disk for
   the whole life of the process, whatever stage it serves. A peer on the run's ban list stops here
   (:class:`~swarm.trust.banlist.PeerBanned`).
2. Pick a stage (the pinned one, or the bottleneck stage, :func:`swarm.trainer.routing.choose_stage`), build its
   module, measure throughput (samples/s), announce ``joining``.
3. Create the stage's collaborative optimizer (:class:`~swarm.averaging.optimizer.StageOptimizer`) and
   restore its state: from live servers of the stage if any, else from the newest checkpoint
   (:class:`~swarm.checkpoint.lifecycle.StageCheckpoints`; :class:`~swarm.checkpoint.lifecycle.RestoreError`
   if the run has checkpoints and none becomes restorable).
4. Register the stage RPCs and announce ``online`` every ``record_ttl_s / 3`` seconds, re-publishing the
   signed spec too, so the run outlives its coordinator. Where an epoch ends (:meth:`ServerSession._epoch_ended`,
   on the compute thread) log the epoch's line, judge its loss (a spike issues a rollback order) and, when one
   is due, capture and commit a checkpoint. Follow rollback orders; honour the run's ban list; and, if the
   stage was not pinned, move to a stage that lacks throughput more (:mod:`swarm.server.rebalance`): drain, then go
   back to step 2 for the new stage.
5. :meth:`ServerSession.pause`: leave the stage as a drain does (:meth:`ServerSession._withdraw`: announce
   ``paused``, with throughput 0 and no progress key, so trainers stop routing here and the stage's other
   servers stop counting and waiting for it; let the micro-batches in flight finish; samples it accumulated in
   the unfinished epoch are dropped and counted, ``samples_dropped``), keeping the DHT, the fragment keeper and
   its fragments. :meth:`ServerSession.resume` rejoins the same stage as a late joiner does: step 2, loading the
   stage's current state from its servers.
6. :meth:`ServerSession.stop` (SIGTERM, Ctrl-C, ``swarm-peer drain``): withdraw as a pause does, announcing
   ``draining``; let a checkpoint being committed finish, shut down the optimizer, hand the fragments it holds
   to other peers (at most :data:`HAND_OFF_S`), stop the keeper and the DHT. A planned move withdraws the same
   way before it joins its new stage.
"""

from __future__ import annotations

import asyncio
import faulthandler
import logging
import sys
import threading
import time
from functools import partial
from typing import Callable, Optional

import torch
from hivemind.utils import get_dht_time

from swarm import __version__
from swarm.aio import periodic, sleep_or_stop
from swarm.averaging.optimizer import StageOptimizer
from swarm.trust.banlist import RunBans
from swarm.checkpoint import FragmentStore
from swarm.checkpoint.keeper import FragmentKeeper
from swarm.checkpoint.lifecycle import StageCheckpoints
from swarm.config import PeerSettings, RunSpec
from swarm.trust.convictions import ConvictionBook, ConvictionFollower, EvidenceService
from swarm.net.dht import connect_run, reachability, relay_enabled, visible_maddrs
from swarm.host import ThreadShare, resolve_device
from swarm.identity import Identity, claim_local_state
from swarm.logs import PeerLog
from swarm.kernels import select_backend
from swarm.kernels.flops import PeakCache, compute_dtype, stage_flops_per_token
from swarm.model import build_stage
from swarm.protocol import ServerInfo, ServerState, StorageInfo, add_history
from swarm.server.rebalance import MovePlanner
from swarm.trainer.routing import choose_stage
from swarm.trust.spotcheck import answers_comparable
from swarm.server.stage import EpochEnd, StageServer
from swarm.trust.statecheck import DonorStateCheck

logger = logging.getLogger(__name__)

HAND_OFF_S = 20.0
"""Seconds a draining server spends copying its fragments to other peers (container stop timeouts: 30 s+)."""
DRAIN_DEADLINE_S = 60.0
"""Seconds after which a drain still running logs every thread's stack."""
SUPPLY_STATES = (ServerState.ONLINE, ServerState.JOINING)
"""States of the servers whose throughput rebalancing counts (freshly announced ones only: a record left by a
server that died would otherwise hide a stage's loss for a whole record TTL, or let the last live server of a
stage leave it)."""
ORDERS_PERIOD_S = 2.0
"""Seconds between looks at the run's rollback orders."""
ROSTER_PERIOD_S = 0.5
"""Seconds between reads of the stage's server records, whose progress keys say whose progress counts: a server
that joins or leaves is counted, or no longer waited for, within about this long (one DHT read each)."""
WITHDRAW_S = 4 * ROSTER_PERIOD_S
"""Seconds a leaving server stays in the stage's averaging after announcing that it leaves: its stage-mates read
the stage's records every :data:`ROSTER_PERIOD_S` and then stop counting its progress."""
LEAVE_GRACE_S = 15.0
"""Seconds a leaving server waits, at most, for the backwards of the micro-batches whose forward it ran."""

OptimizerFactory = Callable[..., StageOptimizer]
StageServerFactory = Callable[..., StageServer]
"""Builds a stage's server: ``(spec, run_id, stage, module, *, bans, identity) -> StageServer``."""
"""Builds a stage's optimizer: ``(spec, run_id, stage, dht, module, identity=...)`` (tests and benchmarks pass
a Byzantine one, :mod:`swarm.attacks`)."""
AnnounceHook = Callable[[ServerInfo, StorageInfo], None]
"""Called after each announcement with the record published and the peer's storage record (the app writes its
heartbeat file and Prometheus metrics from them)."""


class NoSuchStage(ValueError):
    """The stage asked for does not exist in this run."""


class ServerSession:
    """Serves a stage of the run at ``address`` until :meth:`stop` (see the module docstring).

    :param settings: this peer's settings (identity and fragment folders, host, relay, name).
    :param stage: serve this stage and never move (default: the bottleneck stage, moving when another lacks
        throughput more).
    :param optimizer_factory: builds the stage's optimizer (default :class:`StageOptimizer`).
    :param server_factory: builds the stage's RPC server (default :class:`~swarm.server.stage.StageServer`).
    :param on_announce: called after each announcement (:data:`AnnounceHook`).

    Call :meth:`run` on the event loop's thread (hivemind's averagers install signal handlers there), and
    :meth:`stop`, :meth:`pause`, :meth:`resume` on the same thread.
    """

    def __init__(self, address: str, settings: PeerSettings, *, stage: Optional[int] = None,
                 optimizer_factory: OptimizerFactory = StageOptimizer, server_factory: StageServerFactory = StageServer,
                 on_announce: Optional[AnnounceHook] = None):
        self.address, self.settings, self.pinned = address, settings, stage
        self.optimizer_factory, self.server_factory, self.on_announce = optimizer_factory, server_factory, on_announce
        self.identity = Identity.load_or_create(settings.identity_path())
        self.me = self.identity.peer_id
        self.log = PeerLog(logger, self.me)
        self.spec: Optional[RunSpec] = None  # the run's, once joined
        self._stop, self._pause, self._changed = asyncio.Event(), asyncio.Event(), asyncio.Event()
        self.state = ServerState.JOINING
        self.stage: Optional[int] = None
        self.server: Optional[StageServer] = None
        self.checkpoints: Optional[StageCheckpoints] = None
        self.history: list = []  # (epoch, DHT time it began, mean loss of the epoch before), see ServerInfo.history
        self._excluded: set[str] = set()  # banned libp2p ids already excluded from this stage's averaging
        self._roster: Optional[frozenset] = None  # progress sub-keys of the stage's servers (swarm.averaging.progress)
        self._donors: frozenset[str] = frozenset()  # libp2p ids of the stage's servers, as the optimizer last heard
        self.threads = ThreadShare(settings.threads)  # torch's threads: this peer's share of the machine
        self.device = resolve_device(settings.device)  # raises DeviceUnavailable
        self.kernels = select_backend(settings.kernels, self.device)  # raises BackendUnavailable
        self.flops_per_sample, self.peak_flops = 0.0, 0.0  # set when a stage starts (swarm.kernels.flops)
        self._dropped_before = 0  # samples dropped by the optimizers of stages this process left
        self._rounds_logged = (0, 0)  # (rounds, their milliseconds) up to the last epoch line

    # ---- control (event loop thread) ---------------------------------------------------------------------
    def stop(self) -> None:
        """Drain: finish in-flight work, hand fragments off, leave; :meth:`run` then returns."""
        self._stop.set()
        self._changed.set()

    def pause(self) -> None:
        """Take no new stage work and leave the stage's averaging (announced ``paused``), keeping the DHT and
        the fragments, until :meth:`resume` (see the module docstring, step 5)."""
        self._pause.set()
        self._changed.set()

    def resume(self) -> None:
        """Rejoin the stage left by :meth:`pause`, loading its current state from its servers."""
        self._pause.clear()
        self._changed.set()

    @property
    def epoch(self) -> int:
        return self.server.epoch if self.server is not None else 0

    @property
    def samples_dropped(self) -> int:
        """Samples this process accumulated whose gradients never reached a step (``ServerInfo.samples_dropped``)."""
        optimizer = self.server.optimizer if self.server is not None else None  # read also once it was shut down
        return self._dropped_before + (optimizer.samples_dropped if optimizer is not None else 0)

    # ---- the process's life ------------------------------------------------------------------------------
    async def run(self) -> None:
        """Join the run, serve stages until :meth:`stop`, then drain and leave.

        :raises PeerBanned: this peer is on the run's ban list (at start, or banned while serving).
        :raises RestoreError: a stage with checkpoints but no live server could not be restored in time.
        :raises NoSuchStage: the pinned stage does not exist in this run.
        :raises SpecError: the run's spec could not be fetched and verified.
        :raises RunUnreachable: none of the run address's peers answered within ``settings.join_timeout_s``.
        :raises IdentityInUse: another process on this machine runs as this peer or uses its state or fragment
            folder.
        """
        claim_local_state(self.identity, self.settings, fragments=True)
        self.threads.update(self.log)
        loop = asyncio.get_running_loop()
        self.dht, self.directory, self.spec, self.sealed_spec = await loop.run_in_executor(
            None, lambda: connect_run(self.address, self.settings, client_mode=False,
                                      join_timeout_s=self.settings.join_timeout_s, identity=self.identity))
        drained, watchdog = False, None
        try:
            keeping = await self._join()
            try:
                stage = self.pinned
                while not self._stop.is_set():
                    if self._pause.is_set():
                        await self._paused()
                        continue
                    stage = stage if stage is not None else await self._io(self._choose_stage)
                    moved = await self._serve(stage)
                    stage = moved if moved is not None else self.pinned
                drained = True
            finally:
                watchdog = _drain_watchdog(self.log)
                await self._leave(keeping, drained)
        finally:
            self.dht.shutdown()
            if watchdog is not None:
                watchdog.cancel()
            self.log.info("stopped")

    async def _join(self) -> asyncio.Task:
        """Start the fragment keeper and follow the ban list; returns the keeper's task."""
        num_stages = self.spec.model.num_stages
        if self.pinned is not None and not 0 <= self.pinned < num_stages:
            raise NoSuchStage(f"stage {self.pinned} is out of range: run {self.directory.run_id} has stages "
                             f"0..{num_stages - 1}")
        store = FragmentStore(self.settings.fragment_path(), self.settings.fragment_max_bytes,
                              self.spec.checkpoint.keep, grace_s=2 * self.spec.timeouts.record_ttl_s)
        self.bans = RunBans(self.directory)
        self.keeper = FragmentKeeper(self.spec, self.directory, self.identity, store, bans=self.bans)
        self.p2p = await self.dht.replicate_p2p()
        await self.keeper.start(self.p2p)
        self.convictions = ConvictionBook(self.directory.run_id, self.me, self.spec.spot_checks.rtol,
                                          accepts=answers_comparable(self.spec))
        await EvidenceService(self.spec, self.convictions).add_p2p_handlers(self.p2p, namespace=self.directory.run_id)
        self._following: set[asyncio.Task] = set()  # evidence fetched from stage-mates' listings
        self.follower = ConvictionFollower(self.convictions, self.p2p, self.spec, self.directory.run_id,
                                           spawn=self._follow, on_adopted=self._adopted, log=self.log)
        self.bans.check(self.me)
        self.maddrs = await self._io(visible_maddrs, self.dht)
        self._say_reachability()
        return asyncio.create_task(self.keeper.run(self._stop))

    async def _leave(self, keeping: asyncio.Task, drained: bool) -> None:
        """Stop the keeper (a tick in progress is cancelled: it must not hold up the drain) and, after a drain
        (not a failure), hand the fragments held here to other peers, so leaving costs no replica."""
        self._stop.set()
        keeping.cancel()
        for task in self._following:
            task.cancel()
        await asyncio.gather(*self._following, return_exceptions=True)
        await asyncio.gather(keeping, return_exceptions=True)
        if drained:
            await self.keeper.hand_off(timeout_s=HAND_OFF_S)
        await self.keeper.stop()

    def _follow(self, work) -> None:
        task = asyncio.create_task(work)
        self._following.add(task)
        task.add_done_callback(self._following.discard)

    def _adopted(self, peer_id: str, reason: str) -> None:
        self.log.warning("verified the evidence a stage-mate lists against %s: %s", peer_id, reason)
        self._changed.set()  # announce (listing it) and exclude it now, not at the next period

    def _choose_stage(self) -> int:
        return choose_stage(self.spec.model, self.directory.all_servers(self.spec.model.num_stages))

    def _say_reachability(self) -> None:
        """Log how peers outside this one's network reach it (see :func:`swarm.net.dht.reachability`)."""
        shown = ", ".join(self.maddrs[:2]) or "none"
        if reachability(self.maddrs, relay_enabled(self.settings)) == "relayed":
            self.log.warning("the swarm reaches this peer through a relay (no public address: %s): slower; forward "
                             "its port and set SWARM_ANNOUNCE_HOST to be reached directly", shown)
        else:
            self.log.info("the swarm reaches this peer directly at %s", shown)

    async def _io(self, fn, *args):
        """Run the blocking ``fn(*args)`` (DHT access) in the default executor."""
        return await asyncio.get_running_loop().run_in_executor(None, fn, *args)

    # ---- one stage ---------------------------------------------------------------------------------------
    async def _serve(self, stage: int) -> Optional[int]:
        """Serve ``stage`` until :meth:`stop` (returns None) or a planned move (returns the new stage)."""
        await self._start_stage(stage)
        handlers = False
        try:
            await self._restore()
            self.server.on_epoch = self._epoch_ended
            await self.server.add_p2p_handlers(self.p2p, namespace=self.directory.run_id)
            handlers = True
            return await self._announce_until_done()
        finally:
            await self._stop_stage(handlers)

    async def _start_stage(self, stage: int) -> None:
        """Build the stage's module, server and optimizer; announce ``joining``."""
        self._dropped_before = self.samples_dropped  # the stage left before, if any
        self.stage, self.history, self._excluded, self.checkpoints = stage, [], set(), None
        self.keeper.stage = stage
        module = build_stage(self.spec.model, stage, precision=self.spec.training.precision,
                             kernels=self.kernels).to(self.device)
        server = self.server = self.server_factory(self.spec, self.directory.run_id, stage, module, bans=self.bans,
                                                   identity=self.identity)
        self.log = PeerLog(logger, self.me, stage=stage, epoch=lambda: server.epoch)
        throughput = await self._io(server.measure_throughput)
        seq_len = self.spec.data.seq_len
        self.flops_per_sample = stage_flops_per_token(self.spec.model, stage, seq_len) * seq_len
        self.peak_flops = await self._io(PeakCache(self.settings.state_path() / "peak_flops.json").peak,
                                         self.device, compute_dtype(self.spec.training.precision))
        await self._announce(ServerState.JOINING)
        self.log.info("joining run %s, throughput %.1f samples/s, device %s, kernels %s, precision %s, peak %.1f "
                      "GFLOP/s", self.directory.run_id, throughput, self.device, self.kernels.name,
                      self.spec.training.precision, self.peak_flops / 1e9)
        # on the loop's thread: hivemind's averagers install signal handlers, which only the main thread may do
        server.optimizer = self.optimizer_factory(self.spec, self.directory.run_id, stage, self.dht, module,
                                                  identity=self.identity)
        self._roster, self._donors = None, frozenset()
        server.optimizer.set_progress_roster(lambda: self._roster)
        await self._announce(ServerState.JOINING)  # with its progress key, so the stage counts it soon
        self.checkpoints = StageCheckpoints(self.keeper, server, self.identity)
        check = DonorStateCheck(self.p2p, self.directory.run_id, partial(self.directory.fresh_servers, stage),
                                partial(self.keeper.known_manifests, stage), me=str(self.dht.peer_id))
        server.optimizer.state_check = check.blocking(asyncio.get_running_loop())

    async def _restore(self) -> None:
        """Load the stage's state from its live servers, else its newest checkpoint, else start fresh; then make
        sure the stage's other servers count this one before its first epoch ends."""
        checkpoints, optimizer = self.checkpoints, self.server.optimizer
        source = await checkpoints.restore_at_start()
        if source == "peers":
            self.log.info("loading state from live servers of the stage")
            if not await self._io(checkpoints.load_from_peers):
                # the checkpoint, or (none yet) stay behind at the old epoch, with no catch-up: the optimizer
                # then downloads the state from the stage's servers when it steps
                await checkpoints.restore_at_start(ask_peers=False)
        if source == "fresh":
            self.log.info("no live server and no checkpoint: starting from the initial parameters")
            await self.server.compute(checkpoints.catch_up)
        # publish our progress now, so the stage's servers count us before the first epoch ends (otherwise a
        # server that reaches the target first sees a group of one and steps alone)
        optimizer.announce_progress()
        expected = 1 + sum(s.peer_id != self.me for s in await self._io(self.directory.fresh_servers, self.stage))
        await self._io(optimizer.wait_until_counted, expected)

    async def _stop_stage(self, handlers: bool) -> None:
        """Leave the stage: take no more work and commit nothing new, let a commit finish, shut the optimizer
        down, stop the compute thread."""
        started = time.monotonic()
        self.server.on_epoch = None  # an epoch that ends from now on (work in flight) starts no commit
        if handlers:
            await self.server.remove_p2p_handlers(self.p2p, namespace=self.directory.run_id)
        await self.checkpoints.close()
        commits_s = time.monotonic() - started
        # on the compute thread, after any step in progress: hivemind's shutdown iterates the state averager's
        # pending updates, which a step adds to and removes from ("Set changed size during iteration")
        await self.server.compute(self.server.optimizer.shutdown)
        self.server.shutdown()
        self.log.info("left the stage in %.1f s (checkpoint commits %.1f s, optimizer %.1f s)",
                      time.monotonic() - started, commits_s, time.monotonic() - started - commits_s)

    async def _announce_until_done(self) -> Optional[int]:
        """Announce every ``record_ttl_s / 3`` seconds; run the epoch watcher and the rollback follower; return
        None on stop, the stage to move to, or this stage on pause (to rejoin it on resume)."""
        leave = asyncio.Event()  # set by stop or by a planned move
        self.log.info("online")
        tasks = [asyncio.create_task(self.server.watch_epochs(leave)),
                 asyncio.create_task(periodic(leave, ORDERS_PERIOD_S, self.checkpoints.follow_orders,
                                              "following rollback orders", self.log)),
                 asyncio.create_task(periodic(leave, ROSTER_PERIOD_S, self._read_roster, "reading the stage's servers",
                                              self.log))]
        online_since, next_check, target = time.monotonic(), time.monotonic() + self.spec.rebalance.period_s, None
        planner = MovePlanner(self.spec.rebalance.min_gain, confirm_s=2 * self.directory.ttl / 3)
        try:
            while target is None and not self._stop.is_set() and not self._pause.is_set():
                await self._apply_bans()
                await self._announce(ServerState.ONLINE)
                await self._io(self.directory.publish_spec, self.sealed_spec)
                if self.pinned is None and time.monotonic() >= next_check:
                    next_check = time.monotonic() + self.spec.rebalance.period_s
                    if time.monotonic() - online_since >= self.spec.rebalance.min_dwell_s:
                        target = await self._rebalance_target(planner)
                if target is None and await sleep_or_stop(self._stop, self.directory.ttl / 3, self._changed):
                    break
                self._changed.clear()
            if self._pause.is_set() and not self._stop.is_set():
                target = self.stage  # rejoined on resume
        finally:
            pausing = self._pause.is_set() and not self._stop.is_set()
            state = ServerState.PAUSED if pausing else ServerState.DRAINING
            self.log.info("leaving the stage: %s", "paused" if pausing else "draining")
            await self._withdraw(state)
            leave.set()
            await asyncio.gather(*tasks)
            await self._announce(state)
        return target

    async def _withdraw(self, state: ServerState) -> None:
        """Before leaving the stage: refuse new stage work and announce ``state`` (throughput 0, no progress key:
        trainers stop routing here and the stage's servers stop counting this one), then let the backwards of the
        micro-batches in flight finish and give the stage-mates :data:`WITHDRAW_S` to read that record, while the
        epoch watcher still joins any round they begin meanwhile (at most :data:`LEAVE_GRACE_S` in all).

        Leaving at once instead, a stage-mate that began a round still counting this server waits for it
        ``averaging_timeout`` seconds (twice, when the round averages the state too)."""
        server = self.server
        server.leaving = True
        await self._announce(state)
        started = time.monotonic()
        while time.monotonic() - started < LEAVE_GRACE_S and \
                (server.in_flight or time.monotonic() - started < WITHDRAW_S):
            await asyncio.sleep(0.1)

    async def _paused(self) -> None:
        """While paused, out of any stage: announce ``paused`` every ``record_ttl_s / 3`` seconds (and keep the
        spec published) until :meth:`resume` or :meth:`stop`.

        :raises PeerBanned: this peer was banned meanwhile.
        """
        self.log.info("paused: left stage %d's averaging; taking no work until `swarm-peer resume`", self.stage)
        while self._pause.is_set() and not self._stop.is_set():
            self.bans.check(self.me)
            await self._announce(ServerState.PAUSED)
            await self._io(self.directory.publish_spec, self.sealed_spec)
            await sleep_or_stop(self._stop, self.directory.ttl / 3, self._changed)
            self._changed.clear()
        if not self._stop.is_set():
            self.log.info("resumed: rejoining stage %d", self.stage)

    async def _rebalance_target(self, planner: MovePlanner) -> Optional[int]:
        """The stage to move to now (:class:`swarm.server.rebalance.MovePlanner`), or None."""
        if not self.spec.rebalance.enabled:
            return None
        servers = {k: await self._io(self.directory.fresh_servers, k, self.directory.ttl / 3, SUPPLY_STATES)
                   for k in range(self.spec.model.num_stages)}
        target = planner.check(self.me, self.stage, servers)
        if target is not None:
            self.log.info("rebalancing: moving to stage %d, which lacks throughput", target)
        return target

    async def _read_roster(self) -> None:
        """Keep the progress sub-keys the stage's servers announce, the only progress this server counts
        (:mod:`swarm.averaging.progress`; None, counting every entry, until a record names one), and tell the
        optimizer which declared donors are the stage's servers."""
        servers = await self._io(self.directory.servers, self.stage)
        self._roster = frozenset(bytes.fromhex(s.progress_key) for s in servers if s.progress_key) or None
        donors = frozenset(s.p2p_id for s in servers)
        if donors != self._donors and await self._io(self.server.optimizer.set_donor_roster, donors):
            self._donors = donors

    async def _apply_bans(self) -> None:
        """Follow the run's ban list (refreshed by the keeper): stop if this peer is on it, else keep banned
        servers out of this server's averaging groups (the stage RPCs refuse them through the same list), and
        the servers of this stage convicted by spot-check evidence this server verified (:mod:`swarm.trust.convictions`:
        pushed by a trainer, or fetched from a stage-mate's listing by :class:`ConvictionFollower`).

        :raises PeerBanned: this peer is banned.
        """
        self.bans.check(self.me)
        shunned = {p2p: f"banned by the run's coordinator: {reason}" for p2p, reason in self.bans.banned_p2p_ids.items()}
        self.follower.follow(await self._io(self.directory.servers, self.stage))  # convictions this one missed
        shunned |= self.convictions.of_stage(self.stage)
        for p2p, reason in shunned.items():
            if p2p not in self._excluded:
                self.log.warning("excluding %s from averaging: %s", p2p, reason)
                if await self._io(self.server.optimizer.exclude, p2p, reason):
                    self._excluded.add(p2p)

    # ---- announcements -----------------------------------------------------------------------------------
    def _record(self, state: ServerState) -> ServerInfo:
        """This server's signed record as of now."""
        server, checkpoints = self.server, self.checkpoints
        serving = state in (ServerState.ONLINE, ServerState.JOINING)  # else leaving or left: no work, no progress
        optimizer = server.optimizer if serving else None
        report = optimizer.report() if optimizer is not None else None
        return ServerInfo(
            run_id=self.directory.run_id, peer_id=self.me, time=get_dht_time(), stage=self.stage, state=state,
            throughput=server.throughput.samples_per_second if serving else 0.0, p2p_id=str(self.dht.peer_id),
            maddrs=self.maddrs, flops_per_sample=self.flops_per_sample, peak_flops=self.peak_flops,
            epoch=server.epoch, samples=server.samples, samples_dropped=self.samples_dropped, loss=server.loss_ema,
            peers_in_last_round=report.peers if report else 0, state_digests=server.recent_digests(8),
            round_s=server.mean_round_s, rounds=server.rounds,
            version=__version__, excluded=report.excluded if report else {}, averaging=report.wire if report else {},
            lineage=checkpoints.lineage[0] if checkpoints else "", restored=checkpoints.restored if checkpoints else None,
            lr_scale=checkpoints.lr_scale if checkpoints else 1.0, name=self.settings.name,
            rollback_generation=checkpoints.generation if checkpoints else 0,
            rollback_issuer=checkpoints.order_issuer if checkpoints else "",
            reachability=reachability(self.maddrs, relay_enabled(self.settings)), history=self.history,
            convicted=self.convictions.listed(),
            progress_key=optimizer.progress_key if optimizer is not None else "",
            donors_refused=dict(optimizer.donors_refused) if optimizer is not None else {},
        )

    async def _announce(self, state: ServerState) -> None:
        self.state = state
        self.threads.update(self.log)
        record = await self._io(self._record, state)
        await self._io(self.directory.announce_server, record, self.identity)
        if self.on_announce is not None:
            self.on_announce(record, self.keeper.storage_info())

    # ---- where an epoch ends (compute thread) ------------------------------------------------------------
    def _epoch_ended(self, end: EpochEnd) -> None:
        """Right after the stage's optimizer stepped: log the epoch's line, judge its loss, commit a checkpoint
        when one is due (in the background, from a copy of the state taken now)."""
        self.history = add_history(self.history, (end.epoch, get_dht_time(), end.loss))
        self._log_epoch(end)
        if self.checkpoints.is_spike(end):
            self.checkpoints.submit(self.checkpoints.issue_rollback(end.epoch, end.loss))
        if self.checkpoints.due(end.epoch):
            self.checkpoints.submit(self.checkpoints.commit(self.checkpoints.capture(end.epoch)))

    def _log_epoch(self, end: EpochEnd) -> None:
        """The epoch's fixed-key line (``share``: this server's samples of the stage's target batch; ``step_s``: the
        seconds the epoch's transition held the compute thread, matchmaking, all-reduce and optimizer step;
        ``round_s``: the mean seconds of the all-reduces since the last line, ``-`` if none finished; ``gflops``: model
        GFLOP/s while computing, ``samples/s`` x the stage's FLOPs per sample; ``mfu``: that over the device's measured
        peak, :mod:`swarm.kernels.flops`)."""
        server, spec = self.server, self.spec
        wire = server.optimizer.counters()
        rounds, ms = wire.get("rounds", 0), wire.get("round_ms", 0)
        before, self._rounds_logged = self._rounds_logged, (rounds, ms)
        if rounds < before[0]:  # a new optimizer (a rejoin or a move) counts from zero
            before = (0, 0)
        round_s = f"{(ms - before[1]) / 1000 / (rounds - before[0]):.3f}" if rounds > before[0] else "-"
        achieved = server.throughput.samples_per_second * self.flops_per_sample  # model FLOP/s while computing
        self.log.info(
            "loss=%s samples/s=%.2f samples=%d dropped=%d share=%.0f%% progress=%.1f%% peers=%d lr=%.2e "
            "step_s=%.2f round_s=%s avg_bytes=%d failed_rounds=%d rejected=%d flagged=%d gflops=%.2f mfu=%.1f%%",
            f"{server.loss_ema:.4f}" if server.loss_ema is not None else "-", server.throughput.samples_per_second,
            server.samples, self.samples_dropped, 100 * min(1.0, end.samples / spec.training.target_batch_size),
            100 * min(1.0, end.epoch / spec.optim.total_epochs), server.optimizer.peers, server.optimizer.lr,
            end.seconds, round_s, wire.get("sent", 0) + wire.get("received", 0), wire.get("failed", 0),
            wire.get("rejected", 0), wire.get("flagged", 0), achieved / 1e9,
            100 * achieved / max(self.peak_flops, 1e-9),
        )


def _drain_watchdog(log: PeerLog, deadline_s: float = DRAIN_DEADLINE_S) -> threading.Timer:
    """If the process is still alive ``deadline_s`` after the drain began, log every thread's stack: a drain
    that hangs (a library call without a timeout) then says where."""
    def report() -> None:
        log.error("still draining after %.0f s; thread stacks follow", deadline_s)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)

    timer = threading.Timer(deadline_s, report)
    timer.daemon = True
    timer.start()
    return timer


__all__ = ["AnnounceHook", "HAND_OFF_S", "NoSuchStage", "OptimizerFactory", "ServerSession", "StageServerFactory"]
