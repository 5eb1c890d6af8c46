"""Prometheus metrics of a peer (``prometheus-client``), served on ``SWARM_METRICS_PORT`` when it is set.

Every metric carries the labels ``run``, ``peer`` (the peer id) and ``role``; a server's also ``stage``.
Values are copied from the signed records the peer publishes (:class:`~swarm.protocol.ServerInfo`,
:class:`~swarm.protocol.TrainerInfo`, :class:`~swarm.protocol.StorageInfo`) each time it announces, so
the DHT and Prometheus never disagree. Counters that the peer tracks as running totals are exposed as
``*_total`` gauges (they restart from zero with the process, as Prometheus counters do).
"""

from __future__ import annotations

from typing import Optional

from prometheus_client import CollectorRegistry, Gauge, start_http_server

from swarm.protocol import ServerInfo, StorageInfo, TrainerInfo

_SERVER = {
    "swarm_epoch": ("Epoch of the stage's collaborative optimizer.", lambda s: s.epoch),
    "swarm_samples_total": ("Samples this server processed (forward + backward).", lambda s: s.samples),
    "swarm_compute_seconds_total": ("CPU seconds spent in the stage's training forward + backward.",
                                    lambda s: s.compute_s),
    "swarm_throughput_samples_per_second": ("Measured samples/s of forward + backward.", lambda s: s.throughput),
    "swarm_model_flops_per_second": ("Model FLOP/s while computing (throughput x FLOPs per sample; PaLM app. B).",
                                     lambda s: s.achieved_flops),
    "swarm_peak_flops_per_second": ("The device's FLOP/s measured by a matmul microbenchmark at join.",
                                    lambda s: s.peak_flops),
    "swarm_mfu": ("Model FLOPs utilisation: model FLOP/s over the measured peak (NaN if unknown).",
                  lambda s: s.mfu if s.mfu is not None else float("nan")),
    "swarm_loss": ("Training loss EMA, nats/token (last stage).", lambda s: s.loss if s.loss is not None else float("nan")),
    "swarm_averaging_rounds_total": ("Epoch transitions (averaging + step).", lambda s: s.rounds),
    "swarm_averaging_round_seconds": ("Mean seconds of an epoch transition.", lambda s: s.round_s),
    "swarm_averaging_peers": ("Servers of the stage in the last round.", lambda s: s.peers_in_last_round),
    "swarm_averaging_bytes_total": ("All-reduce bytes sent + received.",
                                    lambda s: s.averaging.get("sent", 0) + s.averaging.get("received", 0)),
    "swarm_averaging_failed_rounds_total": ("Averaging rounds that failed.", lambda s: s.averaging.get("failed", 0)),
    "swarm_parts_rejected_total": ("Parts rejected as a reducer.", lambda s: s.averaging.get("rejected", 0)),
    "swarm_parts_flagged_total": ("Parts flagged as outliers as a reducer.", lambda s: s.averaging.get("flagged", 0)),
    "swarm_excluded_peers": ("Peers this server excluded from averaging.", lambda s: len(s.excluded)),
    "swarm_lr_scale": ("Learning-rate multiplier after rollbacks.", lambda s: s.lr_scale),
}
_TRAINER = {
    "swarm_trainer_samples_total": ("Samples this trainer pushed through the swarm.", lambda t: t.samples),
    "swarm_trainer_tokens_total": ("Tokens this trainer pushed through the swarm.", lambda t: t.tokens),
    "swarm_trainer_samples_per_second": ("Trainer throughput.", lambda t: t.samples_per_s),
    "swarm_trainer_loss": ("Trainer's loss EMA, nats/token.", lambda t: t.loss if t.loss is not None else float("nan")),
    "swarm_trainer_retries_total": ("Micro-batch attempts that failed and were retried.", lambda t: t.failures),
}
_STORAGE = {
    "swarm_fragments_held": ("Checkpoint fragments on this peer's disk.", lambda s: len(s.held)),
    "swarm_fragment_free_bytes": ("Fragment budget left (bytes).", lambda s: s.free_bytes),
}


class PeerMetrics:
    """The metrics of one peer in their own registry (so tests and several peers in one process never clash)."""

    def __init__(self, run_id: str, peer_id: str, role: str):
        self.registry = CollectorRegistry()
        self.labels = {"run": run_id, "peer": peer_id, "role": role}
        names = ["run", "peer", "role"]
        self._server = {k: Gauge(k, doc, names + ["stage"], registry=self.registry) for k, (doc, _) in _SERVER.items()}
        self._trainer = {k: Gauge(k, doc, names, registry=self.registry) for k, (doc, _) in _TRAINER.items()}
        self._storage = {k: Gauge(k, doc, names, registry=self.registry) for k, (doc, _) in _STORAGE.items()}
        self.server_port: Optional[int] = None

    def update_server(self, info: ServerInfo) -> None:
        for name, (_, get) in _SERVER.items():
            self._server[name].labels(**self.labels, stage=str(info.stage)).set(get(info))

    def update_trainer(self, info: TrainerInfo) -> None:
        for name, (_, get) in _TRAINER.items():
            self._trainer[name].labels(**self.labels).set(get(info))

    def update_storage(self, info: StorageInfo) -> None:
        for name, (_, get) in _STORAGE.items():
            self._storage[name].labels(**self.labels).set(get(info))

    def serve(self, port: int, host: str = "0.0.0.0") -> None:
        """Serve ``/metrics`` over HTTP on ``host:port`` (a daemon thread).

        :raises OSError: the port is taken (choose another ``SWARM_METRICS_PORT``).
        """
        start_http_server(port, addr=host, registry=self.registry)
        self.server_port = port
