"""Bytes on the wire per averaging round and validation loss, for each compressor against uncompressed fp32.

    python bench/compression.py [--spec runs/demo.toml] [--rounds 100] [--rank 4] [--wire-rounds 3]
                                [--rows per_epoch:none,...,outer10:chunk_topk]
                                [--topk-fraction F --topk-bits B --topk-chunk C] [--outer-momentum M --outer-lr LR]

Bytes: real averagers (hivemind DHT, p2pd, matchmaking, :class:`~swarm.averaging.averager.
RobustGradientAverager`) of 3 peers on loopback average gradients shaped like the spec's largest stage;
``bytes_per_round`` is what one peer sent plus received in a round, counted at the transport
(``WireStats``), and ``ratio`` is the uncompressed run's bytes over the compressor's, both measured here.
Audits are off for the byte count (with ``audit_probability`` p they add about p x one partition download per
phase, whatever the codec). Loss: the in-process harness (``bench/harness.py``; the same compressor code with its error feedback) trains
the spec's whole model with 4 peers for ``rounds`` epochs on the same samples per compressor;
``baseline_val_loss`` is the uncompressed run's.

A row is a mode and a compressor: ``per_epoch:<compressor>`` averages gradients every epoch; ``outer<H>:<compressor>``
runs outer steps (DiLoCo, :mod:`swarm.averaging.outer`) with ``H`` inner steps, each peer's inner step on its share
of the epoch's samples, so every row trains the same tokens (``rounds`` epochs or inner steps); its schedule's
warm-up and length are divided by ``H`` (they count outer steps). ``bytes_per_token`` is the wire bytes of one
round (per peer, measured as above) times the harness's peers, over the tokens the stage trains between two
rounds; ``ratio`` is ``per_epoch:none``'s bytes per token over the row's; ``reference_val_loss`` is
``per_epoch:none``'s loss (with the mean aggregator and fp32 the harness's peers step exactly as one process
running AdamW on the same samples), and ``baseline_val_loss`` too (the name earlier runs used).

Prints one JSON line last: ``{"results": [{"mode", "inner_steps", "compressor", "bytes_per_round",
"bytes_per_token", "ratio", "val_loss", "baseline_val_loss", "reference_val_loss"}]}``.
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

from harness import outer_spec, train  # noqa: E402

from swarm.averaging.averager import AveragingRules, RobustGradientAverager  # noqa: E402
from swarm.averaging.compression import make_compressor  # noqa: E402
from swarm.config import RunSpec  # noqa: E402
from swarm.net.dht import spawn_dht  # noqa: E402
from swarm.identity import Identity  # noqa: E402
from swarm.model import build_stage  # noqa: E402

COMPRESSORS = ("none", "float16", "blockwise8bit", "powersgd", "topk", "chunk_topk")
ROWS = ",".join([f"per_epoch:{c}" for c in COMPRESSORS] + ["outer10:none", "outer10:topk", "outer10:chunk_topk"])
HARNESS_PEERS = 4


def wire_bytes(shapes, compression: str, rank: int, rounds: int, peers: int = 3, **topk) -> float:
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
                                              compressor=make_compressor(compression, rank=rank, **topk),
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


def parse_row(row: str) -> tuple[str, int, str]:
    """``per_epoch:<compressor>`` or ``outer<H>:<compressor>`` -> (mode, inner steps, compressor)."""
    mode, _, compressor = row.partition(":")
    if compressor not in COMPRESSORS or not (mode == "per_epoch" or (mode.startswith("outer") and mode[5:].isdigit())):
        raise SystemExit(f"bad row {row!r}: per_epoch:<compressor> or outer<H>:<compressor>, of {COMPRESSORS}")
    return ("outer", int(mode[5:]), compressor) if mode != "per_epoch" else ("per_epoch", 1, compressor)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spec", type=Path, default=ROOT / "runs" / "demo.toml")
    ap.add_argument("--rounds", type=int, default=100, help="epochs (or inner steps) per row (harness)")
    ap.add_argument("--wire-rounds", type=int, default=3, help="averaging rounds measured on the wire")
    ap.add_argument("--rank", type=int, default=4, help="PowerSGD rank")
    ap.add_argument("--rows", default=ROWS, help="comma-separated mode:compressor rows (per_epoch:none always runs)")
    ap.add_argument("--topk-fraction", type=float,
                    help="topk rows: fraction of chunks (chunk_topk: of each chunk's values) sent (default: the spec's)")
    ap.add_argument("--topk-bits", type=int, choices=[2, 3, 4], help="topk rows: bits per value (default: the spec's)")
    ap.add_argument("--topk-chunk", type=int, help="topk rows: values per chunk (default: the spec's)")
    ap.add_argument("--outer-momentum", type=float, help="outer rows: Nesterov momentum (default: the spec's)")
    ap.add_argument("--outer-lr", type=float, help="outer rows: outer learning rate (default: the spec's)")
    ap.add_argument("--cache-dir", type=Path, default=Path(os.environ.get("SWARM_CACHE_DIR", ROOT / ".test-cache")))
    args = ap.parse_args()
    spec = RunSpec.from_toml(args.spec)
    overrides = {"topk_fraction": args.topk_fraction, "topk_bits": args.topk_bits, "topk_chunk": args.topk_chunk,
                 "outer_momentum": args.outer_momentum, "outer_lr": args.outer_lr}
    spec = spec.updated(averaging={k: v for k, v in overrides.items() if v is not None})
    stages = [build_stage(spec.model, k) for k in range(spec.model.num_stages)]
    largest = max(stages, key=lambda m: sum(p.numel() for p in m.parameters()))
    shapes = [tuple(p.shape) for p in largest.parameters()]
    rows = [parse_row(r) for r in dict.fromkeys(["per_epoch:none"] + args.rows.split(","))]
    avg, wire, results = spec.averaging, {}, []
    topk = dict(fraction=avg.topk_fraction, chunk=avg.topk_chunk, bits=avg.topk_bits)
    per_peer = max(1, spec.training.target_batch_size // (spec.training.micro_batch_size * HARNESS_PEERS))
    epoch_tokens = per_peer * spec.training.micro_batch_size * HARNESS_PEERS * spec.data.seq_len
    for mode, inner_steps, name in rows:
        if name not in wire:
            wire[name] = wire_bytes(shapes, name, args.rank, args.wire_rounds, **(topk if "topk" in name else {}))
        r = train(spec if mode == "per_epoch" else outer_spec(spec, inner_steps), args.cache_dir, peers=HARNESS_PEERS, aggregator="mean",
                  compression=name, rank=args.rank, rounds=args.rounds)
        row = {"mode": mode, "inner_steps": inner_steps,
               "compressor": {"powersgd": f"powersgd{args.rank}", "topk": f"topk{avg.topk_bits}bit",
                               "chunk_topk": f"chunk_topk{avg.topk_bits}bit"}.get(name, name),
               "bytes_per_round": int(wire[name]),
               "bytes_per_token": wire[name] * HARNESS_PEERS / (epoch_tokens * inner_steps),
               "val_loss": round(r.val_loss, 4)}
        print(json.dumps(row | {"seconds": round(r.seconds, 1)}), file=sys.stderr, flush=True)
        results.append(row)
    base = results[0]
    for row in results:
        row |= {"ratio": round(base["bytes_per_token"] / row["bytes_per_token"], 1),
                "bytes_per_token": round(row["bytes_per_token"], 4),
                "baseline_val_loss": base["val_loss"], "reference_val_loss": base["val_loss"]}
    print(json.dumps({"results": results}))

if __name__ == "__main__":
    main()
