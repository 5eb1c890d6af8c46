"""A stage server's life in one process: join, hold fragments, pick a stage, serve it, rebalance, drain.

:class:`ServerSession` is what ``swarm-peer join`` runs (the app only parses settings, configures logging and
turns signals and ``swarm-peer pause|resume|drain`` into :meth:`ServerSession.stop`, :meth:`~ServerSession.pause`
and :meth:`~ServerSession.resume`); a test starts one in-process the same way::

    session = ServerSession(address, PeerSettings(host="127.0.0.1"), stage=0)
    await session.run()            # until session.stop()

1. Join the run's DHT and fetch the verified spec (:func:`swarm.net.dht.connect_run`); start the fragment
   keeper (:mod:`swarm.checkpoint.keeper`), which serves and re-announces the fragments on this peer's disk for
   the whole life of the process, whatever stage it serves. A peer on the run's ban list stops here
   (:class:`~swarm.trust.banlist.PeerBanned`).
2. Pick a stage (the pinned one, or the bottleneck stage, :func:`swarm.server.rebalance.choose_stage`), build its
   module, measure throughput (samples/s), announce ``joining``.
3. Create the stage's collaborative optimizer (:class:`~swarm.averaging.optimizer.StageOptimizer`, with its check
   of a donor's state, :class:`~swarm.trust.statecheck.DonorStateCheck`) and the stage as this server serves it
   (:class:`~swarm.server.served.ServedStage`), which restores its state: from live servers of the stage if any,
   else from the newest checkpoint (:class:`~swarm.checkpoint.restore.RestoreError` if the run has checkpoints and
   none becomes restorable).
4. Register the stage RPCs and announce ``online`` every ``record_ttl_s / 3`` seconds, re-publishing the
   signed spec too, so the run outlives its coordinator; the first announcement logs where the join's seconds
   went (:mod:`swarm.server.joinclock`). The served stage logs each epoch's line, commits
   checkpoints and follows rollback orders; the session honours the run's ban list and convictions and, if the
   stage was not pinned, moves to a stage that lacks throughput more (:mod:`swarm.server.rebalance`): drain, then
   go back to step 2 for the new stage.
5. :meth:`ServerSession.pause`: leave the stage as a drain does (:meth:`~swarm.server.served.ServedStage.withdraw`:
   announce ``paused``, with throughput 0 and no progress key, so trainers stop routing here and the stage's
   other servers stop counting and waiting for it; let the micro-batches in flight finish; samples it accumulated
   in the unfinished epoch are dropped and counted, ``samples_dropped``), keeping the DHT, the fragment keeper and
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
from dataclasses import replace
from functools import partial
from typing import Callable, Optional

from hivemind.p2p import P2P
from hivemind.utils import get_dht_time

from swarm import __version__
from swarm.aio import set_threadsafe, sleep_or_stop
from swarm.averaging.optimizer import StageOptimizer
from swarm.checkpoint import FragmentStore
from swarm.checkpoint.keeper import FragmentKeeper
from swarm.config import RunSpec
from swarm.settings import PeerSettings
from swarm.host import ThreadShare, resolve_device
from swarm.identity import Identity, claim_local_state
from swarm.kernels import select_backend
from swarm.kernels.flops import PeakCache, compute_dtype, stage_flops_per_token
from swarm.logs import PeerLog
from swarm.model import build_stage
from swarm.net.dht import close_dht, connect_run, reachability, relay_enabled, visible_maddrs
from swarm.trust.invites import join_admission
from swarm.trust.standing import Standing
from swarm.trust.tickets import RunTickets
from swarm.trust.recognition import follow_recognition
from swarm.net.directory import AsyncRunDirectory
from swarm.net.links import LinkMeasurement, dht_round_trip, measure_links
from swarm.net.timeouts import DerivedTimeouts, derive_timeouts
from swarm.protocol import ServerHistory, ServerInfo, ServerState, StorageInfo
from swarm.server.compute import measure_throughput
from swarm.server.joinclock import JoinClock
from swarm.server.preload import Preload
from swarm.server.rebalance import MovePlanner
from swarm.server.served import PeerContext, ServedStage, StagePlan, StageServerFactory
from swarm.server.stage import StageServer
from swarm.trust.banlist import RunBans
from swarm.trust.convictions import ConvictionBook, ConvictionFollower, EvidenceService
from swarm.trust.evidence import answers_comparable
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

OptimizerFactory = Callable[..., StageOptimizer]
"""Builds a stage's optimizer: ``(spec, run_id, stage, dht, module, identity=..., state_check=...)`` (tests and
benchmarks pass a Byzantine one, :mod:`swarm.attacks`)."""
AnnounceHook = Callable[[ServerInfo, StorageInfo], None]
"""Called after each announcement with the record published and the peer's storage record (the app writes its
heartbeat file and Prometheus metrics from them)."""


class NoSuchStage(ValueError):
    """The stage asked for does not exist in this run."""


def _say_reachability(log: PeerLog, maddrs: list[str], settings: PeerSettings) -> None:
    """Log how peers outside this one's network reach it (see :func:`swarm.net.dht.reachability`)."""
    shown = ", ".join(maddrs[:2]) or "none"
    if reachability(maddrs, relay_enabled(settings)) == "relayed":
        log.warning("the swarm reaches this peer through a relay (no public address: %s): slower; forward its port "
                    "and set SWARM_ANNOUNCE_HOST to be reached directly", shown)
    else:
        log.info("the swarm reaches this peer directly at %s", shown)


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
        self.p2p: Optional[P2P] = None  # this process's replica of the DHT's libp2p client, once joined
        self._stop, self._pause, self._changed = asyncio.Event(), asyncio.Event(), asyncio.Event()
        self.state, self.stage = ServerState.JOINING, None  # (the stage: an int once chosen)
        self.served: Optional[ServedStage] = None  # the stage served now, or last (reported while paused)
        self._plan: Optional[StagePlan] = None  # the stage being joined, before it is served
        self.threads = ThreadShare(settings.threads)  # torch's threads: this peer's share of the machine
        self.device = resolve_device(settings.device)  # raises DeviceUnavailable
        self.kernels = select_backend(settings.kernels, self.device)  # raises BackendUnavailable
        self._dropped_before = 0  # samples dropped by the optimizers of stages this process left
        self._clock: Optional[JoinClock] = None  # the current join's phases, until it announces online
        self._preload = Preload()  # the join's later imports, while its connect and setup wait on the network

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
        return self.served.epoch if self.served is not None else 0

    @property
    def samples_dropped(self) -> int:
        """Samples this process accumulated whose gradients never reached a step (``ServerInfo.samples_dropped``)."""
        return self.served.samples_dropped if self.served is not None else self._dropped_before

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
        self._clock = JoinClock().enter("connect")
        self.dht, directory, self.spec, self.sealed_spec = await asyncio.to_thread(
            connect_run, self.address, self.settings, client_mode=False, join_timeout_s=self.settings.join_timeout_s,
            identity=self.identity)
        self.directory, self.tickets = AsyncRunDirectory(directory), RunTickets(directory, self.identity, self.spec)
        drained, watchdog = False, None
        try:
            self._clock.enter("setup")
            keeping = await self._join()
            try:
                stage = self.pinned
                while not self._stop.is_set():
                    if self._pause.is_set():
                        await self._paused()
                        continue
                    stage = stage if stage is not None else await self.ctx.bottleneck()
                    moved = await self._serve(stage)
                    stage = moved if moved is not None else self.pinned
                drained = True
            finally:
                watchdog = _drain_watchdog(self.log)
                await self._leave(keeping, drained)
        finally:
            await close_dht(self.dht, self.p2p)
            if watchdog is not None:
                watchdog.cancel()
            self.log.info("stopped")

    async def _join(self) -> asyncio.Task:
        """Start the fragment keeper and follow the ban list and the convictions; returns the keeper's task."""
        num_stages, run_id = self.spec.model.num_stages, self.directory.run_id
        if self.pinned is not None and not 0 <= self.pinned < num_stages:
            raise NoSuchStage(f"stage {self.pinned} is out of range: run {run_id} has stages 0..{num_stages - 1}")
        self.p2p = await self.dht.replicate_p2p()
        await join_admission(self.tickets, self.p2p, self.settings.invite)
        store = FragmentStore(self.settings.fragment_path(), self.settings.fragment_max_bytes,
                              self.spec.checkpoint.keep, grace_s=2 * self.spec.timeouts.record_ttl_s)
        self.bans, gate = RunBans(self.directory), self.tickets.gate()
        self.keeper = FragmentKeeper(self.spec, self.directory, self.identity, store, bans=self.bans, gate=gate)
        await self.keeper.start(self.p2p, announce=False)  # (announced by keeper.run, off the join's path)
        self.ctx = PeerContext(self.spec, self.directory, self.identity, self.p2p, self.keeper, self.keeper.authority,
                               self.bans, gate, Standing(path=self.settings.state_path() / f"standing-{run_id}.json"),
                               follow_recognition(self.directory.blocking))
        self.convictions = ConvictionBook(run_id, self.me, self.spec.spot_checks.rtol, answers_comparable(self.spec),
                                          serves=self.directory.blocking.seen_serving, vouch=self._vouch,
                                          recognized=self.ctx.recognition.recognized)
        await EvidenceService(self.spec, self.convictions, gate=gate).add_p2p_handlers(self.p2p, namespace=run_id)
        self._following: set[asyncio.Task] = set()  # evidence fetched from stage-mates' listings
        self.follower = ConvictionFollower(self.convictions, self.p2p, self.spec, run_id, spawn=self._follow,
                                           on_adopted=self._adopted, log=self.log)
        self.bans.check(self.me)
        self.maddrs = await asyncio.to_thread(visible_maddrs, self.dht)
        _say_reachability(self.log, self.maddrs, self.settings)
        return asyncio.create_task(self.keeper.run(self._stop, announce=True))

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

    def _vouch(self, stage: int, p2p_id: str) -> Optional[float]:
        """This server's weight for a server of ``stage``, None for another stage (ConvictionBook)."""
        return self.ctx.weight(p2p_id) if stage == self.stage else None

    def _adopted(self, peer_id: str, reason: str) -> None:
        self.log.warning("verified the evidence a stage-mate lists against %s: %s", peer_id, reason)
        self._changed.set()  # announce (listing it) and exclude it now, not at the next period

    # ---- one stage ---------------------------------------------------------------------------------------
    async def _serve(self, stage: int) -> Optional[int]:
        """Serve ``stage`` until :meth:`stop` (returns None) or a planned move (returns the new stage)."""
        served = await self._start_stage(stage)
        handlers = False
        try:
            self._clock.enter("state")
            await served.restore_state()
            self._clock.enter("announce")
            await served.server.add_p2p_handlers(self.p2p, namespace=self.directory.run_id)
            handlers = True
            return await self._announce_until_done()
        finally:
            await served.stop(self.p2p, handlers)
            self._dropped_before = served.samples_dropped

    async def _start_stage(self, stage: int) -> ServedStage:
        """Build the stage's module, measure it and its links and announce ``joining``; build its optimizer and the
        served stage (with the links' timeouts), and announce ``joining`` again, with its progress key."""
        self.stage, self.served = stage, None
        self.keeper.stage = stage
        self._clock = (self._clock or JoinClock(first=False)).enter("measure")  # (a move, a resume: a new join)
        await asyncio.to_thread(self._preload.wait)  # (done by now on a move or a resume)
        spec, run_id = self.spec, self.directory.run_id
        module = build_stage(spec.model, stage, precision=spec.training.precision, kernels=self.kernels).to(self.device)
        self.log = PeerLog(logger, self.me, stage=stage, epoch=lambda: self.epoch)
        plan, _, timeouts = await asyncio.gather(_stage_plan(spec, stage, module, self.device, PeakCache(
            self.settings.state_path() / "peak_flops.json")), self.ctx.recognition.current(),
            _link_timeouts(self.ctx, self.dht, stage, module, self.log))
        self._plan = plan = replace(plan, timeouts=timeouts)
        await self._announce(ServerState.JOINING)
        self.log.info("joining run %s, throughput %.1f samples/s, device %s, kernels %s, precision %s, peak %.1f "
                      "GFLOP/s", run_id, plan.throughput, self.device, self.kernels.name, spec.training.precision,
                      plan.peak_flops / 1e9)
        check = DonorStateCheck(self.p2p, run_id, partial(self.directory.fresh_servers, stage), partial(
            self.keeper.known_manifests, stage), me=str(self.dht.peer_id), weight=self.ctx.standing.weight,
            named=partial(self.ctx.named, stage))
        # on the loop's thread: hivemind's averagers install signal handlers, which only the main thread may do
        self._clock.enter("optimizer")
        optimizer = self.optimizer_factory(plan.local_spec(spec), run_id, stage, self.dht, module,
                                           identity=self.identity,
                                           state_check=check.blocking(asyncio.get_running_loop()))
        self.served = ServedStage(self.ctx, plan, module, optimizer, server_factory=self.server_factory,
                                  dropped_before=self._dropped_before)
        await self._announce(ServerState.JOINING)  # with its progress key, so the stage counts it soon
        return self.served

    async def _announce_until_done(self) -> Optional[int]:
        """Announce every ``record_ttl_s / 3`` seconds while the served stage does its duties; return None on
        stop, the stage to move to, or this stage on pause (to rejoin it on resume)."""
        leave = asyncio.Event()  # set by stop or by a planned move
        self.log.info("online")
        tasks = self.served.duties(leave)
        online_since, next_check, target = time.monotonic(), time.monotonic() + self.spec.rebalance.period_s, None
        # catching up or caught up (on the compute thread): announced at once, not at the next period
        self.served.optimizer.catch_up.on_change = partial(set_threadsafe, asyncio.get_running_loop(), self._changed)
        planner = MovePlanner(self.spec.rebalance.min_gain, confirm_s=2 * self.directory.ttl / 3)
        try:
            while target is None and not self._stop.is_set() and not self._pause.is_set():
                await self._apply_bans()
                behind = self.served.optimizer.catch_up.active  # (swarm.averaging.catchup)
                await self._announce(ServerState.JOINING if behind else ServerState.ONLINE)
                self._clock = self._clock and self._clock.report(self.log)  # where the join's seconds went
                await self.directory.publish_spec(self.sealed_spec)
                if self.pinned is None and self.spec.rebalance.enabled and time.monotonic() >= next_check:
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
            await self.served.withdraw(partial(self._announce, state))
            leave.set()
            await asyncio.gather(*tasks)
            await self._announce(state)
        return target

    async def _paused(self) -> None:
        """While paused, out of any stage: announce ``paused`` every ``record_ttl_s / 3`` seconds (and keep the
        spec published) until :meth:`resume` or :meth:`stop`. :raises PeerBanned: this peer was banned meanwhile."""
        self.log.info("paused: left stage %d's averaging; taking no work until `swarm-peer resume`", self.stage)
        while self._pause.is_set() and not self._stop.is_set():
            self.bans.check(self.me)
            await self._announce(ServerState.PAUSED)
            await self.directory.publish_spec(self.sealed_spec)
            await sleep_or_stop(self._stop, self.directory.ttl / 3, self._changed)
            self._changed.clear()
        if not self._stop.is_set():
            self.log.info("resumed: rejoining stage %d", self.stage)

    async def _rebalance_target(self, planner: MovePlanner) -> Optional[int]:
        """The stage to move to now (:class:`swarm.server.rebalance.MovePlanner`), or None."""
        servers = {k: await self.directory.fresh_servers(k, self.directory.ttl / 3, SUPPLY_STATES)
                   for k in range(self.spec.model.num_stages)}
        target = planner.check(self.me, await self.ctx.claims(servers))
        if target is not None:
            self.log.info("rebalancing: moving to stage %d, which lacks throughput", target)
        return target

    async def _apply_bans(self) -> None:
        """Follow the run's ban list (refreshed by the keeper): stop if this peer is on it, else keep banned
        servers out of the stage's averaging (the stage RPCs refuse them through the same list), and the servers of
        this stage convicted by spot-check evidence this server verified (:mod:`swarm.trust.convictions`: pushed by
        a trainer, or fetched from a stage-mate's listing by :class:`ConvictionFollower`).

        :raises PeerBanned: this peer is banned.
        """
        self.bans.check(self.me)
        excluded = {p2p: f"banned by the run's coordinator: {reason}"
                    for p2p, reason in self.bans.banned_p2p_ids.items()}
        self.follower.follow(await self.served.stage_servers())  # convictions this one missed
        excluded |= self.convictions.of_stage(self.stage)
        await self.served.exclude(excluded)

    # ---- announcements -----------------------------------------------------------------------------------
    def _record(self, state: ServerState) -> ServerInfo:
        """This server's signed record as of now (blocking: the stage's part asks the averager for its report)."""
        self.tickets.refresh()  # (a ticketed run: renewed once due)
        stage = self.served.record(state) if self.served is not None else self._plan.record()
        return ServerInfo(
            run_id=self.directory.run_id, peer_id=self.me, time=get_dht_time(), state=state,
            p2p_id=str(self.dht.peer_id), maddrs=self.maddrs, samples_dropped=self.samples_dropped,
            version=__version__, name=self.settings.name,
            reachability=reachability(self.maddrs, relay_enabled(self.settings)),
            convicted=self.convictions.listed(), **stage,
        )

    async def _announce(self, state: ServerState) -> None:
        self.state = state
        self.threads.update(self.log)
        record = await asyncio.to_thread(self._record, state)
        history = ServerHistory(run_id=record.run_id, peer_id=self.me, time=record.time, stage=record.stage,
                                history=self.served.history if self.served is not None else [])
        await asyncio.gather(self.directory.announce_server(record, self.identity),
                             self.directory.announce_history(history, self.identity))
        if self.on_announce is not None:
            self.on_announce(record, self.keeper.storage_info())


