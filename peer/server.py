"""Lifecycle of a stage server: join, pick a stage, measure, load state, serve, re-announce, drain.

1. Join the run's DHT and fetch the verified spec (:func:`swarm.directory.connect_run`).
2. Pick a stage (``--stage`` or the bottleneck stage, :func:`swarm.routing.choose_stage`), build its module,
   measure throughput (samples/s), announce ``joining``.
3. Create the stage's collaborative optimizer; if the stage has online servers, download their state.
4. Register the RPCs on libp2p and announce ``online`` every ``record_ttl_s / 3`` seconds, re-publishing the
   signed spec too, so the run outlives its coordinator.
5. On SIGTERM/SIGINT: announce ``draining``, stop taking work, shut down the optimizer and the DHT.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from typing import Optional

import torch
from hivemind.utils import get_dht_time

from swarm import __version__
from swarm.averaging import build_stage_optimizer
from swarm.averaging.attacks import make_attack
from swarm.config import PeerSettings
from swarm.directory import connect_run, visible_maddrs
from swarm.identity import Identity
from swarm.model import build_stage
from swarm.protocol import ServerInfo, ServerState
from swarm.routing import choose_stage
from swarm.stage import StageServer

logger = logging.getLogger("swarm.peer")


def run_server(address: str, settings: PeerSettings, stage: Optional[int] = None) -> None:
    """Serve one stage of the run at ``address`` until SIGTERM/SIGINT."""
    identity = Identity.load_or_create(settings.identity_path())
    if settings.threads:
        torch.set_num_threads(settings.threads)
    dht, directory, spec, sealed_spec = connect_run(address, settings, client_mode=False)
    run_id, me = directory.run_id, identity.peer_id
    optimizer = None
    try:
        num_stages = spec.model.num_stages
        if stage is None:
            stage = choose_stage(spec.model, directory.all_servers(num_stages))
        elif not 0 <= stage < num_stages:
            raise SystemExit(f"--stage {stage} is out of range: run {run_id} has stages 0..{num_stages - 1}")
        module = build_stage(spec.model, stage)
        server = StageServer(spec, run_id, stage, module)
        throughput = server.measure_throughput()
        p2p_id = str(dht.peer_id)
        maddrs = visible_maddrs(dht)

        def info(state: ServerState) -> ServerInfo:
            opt = server.optimizer
            banned, counters = averaging_report(opt)
            return ServerInfo(
                run_id=run_id, peer_id=me, time=get_dht_time(), stage=stage, state=state,
                throughput=server.throughput.samples_per_second,
                p2p_id=p2p_id, maddrs=maddrs, epoch=server.epoch, samples=server.samples,
                loss=server.loss_ema, peers_in_last_round=opt.tracker.global_progress.num_peers if opt else 0,
                fingerprints=server.fingerprints, round_s=server.mean_round_s, rounds=server.rounds,
                version=__version__, banned=banned, averaging=counters,
            )

        directory.announce_server(info(ServerState.JOINING), identity)
        logger.info("[%s stage=%d] joining run %s, throughput %.1f samples/s", me, stage, run_id, throughput)
        attack = make_attack(settings.byzantine)
        if attack is not None:
            logger.warning("[%s stage=%d] BYZANTINE TEST MODE: this server runs the %r attack", me, stage, attack.name)
        optimizer = server.optimizer = build_stage_optimizer(spec, run_id, stage, dht, module, attack=attack,
                                                             identity=identity)
        if any(s.state == ServerState.ONLINE and s.peer_id != me for s in directory.servers(stage)):
            logger.info("[%s stage=%d] loading state from live servers of the stage", me, stage)
            optimizer.load_state_from_peers()
        # publish our progress record now, so the stage's servers count us before the first epoch ends
        # (otherwise a server that reaches the target first sees a group of one and steps alone)
        optimizer.tracker.report_local_progress(optimizer.local_epoch, 0)
        _wait_until_counted(optimizer, directory, stage, me)

        def on_epoch(epoch: int) -> None:
            lr = optimizer.opt.param_groups[0]["lr"]
            wire = optimizer.grad_averager.wire.snapshot()
            logger.info(
                "[%s stage=%d epoch=%d] loss=%s samples/s=%.2f samples=%d peers=%d lr=%.2e "
                "avg_bytes=%d failed_rounds=%d rejected=%d flagged=%d",
                me, stage, epoch, f"{server.loss_ema:.4f}" if server.loss_ema is not None else "-",
                server.throughput.samples_per_second, server.samples,
                optimizer.tracker.global_progress.num_peers, lr,
                wire["sent"] + wire["received"], wire["failed"], wire["rejected"], wire["flagged"],
            )

        server.epoch_listeners.append(on_epoch)
        asyncio.run(_serve(server, dht, directory, identity, sealed_spec, info))
    finally:
        if optimizer is not None:
            optimizer.shutdown()
        dht.shutdown()
        logger.info("[%s] stopped", me)


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


def _wait_until_counted(optimizer, directory, stage: int, me: str, timeout: float = 10.0) -> None:
    """Wait (bounded) until the progress tracker sees as many servers as the directory lists for the stage."""
    deadline = time.monotonic() + timeout
    expected = 1 + sum(s.peer_id != me and s.state != ServerState.DRAINING for s in directory.servers(stage))
    while optimizer.tracker.global_progress.num_peers < expected and time.monotonic() < deadline:
        time.sleep(0.2)


async def _serve(server: StageServer, dht, directory, identity: Identity, sealed_spec: bytes, info) -> None:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    p2p = await dht.replicate_p2p()
    await server.add_p2p_handlers(p2p, namespace=directory.run_id)
    period = directory.ttl / 3
    logger.info("[%s stage=%d epoch=%d] online", identity.peer_id, server.stage, server.epoch)
    watcher = asyncio.create_task(server.watch_epochs(stop))
    try:
        while not stop.is_set():
            await loop.run_in_executor(None, directory.announce_server, info(ServerState.ONLINE), identity)
            await loop.run_in_executor(None, directory.publish_spec, sealed_spec)
            try:
                await asyncio.wait_for(stop.wait(), period)
            except asyncio.TimeoutError:
                pass
    finally:
        logger.info("[%s stage=%d] draining", identity.peer_id, server.stage)
        stop.set()
        await watcher
        await loop.run_in_executor(None, directory.announce_server, info(ServerState.DRAINING), identity)
        await server.remove_p2p_handlers(p2p, namespace=directory.run_id)
        server.shutdown()
