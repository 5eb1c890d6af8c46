"""A small fluent helper for multi-process swarm tests: start peers, wait for epochs, inject faults.

    sc = Scenario(swarm).servers(per_stage=2).trainers(2).until_epoch(3)
    sc.kill(sc.server(stage=0)).until_epoch(6)
"""

from __future__ import annotations

import signal
import time
from typing import Callable, Optional

from hivemind.utils import get_dht_time

from coordinator.launch import LocalSwarm, Peer
from swarm.config import PeerSettings
from swarm.directory import connect_run
from swarm.protocol import ServerState

LIFECYCLE = ("joining", "] online", "rebalancing", "draining", "restor", "loading state", "left the stage",
             "stopped", "paused", "resumed", "rollback", "banned", "ERROR", "Error:")
"""Substrings of the log lines :meth:`Scenario.story` keeps."""


class Scenario:
    def __init__(self, swarm: LocalSwarm):
        self.swarm = swarm
        swarm.start_coordinator()
        self.dht, self.directory, self.spec, _ = connect_run(swarm.address, PeerSettings(host="127.0.0.1"))
        self.num_stages = self.spec.model.num_stages
        self.stage_of: dict[str, int] = {}

    def close(self) -> None:
        self.dht.shutdown()

    # ---- waiting --------------------------------------------------------------------------------------
    def wait(self, predicate: Callable[[], bool], timeout: float, what: str) -> "Scenario":
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}\n{self.story()}")
            time.sleep(0.5)
        return self

    def epochs(self) -> list[int]:
        """Highest epoch announced by an online server of each stage."""
        return [max((s.epoch for s in g if s.state == ServerState.ONLINE), default=-1)
                for g in self.directory.all_servers(self.num_stages).values()]

    def until_epoch(self, epoch: int, timeout: float = 240.0) -> "Scenario":
        return self.wait(lambda: min(self.epochs()) >= epoch, timeout, f"every stage at epoch {epoch}")

    # ---- peers ----------------------------------------------------------------------------------------
    def servers(self, per_stage: int, timeout: float = 120.0, byzantine: Optional[str] = None) -> "Scenario":
        """Start ``per_stage`` servers per stage, one after another; with ``byzantine`` (an attack name) the
        last server of each stage attacks the run."""
        for i in range(per_stage * self.num_stages):  # one after another, as volunteers join
            stage = i % self.num_stages
            bad = byzantine is not None and i >= (per_stage - 1) * self.num_stages
            peer = self.swarm.start_peer("server", "--stage", str(stage), name=f"byzantine{i}" if bad else None,
                                         env={"SWARM_BYZANTINE": byzantine} if bad else None)
            self.stage_of[peer.name] = stage
            self.wait(lambda pid=peer.peer_id, k=stage: any(s.peer_id == pid and s.state == ServerState.ONLINE
                                                            for s in self.directory.servers(k)),
                      timeout, f"{peer.name} online")
        return self.wait(
            lambda: all(sum(s.state == ServerState.ONLINE for s in g) >= per_stage
                        for g in self.directory.all_servers(self.num_stages).values()),
            timeout, f"{per_stage} online servers per stage")

    def trainers(self, count: int, *args: str) -> "Scenario":
        for i in range(count):
            self.swarm.start_peer("trainer", "--shard", str(i), *args)
        return self

    def server(self, stage: int, alive: bool = True) -> Peer:
        return next(p for p in self.swarm.peers
                    if p.role == "server" and self.stage_of.get(p.name) == stage and p.alive() == alive)

    def kill(self, peer: Peer, sig: int = signal.SIGKILL) -> "Scenario":
        self.swarm.kill(peer, sig)
        return self

    def trainer_samples(self) -> int:
        return sum(t.samples for t in self.directory.trainers())

    def story(self, lines: int = 14) -> str:
        """What happened, for assertion messages (a log's tail is a screen of per-epoch lines): each peer's
        lifecycle and error lines (the last ``lines``), and every server record this test process sees."""
        out = []
        for p in self.swarm.peers + ([self.swarm.coordinator] if self.swarm.coordinator else []):
            try:
                text = p.log.read_text(errors="replace").splitlines()
            except FileNotFoundError:
                text = []
            picked = [line[:240] for line in text if any(w in line for w in LIFECYCLE)]
            state = "alive" if p.alive() else "exited"
            out.append(f"--- {p.name} ({p.peer_id}, {state})\n" + "\n".join(picked[-lines:]))
        names = {p.peer_id: p.name for p in self.swarm.peers}
        try:
            now = get_dht_time()
            for k, group in self.directory.all_servers(self.num_stages).items():
                rows = ", ".join(f"{names.get(s.peer_id, s.peer_id)} {s.state.value} epoch {s.epoch} "
                                 f"{now - s.time:.0f}s ago" for s in group)
                out.append(f"--- stage {k} records: {rows or 'none'}")
        except Exception as e:  # the test's own DHT node is the problem: say so
            out.append(f"--- reading the directory failed: {e!r}")
        return "\n".join(out)

    def log_warnings(self) -> str:
        """Warning and error lines of every peer's log, for assertion messages."""
        out = []
        for p in self.swarm.peers:
            lines = [line for line in p.log.read_text(errors="replace").splitlines()
                     if any(w in line for w in ("WARN", "ERROR", "epoch="))]
            out.append(f"--- {p.name}\n" + "\n".join(lines[-25:]))
        return "\n".join(out)

    def fingerprints(self, stage: int) -> dict[str, dict[int, list[float]]]:
        return {s.peer_id: s.fingerprints for s in self.directory.servers(stage) if s.state == ServerState.ONLINE}

    def __enter__(self) -> "Scenario":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def make_swarm(spec_path, tmp_path, cache_dir, keep: bool = False, extra_env: Optional[dict] = None) -> LocalSwarm:
    return LocalSwarm(spec_path, tmp_path / "swarm", cache_dir, keep=keep, extra_env=extra_env)
