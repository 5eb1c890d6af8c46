"""Attacks x aggregators with 3 of 7 peers Byzantine: final validation loss next to two clean runs'.

    python bench/robustness.py [--rounds 100] [--byzantine 3] [--seeds 3] [--attacks sign_flip,noise,...]
                               [--aggregators mean,centered_clip,nnm+centered_clip]
                               [--mode outer --inner-steps 5 --compression topk]
                               [--peers 16 --group-size 8 --placement together]

Runs the in-process harness (``bench/harness.py``: the real compressor, reducer, aggregator, exclusion and attack
code with the network taken out) on a 2-layer GPT over Shakespeare. An aggregator is a rule of
``swarm.averaging.aggregation`` with an optional pre-aggregation (``nnm+centered_clip``,
``bucketing+median``). For every aggregator two baselines are measured in the same run, with no attacker:
``clean_val_loss`` (all 7 peers honest: the same data as the attacked runs' peers) and ``honest_val_loss``
(only the honest peers: what the attacked run could at best reach without the attackers' data). ``mean`` is the
control: plain averaging as hivemind does it (no norm check, no exclusions); the robust rules run with the
reducer's checks and exclusions, every honest peer with its own exclusion book. Server attacks put the
attackers among 7 servers of a stage; trainer attacks (``label_flip``, ``grad_flip``) among 7 trainers of a
server.

The attacks include the adaptive ones of ``swarm.attacks.adaptive`` (tuned against the configured rule and checks,
sleepers, drift under the exclusion threshold, inflated sample claims, lies only where the attackers reduce, exact
zeros).

Prints one JSON line per configuration on stderr and, last on stdout, ``{"byzantine_fraction", "results":
[{"attack", "aggregator", "val_loss", "clean_val_loss", "honest_val_loss", "ratio_to_clean", "ratios",
"rounds_to_exclusion", "attackers_excluded", "honest_excluded", "kappa_median", "kappa_max", "kappa_bound"}],
"within_5pct": {aggregator: bool}, "within_10pct": {aggregator: bool}}``; ``rounds_to_exclusion`` is the round by
which most honest peers had excluded the last attacker (null: never), ``attackers_excluded`` how many attackers
most honest peers excluded, ``honest_excluded`` the honest peers excluded by at least one honest peer,
``kappa_*`` the error of each partition reduced with attackers in the group as the kappa of (f, kappa)-robustness
(Allouah et al. 2023: squared distance of the aggregate to the honest parts' mean over their mean squared
distance to it) next to the rule's proven bound at f of 7 (``swarm.averaging.aggregation.kappa_bound``; null:
none proven), ``within_5pct`` whether every attack ended within 5% of the clean loss with no honest peer
excluded, ``within_10pct`` within 10%. ``--mode outer`` runs every configuration with outer steps (DiLoCo: the
attackers corrupt their pseudo-gradients, ``rounds`` counts inner steps) and ``--compression`` with that
compressor (``topk``: the shared top-k); the clean runs use the same mode and compressor.

``--group-size G`` runs every round as the hops of bounded groups (``[averaging] group_size``; the project's own
grid, ``bench/harness_hops.py``) over ``--peers`` servers, the attackers where each round's seed puts them
(``--placement random``) or, every round, where they sit closest together (``together``: an upper bound on what
key grinding buys); each row then adds ``hops_per_round``, ``mean_group``, ``bad_group_share`` and
``bad_lane_share`` (hop-0 groups and later lanes with at least half their voters bad), ``divergent_rounds`` (rounds
whose honest peers ended with different values: a lying voter splits its lanes) and ``grouped_rounds``, and
``kappa_bound`` is null (the proven bound is for one group).
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

from harness import bench_spec, outer_spec, train  # noqa: E402
from bench.harness_hops import Groups  # noqa: E402

from swarm.attacks import ATTACKS  # noqa: E402
from swarm.averaging.aggregation import assumed_byzantine, kappa_bound  # noqa: E402

PEERS = 7


def _run(spec, args, aggregator: str, **kw) -> list:
    """One run per seed (``--seeds``), the same configuration otherwise."""
    pre, _, rule = aggregator.rpartition("+")
    peers = kw.pop("peers", args.peers)
    groups = Groups(args.group_size, args.placement, args.tries) if args.group_size else None
    return [train(spec, args.cache_dir, peers=peers, aggregator=rule, pre=pre or "none", rounds=args.rounds,
                  checks=rule != "mean", compression=args.compression, seed=seed, groups=groups, **kw)
            for seed in range(args.seeds)]


def _mean_loss(runs: list) -> float:
    return sum(r.val_loss for r in runs) / len(runs)


def _row(runs: list, attack: str, aggregator: str, clean: list, honest: list, f: int, spec, n: int) -> dict:
    """The JSON row of one attack's runs (one per seed) beside the clean runs of the same seeds: losses and the
    ratio are means over the seeds (``ratios``: per seed), exclusions the worst seed's."""
    per_seed = [[r.excluded_at.get(i) for i in range(n - f, n)] for r in runs]
    never = any(b is None for excluded in per_seed for b in excluded)
    kappas = sorted(k for r in runs for k in r.kappas if k is not None)
    ratios = [r.val_loss / c.val_loss for r, c in zip(runs, clean)]
    avg = spec.averaging  # the bench's trim and byzantine_fraction agree (0.3 each): one f assumed
    grouped = any(r.hops.rounds for r in runs)  # the proven bound is for one group of n holding f attackers
    bound = None if grouped else kappa_bound(aggregator, n, f, assumed=assumed_byzantine(n, avg.byzantine_fraction))
    return {"attack": attack, "aggregator": aggregator, "val_loss": round(_mean_loss(runs), 4),
            "clean_val_loss": round(_mean_loss(clean), 4), "honest_val_loss": round(_mean_loss(honest), 4),
            "ratio_to_clean": round(sum(ratios) / len(ratios), 4), "ratios": [round(x, 4) for x in ratios],
            "rounds_to_exclusion": None if never else max(max(excluded) for excluded in per_seed),
            "attackers_excluded": min(sum(b is not None for b in excluded) for excluded in per_seed),
            "honest_excluded": max(r.honest_excluded for r in runs),
            "kappa_median": round(kappas[len(kappas) // 2], 4) if kappas else None,
            "kappa_max": round(kappas[-1], 4) if kappas else None,
            "kappa_bound": None if bound is None else round(bound, 2)} | (_hop_fields(runs) if grouped else {})


def _hop_fields(runs: list) -> dict:
    """With ``--group-size``: hops per round, mean hop-0 group, the shares of hop-0 groups and later lanes with
    at least half their voters bad, and rounds whose honest peers ended apart (summed over the seeds)."""
    h = [r.hops for r in runs]
    rounds, groups, lanes = sum(x.rounds for x in h), sum(x.groups for x in h), sum(x.lanes for x in h)
    return {"hops_per_round": round(sum(x.hops for x in h) / max(1, rounds), 2),
            "mean_group": round(sum(sum(x.sizes) for x in h) / max(1, groups), 2),
            "bad_group_share": round(sum(x.bad_groups for x in h) / max(1, groups), 4),
            "bad_lane_share": round(sum(x.bad_lanes for x in h) / max(1, lanes), 4),
            "divergent_rounds": sum(x.divergent_rounds for x in h), "grouped_rounds": rounds}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=100, help="averaging rounds (epochs) per configuration")
    ap.add_argument("--byzantine", type=int, default=3, help="attackers among the peers")
    ap.add_argument("--peers", type=int, default=PEERS, help="servers of the stage")
    ap.add_argument("--group-size", type=int, default=0, help="[averaging] group_size: average in hops over a grid "
                    "of groups of at most this many (bench/harness_hops.py); 0: one group")
    ap.add_argument("--placement", choices=["random", "together"], default="random",
                    help="with --group-size: the attackers land where each round's seed puts them, or, every round, "
                    "where they are closest together among --tries seeds (an upper bound on key grinding)")
    ap.add_argument("--tries", type=int, default=200, help="--placement together: seeds tried per round")
    ap.add_argument("--attacks", default=",".join(ATTACKS))
    ap.add_argument("--aggregators", default="mean,median,trimmed_mean,centered_clip,nnm+centered_clip")
    ap.add_argument("--mode", choices=["per_epoch", "outer"], default="per_epoch")
    ap.add_argument("--inner-steps", type=int, default=5, help="--mode outer: inner steps per outer step")
    ap.add_argument("--compression", default="none", help="the compressor of every run (none, topk, powersgd, ...)")
    ap.add_argument("--seeds", type=int, default=1, help="runs per configuration, seeds 0..N-1 (reported: the "
                    "mean ratio to the clean runs of the same seeds; one seed's trajectory noise is a few percent)")
    ap.add_argument("--cache-dir", type=Path, default=Path(os.environ.get("SWARM_CACHE_DIR", ROOT / ".test-cache")))
    args = ap.parse_args()
    spec, f = bench_spec(), args.byzantine
    if args.mode == "outer":
        spec = outer_spec(spec, args.inner_steps)
    results, within, within10 = [], {}, {}
    for aggregator in args.aggregators.split(","):
        clean = _run(spec, args, aggregator)
        honest = _run(spec, args, aggregator, peers=args.peers - f)
        print(json.dumps({"aggregator": aggregator, "attack": None, "val_loss": round(_mean_loss(clean), 4),
                          "honest_val_loss": round(_mean_loss(honest), 4)}), file=sys.stderr, flush=True)
        within[aggregator] = within10[aggregator] = True
        for attack in args.attacks.split(","):
            r = _run(spec, args, aggregator, byzantine=f, attack=attack)
            row = _row(r, attack, aggregator, clean, honest, f, spec, args.peers)
            within[aggregator] &= row["ratio_to_clean"] <= 1.05 and row["honest_excluded"] == 0
            within10[aggregator] &= row["ratio_to_clean"] <= 1.10
            print(json.dumps(row | {"seconds": round(sum(x.seconds for x in r), 1)}), file=sys.stderr, flush=True)
            results.append(row)
    print(json.dumps({"byzantine_fraction": round(f / args.peers, 3), "peers": args.peers,
                      "group_size": args.group_size, "placement": args.placement if args.group_size else None,
                      "mode": args.mode, "compression": args.compression,
                      "inner_steps": args.inner_steps if args.mode == "outer" else 1, "results": results,
                      "within_5pct": within, "within_10pct": within10}))


if __name__ == "__main__":
    main()
