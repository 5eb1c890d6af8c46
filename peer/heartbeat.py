"""What a running peer reports on its own machine: the heartbeat file that ``swarm-peer status`` (and a
container HEALTHCHECK) reads, and its Prometheus metrics endpoint (:func:`start_metrics`).

The running peer rewrites ``peer-status.json`` in its state folder (``SWARM_STATE_DIR``, default
``SWARM_CACHE_DIR``; atomically) at every announcement:
``{"peer_id", "role", "stage", "state", "epoch", "time", "ttl_s"}`` (time: Unix seconds). A heartbeat older
than ``ttl_s`` means the peer is stuck or gone.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Optional

from swarm.settings import PeerSettings
from swarm.logs import PeerLog
from swarm.metrics import PeerMetrics

logger = logging.getLogger(__name__)
FILENAME = "peer-status.json"
_warned: list[bool] = []
HEALTHY_STATES = ("joining", "online", "training", "paused")  # paused: by its operator, on purpose


def write_heartbeat(cache_dir: Path, **fields) -> bool:
    """Atomically (temporary file + rename) write the heartbeat with ``time`` = now. A cache folder that is
    not writable (or full) is logged, once, and never stops the peer; returns whether it was written."""
    path = Path(cache_dir) / FILENAME
    tmp = path.with_name(f".{FILENAME}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps({**fields, "time": time.time()}))
        os.replace(tmp, path)
        return True
    except OSError as e:
        if not _warned:
            _warned.append(True)
            logger.warning("cannot write the heartbeat %s (%s); `swarm-peer status` and container health checks "
                           "will report this peer unhealthy: make SWARM_CACHE_DIR writable", path, e)
        return False


def probe(cache_dir: Path, now: Optional[float] = None) -> tuple[bool, str, dict]:
    """``(healthy, reason, heartbeat)``: healthy if the heartbeat is fresh and the peer is joining, online,
    training or paused (by its operator: a container must not be restarted for that)."""
    path = Path(cache_dir) / FILENAME
    try:
        beat = json.loads(path.read_text())
    except FileNotFoundError:
        return False, f"no heartbeat at {path}: the peer has not started (or SWARM_CACHE_DIR differs)", {}
    except (OSError, ValueError) as e:
        return False, f"unreadable heartbeat {path}: {e}", {}
    age = (now or time.time()) - float(beat.get("time", 0))
    if age > float(beat.get("ttl_s", 30.0)):
        return False, f"heartbeat is {age:.0f} s old (> {beat.get('ttl_s')} s): the peer is stuck or stopped", beat
    if beat.get("state") not in HEALTHY_STATES:
        return False, f"the peer is {beat.get('state')}", beat
    return True, f"{beat.get('role')} {beat.get('state')}, heartbeat {age:.0f} s old", beat


def start_metrics(run_id: str, peer_id: str, role: str, settings: PeerSettings) -> PeerMetrics:
    """The peer's Prometheus metrics, served on ``SWARM_METRICS_PORT`` if set (a taken port is logged, not fatal)."""
    metrics, log = PeerMetrics(run_id, peer_id, role), PeerLog(logger, peer_id, role="trainer" if role == "trainer" else "")
    if settings.metrics_port:
        try:
            metrics.serve(settings.metrics_port, settings.host)
            log.info("Prometheus metrics on http://%s:%d/metrics", settings.host, settings.metrics_port)
        except OSError as e:
            log.error("cannot serve metrics on port %d (%s); choose another SWARM_METRICS_PORT", settings.metrics_port,
                      e.strerror)
    return metrics
