"""``swarm-peer join`` as a stage server: the process around :class:`swarm.server.session.ServerSession`.

The server's life (join, restore, serve, checkpoint, rollback, rebalance, drain) is the library's
:class:`~swarm.server.session.ServerSession`; this module wires it to the process: SIGTERM/SIGINT and
``swarm-peer pause|resume|drain`` (:mod:`peer.control`), the heartbeat file and Prometheus metrics
(:mod:`peer.heartbeat`), and exit codes: 0 after a drain, 3 when the stage could not be restored, 4 when the
run's coordinator banned this peer, 5 when none of the run address's peers answered within
``SWARM_JOIN_TIMEOUT_S``, 7 when the run admits only ticketed peers and this one has no ticket, 1 (with the
message) for a stage the run does not have.
"""

from __future__ import annotations

import asyncio
from typing import Optional


from peer.control import EXIT_GRACE_S, run_controlled
from peer.exits import EXIT_CODES, exit_code
from peer.heartbeat import start_metrics, write_heartbeat
from swarm.averaging.optimizer import StageOptimizer
from swarm.settings import PeerSettings
from swarm.net.dht import parse_run_address
from swarm.protocol import ServerInfo, StorageInfo
from swarm.server.session import NoSuchStage, OptimizerFactory, ServerSession, StageServerFactory
from swarm.host import DeviceUnavailable
from swarm.kernels import BackendUnavailable
from swarm.server.stage import StageServer



def run_server(address: str, settings: PeerSettings, stage: Optional[int] = None, *,
               optimizer_factory: OptimizerFactory = StageOptimizer,
               server_factory: StageServerFactory = StageServer) -> None:
    """Serve a stage of the run at ``address`` until SIGTERM/SIGINT or ``swarm-peer drain``.

    :param optimizer_factory: how the stage's optimizer is built (tests start Byzantine servers with it).
    :param server_factory: how the stage's RPC server is built (tests start servers that lie to trainers).
    :raises SystemExit: 3 (restore failed), 4 (banned), 5 (run unreachable), or the message of a stage the run
        does not have or of a device (``SWARM_DEVICE``) or kernel backend (``SWARM_KERNELS``) this machine cannot
        run.
    """
    run_id, _ = parse_run_address(address)
    try:
        session = ServerSession(address, settings, stage=stage, optimizer_factory=optimizer_factory,
                                server_factory=server_factory)
    except (BackendUnavailable, DeviceUnavailable) as e:  # SWARM_KERNELS / SWARM_DEVICE this machine cannot run
        raise SystemExit(str(e)) from None
    metrics = start_metrics(run_id, session.me, "server", settings)

    def announced(record: ServerInfo, storage: StorageInfo) -> None:
        write_heartbeat(settings.state_path(), peer_id=session.me, role="server", stage=record.stage,
                        state=str(record.state), epoch=record.epoch, ttl_s=session.spec.timeouts.record_ttl_s)
        metrics.update_server(record)
        metrics.update_storage(storage)

    session.on_announce = announced
    try:
        asyncio.run(run_controlled(session, settings.state_path(), EXIT_GRACE_S, exit_code))
    except tuple(cls for cls, _ in EXIT_CODES) as e:
        session.log.error("%s", e)
        raise SystemExit(exit_code(e)) from None
    except NoSuchStage as e:
        raise SystemExit(f"--stage: {e}") from None
    finally:
        ttl = session.spec.timeouts.record_ttl_s if session.spec is not None else 30.0
        write_heartbeat(settings.state_path(), peer_id=session.me, role="server", state="stopped", ttl_s=ttl)

