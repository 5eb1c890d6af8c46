"""Attacks x aggregators with 2 of 7 peers Byzantine: final validation loss next to the clean run's.

    python bench/robustness.py [--rounds 100] [--attacks sign_flip,noise,...] [--aggregators mean,centered_clip]

Runs the in-process harness (``bench/harness.py``: the real compressor, reducer, aggregator, exclusion and attack
code with the network taken out) on a 2-layer GPT over Shakespeare. For every aggregator the baseline is
the same aggregator with no attacker, measured in the same run. ``mean`` is the control: plain averaging
as hivemind does it (no norm check, no exclusions); the robust rules run with the reducer's checks and exclusions.
Server attacks put the 2 attackers among 7 servers of a stage; trainer attacks (``label_flip``,
``grad_flip``) among 7 trainers of a server.

Prints one JSON line per configuration on stderr and, last on stdout,
``{"byzantine_fraction", "results": [{"attack", "aggregator", "val_loss", "clean_val_loss", "rounds_to_exclusion",
"honest_excluded"}]}``; ``rounds_to_exclusion`` is the round at which the last attacker was excluded (null: never).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from harness import bench_spec, train  # noqa: E402

from swarm.attacks import ATTACKS  # noqa: E402

PEERS, BYZANTINE = 7, 2


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=100, help="averaging rounds (epochs) per configuration")
    ap.add_argument("--attacks", default=",".join(ATTACKS))
    ap.add_argument("--aggregators", default="mean,median,trimmed_mean,centered_clip")
    ap.add_argument("--cache-dir", type=Path, default=Path(os.environ.get("SWARM_CACHE_DIR", ROOT / ".test-cache")))
    args = ap.parse_args()
    spec = bench_spec()
    results = []
    for aggregator in args.aggregators.split(","):
        checks = aggregator != "mean"
        clean = train(spec, args.cache_dir, peers=PEERS, aggregator=aggregator, rounds=args.rounds, checks=checks)
        print(json.dumps({"aggregator": aggregator, "attack": None, "val_loss": round(clean.val_loss, 4)}),
              file=sys.stderr, flush=True)
        for attack in args.attacks.split(","):
            r = train(spec, args.cache_dir, peers=PEERS, byzantine=BYZANTINE, attack=attack, aggregator=aggregator,
                      rounds=args.rounds, checks=checks)
            attackers = range(PEERS - BYZANTINE, PEERS)
            excluded = [r.excluded_at.get(i) for i in attackers]
            row = {"attack": attack, "aggregator": aggregator, "val_loss": round(r.val_loss, 4),
                   "clean_val_loss": round(clean.val_loss, 4),
                   "rounds_to_exclusion": max(excluded) if all(b is not None for b in excluded) else None,
                   "honest_excluded": r.honest_excluded}
            print(json.dumps(row | {"seconds": round(r.seconds, 1)}), file=sys.stderr, flush=True)
            results.append(row)
    print(json.dumps({"byzantine_fraction": round(BYZANTINE / PEERS, 3), "results": results}))


if __name__ == "__main__":
    main()
