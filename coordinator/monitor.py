"""Watching a run: refresh the views every few seconds, and serve the whole run's Prometheus metrics.

Both read only the DHT, so they work from any machine that can reach one peer of the run, as a client-mode
node that stores nothing and accepts no connections (``swarm-coordinator monitor``): anyone can watch a
public run. The run's own coordinator serves the same metrics with ``serve --metrics-port``.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from typing import Any, Callable, Optional

from prometheus_client import CollectorRegistry, Gauge, start_http_server

logger = logging.getLogger(__name__)

_RUN = {
    "swarm_run_epoch": ("Fewest epochs of any stage.", lambda r: r["epoch"]),
    "swarm_run_progress_ratio": ("Epoch / optim.total_epochs.", lambda r: r["progress"]),
    "swarm_run_eta_seconds": ("Seconds to optim.total_epochs at the slowest stage's rate (NaN: unknown).",
                              lambda r: r["eta_s"]),
    "swarm_run_tokens_total": ("Tokens the live trainers pushed through the swarm.", lambda r: r["tokens"]),
    "swarm_run_samples_per_second": ("Samples/s of all trainers.", lambda r: r["samples_per_s"]),
    "swarm_run_train_loss": ("Training loss EMA of the last stage, nats/token.", lambda r: r["train_loss"]),
    "swarm_run_val_loss": ("Newest validation loss a trainer measured, nats/token.", lambda r: r["val_loss"]),
}
_STAGE = {
    "swarm_stage_servers_online": ("Online servers of the stage.", lambda s: s["servers_online"]),
    "swarm_stage_throughput_samples_per_second": ("Sum of the online servers' throughput.", lambda s: s["throughput"]),
    "swarm_stage_epoch": ("Newest epoch of the stage.", lambda s: s["epoch"]),
    "swarm_stage_lagging_servers": ("Servers behind or silent.", lambda s: s["lagging"]),
    "swarm_stage_last_round_group_size": ("Servers in the stage's last averaging round.",
                                          lambda s: s["last_round"]["group_size"]),
}


def _num(value: Optional[float]) -> float:
    return float("nan") if value is None else float(value)


class RunMetrics:
    """Prometheus gauges of a whole run, set from :func:`coordinator.status.snapshot` results.

    Labels: ``run``; per stage also ``stage``; ``swarm_run_peers`` has ``state``; ``swarm_peer_*`` have
    ``peer``, ``role``, ``stage`` (``-`` for trainers). Peers that vanished are dropped at the next update.
    """

    def __init__(self, run_id: str):
        self.run_id, self.registry = run_id, CollectorRegistry()
        self.run = {n: (Gauge(n, h, ["run"], registry=self.registry), f) for n, (h, f) in _RUN.items()}
        self.stage = {n: (Gauge(n, h, ["run", "stage"], registry=self.registry), f) for n, (h, f) in _STAGE.items()}
        self.peers = Gauge("swarm_run_peers", "Peers by state (online, joining, lagging, paused, draining, trainers, "
                           "banned, excluded).", ["run", "state"], registry=self.registry)
        self.peer_rate = Gauge("swarm_peer_samples_per_second", "A peer's samples/s (servers: measured throughput).",
                               ["run", "peer", "role", "stage"], registry=self.registry)
        self.peer_share = Gauge("swarm_peer_contribution_ratio", "A peer's share of its stage's samples (servers) or "
                                "of the trainers' samples/s.", ["run", "peer", "role", "stage"], registry=self.registry)
        self.healthy = Gauge("swarm_run_healthy", "1 if every stage has an online server.", ["run"],
                             registry=self.registry)

    def update(self, snap: dict[str, Any]) -> None:
        run = snap["run"]
        for gauge, f in self.run.values():
            gauge.labels(self.run_id).set(_num(f(run)))
        for s in snap["stages"]:
            for gauge, f in self.stage.values():
                gauge.labels(self.run_id, str(s["stage"])).set(_num(f(s)))
        for state, n in run["peers"].items():
            self.peers.labels(self.run_id, state).set(n)
        self.peer_rate.clear()
        self.peer_share.clear()
        for p in snap["peers"]:
            labels = (self.run_id, p["peer_id"], p["role"], "-" if p["stage"] is None else str(p["stage"]))
            self.peer_rate.labels(*labels).set(p["samples_per_s"])
            self.peer_share.labels(*labels).set(p["contribution"])
        self.healthy.labels(self.run_id).set(1 if snap["healthy"] else 0)

    def serve(self, port: int, host: str = "0.0.0.0") -> None:
        """Serve ``/metrics`` on ``host:port`` from a daemon thread.

        :raises OSError: the port is taken.
        """
        start_http_server(port, addr=host, registry=self.registry)


def watch(take: Callable[[], dict[str, Any]], show: Callable[[dict[str, Any]], None], every_s: float,
          stop: Optional[threading.Event] = None) -> dict[str, Any]:
    """Take and show a snapshot every ``every_s`` seconds until ``stop`` or Ctrl-C; returns the last one.

    Ctrl-C (SIGINT, in the main thread) sets ``stop``: the snapshot being taken completes and the loop ends. Raised
    as KeyboardInterrupt instead, it could land inside a library's blocking call that swallows it, and the loop went
    on printing (``coordinator status --watch`` ignored a SIGINT for 60 s in tests/test_operations.py once). A second
    Ctrl-C raises KeyboardInterrupt as usual."""
    stop = stop or threading.Event()
    snap: dict[str, Any] = {}
    restore = _stop_on_sigint(stop)
    try:
        while not stop.is_set():
            started = time.monotonic()
            snap = take()
            show(snap)
            stop.wait(max(0.0, every_s - (time.monotonic() - started)))
    except KeyboardInterrupt:
        pass
    finally:
        restore()
    return snap


def _stop_on_sigint(stop: threading.Event) -> Callable[[], None]:
    """Make SIGINT set ``stop`` once (then the previous handler is back); returns the function that puts the previous
    handler back. Does nothing outside the main thread: only the main thread may set handlers, and runs them."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    previous = signal.getsignal(signal.SIGINT)
    previous = signal.default_int_handler if previous is None else previous  # (set outside Python)

    def handler(signum, frame) -> None:
        stop.set()
        signal.signal(signal.SIGINT, previous)

    signal.signal(signal.SIGINT, handler)
    return lambda: signal.signal(signal.SIGINT, previous)
