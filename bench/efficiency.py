"""Where a local swarm's CPU goes: the share in the model's forward and backward, and the rest by process kind.

    python bench/efficiency.py [--spec runs/demo.toml] [--servers-per-stage 2] [--trainers 2] [--idle 30]
                               [--warmup 30] [--window 60] [--local-samples 512] [--precision auto]
                               [--logs DIR] [--no-early-start]

1. **Local**: the same model trained in one process on this machine's cores (:func:`swarm.reference.train_reference`,
   ``--local-samples`` samples), before the swarm starts and again after it stopped: ``local_tokens_per_s`` is the
   faster of the two (``local_runs``), since other load on the machine only slows a run down.
2. **Idle**: a coordinator and ``servers_per_stage`` servers per stage on loopback, no trainer, for ``--idle``
   seconds: ``idle_server_cores``, the CPU an idle server uses with its DHT, averager and p2pd processes (cores:
   CPU seconds per second; the mean over the servers, and the most).
3. **Training**: ``--trainers`` trainers join; after ``--warmup`` seconds a ``--window`` of seconds is measured.
   ``cpu_s`` is the CPU seconds of every process of the swarm in the window by kind (:mod:`bench.procstat`);
   ``useful_fraction`` is the servers' CPU in the stage's training forward and backward
   (:attr:`~swarm.protocol.ServerInfo.compute_s`, measured in-process, as a rate between the servers' records)
   over the swarm's CPU rate; ``swarm_tokens_per_s`` is the trainers' tokens between their records, and
   ``swarm_over_local`` its ratio to the local run's.

Everything shares this machine's cores; the bench's own DHT client (it reads the records) is not counted. Prints
progress on stderr and one JSON line on stdout (the last line).
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import procstat  # noqa: E402
from bench.swarm_vs_local import wait  # noqa: E402
from coordinator.demo import pick_precision, start_servers  # noqa: E402
from coordinator.launch import LocalSwarm  # noqa: E402
from swarm.config import RunSpec  # noqa: E402
from swarm.settings import PeerSettings  # noqa: E402
from swarm.data import prepare_dataset  # noqa: E402
from swarm.host import keep_freed_memory  # noqa: E402
from swarm.net.dht import connect_run  # noqa: E402
from swarm.reference import train_reference  # noqa: E402

logger = logging.getLogger("bench.efficiency")


def measure_cpu(swarm: LocalSwarm, seconds: float) -> tuple[dict, float]:
    """CPU seconds by (leader pid, kind) over the next ``seconds``, and the seconds actually measured."""
    watched = procstat.swarm_leaders(swarm)
    first = procstat.sample(watched, time.monotonic())
    time.sleep(seconds)
    last = procstat.sample(watched, time.monotonic())
    return procstat.cpu_between(first, last), last.at - first.at


def rates(before: dict, after: dict, field: str) -> float:
    """Sum over the records present in both (key -> record) of ``field``'s growth per second of record time."""
    total = 0.0
    for key, old in before.items():
        new = after.get(key)
        if new is not None and new.time > old.time:
            total += max(0.0, getattr(new, field) - getattr(old, field)) / (new.time - old.time)
    return total


def records(directory, stages: int) -> tuple[dict, dict]:
    servers = {s.peer_id: s for g in directory.all_servers(stages).values() for s in g}
    return servers, {t.peer_id: t for t in directory.trainers()}


def spec_written(spec: RunSpec, folder: Path) -> Path:
    """``spec`` as a TOML file in ``folder`` (the peers read it)."""
    path = folder / "spec.toml"
    path.write_text(spec.to_toml())
    return path


def local_tokens_per_s(spec: RunSpec, dataset, samples: int) -> float:
    """Tokens/s of the model trained in one process on this machine's cores (``samples`` samples)."""
    local = train_reference(spec, dataset, max_samples=samples)
    logger.info("local: %.0f tokens/s (%s)", local.tokens / local.seconds, spec.training.precision)
    return local.tokens / local.seconds


