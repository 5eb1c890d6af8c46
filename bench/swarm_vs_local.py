"""The same model and the same number of tokens, trained in one process and through a local swarm.

    python bench/swarm_vs_local.py [--spec runs/demo.toml] [--samples 512] [--servers-per-stage 2] [--trainers 2]
                                   [--modes synchronous,overlapped]

Local: :func:`swarm.reference.train_reference` (all stages chained in one process, torch's default threads).
Swarm: a coordinator, ``servers_per_stage`` servers per stage and ``trainers`` trainers as separate processes on
loopback, the trainers splitting ``samples`` between them; timed from the trainers' start until both exit.
Both share this machine's cores, so ``ratio`` = swarm / local throughput is the cost of the swarm's
processes, RPCs and averaging rounds on one box, not a network figure.

Each of ``modes`` runs the swarm once on the same local baseline: ``synchronous`` (the spec's averaging as it is
written, with ``overlap_rounds`` off: each epoch's transition waits for its gradient round) and ``overlapped``
(``overlap_rounds`` on: :mod:`swarm.averaging.overlap`).

Prints one JSON line per mode: ``mode, local_tokens_per_s, swarm_tokens_per_s, ratio, avg_round_s`` (mean seconds of an
epoch transition on a server: matchmaking + all-reduce + optimizer step), ``bytes_per_round`` (bytes a
server sent plus received per gradient all-reduce phase, counted at the transport
and published in its ServerInfo), and the counts behind them.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from coordinator.launch import LocalSwarm  # noqa: E402
from swarm.config import RunSpec  # noqa: E402
from swarm.settings import PeerSettings  # noqa: E402
from swarm.data import prepare_dataset  # noqa: E402
from swarm.host import keep_freed_memory  # noqa: E402
from swarm.net.dht import connect_run  # noqa: E402
from swarm.protocol import ServerState  # noqa: E402
from swarm.reference import train_reference  # noqa: E402

def wait(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.5)


def run_swarm(spec_path: Path, spec: RunSpec, cache_dir: Path, samples: int, per_stage: int, trainers: int) -> dict:
    workdir = Path(tempfile.mkdtemp(prefix="swarm-bench-"))
    with LocalSwarm(spec_path, workdir, cache_dir) as swarm:
        address = swarm.start_coordinator()
        dht, directory, _, _ = connect_run(address, PeerSettings(host="127.0.0.1"))
        try:
            stages = spec.model.num_stages
            for i in range(stages * per_stage):
                stage = i % stages
                peer = swarm.start_peer("server", "--stage", str(stage))
                wait(lambda pid=peer.peer_id, k=stage: any(s.peer_id == pid and s.state == ServerState.ONLINE
                                                          for s in directory.servers(k)), 180, f"{peer.name} online")
            share = samples // trainers
            start = time.monotonic()
            procs = [swarm.start_peer("trainer", "--share", str(k), "--max-samples", str(share))
                     for k in range(trainers)]
            wait(lambda: all(not p.alive() for p in procs), 3600, "trainers to finish")
            seconds = time.monotonic() - start
            servers = [s for g in directory.all_servers(stages).values() for s in g]
            tokens = sum(t.tokens for t in directory.trainers())
        finally:
            dht.shutdown()
    rounds = [s for s in servers if s.rounds]
    wire = sum(s.averaging.get("sent", 0) + s.averaging.get("received", 0) for s in servers)
    phases = sum(s.averaging.get("phases", 0) for s in servers)
    return {
        "seconds": seconds, "tokens": tokens,
        "bytes_per_phase": wire / phases if phases else 0.0,
        "avg_round_s": sum(s.round_s * s.rounds for s in rounds) / max(1, sum(s.rounds for s in rounds)),
        "epochs": min(s.epoch for s in servers) if servers else 0,
    }


MODES = {"synchronous": {"overlap_rounds": False}, "overlapped": {"overlap_rounds": True}}
"""Mode name -> the ``[averaging]`` settings it overrides in the spec."""


def spec_for_mode(spec: RunSpec, mode: str, workdir: Path) -> tuple[Path, RunSpec]:
    """The spec with ``mode``'s averaging settings, written as TOML under ``workdir``."""
    moded = spec.updated(averaging=MODES[mode])
    path = workdir / f"{spec.name}-{mode}.toml"
    path.write_text(moded.to_toml())
    return path, moded


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--spec", type=Path, default=ROOT / "runs" / "demo.toml")
    parser.add_argument("--samples", type=int, default=512)
    parser.add_argument("--servers-per-stage", type=int, default=2)
    parser.add_argument("--trainers", type=int, default=2)
    parser.add_argument("--modes", default="synchronous,overlapped",
                        help=f"comma-separated, of {list(MODES)}")
    args = parser.parse_args()
    keep_freed_memory()  # as every peer does: the one-process baseline allocates the same way
    modes = args.modes.split(",")
    if not set(modes) <= set(MODES):
        parser.error(f"--modes: unknown {sorted(set(modes) - set(MODES))}; choose from {list(MODES)}")
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)

    spec = RunSpec.from_toml(args.spec)
    cache_dir = PeerSettings().cache_dir
    dataset = prepare_dataset(spec, cache_dir)
    local = train_reference(spec, dataset, max_samples=args.samples)
    local_tps = local.tokens / local.seconds
    for mode in modes:
        with tempfile.TemporaryDirectory(prefix="swarm-bench-specs-") as workdir:
            path, moded = spec_for_mode(spec, mode, Path(workdir))
            swarm = run_swarm(path, moded, cache_dir, args.samples, args.servers_per_stage, args.trainers)
        swarm_tps = swarm["tokens"] / swarm["seconds"]
        print(json.dumps({
            "mode": mode,
            "local_tokens_per_s": round(local_tps, 1),
            "swarm_tokens_per_s": round(swarm_tps, 1),
            "ratio": round(swarm_tps / local_tps, 3),
            "avg_round_s": round(swarm["avg_round_s"], 3),
            "bytes_per_round": int(swarm["bytes_per_phase"]),
            "tokens": {"local": local.tokens, "swarm": swarm["tokens"]},
            "epochs": {"local": local.epochs, "swarm": swarm["epochs"]},
            "servers_per_stage": args.servers_per_stage, "trainers": args.trainers, "stages": spec.model.num_stages,
            "final_loss_local": round(sum(local.losses[-8:]) / len(local.losses[-8:]), 4),
        }), flush=True)

if __name__ == "__main__":
    main()
