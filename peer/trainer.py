"""``swarm-peer join --role trainer``: the process around :class:`swarm.trainer.session.Trainer`.

The trainer's life (join in client mode, claim a data share, train, report) is the library's
:class:`~swarm.trainer.session.Trainer`; this module wires it to the process: SIGTERM/SIGINT and
``swarm-peer pause|resume|drain`` (:mod:`peer.control`), the heartbeat file and Prometheus metrics
(:mod:`peer.heartbeat`), and exit codes 4 when the run's coordinator banned this peer, 5 when none of the run
address's peers answered within ``SWARM_JOIN_TIMEOUT_S``, 7 when the run admits only ticketed peers and this one
has no ticket (``swarm-coordinator admit``).
"""

from __future__ import annotations

import asyncio


from peer.control import EXIT_GRACE_S, run_controlled
from peer.exits import EXIT_CODES, exit_code
from peer.heartbeat import start_metrics, write_heartbeat
from swarm.settings import PeerSettings
from swarm.net.dht import parse_run_address
from swarm.trainer.pipeline import RemotePipeline
from swarm.protocol import TrainerInfo
from swarm.trainer.session import PipelineFactory, Trainer, TrainerOptions



def run_trainer(address: str, settings: PeerSettings, options: TrainerOptions = TrainerOptions(), *,
                pipeline_factory: PipelineFactory = RemotePipeline) -> None:
    """Train through the run at ``address`` until SIGTERM/SIGINT, ``swarm-peer drain`` or ``max_samples``.

    :param pipeline_factory: how the trainer's pipeline is built (tests start Byzantine trainers with it).
    :raises SystemExit: 4 if the run's coordinator banned this peer, 5 if the run could not be reached.
    """
    run_id, _ = parse_run_address(address)
    trainer = Trainer(address, settings, options, pipeline_factory=pipeline_factory)
    metrics = start_metrics(run_id, trainer.identity.peer_id, "trainer", settings)

    def announced(info: TrainerInfo) -> None:
        write_heartbeat(settings.state_path(), peer_id=info.peer_id, role="trainer", stage=-1, state=info.state,
                        epoch=0, ttl_s=trainer.spec.timeouts.record_ttl_s, samples=info.samples)
        metrics.update_trainer(info)

    trainer.on_announce = announced
    try:
        asyncio.run(run_controlled(trainer, settings.state_path(), EXIT_GRACE_S, exit_code))
    except tuple(cls for cls, _ in EXIT_CODES) as e:
        trainer.log.error("%s", e)
        raise SystemExit(exit_code(e)) from None
    finally:
        ttl = trainer.spec.timeouts.record_ttl_s if trainer.spec is not None else 30.0
        write_heartbeat(settings.state_path(), peer_id=trainer.identity.peer_id, role="trainer", stage=-1,
                        state="stopped", epoch=0, ttl_s=ttl)

