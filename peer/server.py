"""Lifecycle of a stage server: join, hold fragments, pick a stage, restore, serve, rebalance, drain.

1. Join the run's DHT and fetch the verified spec (:func:`swarm.directory.connect_run`); start the fragment
   keeper (:mod:`swarm.checkpoint.keeper`), which serves and re-announces the fragments on this peer's disk
   for the whole life of the process, whatever stage it serves.
2. Pick a stage (``--stage`` or the bottleneck stage, :func:`swarm.routing.choose_stage`), build its module,
   measure throughput (samples/s), announce ``joining``.
3. Create the stage's collaborative optimizer and restore its state: from live servers of the stage if any,
   else from the newest checkpoint (:class:`swarm.checkpoint.lifecycle.StageCheckpoints`).
4. Register the stage RPCs and announce ``online`` every ``record_ttl_s / 3`` seconds, re-publishing the
   signed spec too, so the run outlives its coordinator. Commit checkpoints, follow rollback orders, and, if
   the stage was not pinned, move to a stage that lacks throughput more (:mod:`swarm.rebalance`): drain,
   then go back to step 2 for the new stage.
5. ``swarm-peer pause`` (:mod:`peer.control`): announce ``paused`` (not routed to, refuses new stage
   work, keeps its state, its place in the stage and its fragments; hivemind loads the state from the
   stage's servers at the next step if they moved on meanwhile); ``resume`` announces ``online`` again. A peer on the coordinator's ban list
   (:mod:`swarm.banlist`) stops with exit code 4; the others refuse its RPCs and keep it out of averaging.
6. On SIGTERM/SIGINT or ``swarm-peer drain``: announce ``draining``, stop taking work, shut down the
   optimizer, hand the fragments it holds to other peers (at most :data:`HAND_OFF_S`), stop the keeper and
   the DHT; the heartbeat says ``stopped``.
"""

from __future__ import annotations

import asyncio
import faulthandler
import logging
import signal
import sys
import threading
import time
from typing import Optional

import torch
from hivemind.utils import get_dht_time

from peer.control import follow
from peer.heartbeat import start_metrics, write_heartbeat
from swarm import __version__
from swarm.aio import wait_any
from swarm.averaging import build_stage_optimizer
from swarm.averaging.attacks import make_attack
from swarm.banlist import PeerBanned
from swarm.checkpoint import FragmentStore
from swarm.checkpoint.keeper import FragmentKeeper
from swarm.checkpoint.lifecycle import RestoreError, StageCheckpoints
from swarm.config import PeerSettings, RunSpec
from swarm.directory import RunDirectory, connect_run, reachability, relay_enabled, visible_maddrs
from swarm.identity import Identity
from swarm.metrics import PeerMetrics
from swarm.model import build_stage
from swarm.protocol import ServerInfo, ServerState, add_history
from swarm.rebalance import plan_move
from swarm.routing import choose_stage
from swarm.stage import StageServer

logger = logging.getLogger("swarm.peer")
HAND_OFF_S = 20.0
"""Seconds a draining server spends copying its fragments to other peers (container stop timeouts: 30 s+)."""
DRAIN_DEADLINE_S = 60.0
"""Seconds after which a drain still running logs every thread's stack (:func:`_drain_watchdog`)."""
SUPPLY_STATES = (ServerState.ONLINE, ServerState.JOINING)
"""States of the servers whose throughput rebalancing counts (freshly announced ones only: a record left by a
server that died would otherwise hide a stage's loss for a whole record TTL, or let the last live server of a
stage leave it)."""


def run_server(address: str, settings: PeerSettings, stage: Optional[int] = None) -> None:
    """Serve a stage of the run at ``address`` until SIGTERM/SIGINT."""
    identity = Identity.load_or_create(settings.identity_path())
    if settings.threads:
        torch.set_num_threads(settings.threads)
    dht, directory, spec, sealed_spec = connect_run(address, settings, client_mode=False)
    try:
        num_stages = spec.model.num_stages
        if stage is not None and not 0 <= stage < num_stages:
            raise SystemExit(f"--stage {stage} is out of range: run {directory.run_id} has stages 0..{num_stages - 1}")
        store = FragmentStore(settings.fragment_path(), settings.fragment_max_bytes, spec.checkpoint.keep,
                              grace_s=2 * spec.timeouts.record_ttl_s)
        keeper = FragmentKeeper(spec, directory, identity, store)
        metrics = start_metrics(directory.run_id, identity.peer_id, "server", settings)
        asyncio.run(_main(spec, dht, directory, identity, sealed_spec, keeper, settings, stage, metrics))
    except PeerBanned as e:
        logger.error("[%s] %s", identity.peer_id, e)
        raise SystemExit(4) from None
    finally:
        dht.shutdown()
        write_heartbeat(settings.state_path(), peer_id=identity.peer_id, role="server", state="stopped",
                        ttl_s=spec.timeouts.record_ttl_s)
        logger.info("[%s] stopped", identity.peer_id)


