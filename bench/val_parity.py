"""Validation loss at equal tokens: the demo swarm against the single-process reference, over several data orders.

    python bench/val_parity.py [--spec runs/demo.toml] [--seconds 150] [--runs 3] [--ref-shares 2]
                               [--precision bf16]

The swarm: ``runs`` runs of the demo (:func:`coordinator.demo.run_demo`: 2 x 2 servers, 2 trainers on data shares
0 and 1), run ``r`` with the spec's ``data.seed = r`` (another sample order), each scored on the whole validation
split after its trainers stop. The reference: :func:`swarm.reference.train_reference` on the same spec, for every
seed ``r`` and data share ``0 .. ref_shares - 1``, trained for the swarm runs' mean number of samples and scored
on the same split (:func:`swarm.reference.reference_validation_loss`).

One run's validation loss is not enough to compare the two: at the demo's length the reference alone moves by
~0.2 nats from one data order to another (measured: shares 0-5 of seed 0 at 6384 samples gave 5.47-5.91).
``gap`` is the swarm's mean minus the reference's; ``gap_se`` its standard error (Welch); ``gap_z`` =
gap / gap_se. A swarm that loses nothing at equal tokens has ``|gap_z|`` around 1 or less; a real loss shows as a
gap several standard errors wide.

Prints one JSON line (the last): ``swarm`` and ``reference`` (per run: seed, share, samples, epochs, val_loss),
their means and standard deviations, ``gap``, ``gap_se``, ``gap_z``, ``samples``.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from coordinator.demo import pick_precision, run_demo  # noqa: E402
from swarm.config import RunSpec  # noqa: E402
from swarm.settings import PeerSettings  # noqa: E402
from swarm.data import prepare_dataset  # noqa: E402
from swarm.host import keep_freed_memory  # noqa: E402
from swarm.reference import reference_validation_loss, train_reference  # noqa: E402


def swarm_runs(spec: RunSpec, runs: int, seconds: float, cache_dir: Path) -> list[dict]:
    """The demo swarm once per seed ``0 .. runs - 1``: seed, samples trained, epochs, validation loss."""
    out = []
    with tempfile.TemporaryDirectory(prefix="swarm-val-parity-") as folder:
        for seed in range(runs):
            path = Path(folder) / f"seed{seed}.toml"
            path.write_text(spec.updated(data={"seed": seed}).to_toml())
            summary = run_demo(path, seconds=seconds, cache_dir=cache_dir, precision=spec.training.precision)
            out.append({"seed": seed, "samples": summary["tokens"] // spec.data.seq_len, "epochs": summary["epochs"],
                        "val_loss": summary["val_loss"], "tokens_per_s": summary["tokens_per_s"]})
            print(json.dumps({"swarm": out[-1]}), flush=True)
    return out


def reference_runs(spec: RunSpec, seeds: int, shares: int, samples: int, cache_dir: Path) -> list[dict]:
    """The reference for every seed and data share, ``samples`` samples each: its validation loss."""
    out = []
    for seed in range(seeds):
        seeded = spec.updated(data={"seed": seed})
        dataset = prepare_dataset(seeded, cache_dir)
        for share in range(shares):
            result = train_reference(seeded, dataset, share=share, max_samples=samples)
            out.append({"seed": seed, "share": share, "samples": samples, "epochs": result.epochs,
                        "val_loss": round(reference_validation_loss(result.stages, dataset), 4)})
            print(json.dumps({"reference": out[-1]}), flush=True)
    return out


def compare(swarm: list[float], reference: list[float]) -> dict:
    """Means, standard deviations, the gap (swarm - reference), its Welch standard error and their ratio."""
    ms, mr = statistics.fmean(swarm), statistics.fmean(reference)
    ss = statistics.stdev(swarm) if len(swarm) > 1 else 0.0
    sr = statistics.stdev(reference) if len(reference) > 1 else 0.0
    se = (ss ** 2 / len(swarm) + sr ** 2 / len(reference)) ** 0.5
    return {"swarm_mean": round(ms, 4), "swarm_sd": round(ss, 4), "reference_mean": round(mr, 4),
            "reference_sd": round(sr, 4), "gap": round(ms - mr, 4), "gap_se": round(se, 4),
            "gap_z": round((ms - mr) / se, 2) if se > 0 else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--spec", type=Path, default=ROOT / "runs" / "demo.toml")
    parser.add_argument("--seconds", type=float, default=150.0, help="training seconds of each swarm run")
    parser.add_argument("--runs", type=int, default=3, help="swarm runs (one data seed each)")
    parser.add_argument("--ref-shares", type=int, default=2, help="reference runs per seed (data shares)")
    parser.add_argument("--precision", choices=("auto", "fp32", "bf16"), default="bf16",
                        help="both sides' precision (pinned: 'auto' measures the machine, which a load can sway)")
    args = parser.parse_args()
    keep_freed_memory()  # as every peer does: the one-process baseline allocates the same way
    if args.runs < 1 or args.ref_shares < 1:
        parser.error("--runs and --ref-shares must be at least 1")
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    spec = pick_precision(RunSpec.from_toml(args.spec), args.precision)
    cache_dir = PeerSettings().cache_dir
    swarm = swarm_runs(spec, args.runs, args.seconds, cache_dir)
    samples = round(statistics.fmean(r["samples"] for r in swarm))
    samples -= samples % spec.training.micro_batch_size
    reference = reference_runs(spec, args.runs, args.ref_shares, samples, cache_dir)
    result = {"samples": samples, "precision": spec.training.precision,
              **compare([r["val_loss"] for r in swarm], [r["val_loss"] for r in reference]),
              "swarm": swarm, "reference": reference}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
