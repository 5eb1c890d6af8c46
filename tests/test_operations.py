"""The operator's commands on a live local swarm: the monitoring CLI read by an observer (client-mode) node,
pause / resume / drain of running peers, and a signed coordinator ban that every peer honours."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from swarm.protocol import ServerState
from tests.scenario import Scenario, make_swarm

pytestmark = [pytest.mark.scenario, pytest.mark.timeout(600)]

RUN_KEYS = {"run_id", "name", "spec_hash", "num_stages", "epoch", "total_epochs", "progress", "eta_s", "tokens",
            "samples_per_s", "loss", "train_loss", "val_loss", "loss_history", "peers"}
PEER_KEYS = {"peer_id", "name", "version", "role", "stage", "state", "reachability", "epoch", "throughput",
             "samples_per_s", "samples", "contribution", "last_seen_s", "lagging", "loss", "rejected_parts",
             "flagged_parts", "banned", "ban_reason", "excluded"}
STAGE_KEYS = {"stage", "servers_online", "servers", "throughput", "demand", "epoch", "lagging", "last_round", "samples",
              "samples_dropped"}


def _cli(module: str, *args: str, env=None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=timeout,
                          env=env)


def _state(sc, stage, peer_id):
    return next((s.state for s in sc.directory.servers(stage) if s.peer_id == peer_id), None)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _watch_and_monitor(address: str, run_id: str) -> None:
    """``status --watch --json`` prints a JSON line per refresh until Ctrl-C; ``monitor`` serves the run's
    Prometheus metrics as an observer."""
    watch = subprocess.Popen([sys.executable, "-m", "coordinator", "status", address, "--json", "--watch", "1"],
                             stdout=subprocess.PIPE, text=True)
    try:
        lines = [json.loads(watch.stdout.readline()) for _ in range(2)]
    finally:
        watch.send_signal(signal.SIGINT)
    # drain what it printed meanwhile: a line a second into an unread pipe can block its exit (seen twice here)
    watch.communicate(timeout=60)
    assert watch.returncode == 0 and all(set(snap) == {"run", "stages", "peers", "healthy"} for snap in lines)
    port = _free_port()
    monitor = subprocess.Popen([sys.executable, "-m", "coordinator", "monitor", address, "--metrics-port", str(port),
                                "--host", "127.0.0.1", "--every", "1"], stderr=subprocess.PIPE, text=True)
    try:
        deadline, scraped = time.monotonic() + 60, ""
        while f'swarm_run_epoch{{run="{run_id}"}}' not in scraped:
            assert time.monotonic() < deadline and monitor.poll() is None, f"no run metrics on :{port}: {scraped}"
            time.sleep(1.0)
            try:
                scraped = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
            except OSError:
                continue
        assert 'swarm_stage_servers_online{run="%s",stage="1"} 1.0' % run_id in scraped
        assert 'swarm_run_healthy{run="%s"} 1.0' % run_id in scraped
    finally:
        monitor.send_signal(signal.SIGINT)
        monitor.wait(30)


def test_monitoring_pause_resume_ban_and_drain_on_a_live_swarm(tmp_path, tiny_spec_path, cache_dir, tiny_dataset):
    with make_swarm(tiny_spec_path, tmp_path, cache_dir, extra_env={"SWARM_VAL_EVERY_S": "4"}) as sw, \
            Scenario(sw) as sc:
        sc.servers(per_stage=1)
        trainer = sw.start_peer("trainer", env={"SWARM_NAME": "alice"})
        sc.until_epoch(4)
        address = sw.address

        # ---- the monitoring CLI, as an observer in client mode ----------------------------------------
        png = tmp_path / "loss.png"
        sc.wait(lambda: any(t.val_loss is not None for t in sc.directory.trainers()), 120, "a validation loss")
        done = _cli("coordinator", "status", address, "--json", "--plot", str(png))
        assert done.returncode == 0, done.stderr
        snap = json.loads(done.stdout)
        assert set(snap) == {"run", "stages", "peers", "healthy"} and snap["healthy"] is True
        run = snap["run"]
        assert RUN_KEYS <= set(run) and run["run_id"] == sc.directory.run_id and run["epoch"] >= 4
        assert len(run["loss_history"]) >= 2 and run["val_loss"] is not None and run["eta_s"] is not None
        assert run["peers"]["trainers"] == 1 and run["peers"]["online"] == 3
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        peers = {p["peer_id"]: p for p in snap["peers"]}
        assert all(PEER_KEYS <= set(p) for p in peers.values())
        assert peers[trainer.peer_id]["name"] == "alice" and peers[trainer.peer_id]["contribution"] == 1.0
        assert all(p["reachability"] == "direct" for p in peers.values() if p["role"] == "server")
        assert sum(p["contribution"] for p in peers.values() if p["stage"] == 0) == pytest.approx(1.0)
        done = _cli("coordinator", "stages", address, "--json")
        assert done.returncode == 0 and set(json.loads(done.stdout)) == {"stages", "healthy"}
        assert all(STAGE_KEYS <= set(s) for s in json.loads(done.stdout)["stages"])
        done = _cli("coordinator", "peers", address)
        assert done.returncode == 0 and "alice" in done.stdout and "peers" in done.stdout
        done = _cli("coordinator", "status", address)
        assert done.returncode == 0 and "training loss" in done.stdout and "ETA" in done.stdout
        assert _cli("coordinator", "peers", "not-an-address").returncode == 2
        _watch_and_monitor(address, sc.directory.run_id)

        # ---- pause and resume a server from its own machine -------------------------------------------
        server = sc.server(0)
        env = dict(os.environ, SWARM_STATE_DIR=str(sw.state_dir(server.name)))
        done = _cli("peer", "pause", "--timeout", "60", env=env)
        assert done.returncode == 0 and "paused" in done.stdout, done.stderr
        sc.wait(lambda: _state(sc, 0, server.peer_id) == ServerState.PAUSED, 60, "the paused record")
        done = _cli("coordinator", "status", address, "--json")
        assert done.returncode == 1 and json.loads(done.stdout)["healthy"] is False  # stage 0 has no online server
        assert _cli("peer", "status", "--probe", env=env).returncode == 0  # paused on purpose: still healthy
        epoch = min(sc.epochs())
        done = _cli("peer", "resume", "--timeout", "60", env=env)
        assert done.returncode == 0 and "online" in done.stdout, done.stderr
        sc.until_epoch(epoch + 2)

        # ---- a signed ban: the trainer stops itself, the others leave it out ----------------------------
        key = str(sw.workdir / "keys" / "coordinator.key")
        done = _cli("coordinator", "ban", address, trainer.peer_id, "--reason", "test ban",
                    "--key", str(sw.workdir / "keys" / "server1.key"))
        assert done.returncode == 1 and "did not create run" in done.stderr
        done = _cli("coordinator", "ban", address, trainer.peer_id, "--reason", "test ban", "--key", key)
        assert done.returncode == 0 and json.loads(done.stdout)["banned"] == {trainer.peer_id: "test ban"}
        assert trainer.proc.wait(90) == 4
        assert "banned from run" in sw.tail(trainer, 20)
        peers = {p["peer_id"]: p for p in json.loads(_cli("coordinator", "peers", address, "--json").stdout)["peers"]}
        assert peers[trainer.peer_id]["banned"] and peers[trainer.peer_id]["ban_reason"] == "test ban"
        done = _cli("coordinator", "unban", address, trainer.peer_id, "--key", key)
        assert done.returncode == 0 and json.loads(done.stdout)["banned"] == {}

        # ---- drain: the server leaves cleanly and says so ----------------------------------------------
        last = sc.server(1)
        env = dict(os.environ, SWARM_STATE_DIR=str(sw.state_dir(last.name)))
        done = _cli("peer", "drain", "--timeout", "90", env=env)
        assert done.returncode == 0 and "stopped" in done.stdout, f"{done.stderr}\n{sw.tail(last, 40)}"
        assert last.proc.wait(30) == 0
        assert _cli("peer", "status", "--probe", env=env).returncode == 1
        assert _cli("peer", "drain", "--timeout", "5", env=env).returncode == 1  # nothing runs there any more