async def _main(spec: RunSpec, dht, directory: RunDirectory, identity: Identity, sealed_spec: bytes,
                keeper: FragmentKeeper, settings: PeerSettings, pinned: Optional[int], metrics: PeerMetrics) -> None:
    loop = asyncio.get_running_loop()
    stop, pause, changed = asyncio.Event(), asyncio.Event(), asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    p2p = await dht.replicate_p2p()
    await keeper.start(p2p)
    keeper.run_bans.check(identity.peer_id)
    keeping = asyncio.create_task(keeper.run(stop))
    controls = asyncio.create_task(follow(settings.state_path(), {
        "pause": lambda: (pause.set(), changed.set()), "resume": lambda: (pause.clear(), changed.set()),
        "drain": stop.set}, stop))
    drained = False
    try:
        stage = pinned
        while not stop.is_set():
            if stage is None:
                stage = await loop.run_in_executor(
                    None, lambda: choose_stage(spec.model, directory.all_servers(spec.model.num_stages)))
            moved = await _serve_stage(spec, dht, p2p, directory, identity, sealed_spec, keeper, settings, stage,
                                       metrics, movable=pinned is None, stop=stop, pause=pause, changed=changed)
            stage = moved if moved is not None else pinned
        drained = True
    finally:
        stop.set()
        _drain_watchdog(identity.peer_id)
        keeping.cancel()  # a keeper tick in progress (a repair, slow DHT reads) must not hold up the drain
        await asyncio.gather(keeping, controls, return_exceptions=True)
        if drained:  # a drain, not a failure: leave no checkpoint a replica short
            await keeper.hand_off(timeout_s=HAND_OFF_S)
        await keeper.stop()


def _drain_watchdog(me: str, deadline_s: float = DRAIN_DEADLINE_S) -> threading.Timer:
    """If the process is still alive ``deadline_s`` after the drain began, log every thread's stack: a drain
    that hangs (a library call without a timeout) then says where."""
    def report() -> None:
        logger.error("[%s] still draining after %.0f s; thread stacks follow", me, deadline_s)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)

    timer = threading.Timer(deadline_s, report)
    timer.daemon = True
    timer.start()
    return timer


def _say_reachability(maddrs: list[str], relay: bool, me: str) -> None:
    """Log how peers outside this one's network reach it (see :func:`swarm.directory.reachability`)."""
    if reachability(maddrs, relay) == "relayed":
        logger.warning("[%s] the swarm reaches this peer through a relay (no public address: %s): slower; forward "
                       "its port and set SWARM_ANNOUNCE_HOST to be reached directly", me, ", ".join(maddrs[:2]) or "none")
    else:
        logger.info("[%s] the swarm reaches this peer directly at %s", me, ", ".join(maddrs[:2]) or "-")


