"""Round time, DHT traffic and tokens/s against peers: the simulator's curves and the real runs' points.

    python bench/scaling_plot.py [--out docs/img/scaling.png] [--largest 10000] [--hours 0.5]

Two simulated series (``bench/simulate.py``'s code, in process):

* **this host**: the tiny spec at 512 samples an epoch, every server 1.3 GFLOP/s (what one computed at 2 x 2 + 2
  on this 2-core machine), loopback links, no churn, ``group_size`` 4: the conditions of ``bench/scale.py``,
  whose measured points (``bench/measured_scale.json``) are drawn over it;
* **public run**: ``runs/large.toml`` in outer mode (DiLoCo, 100 inner steps; ``averaging_timeout`` 600 s), the
  GPU mix and WAN links of :mod:`bench.sim.world`, 30% churn an hour, 20% Byzantine servers, 80% servers.

Prints one JSON line per simulated point; the last line is ``{"plot": path, "points": n}``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.sim.run import Options, Simulation  # noqa: E402
from bench.simulate import sizes, summarize  # noqa: E402
from swarm.config import RunSpec  # noqa: E402

HOST_SIZES = [(2, 2), (4, 4), (6, 4), (8, 8), (20, 8)]  # (servers per stage, trainers)
PUBLIC_SIZES = [100, 300, 1000, 3000, 10000]


def host_points(hours: float) -> list[dict]:
    spec = RunSpec.from_toml(ROOT / "runs" / "tiny.toml").updated(training={"target_batch_size": 512},
                                                                   averaging={"group_size": 4})
    out = []
    for per_stage, trainers in HOST_SIZES:
        opts = Options(servers=2 * per_stage, trainers=trainers, hours=hours, tick_s=10.0, churn_per_h=0.0,
                       byzantine=0.0, links="loopback", server_flops=1.3e9)
        sim = Simulation(spec, opts, **sizes(spec))
        sim.run()
        out.append({"series": "this host", **summarize(sim, opts, 0.0)})
        print(json.dumps(out[-1]), flush=True)
    return out


def public_points(largest: int, hours: float) -> list[dict]:
    spec = RunSpec.from_toml(ROOT / "runs" / "large.toml").updated(
        averaging={"mode": "outer", "inner_steps": 100, "averaging_timeout": 600.0})
    out = []
    for peers in [n for n in PUBLIC_SIZES if n <= largest]:
        opts = Options(servers=round(0.8 * peers), trainers=round(0.2 * peers), hours=hours, tick_s=60.0,
                       churn_per_h=0.3, byzantine=0.2)
        sim = Simulation(spec, opts, **sizes(spec))
        sim.run()
        out.append({"series": "public run", **summarize(sim, opts, 0.0)})
        print(json.dumps(out[-1]), flush=True)
    return out


def plot(points: list[dict], measured: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("round_s_p50", "round_s_p50", "round time p50 (s)"),
              ("dht_kb_per_server_min", "dht_io_kb_per_server_min", "DHT KB per server and minute"),
              ("tokens_per_s", "tokens_per_s", "tokens/s")]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for ax, (key, real_key, label) in zip(axes, panels):
        for series, style in (("this host", "o-"), ("public run", "s-")):
            xs = [p["peers"] for p in points if p["series"] == series and p.get(key) is not None]
            ys = [p[key] for p in points if p["series"] == series and p.get(key) is not None]
            ax.plot(xs, ys, style, label=f"simulated: {series}")
        real = [(m["peers"], m[real_key]) for m in measured if m.get(real_key) is not None]
        if real:
            what = "DHT process I/O" if real_key != key else "bench/scale.py"
            ax.plot(*zip(*real), "k^", markersize=9, label=f"measured: {what}")
            ax.legend(fontsize=8)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("peers")
        ax.set_title(label)
        ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "img" / "scaling.png")
    ap.add_argument("--largest", type=int, default=10000)
    ap.add_argument("--hours", type=float, default=0.5)
    args = ap.parse_args()
    points = host_points(min(args.hours, 0.1)) + public_points(args.largest, args.hours)
    for p in points:
        p["dht_kb_per_server_min"] = p["dht_kb_per_peer_min"]["server"]
    measured = json.loads((ROOT / "bench" / "measured_scale.json").read_text())["runs"]
    plot(points, measured, args.out)
    out = args.out.resolve()
    print(json.dumps({"plot": str(out.relative_to(ROOT) if out.is_relative_to(ROOT) else out), "points": len(points)}))


if __name__ == "__main__":
    main()
