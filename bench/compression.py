"""Bytes on the wire per averaging round and validation loss, for each compressor against uncompressed fp32.

    python bench/compression.py [--spec runs/demo.toml] [--rounds 100] [--rank 4] [--wire-rounds 3]

Bytes: real averagers (hivemind DHT, p2pd, matchmaking, :class:`~swarm.averaging.averager.
RobustGradientAverager`) of 3 peers on loopback average gradients shaped like the spec's largest stage;
``bytes_per_round`` is what one peer sent plus received in a round, counted at the transport
(``WireStats``), and ``ratio`` is the uncompressed run's bytes over the compressor's, both measured here.
Audits are off for the byte count (with ``audit_probability`` p they add about p x one partition download per
phase, whatever the codec). Loss: the in-process harness (``bench/harness.py``; the same compressor code with its error feedback) trains
the spec's whole model with 4 peers for ``rounds`` epochs on the same samples per compressor;
``baseline_val_loss`` is the uncompressed run's.

Prints one JSON line last: ``{"results": [{"compressor", "bytes_per_round", "ratio", "val_loss",
"baseline_val_loss"}]}``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from harness import train  # noqa: E402

from swarm.averaging.averager import AveragingRules, RobustGradientAverager  # noqa: E402
from swarm.averaging.compression import make_compressor  # noqa: E402
from swarm.config import RunSpec  # noqa: E402
from swarm.directory import spawn_dht  # noqa: E402
from swarm.identity import Identity  # noqa: E402
from swarm.model import build_stage  # noqa: E402

COMPRESSORS = ("none", "float16", "blockwise8bit", "powersgd")


def wire_bytes(shapes, compression: str, rank: int, rounds: int, peers: int = 3) -> float:
    """Mean bytes (sent + received) per peer per round, counted by the transport of real averagers."""
    kw = dict(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], use_relay=False, use_auto_relay=False)
    keys, dhts, avs = [Identity.generate() for _ in range(peers)], [], []
    try:
        for key in keys:
            dhts.append(spawn_dht(key, initial_peers=[str(m) for m in dhts[0].get_visible_maddrs()] if dhts else [],
                                  **kw))
        for key, dht in zip(keys, dhts):
            params = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
            avs.append(RobustGradientAverager(params, dht=dht, prefix=f"bench-{compression}", identity=key,
                                              rules=AveragingRules(audit_probability=0.0),
                                              compressor=make_compressor(compression, rank=rank),
                                              target_group_size=peers, min_matchmaking_time=2.0,
                                              request_timeout=1.0, allreduce_timeout=60, start=True))
        gen = torch.Generator().manual_seed(0)
        for _ in range(rounds):
            for av in avs:
                for p in av.parameters:
                    p.grad = torch.randn(p.shape, generator=gen) * 1e-3
                av.accumulate_grads_(batch_size=8)
            controls = [av.step(wait=False, timeout=60) for av in avs]
            sizes = [len(c.result()) for c in controls]
            if sizes != [peers] * peers:
                raise RuntimeError(f"a round formed groups of {sizes}, expected {peers}")
            for av in avs:
                av.notify_used_averaged_gradients()
        totals = [av.wire.snapshot() for av in avs]
        return sum(t["sent"] + t["received"] for t in totals) / peers / rounds
    finally:
        for av in avs:
            av.shutdown()
        for dht in dhts:
            dht.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spec", type=Path, default=ROOT / "runs" / "demo.toml")
    ap.add_argument("--rounds", type=int, default=100, help="training epochs per compressor (harness)")
    ap.add_argument("--wire-rounds", type=int, default=3, help="averaging rounds measured on the wire")
    ap.add_argument("--rank", type=int, default=4, help="PowerSGD rank")
    ap.add_argument("--compressors", default=",".join(COMPRESSORS))
    ap.add_argument("--cache-dir", type=Path, default=Path(os.environ.get("SWARM_CACHE_DIR", ROOT / ".test-cache")))
    args = ap.parse_args()
    spec = RunSpec.from_toml(args.spec)
    stages = [build_stage(spec.model, k) for k in range(spec.model.num_stages)]
    largest = max(stages, key=lambda m: sum(p.numel() for p in m.parameters()))
    shapes = [tuple(p.shape) for p in largest.parameters()]
    names = args.compressors.split(",")
    rows = {}
    for name in ["none"] + [n for n in names if n != "none"]:
        b = wire_bytes(shapes, name, args.rank, args.wire_rounds)
        r = train(spec, args.cache_dir, peers=4, aggregator="mean", compression=name, rank=args.rank,
                  rounds=args.rounds)
        rows[name] = {"compressor": name if name != "powersgd" else f"powersgd{args.rank}",
                      "bytes_per_round": int(b), "val_loss": round(r.val_loss, 4)}
        print(json.dumps(rows[name] | {"seconds": round(r.seconds, 1)}), file=sys.stderr, flush=True)
    base = rows["none"]
    results = [row | {"ratio": round(base["bytes_per_round"] / row["bytes_per_round"], 2),
                      "baseline_val_loss": base["val_loss"]} for row in rows.values()]
    print(json.dumps({"results": results}))


if __name__ == "__main__":
    main()