async def _serve_stage(spec: RunSpec, dht, p2p, directory: RunDirectory, identity: Identity, sealed_spec: bytes,
                       keeper: FragmentKeeper, settings: PeerSettings, stage: int, metrics: PeerMetrics, *,
                       movable: bool, stop: asyncio.Event, pause: asyncio.Event,
                       changed: asyncio.Event) -> Optional[int]:
    """Serve ``stage`` (``paused`` while ``pause`` is set; ``changed`` wakes the loop) until ``stop`` (returns None)
    or a move is planned (returns the new stage)."""
    loop = asyncio.get_running_loop()
    io = lambda fn, *a: loop.run_in_executor(None, fn, *a)  # noqa: E731
    run_id, me = directory.run_id, identity.peer_id
    keeper.stage = stage
    module = build_stage(spec.model, stage)
    server = StageServer(spec, run_id, stage, module)
    throughput = await io(server.measure_throughput)
    checkpoints = StageCheckpoints(keeper, server, identity)
    p2p_id, maddrs = str(dht.peer_id), await io(visible_maddrs, dht)
    _say_reachability(maddrs, relay_enabled(settings), me)
    history: list = []  # (epoch, DHT time it began, mean loss of the epoch before), see ServerInfo.history
    epoch_start_samples = [0]

    def info(state: ServerState) -> ServerInfo:
        opt = server.optimizer
        banned, counters = averaging_report(opt)
        return ServerInfo(
            run_id=run_id, peer_id=me, time=get_dht_time(), stage=stage, state=state,
            throughput=server.throughput.samples_per_second, p2p_id=p2p_id, maddrs=maddrs, epoch=server.epoch,
            samples=server.samples, loss=server.loss_ema,
            peers_in_last_round=opt.tracker.global_progress.num_peers if opt else 0,
            fingerprints=server.fingerprints, round_s=server.mean_round_s, rounds=server.rounds,
            version=__version__, banned=banned, averaging=counters, lineage=checkpoints.lineage[0],
            restored=checkpoints.restored, lr_scale=checkpoints.lr_scale, name=settings.name,
            reachability=reachability(maddrs, relay_enabled(settings)), history=history,
        )

    def beat(state: ServerState, record: Optional[ServerInfo] = None) -> None:
        """Heartbeat file and Prometheus metrics, after each announcement."""
        write_heartbeat(settings.state_path(), peer_id=me, role="server", stage=stage, state=str(state),
                        epoch=server.epoch, ttl_s=directory.ttl)
        if record is not None:
            metrics.update_server(record)
            metrics.update_storage(keeper.storage_info())

    await io(directory.announce_server, info(ServerState.JOINING), identity)
    beat(ServerState.JOINING)
    logger.info("[%s stage=%d] joining run %s, throughput %.1f samples/s", me, stage, run_id, throughput)
    attack = make_attack(settings.byzantine)
    if attack is not None:
        logger.warning("[%s stage=%d] BYZANTINE TEST MODE: this server runs the %r attack", me, stage, attack.name)
    # on the loop's thread: hivemind's averagers install signal handlers, which only the main thread may do
    optimizer = server.optimizer = build_stage_optimizer(spec, run_id, stage, dht, module, attack=attack,
                                                         identity=identity)
    handlers = False
    try:
        checkpoints.loop = loop
        try:
            source = await checkpoints.restore_at_start()
            if source == "peers":
                logger.info("[%s stage=%d] loading state from live servers of the stage", me, stage)
                if not await io(checkpoints.load_from_peers):
                    # the checkpoint, or (none yet) stay behind: hivemind's optimizer downloads the state when it steps
                    await checkpoints.restore_at_start(ask_peers=False)
        except RestoreError as e:
            logger.error("[%s stage=%d] %s", me, stage, e)
            stop.set()
            raise SystemExit(3) from None
        if source == "fresh":
            logger.info("[%s stage=%d] no live server and no checkpoint: starting from the initial parameters", me, stage)
            await server.compute(checkpoints.catch_up)
        # publish our progress record now, so the stage's servers count us before the first epoch ends
        # (otherwise a server that reaches the target first sees a group of one and steps alone)
        optimizer.tracker.report_local_progress(optimizer.local_epoch, 0)
        await io(_wait_until_counted, optimizer, directory, stage, me)

        def on_epoch(epoch: int) -> None:
            nonlocal history
            history = add_history(history, (epoch, get_dht_time(), server.epoch_loss))
            lr = optimizer.opt.param_groups[0]["lr"]
            wire = optimizer.grad_averager.wire.snapshot()
            # share: this server's samples in the epoch that ended, of the stage's target batch
            share = min(1.0, (server.samples - epoch_start_samples[0]) / spec.training.target_batch_size)
            epoch_start_samples[0] = server.samples
            logger.info(
                "[%s stage=%d epoch=%d] loss=%s samples/s=%.2f samples=%d share=%.0f%% progress=%.1f%% peers=%d "
                "lr=%.2e avg_bytes=%d failed_rounds=%d rejected=%d flagged=%d",
                me, stage, epoch, f"{server.loss_ema:.4f}" if server.loss_ema is not None else "-",
                server.throughput.samples_per_second, server.samples, 100 * share,
                100 * min(1.0, epoch / spec.optim.total_epochs), optimizer.tracker.global_progress.num_peers, lr,
                wire["sent"] + wire["received"], wire["failed"], wire["rejected"], wire["flagged"],
            )

        server.epoch_listeners += [on_epoch, checkpoints.on_epoch]
        await server.add_p2p_handlers(p2p, namespace=run_id)
        handlers = True
        return await _announce_until_done(spec, server, directory, identity, sealed_spec, checkpoints, info, beat,
                                          movable=movable, stop=stop, pause=pause, changed=changed)
    finally:
        started = time.monotonic()
        await checkpoints.close()
        commits_s = time.monotonic() - started
        optimizer.shutdown()
        if handlers:
            await server.remove_p2p_handlers(p2p, namespace=run_id)
        server.shutdown()
        logger.info("[%s stage=%d] left the stage in %.1f s (checkpoint commits %.1f s, optimizer %.1f s)", me, stage,
                    time.monotonic() - started, commits_s, time.monotonic() - started - commits_s)


