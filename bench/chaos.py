"""Chaos: a local swarm trains while random peers are SIGKILLed and restarted; nothing accepted may be lost.

    python bench/chaos.py [--seconds 300] [--seed 0] [--spec PATH]

A coordinator, ``--servers-per-stage`` servers per stage (pinned to their stage) and ``--trainers`` trainers
run as separate processes on loopback, checkpointing every few epochs. Every 8-20 s (seeded) one event
SIGKILLs a random server, a random trainer, the coordinator, or every server of one stage at once (a *stage
wipe*); the first four events cover each kind once. Killed peers restart 2-8 s later under the same name,
so with the same identity and fragment directory, as a volunteer's machine coming back; a wiped stage's
servers restart at once. A restarted coordinator joins the live swarm through a server's address.

Measured:

* ``epochs``: the fewest epochs any stage reached;
* ``lost_epochs``: checkpoint epochs that were committed (a manifest seen in the DHT) but are not on the
  stage's final hash chain (newest manifest -> parent -> ...), plus committed epochs newer than what the final
  restore brought back. Must be 0;
* ``recovery_s_median`` / ``recovery_s_max``: from the moment a stage has no live server process until a
  server of it announces itself online again, over every stage wipe (and the final kill of every peer);
* ``restored_bit_exact``: at the end, every peer is SIGKILLed and restarted; each stage's state is restored
  from fragments alone and must hash to the stage's newest committed checkpoint.

The last line of stdout is one JSON object with ``kills, epochs, lost_epochs, recovery_s_median,
recovery_s_max, restored_bit_exact``; the line before it has the details.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from coordinator.launch import LocalSwarm, Peer  # noqa: E402
from swarm.config import RunSpec  # noqa: E402
from swarm.settings import PeerSettings  # noqa: E402
from swarm.net.dht import connect_run, format_run_address  # noqa: E402
from swarm.protocol import ServerState  # noqa: E402

logger = logging.getLogger("swarm.chaos")

SPEC = RunSpec.from_toml(ROOT / "runs" / "tiny.toml").updated(
    name="chaos", optim={"total_epochs": 400}, training={"target_batch_size": 64},
    checkpoint={"interval_epochs": 3, "fragments_needed": 2, "fragments_total": 4, "restore_timeout_s": 120},
    rollback={"enabled": False}, timeouts={"record_ttl_s": 9.0})
"""The chaos run: the tiny spec, checkpointed every 3 epochs (any 2 of 4 fragments), no rollbacks, short records."""
EVENTS = ("server", "wipe", "coordinator", "trainer")


@dataclass
class Chaos:
    swarm: LocalSwarm
    rng: random.Random
    per_stage: int
    trainers: int
    stage_of: dict[str, int] = field(default_factory=dict)
    restarts: list[tuple[float, str, str]] = field(default_factory=list)  # (when, role, name)
    committed: dict[tuple[int, str], tuple[int, str, int]] = field(default_factory=dict)  # (stage, sha) -> epoch, parent, parent epoch
    down_since: dict[int, float] = field(default_factory=dict)
    recoveries: list[float] = field(default_factory=list)
    kills: int = 0
    max_epochs: dict[int, int] = field(default_factory=dict)

    def __post_init__(self):
        self.dht, self.directory, self.spec, _ = connect_run(self.swarm.address, PeerSettings(host="127.0.0.1"))
        self.num_stages = self.spec.model.num_stages

    # ---- peers ----------------------------------------------------------------------------------------
    def live(self, role: str, stage: Optional[int] = None) -> list[Peer]:
        latest = {p.name: p for p in self.swarm.peers}  # a restarted name's newest process
        return [p for p in latest.values() if p.role == role and p.alive()
                and (stage is None or self.stage_of.get(p.name) == stage)]

    def _address(self) -> str:
        """A run address through the coordinator or, while it is dead, through every live server announced online
        (a record may outlive its peer, and a restarted peer listens on another port)."""
        if self.swarm.coordinator is not None and self.swarm.coordinator.alive():
            return self.swarm.address
        alive = {p.peer_id for p in self.live("server")}
        maddrs = [s.maddrs[0] for k in range(self.num_stages) for s in self.directory.servers(k)
                  if s.state == ServerState.ONLINE and s.maddrs and s.peer_id in alive]
        return format_run_address(self.directory.run_id, maddrs) if maddrs else self.swarm.address

    def start(self, role: str, name: str) -> Peer:
        via = self._address()
        if role == "coordinator":  # a restart: join the live swarm through a server
            self.swarm.start_coordinator(peers=via.split("@", 1)[1].split(",") if via != self.swarm.address else [])
            return self.swarm.coordinator
        self.swarm.address = via
        if role == "server":
            return self.swarm.start_peer("server", "--stage", str(self.stage_of[name]), name=name)
        return self.swarm.start_peer("trainer", "--share", name.removeprefix("trainer"), name=name)

    def kill(self, peer: Peer, restart_after: float) -> None:
        self.swarm.kill(peer, signal.SIGKILL)
        self.kills += 1
        self.restarts.append((time.monotonic() + restart_after, peer.role, peer.name))
        logger.info("killed %s (%s); restart in %.0f s", peer.name, peer.role, restart_after)

    def event(self, kind: str) -> None:
        if kind == "wipe":
            stage = self.rng.randrange(self.num_stages)
            for p in self.live("server", stage):
                self.kill(p, restart_after=self.rng.uniform(0.5, 2.0))
            return
        if kind == "coordinator":
            if self.swarm.coordinator is not None and self.swarm.coordinator.alive():
                self.kill(self.swarm.coordinator, self.rng.uniform(2, 5))
            return
        pool = self.live(kind)
        if pool:
            self.kill(self.rng.choice(pool), self.rng.uniform(2, 8))

    # ---- watching -------------------------------------------------------------------------------------
    def observe(self) -> None:
        now_wall, now = time.time(), time.monotonic()
        for when, role, name in [r for r in self.restarts if r[0] <= now]:
            self.restarts.remove((when, role, name))
            self.start(role, name)
        for k in range(self.num_stages):
            for m, _ in self.directory.manifests(k):
                self.committed.setdefault((k, m.shard_sha256), (m.epoch, m.parent, m.parent_epoch))
            servers = self.directory.servers(k)
            self.max_epochs[k] = max([self.max_epochs.get(k, 0)] + [s.epoch for s in servers])
            if not self.live("server", k):
                self.down_since.setdefault(k, now_wall)
            elif k in self.down_since and any(s.state == ServerState.ONLINE and s.time > self.down_since[k]
                                               for s in servers):
                self.recoveries.append(round(now_wall - self.down_since.pop(k), 2))
                logger.info("stage %d recovered in %.1f s", k, self.recoveries[-1])

    def diagnose(self, tail: int = 12) -> str:
        """Why the swarm is not where it should be: each stage's records and down time, and each server
        process's exit status and last log lines."""
        lines = []
        for k in range(self.num_stages):
            records = [f"{s.peer_id[:8]} {s.state.value} epoch {s.epoch}" for s in self.directory.servers(k)]
            down = f", down since {time.time() - self.down_since[k]:.0f} s ago" if k in self.down_since else ""
            lines.append(f"stage {k}{down}: records {records}")
        latest = {p.name: p for p in self.swarm.peers}
        for p in latest.values():
            if p.role != "server":
                continue
            status = "alive" if p.alive() else f"exited with {p.proc.returncode}"
            log = p.log.read_text(errors="replace").splitlines()[-tail:] if p.log.exists() else []
            lines.append(f"--- {p.name} (stage {self.stage_of.get(p.name)}, {status}):")
            lines.extend("    " + line[:240] for line in log)
        return "\n".join(lines)

    def checkpoint_story(self, most: int = 200) -> str:
        """Every server process's log lines about checkpoints, restores and lost epochs (at most ``most``)."""
        words = ("checkpoint", "restor", "initial parameters", "lost", "skipping to")
        noise = ("fragment ", "recognizes")
        lines = []
        for name in sorted({p.name for p in self.swarm.peers if p.role == "server"}):
            log = self.swarm.workdir / "logs" / f"{name}.log"  # a restart appends to its name's log
            if log.exists():
                lines += [f"{name}: {line[:240]}" for line in log.read_text(errors="replace").splitlines()
                          if any(w in line for w in words) and not any(w in line for w in noise)]
        lines.sort(key=lambda line: line.split(": ", 1)[1][:8])  # by their clock (HH:MM:SS)
        return "\n".join(lines[-most:])

    def lost_epochs(self, final: dict[int, str]) -> int:
        """Committed epochs not on each stage's final hash chain (see the module docstring)."""
        lost = 0
        for k in range(self.num_stages):
            mine = {sha: v for (stage, sha), v in self.committed.items() if stage == k}
            chain, sha, end = set(), final.get(k), -1
            while sha in mine:
                epoch, parent, end = mine[sha]
                chain.add(epoch)
                sha = parent
            epochs = {v[0] for v in mine.values()}
            missing = sorted(epochs - chain)
            if missing:  # where the chain ends tells a writer that named no parent (-1) from a manifest never seen here
                logger.warning("stage %d: committed epochs %s are not on the final chain %s, which ends at parent "
                               "epoch %d (sha256 %s)", k, missing, sorted(chain), end, (sha or "none")[:16])
            lost += len(missing)
        return lost

    def newest(self, k: int):
        return max(((v[0], sha) for (stage, sha), v in self.committed.items() if stage == k), default=(None, None))


