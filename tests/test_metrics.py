"""Prometheus metrics of a peer: values copied from its signed records, served over HTTP."""

import socket
import urllib.request

from swarm.metrics import PeerMetrics
from swarm.protocol import ServerInfo, ServerState, StorageInfo, TrainerInfo


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_metrics_mirror_the_records_and_are_served():
    metrics = PeerMetrics("run-x", "peer-a", "server")
    metrics.update_server(ServerInfo(run_id="run-x", peer_id="peer-a", time=0, stage=1, state=ServerState.ONLINE,
                                     throughput=12.5, p2p_id="x", epoch=42, samples=1000, loss=3.25,
                                     averaging={"sent": 100, "received": 50, "rejected": 2}, lr_scale=0.5,
                                     flops_per_sample=2e9, peak_flops=1e11))
    metrics.update_storage(StorageInfo(run_id="run-x", peer_id="peer-a", time=0, p2p_id="x", free_bytes=777,
                                       held=[(1, 40, 0, "ab" * 8), (0, 40, 2, "cd" * 8)]))
    metrics.update_trainer(TrainerInfo(run_id="run-x", peer_id="peer-a", time=0, share=0, samples=64, tokens=2048))
    port = _free_port()
    metrics.serve(port, "127.0.0.1")
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    labels = 'peer="peer-a",role="server",run="run-x"'
    for line in (f'swarm_epoch{{{labels},stage="1"}} 42.0', f'swarm_averaging_bytes_total{{{labels},stage="1"}} 150.0',
                 f'swarm_parts_rejected_total{{{labels},stage="1"}} 2.0', f'swarm_lr_scale{{{labels},stage="1"}} 0.5',
                 f'swarm_fragments_held{{{labels}}} 2.0', f'swarm_fragment_free_bytes{{{labels}}} 777.0',
                 f'swarm_trainer_tokens_total{{{labels}}} 2048.0', f'swarm_mfu{{{labels},stage="1"}} 0.25',
                 f'swarm_model_flops_per_second{{{labels},stage="1"}} 2.5e+10'):
        assert line in text, line