async def _announce_until_done(spec: RunSpec, server: StageServer, directory: RunDirectory, identity: Identity,
                               sealed_spec: bytes, checkpoints: StageCheckpoints, info, beat, *, movable: bool,
                               stop: asyncio.Event, pause: asyncio.Event, changed: asyncio.Event) -> Optional[int]:
    loop = asyncio.get_running_loop()
    me, stage = identity.peer_id, server.stage
    leave = asyncio.Event()  # set by stop or by a planned move
    period = directory.ttl / 3
    logger.info("[%s stage=%d epoch=%d] online", me, stage, server.epoch)
    tasks = [asyncio.create_task(server.watch_epochs(leave)), asyncio.create_task(checkpoints.watch(leave))]
    online_since, next_check, target = time.monotonic(), time.monotonic() + spec.rebalance.period_s, None
    try:
        while not (leave.is_set() or stop.is_set()):
            _follow_bans(checkpoints.keeper.run_bans, server, me)
            if pause.is_set() != server.paused:
                server.paused = pause.is_set()
                logger.info("[%s stage=%d epoch=%d] %s", me, stage, server.epoch,
                            "paused: taking no new work until `swarm-peer resume`" if server.paused else "resumed")
            record = info(ServerState.PAUSED if server.paused else ServerState.ONLINE)
            await loop.run_in_executor(None, directory.announce_server, record, identity)
            beat(record.state, record)
            await loop.run_in_executor(None, directory.publish_spec, sealed_spec)
            if movable and spec.rebalance.enabled and not server.paused and time.monotonic() >= next_check:
                next_check = time.monotonic() + spec.rebalance.period_s
                if time.monotonic() - online_since >= spec.rebalance.min_dwell_s:
                    servers = {k: await loop.run_in_executor(None, directory.fresh_servers, k, 1.5, SUPPLY_STATES)
                               for k in range(spec.model.num_stages)}
                    target = plan_move(me, stage, servers, spec.rebalance.min_gain)
                    if target is not None:
                        logger.info("[%s stage=%d epoch=%d] rebalancing: moving to stage %d, which lacks throughput",
                                    me, stage, server.epoch, target)
                        break
            try:
                await asyncio.wait_for(wait_any(stop, leave, changed), period)
            except asyncio.TimeoutError:
                pass
            changed.clear()
    finally:
        logger.info("[%s stage=%d] draining", me, stage)
        leave.set()
        await asyncio.gather(*tasks)
        await loop.run_in_executor(None, directory.announce_server, info(ServerState.DRAINING), identity)
        beat(ServerState.DRAINING)
    return None if stop.is_set() else target


def _follow_bans(bans, server: StageServer, me: str) -> None:
    """Apply the coordinator's ban list (refreshed by the keeper): stop if this peer is on it, else refuse the
    banned peers' RPCs and keep banned servers out of this server's averaging groups.

    :raises PeerBanned: this peer is banned.
    """
    bans.check(me)
    current = bans.current
    blocked = {p2p: current.banned.get(peer, "banned") for peer, p2p in current.p2p_ids.items()} if current else {}
    averager = getattr(server.optimizer, "grad_averager", None)
    for p2p in set(blocked) - set(server.blocked):
        logger.warning("[%s stage=%d] refusing %s: banned by the run's coordinator (%s)", me, server.stage, p2p,
                       blocked[p2p])
    server.blocked = blocked
    for p2p in set(blocked) - server.banned_in_averaging:
        if averager is None:
            break
        try:
            averager.ban(p2p, f"banned by the run's coordinator: {blocked[p2p]}")
            server.banned_in_averaging.add(p2p)
        except Exception as e:  # the averager is busy or gone: the next announcement retries
            logger.debug("could not ban %s in the averager: %s", p2p, e)


def averaging_report(optimizer) -> tuple[dict[str, str], dict[str, int]]:
    """Bans (libp2p id -> reason, at most 32) and wire counters of the stage's gradient averager."""
    averager = getattr(optimizer, "grad_averager", None)
    if averager is None:
        return {}, {}
    counters = averager.wire.snapshot()
    try:
        banned = averager.report(timeout=2.0)["banned"]
    except Exception as e:  # the averager process is busy or gone: publish counters without bans this time
        logger.debug("could not read bans from the averager: %s", e)
        banned = {}
    return {p: r[:200] for p, r in sorted(banned.items())[:32]}, counters


def _wait_until_counted(optimizer, directory, stage: int, me: str, timeout: float = 5.0) -> None:
    """Wait (bounded) until the progress tracker counts the stage's other live servers."""
    deadline = time.monotonic() + timeout
    expected = 1 + sum(s.peer_id != me for s in directory.fresh_servers(stage))
    while optimizer.tracker.global_progress.num_peers < expected and time.monotonic() < deadline:
        time.sleep(0.2)