def run_chaos(seconds: float, *, seed: int = 0, per_stage: int = 2, trainers: int = 2, cache_dir: Path,
              spec: RunSpec = SPEC, min_gap: float = 8.0, max_gap: float = 20.0, keep: bool = False) -> dict:
    """Run the chaos scenario (module docstring) and return its figures."""
    workdir = Path(tempfile.mkdtemp(prefix="swarm-chaos-"))
    spec_path = workdir / "chaos.toml"
    spec_path.write_text(spec.to_toml())
    logger.info("work folder %s (peer logs in logs/; %s)", workdir, "kept" if keep else "removed at the end")
    rng = random.Random(seed)
    with LocalSwarm(spec_path, workdir, cache_dir, keep=keep) as swarm:  # removes workdir unless keep
        swarm.start_coordinator()
        chaos = Chaos(swarm, rng, per_stage, trainers)
        try:
            for i in range(per_stage * chaos.num_stages):
                name = f"server{i}"
                chaos.stage_of[name] = i % chaos.num_stages
                chaos.start("server", name)
            _wait(lambda: all(len([s for s in chaos.directory.servers(k) if s.state == ServerState.ONLINE])
                              >= per_stage for k in range(chaos.num_stages)), 240, "servers online", chaos.diagnose)
            for i in range(trainers):
                chaos.start("trainer", f"trainer{i}")
            started = time.monotonic()
            schedule = list(EVENTS) + [rng.choice(("server", "server", "wipe", "trainer", "coordinator"))
                                       for _ in range(1000)]
            next_event = started + rng.uniform(min_gap, max_gap)
            while time.monotonic() - started < seconds:
                chaos.observe()
                if time.monotonic() >= next_event:
                    chaos.event(schedule.pop(0))
                    next_event = time.monotonic() + rng.uniform(min_gap, max_gap)
                time.sleep(0.5)
            # pending restarts happen, then training stops and the newest checkpoints settle
            deadline = time.monotonic() + 60
            while chaos.restarts and time.monotonic() < deadline:
                chaos.observe()
                time.sleep(0.5)
            def back_online() -> bool:
                chaos.observe()
                return not chaos.down_since and all(chaos.live("server", k) for k in range(chaos.num_stages))

            _wait(back_online, 240, "every stage back online", chaos.diagnose)

            def every_stage_committed() -> bool:  # the final kill-all must have a checkpoint of each to come back from
                chaos.observe()
                return all(chaos.newest(k)[0] is not None for k in range(chaos.num_stages))

            _wait(every_stage_committed, 240, "a committed checkpoint of every stage", chaos.diagnose)
            for p in chaos.live("trainer"):
                swarm.stop(p)
            time.sleep(2 * chaos.directory.ttl / 3)
            chaos.observe()
            newest = {k: chaos.newest(k) for k in range(chaos.num_stages)}
            # the end of the world: every peer dies at once; restart them all from their disks
            for p in chaos.live("server") + ([swarm.coordinator] if swarm.coordinator.alive() else []):
                swarm.kill(p, signal.SIGKILL)
                chaos.kills += 1
            wiped = time.time()
            chaos.dht.shutdown()
            swarm.start_coordinator()
            chaos.dht, chaos.directory, _, _ = connect_run(swarm.address, PeerSettings(host="127.0.0.1"))
            for name in chaos.stage_of:
                chaos.start("server", name)

            reports = {}

            def restored() -> bool:
                for k in range(chaos.num_stages):
                    done = [s.restored for s in chaos.directory.servers(k) if s.state == ServerState.ONLINE and s.restored]
                    if done and k not in reports:
                        reports[k] = done[0]
                        chaos.recoveries.append(round(time.time() - wiped, 2))
                return len(reports) == chaos.num_stages

            _wait(restored, 300, "every stage restored after the wipe", chaos.diagnose)
            final = {}
            exact = True
            for k in range(chaos.num_stages):
                report = reports[k]
                final[k] = report.shard_sha256
                exact &= report.bit_exact and report.shard_sha256 == newest[k][1]
                if report.shard_sha256 != newest[k][1]:
                    logger.warning("stage %d restored epoch %d, the newest committed was %s", k, report.epoch,
                                   newest[k][0])
            lost = chaos.lost_epochs(final)
            if lost or not exact:  # the peers' logs go with the work folder: say what they said of checkpoints
                logger.warning("the servers' checkpoint lines:\n%s", chaos.checkpoint_story())
            epochs = min(chaos.max_epochs.values())
        finally:
            chaos.dht.shutdown()
    rec = sorted(chaos.recoveries)
    return {
        "kills": chaos.kills, "epochs": epochs, "lost_epochs": lost,
        "recovery_s_median": round(statistics.median(rec), 2) if rec else None,
        "recovery_s_max": max(rec) if rec else None, "restored_bit_exact": bool(exact),
        "recoveries": rec, "committed_checkpoints": len(chaos.committed), "seconds": seconds,
        "final_epochs": {k: newest[k][0] for k in newest},
    }


def _wait(predicate, timeout: float, what: str, diagnose=lambda: "") -> None:
    """Poll ``predicate`` every 0.5 s; :class:`TimeoutError` after ``timeout`` seconds, with ``diagnose()``."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}\n{diagnose()}")
        time.sleep(0.5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=300.0, help="Seconds of chaos before the final wipe.")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--servers-per-stage", type=int, default=2)
    parser.add_argument("--trainers", type=int, default=2)
    parser.add_argument("--spec", type=Path, default=None, help="Run spec TOML (default: the built-in chaos spec).")
    parser.add_argument("--keep", action="store_true", help="Keep the work folder (logs).")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    result = run_chaos(args.seconds, seed=args.seed, per_stage=args.servers_per_stage, trainers=args.trainers,
                       cache_dir=PeerSettings().cache_dir,
                       spec=RunSpec.from_toml(args.spec) if args.spec else SPEC, keep=args.keep)
    print(json.dumps(result))
    keys = ("kills", "epochs", "lost_epochs", "recovery_s_median", "recovery_s_max", "restored_bit_exact")
    print(json.dumps({k: result[k] for k in keys}))


if __name__ == "__main__":
    main()
