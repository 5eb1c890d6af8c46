"""The run's records at the size of a public run: what one read of a stage returns, and what ``status`` costs.

    python bench/records.py [--servers-per-stage 300] [--trainers 100] [--baseline 2] [--nodes 3] [--stripe-bits 2]

Starts ``--nodes`` hivemind DHT nodes on loopback (real p2pd), stores the records of a run of 2 stages x
``--servers-per-stage`` servers and ``--trainers`` trainers in them (each record signed by its own key, as full
as a long-running peer's: 8 state digests, a progress key, a 64-point history), and, from a fresh client node:

* ``stage_read_kb``: the sealed server records one read of a stage returns (what every server and trainer of
  the stage reads every few seconds), and ``history_kb``: the servers' histories, which until protocol 8 were
  part of those records and are now a record of their own that only monitors read; with ``--stripe-bits`` the
  large run spreads each stage's records over ``2^bits`` keys (``[records] stage_stripe_bits``), a read looks them
  all up at once, and ``stripe_read_kb_max`` is the largest one key's nodes return (on these few local nodes every
  node holds every key: what the spreading saves the DHT's nodes is counted by ``bench/simulate.py``);
* ``stage_read_s``: one read of a stage (the DHT lookup, signature checks, parsing), the median of 5 reads of
  records already verified once (a peer re-reads the same records; :data:`swarm.protocol.schema.VERIFIED_KEPT`)
  and ``stage_first_read_s``: the first read, every signature checked;
* ``snapshot_s``: :func:`coordinator.status.snapshot` (every record of the run, read concurrently, and the
  summary ``status --json`` prints) and ``table_s``: the tables of ``status`` drawn with ``--top 40``.

The same figures at ``--baseline`` servers per stage (trainers scaled alike) come first; the last stdout line is
one JSON object ``{"runs": [baseline, large], "growth": {figure: large / baseline}}``. What it leaves out: the
peers' own traffic (``bench/scale.py`` measures a live swarm) and the cold start of a ``status`` process.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import hivemind  # noqa: E402
from hivemind.utils import get_dht_time  # noqa: E402
from rich.console import Console  # noqa: E402

from coordinator.status import snapshot  # noqa: E402
from coordinator.views import render  # noqa: E402
from swarm.config import RunSpec  # noqa: E402
from swarm.identity import Identity  # noqa: E402
from swarm.net.directory import RunDirectory  # noqa: E402
from swarm.protocol import (  # noqa: E402
    HISTORY_POINTS, ServerHistory, ServerInfo, ServerState, TrainerInfo, history_key, stage_keys)

RUN = "tiny-aaaaaaaaaaaaaaaa"
TTL_S = 600.0


def _node(initial_peers=(), client_mode: bool = False) -> hivemind.DHT:
    return hivemind.DHT(start=True, initial_peers=list(initial_peers), host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                        client_mode=client_mode, use_relay=False, use_auto_relay=False)


def _server(ident: Identity, stage: int, now: float, i: int) -> tuple[ServerInfo, ServerHistory]:
    info = ServerInfo(
        run_id=RUN, peer_id=ident.peer_id, time=now, stage=stage, state=ServerState.ONLINE, throughput=10.0 + i,
        p2p_id=ident.p2p_id, maddrs=[f"/ip4/10.0.{i // 250}.{i % 250}/tcp/31337/p2p/{ident.p2p_id}"], epoch=500,
        samples=100_000 + i, compute_s=3000.0, loss=3.2, peers_in_last_round=8, round_s=0.8, rounds=500,
        state_digests={e: f"{e:064x}" for e in range(493, 501)}, version="0.1.0", averaging={"sent": 10**9,
        "received": 10**9, "failed": 3, "rejected": 1, "flagged": 2, "groups": 1000, "group_members": 4000},
        lineage="f" * 64, progress_key="ab" * 389, name=f"volunteer-{i}")
    curve = [(e * 8, now - 4000 + e * 60, 5.0 - e / 40) for e in range(HISTORY_POINTS)]
    return info, ServerHistory(run_id=RUN, peer_id=ident.peer_id, time=now, stage=stage, history=curve)


def publish(directory: RunDirectory, per_stage: int, trainers: int) -> None:
    """Store the records of a run of 2 stages x ``per_stage`` servers and ``trainers`` trainers."""
    now = get_dht_time()
    for stage in range(2):
        for i in range(per_stage):
            ident = Identity.generate()
            info, history = _server(ident, stage, now, i)
            if not (directory.announce_server(info, ident) and directory.announce_history(history, ident)):
                raise RuntimeError(f"the DHT did not take the records of server {i} of stage {stage}")
    for i in range(trainers):
        ident = Identity.generate()
        record = TrainerInfo(run_id=RUN, peer_id=ident.peer_id, time=now, samples=10**5, samples_per_s=20.0,
                             tokens=3 * 10**6, share=i % 4, loss=3.3)
        if not directory.announce_trainer(record, ident):
            raise RuntimeError(f"the DHT did not take the record of trainer {i}")


def _sealed_kb(dht: hivemind.DHT, key: str) -> float:
    found = dht.get(key, latest=True)
    return round(sum(len(v.value) for v in found.value.values()) / 1024, 1) if found is not None else 0.0


def measure(per_stage: int, trainers: int, nodes: int, stripe_bits: int = 0) -> dict:
    """The module docstring's figures for one run size, on fresh DHT nodes, its stages' records spread over
    ``2^stripe_bits`` keys."""
    spec = RunSpec.from_toml(ROOT / "runs" / "tiny.toml").updated(records={"stage_stripe_bits": stripe_bits})
    first = _node()
    others = [_node(first.get_visible_maddrs()) for _ in range(nodes - 1)]
    client = _node(first.get_visible_maddrs(), client_mode=True)
    try:
        publish(RunDirectory(first, RUN, ttl=TTL_S, stage_stripe_bits=stripe_bits), per_stage, trainers)
        reader = RunDirectory(client, RUN, ttl=TTL_S, stage_stripe_bits=stripe_bits)
        began = time.perf_counter()
        found = reader.servers(0)
        first_read_s = time.perf_counter() - began
        reads = []
        for _ in range(5):
            began = time.perf_counter()
            found = reader.servers(0)
            reads.append(time.perf_counter() - began)
        began = time.perf_counter()
        snap = snapshot(reader, spec)
        snapshot_s = time.perf_counter() - began
        began = time.perf_counter()
        render(snap, "status", Console(file=open("/dev/null", "w"), width=200), top=40)
        table_s = time.perf_counter() - began
        return {
            "servers_per_stage": per_stage, "trainers": trainers, "servers_read": len(found),
            "peers_listed": len(snap["peers"]),
            "stripe_bits": stripe_bits,
            "stage_read_kb": round(sum(stripes := [_sealed_kb(client, key) for key in stage_keys(RUN, 0, stripe_bits)]), 1),
            "stripe_read_kb_max": max(stripes),
            "history_kb": _sealed_kb(client, history_key(RUN, 0)),
            "stage_first_read_s": round(first_read_s, 3), "stage_read_s": round(statistics.median(reads), 3),
            "snapshot_s": round(snapshot_s, 3), "table_s": round(table_s, 3),
        }
    finally:
        for node in (client, *others, first):
            node.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--servers-per-stage", type=int, default=300)
    parser.add_argument("--trainers", type=int, default=100)
    parser.add_argument("--baseline", type=int, default=2, help="servers per stage of the baseline run")
    parser.add_argument("--nodes", type=int, default=3, help="DHT nodes that hold the records")
    parser.add_argument("--stripe-bits", type=int, default=0, help="[records] stage_stripe_bits of the large run "
                        "(the baseline keeps one key a stage)")
    args = parser.parse_args()
    scaled = max(1, round(args.trainers * args.baseline / args.servers_per_stage))
    runs = [measure(args.baseline, scaled, args.nodes),
            measure(args.servers_per_stage, args.trainers, args.nodes, args.stripe_bits)]
    for run in runs:
        print(json.dumps(run), file=sys.stderr, flush=True)
    base, large = runs
    growth = {k: round(large[k] / base[k], 1) for k in ("stage_read_kb", "stage_read_s", "snapshot_s", "table_s")
              if base[k]}
    print(json.dumps({"runs": runs, "growth": growth}), flush=True)


if __name__ == "__main__":
    main()