def run(args) -> dict:
    spec = pick_precision(RunSpec.from_toml(args.spec), args.precision)
    if args.no_early_start:
        spec = spec.model_copy(update={"averaging": spec.averaging.model_copy(update={"early_start": False})})
    cache_dir = PeerSettings().cache_dir
    dataset = prepare_dataset(spec, cache_dir)
    local_runs = [local_tokens_per_s(spec, dataset, args.local_samples)]
    stages = spec.model.num_stages
    with tempfile.TemporaryDirectory(prefix="swarm-efficiency-") as workdir, \
            LocalSwarm(spec_written(spec, Path(workdir)), Path(workdir) / "swarm", cache_dir) as swarm:
        dht, directory, _, _ = connect_run(swarm.start_coordinator(), PeerSettings(host="127.0.0.1"),
                                           client_mode=True)
        try:
            start_servers(swarm, directory, stages, args.servers_per_stage)
            time.sleep(10.0)  # the servers' start-up work (first records, state downloads) is over
            idle, idle_s = measure_cpu(swarm, args.idle)
            servers = [p.proc.pid for p in swarm.peers if p.role == "server"]
            idle_cores = [sum(procstat.by_kind(idle, [pid]).values()) / idle_s for pid in servers]
            logger.info("idle servers: %s cores", [round(c, 3) for c in idle_cores])
            for share in range(args.trainers):
                swarm.start_peer("trainer", "--share", str(share))
            wait(lambda: sum(t.tokens for t in directory.trainers()) > 0, 300, "the trainers' first tokens")
            time.sleep(args.warmup)
            before = records(directory, stages)
            used, window_s = measure_cpu(swarm, args.window)
            after = records(directory, stages)
        finally:
            dht.shutdown()
            if args.logs is not None:  # the peers' logs, for their epoch lines (step_s, round_s)
                shutil.copytree(swarm.workdir / "logs", args.logs, dirs_exist_ok=True)
    local_runs.append(local_tokens_per_s(spec, dataset, args.local_samples))
    local_tps = max(local_runs)  # the less disturbed of the two (a machine's other load only slows a run down)
    cpu = procstat.by_kind(used)
    total = sum(cpu.values())
    compute_rate = rates(before[0], after[0], "compute_s")
    tokens_rate = rates(before[1], after[1], "tokens")
    return {
        "useful_fraction": round(compute_rate / (total / window_s), 3) if total else None,
        "swarm_over_local": round(tokens_rate / local_tps, 3),
        "swarm_tokens_per_s": round(tokens_rate, 1),
        "local_tokens_per_s": round(local_tps, 1), "local_runs": [round(x, 1) for x in local_runs],
        "cores_used": round(total / window_s, 3),
        "compute_cores": round(compute_rate, 3),
        "cpu_share": {k: round(v / total, 3) for k, v in cpu.items()} if total else {},
        "cpu_s": {k: round(v, 1) for k, v in cpu.items()},
        "idle_server_cores": {"mean": round(sum(idle_cores) / len(idle_cores), 4), "max": round(max(idle_cores), 4)},
        "window_s": round(window_s, 1), "precision": spec.training.precision,
        "servers_per_stage": args.servers_per_stage, "trainers": args.trainers, "stages": stages,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--spec", type=Path, default=ROOT / "runs" / "demo.toml")
    parser.add_argument("--servers-per-stage", type=int, default=2)
    parser.add_argument("--trainers", type=int, default=2)
    parser.add_argument("--idle", type=float, default=30.0, help="seconds the idle servers are measured")
    parser.add_argument("--warmup", type=float, default=30.0, help="seconds of training before the window")
    parser.add_argument("--window", type=float, default=60.0, help="seconds of training measured")
    parser.add_argument("--local-samples", type=int, default=512, help="samples the one-process baseline trains")
    parser.add_argument("--no-early-start", action="store_true", help="[averaging] early_start = false")
    parser.add_argument("--logs", type=Path, default=None, help="copy the peers' logs into this folder")
    parser.add_argument("--precision", choices=("auto", "fp32", "bf16"), default="auto",
                        help="as `swarm-coordinator demo --precision`")
    args = parser.parse_args()
    keep_freed_memory()  # as every peer does: the one-process baseline allocates the same way
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")
    print(json.dumps(run(args)), flush=True)


if __name__ == "__main__":
    main()
