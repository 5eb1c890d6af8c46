"""Lifecycle of a trainer: join (client mode works), prepare data, claim a share, train, report."""

from __future__ import annotations

import asyncio
import logging
import signal
from pathlib import Path
from typing import Optional

import torch

from peer.control import follow
from peer.heartbeat import start_metrics, write_heartbeat
from swarm.averaging.attacks import make_attack
from swarm.banlist import BanFollower, PeerBanned
from swarm.config import PeerSettings
from swarm.data import prepare_dataset
from swarm.directory import connect_run
from swarm.identity import Identity
from swarm.pipeline import RemotePipeline
from swarm.trainer import Trainer, claim_shard, resume_position

logger = logging.getLogger("swarm.peer")


def run_trainer(address: str, settings: PeerSettings, *, shard: Optional[int] = None, concurrency: int = 2,
                max_samples: Optional[int] = None, loss_log: Optional[Path] = None) -> None:
    """Train through the run at ``address`` until SIGTERM/SIGINT or ``max_samples``."""
    identity = Identity.load_or_create(settings.identity_path())
    if settings.threads:
        torch.set_num_threads(settings.threads)
    dht, directory, spec, _ = connect_run(address, settings, client_mode=True)
    try:
        dataset = prepare_dataset(spec, settings.cache_dir)
        if shard is None:
            shard = claim_shard(directory, spec.data.num_shards, identity.peer_id)
        position = resume_position(directory, shard, spec.model.num_stages)
        logger.info("[%s trainer] run %s, data share %d/%d, %d samples per pass, resuming at sample %d, tokenizer %s",
                    identity.peer_id, directory.run_id, shard, spec.data.num_shards,
                    dataset.num_samples() // spec.data.num_shards, position, dataset.tokenizer_sha256[:16])

        metrics = start_metrics(directory.run_id, identity.peer_id, "trainer", settings)

        bans = BanFollower(directory)
        bans.refresh()
        bans.check(identity.peer_id)

        def report(info) -> None:
            """Heartbeat file and Prometheus metrics, after each announcement."""
            write_heartbeat(settings.state_path(), peer_id=identity.peer_id, role="trainer", stage=-1, state=info.state,
                            epoch=0, ttl_s=spec.timeouts.record_ttl_s, samples=info.samples)
            metrics.update_trainer(info)

        async def main() -> None:
            loop = asyncio.get_running_loop()
            stop = asyncio.Event()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, stop.set)
            p2p = await dht.replicate_p2p()
            attack = make_attack(settings.byzantine)
            if attack is not None:
                logger.warning("[%s trainer] BYZANTINE TEST MODE: running the %r attack", identity.peer_id, attack.name)
            pipeline = RemotePipeline(spec, directory.run_id, directory, p2p, attack=attack, bans=bans)
            trainer = Trainer(spec, directory.run_id, directory, identity, pipeline, dataset, shard,
                              concurrency=concurrency, max_samples=max_samples, loss_log=loss_log, position=position,
                              on_report=report, name=settings.name, p2p_id=str(p2p.peer_id),
                              val_every_s=settings.val_every_s, bans=bans)
            controls = asyncio.create_task(follow(settings.state_path(), {
                "pause": trainer.pause, "resume": trainer.resume, "drain": stop.set}, stop))
            try:
                await trainer.run(stop)
            finally:
                stop.set()
                await controls

        asyncio.run(main())
    except PeerBanned as e:
        logger.error("[%s trainer] %s", identity.peer_id, e)
        raise SystemExit(4) from None
    finally:
        dht.shutdown()
        write_heartbeat(settings.state_path(), peer_id=identity.peer_id, role="trainer", stage=-1, state="stopped",
                        epoch=0, ttl_s=spec.timeouts.record_ttl_s)