async def _stage_plan(spec: RunSpec, stage: int, module, device, peaks: PeakCache) -> StagePlan:
    """Stage ``stage``'s throughput on this machine (samples/s, of ``module`` on ``device``), its FLOPs per sample,
    the device's peak FLOP/s (``peaks``: measured once per machine and kept)."""
    throughput = await asyncio.to_thread(measure_throughput, module, spec, stage)
    seq_len = spec.data.seq_len
    peak = await asyncio.to_thread(peaks.peak, device, compute_dtype(spec.training.precision))
    return StagePlan(stage, throughput, stage_flops_per_token(spec.model, stage, seq_len) * seq_len, peak)


async def _link_timeouts(ctx: PeerContext, dht, stage: int, module, log: PeerLog) -> DerivedTimeouts:
    """This server's timeouts (:mod:`swarm.net.timeouts`, logged once) from its links to stage ``stage``'s online
    servers (its averaging partners), or to the other stages' where it has none yet, or to its DHT peers where the
    run has no other server (a round trip, no rate); the spec's ceilings where none answers."""
    spec, directory = ctx.spec, ctx.directory
    servers = await directory.all_servers(spec.model.num_stages)
    online = {k: [s for s in found if s.state == ServerState.ONLINE and s.p2p_id != str(ctx.p2p.peer_id)]
              for k, found in servers.items()}
    mates = online.get(stage) or [s for found in online.values() for s in found]
    link = await measure_links(ctx.p2p, mates, directory.run_id) if mates else None
    if link is None and (rtt := await dht_round_trip(dht)) is not None:  # no server yet: the DHT's peers, no rate
        link = LinkMeasurement(round_trip_s=rtt, rate=None, servers=0)
    timeouts = derive_timeouts(spec, link, sum(p.numel() for p in module.parameters()))
    log.info("%s", timeouts.describe())
    return timeouts


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
