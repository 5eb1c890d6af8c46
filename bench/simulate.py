"""The swarm's mechanisms at 1,000 and 10,000 peers, in one process on a simulated clock.

    python bench/simulate.py --peers 1000 [--spec runs/large.toml] [--hours 1] [--churn 0.3] [--byzantine 0.2]
    python bench/simulate.py --peers 1000 --set averaging.mode=outer --set averaging.inner_steps=100
    python bench/simulate.py --servers-per-stage 6 --trainers 4 --spec runs/tiny.toml --group-size 4 --links loopback
        --churn 0 --byzantine 0 --leave-at-h 0
        (the size of a real bench/scale.py run, to compare the two)

The project's own code decides: stage choice, rebalancing (``plan_moves``, ``MovePlanner``), the round's grid
and each server's check of its group (``GroupPlan``, ``whole_enough``), routing (``Router``, ``is_fresh``), read
cadences (``read_period_s``), checkpoint writers, placement and restorability (``writer_of``, ``choose_holders``,
``checkpoint_views``, ``newest_restorable``). What is simulated around it (:mod:`bench.sim`): the population
(GPU mix, links from the WAN lab's profiles, churn, Byzantine servers), the DHT (counted traffic, no network),
matchmaking (a lane forms from the servers that computed its key), compute and transfer times. Peers: 80%
servers, 20% trainers unless given.

Last stdout line: one JSON object with ``peers`` and the figures: ``throughput_vs_ideal`` (samples/s over what
the same servers would compute perfectly balanced with free links), ``tokens_per_s``, ``epochs``,
``round_success`` (server-rounds that completed every hop), ``rounds_corrupted`` (of the honest servers' completed
rounds, those whose aggregate came from a lane with half or more Byzantine votes, a corrupted block counting as one) and, with
``--grind K``, ``rounds_corrupted_targeted`` (the same in the round of the epoch the attackers ground keys for), ``hops``, ``lane_size_mean``, ``dht_msgs_per_peer_epoch``
and ``dht_kb_per_peer_epoch`` by role, ``hot_node_mb_per_min`` (what each of the nodes holding the busiest stage key serves),
``averaging_mb_per_server_epoch``, ``activation_mb_per_epoch`` (the whole swarm's), ``restorable`` (fraction of
stage-ticks with a restorable checkpoint), ``lag_epochs_p99``, ``rebalance_s`` after 10% of the servers leave at
once (the first stages' first), ``sim_wall_s``.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.records import _server  # noqa: E402
from bench.sim.dht import REPLICAS  # noqa: E402
from bench.sim.run import Options, Simulation, rebalance_s  # noqa: E402
from swarm.config import RunSpec  # noqa: E402
from swarm.identity import Identity  # noqa: E402
from swarm.kernels.flops import stage_flops_per_token  # noqa: E402
from swarm.model.gpt import build_stage  # noqa: E402
from swarm.protocol import seal  # noqa: E402

WIRE_BYTES = {"none": 4.0, "float16": 2.0, "blockwise8bit": 1.03, "blockwise4bit": 0.53, "blockwise3bit": 0.41}
"""Bytes per element on the wire by codec (8/4/3-bit blockwise: the codes plus one fp32 scale per 128 elements)."""


def sizes(spec: RunSpec) -> dict:
    """Per stage: training FLOPs per sample, state bytes (fp32 parameters + AdamW's two moments), averaged vector
    bytes on the wire; one sample's activation bytes at a boundary; one sealed server record's bytes."""
    with torch.device("meta"):
        params = [sum(p.numel() for p in build_stage(spec.model, k).parameters()) for k in range(spec.model.num_stages)]
    seq = spec.data.seq_len
    wire = WIRE_BYTES.get(spec.averaging.compression, 2.0)
    ident = Identity.generate()
    info, _ = _server(ident, 0, time.time(), 0)
    return {"demand": [stage_flops_per_token(spec.model, k, seq) * seq for k in range(spec.model.num_stages)],
            "state_bytes": [12.0 * n for n in params], "vector_bytes": [wire * n for n in params],
            "activation_bytes": seq * spec.model.d_model * WIRE_BYTES[spec.training.activation_compression],
            "record_bytes": float(len(seal(info.model_copy(update={"run_id": "sim"}), ident)))}


def _q(values: list[float], q: float):
    values = sorted(values)
    return float(f"{values[int(q * (len(values) - 1))]:.3g}") if values else None


def summarize(sim: Simulation, opts: Options, wall_s: float) -> dict:
    t, tr = sim.tally, sim.traffic
    epochs = max(t.epochs, 1e-9)
    peers = {"server": opts.servers, "trainer": opts.trainers}
    per = {role: {"msgs": tr.messages[role] / max(1, peers[role]) / epochs,
                  "kb": tr.bytes[role] / 1e3 / max(1, peers[role]) / epochs} for role in peers}
    minutes = opts.hours * 60
    lag = t.lag_epochs
    return {
        "peers": opts.servers + opts.trainers, "servers": opts.servers, "trainers": opts.trainers,
        "stages": sim.spec.model.num_stages, "group_size": sim.spec.averaging.group_size, "hours": opts.hours,
        "churn_per_h": opts.churn_per_h, "byzantine": opts.byzantine,
        "throughput_vs_ideal": float(f"{t.samples / max(t.ideal_samples, 1e-9):.3g}"),
        "tokens_per_s": round(t.samples * sim.spec.data.seq_len / (opts.hours * 3600), 1),
        "epochs": round(t.epochs, 1),
        "round_success": round(t.rounds_ok / t.rounds, 4) if t.rounds else None,
        "rounds_corrupted": round(t.rounds_corrupted / t.rounds_honest, 4) if t.rounds_honest else None,
        "rounds_corrupted_targeted": round(t.targeted_corrupted / t.targeted_honest, 4) if t.targeted_honest
        else None,
        "round_failures": {c: round(n / max(t.rounds, 1e-9), 4) for c, n in t.causes.most_common(4)},
        "round_s_p50": _q(t.round_s, 0.5), "round_s_p99": _q(t.round_s, 0.99),
        "epoch_s_p50": _q([e for e in t.epoch_s if math.isfinite(e)], 0.5),
        "hops": dict(t.hops), "lane_size_mean": round(statistics.fmean(t.lane_sizes.elements()), 2)
        if t.lane_sizes else None,
        "dht_msgs_per_peer_epoch": {r: round(v["msgs"], 1) for r, v in per.items()},
        "dht_kb_per_peer_epoch": {r: round(v["kb"], 1) for r, v in per.items()},
        "dht_calls_per_server_s": round(tr.calls["server"] / max(1, opts.servers) / (minutes * 60), 2),
        "dht_kb_per_peer_min": {r: round(tr.bytes[r] / 1e3 / max(1, peers[r]) / minutes, 1) for r in peers},
        "hot_node_mb_per_min": round(max(tr.key_bytes.values(), default=0.0) / REPLICAS / 1e6 / minutes, 2),
        "stage_read_kb": round(opts.servers / sim.spec.model.num_stages * tr.record_bytes / 1e3, 1),
        "averaging_mb_per_server_epoch": round(t.averaging_bytes / max(t.rounds, 1e-9) / 1e6, 3),
        "activation_mb_per_epoch": round(sim.batch * 2 * (sim.spec.model.num_stages - 1) * sim.activation_bytes / 1e6, 1),
        "failed_picks": round(t.failed_picks / max(1, t.picks), 4),
        "restorable": round(t.restorable_ticks / t.stage_ticks, 4) if t.stage_ticks else None,  # None: none written
        "lag_epochs_p99": _q(lag, 0.99),
        "checkpoint_writers": len(sim.shards.writers), "fragments_repaired": sim.shards.repaired,
        "moves": t.moves, **rebalance_s(t.balance, opts.leave_at_s), "sim_wall_s": round(wall_s, 1),
    }


def spec_with(spec: RunSpec, changes: list[str]) -> RunSpec:
    """``spec`` with ``SECTION.FIELD=VALUE`` changes (``VALUE`` read as JSON, else a string) applied in order.

    :raises pydantic.ValidationError: a change the spec's validation refuses."""
    for change in changes:
        name, _, value = change.partition("=")
        section, _, key = name.partition(".")
        try:
            value = json.loads(value)
        except ValueError:
            pass  # a string
        spec = spec.updated(**{section: {key: value}})
    return spec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--peers", type=int, default=1000)
    ap.add_argument("--servers-per-stage", type=int, default=0, help="instead of --peers: servers per stage")
    ap.add_argument("--trainers", type=int, default=-1, help="trainers (default: 20%% of --peers)")
    ap.add_argument("--spec", type=Path, default=ROOT / "runs" / "large.toml")
    ap.add_argument("--group-size", type=int, default=None)
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                    help="change the spec, e.g. --set averaging.mode=outer --set averaging.inner_steps=500")
    ap.add_argument("--hours", type=float, default=1.0)
    ap.add_argument("--tick-s", type=float, default=30.0)
    ap.add_argument("--churn", type=float, default=0.3, help="fraction of the peers that leave per hour")
    ap.add_argument("--byzantine", type=float, default=0.2, help="fraction of the servers that are Byzantine")
    ap.add_argument("--leave-at-h", type=float, default=None, help="when 10%% of the servers leave (default: mid-run)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--grind", type=int, default=0, help="keys each Byzantine server tries to sort first in the grid "
                    "of one chosen epoch (its seed is known in advance); adds rounds_corrupted_targeted")
    ap.add_argument("--server-flops", type=float, default=None,
                    help="every server's FLOP/s instead of the GPU mix (1.3e9: a tiny-spec server on this 2-core host "
                         "at 2 x 2 + 2, from bench/scale.py's 5024 tokens/s)")
    ap.add_argument("--links", choices=["mix", "loopback"], default="mix",
                    help="mix: the WAN lab's datacenter/wan/home profiles; loopback: one host (as bench/scale.py)")
    args = ap.parse_args()
    spec = RunSpec.from_toml(args.spec)
    if args.group_size is not None:
        spec = spec.updated(averaging={"group_size": args.group_size})
    spec = spec_with(spec, args.set)
    stages = spec.model.num_stages
    servers = args.servers_per_stage * stages if args.servers_per_stage else round(0.8 * args.peers)
    trainers = args.trainers if args.trainers >= 0 else (round(0.2 * args.peers) if not args.servers_per_stage else 1)
    leave = args.hours / 2 if args.leave_at_h is None else args.leave_at_h
    opts = Options(servers=servers, trainers=trainers, hours=args.hours, tick_s=args.tick_s, churn_per_h=args.churn,
                   byzantine=args.byzantine, leave_at_s=leave * 3600 if leave > 0 else math.inf, seed=args.seed,
                   links=args.links, server_flops=args.server_flops, grind=args.grind)
    started = time.monotonic()
    sim = Simulation(spec, opts, **sizes(spec))
    sim.run()
    print(json.dumps(summarize(sim, opts, time.monotonic() - started)))


if __name__ == "__main__":
    main()
