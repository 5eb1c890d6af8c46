"""The demo swarm on loopback and on emulated internet links: what slow, far links cost it.

    python bench/wan.py [--profiles loopback,lab,100:50,20:150,100:50+20:150] [--seconds 150] [--spec runs/demo.toml]

A profile ``MBIT:RTT_MS`` (optionally ``:LOSS``) puts every peer on its own host of a WAN lab
(:mod:`bench.wanlab`): each host uploads and downloads at MBIT Mbit/s and two hosts see RTT_MS of round trip.
A mixed profile ``FAST+SLOW`` (two such profiles) puts the hosts of :data:`SLOW_HOSTS` (one server of each stage,
a trainer and the late joiner) on ``SLOW`` and the others on ``FAST``; the link measured and the bounds are then
those of a fast host to a slow one. ``loopback`` runs the same processes on this machine's loopback. ``lab`` puts
them on the lab's hosts with no delay and no rate limit: the control that tells the links' cost from the lab's own.
The lab carries every packet through one user-space process and the hosts' network namespaces on the swarm's own
cores: 8-13 CPU seconds of the switch in a 150 s run on this project's 2-core machine (``runs/home.toml``). There
``lab`` trained 1.27x, 1.02x and (100 s) 1.06x loopback's tokens/s in three runs, and 1 Gbit/s at 1 ms 0.86x in
a fourth: the machine's own noise between runs is larger than the lab's cost. For each profile the bench

1. measures the link it got (TCP round trip and throughput between two server hosts; on loopback, between two
   local sockets): the figures reported are these, never the ones asked for;
2. starts the demo swarm: a coordinator, 2 servers per stage and 2 trainers, each on its own host (with its
   share of this machine's cores as torch threads, as on loopback: :func:`lab_threads`);
3. trains ``--seconds``; a third of the way in, a DHT probe on its own host times stores and gets, and halfway
   in a late server joins stage 0 on its own host;
4. measures the validation loss through the swarm (the same held-out micro-batches on every profile).

Figures per profile (one JSON line each; the last line has them all under ``profiles``):

* ``tokens_per_s`` (the trainers' tokens over the training seconds) and ``ratio_to_loopback``; for a lab profile
  run after ``lab``, ``ratio_to_lab`` (the links' cost alone); for a mixed profile run after its two pure ones,
  ``ratio_to_better_pure`` (to the higher of their ``tokens_per_s``);
* ``round_s``: mean seconds of a gradient all-reduce, from the group's forming to the averaged result (the
  servers' own counters, ``rounds`` and ``round_ms``), and ``round_bound_s``: the least time the same bytes
  need, ``sent_per_round / link rate + 2 x phases x RTT``. ``sent_per_round`` is what a server's averager counted
  sending per round, which is 2(n-1)/n x the round's bytes for n servers in the group (the butterfly's
  reduce-scatter and all-gather); each phase costs one round trip to open its streams and one to send a part and
  get the partition's aggregate back;
* ``round_bytes``: bytes a server's averager sent and received per round, and ``wire_bytes_per_round``: every
  IP byte between the servers of one stage (counted by the lab's switch: also DHT, checkpoint fragments and the
  state averaging every ``average_state_every`` epochs) over the rounds (lab profiles only);
* ``dht_get_ms``, ``dht_store_ms``: medians of 10 gets (``latest=True``) and 10 stores from a client node;
* ``join_s``: from the late server's process start to its record saying ``online`` (its state loaded);
  ``state_s``: the part of it from its "loading state" line to "online"; ``join_bound_s``: the stage state's
  bytes (fp32 parameters and the two AdamW moments, or outer mode's outer momentum) over the measured link rate,
  plus 4 round trips;
  ``join_phases``: the seconds of each phase of the join as the server timed them (:mod:`swarm.server.joinclock`:
  ``joined``, the whole; ``start``, the interpreter and imports; then ``connect`` to ``announce``);
  ``joiner_timeouts``: the round trip and rate the late server measured to the swarm's servers and the timeouts it
  derived from them (:mod:`swarm.net.timeouts`);
* ``step_s``: median seconds an epoch's transition held a server's compute thread (matchmaking, all-reduce and
  optimizer step; the servers' epoch lines);
* ``activation_bytes_per_token``: the trainers' stage RPC bytes (sent and received) per trained token per stage
  boundary: a micro-batch's activations and their input gradients each cross the trainer twice (from one stage's
  server, to the next's), with the token ids, targets and the spot checks' replays;
* ``recomputed_share``: of stage 0's micro-batches (the initial servers'), the share whose backward recomputed the
  forward, its graph stale after an inner step or evicted (the servers' epoch lines, ``recomputed``);
* ``val_loss`` after the equal training time; ``epochs``; ``failed_rounds`` and ``dropped`` samples;
  ``switch_cpu_s``: CPU seconds the lab's switch used (it shares the machine's cores with the swarm);
* ``cpu_s``: CPU seconds of the training window (``cpu_window_s``, from the trainers' start to their stop) by
  process kind (:mod:`bench.procstat`), with the switch, ``unattributed`` busy CPU (the kernel's network paths),
  the cores' ``idle`` seconds and ``steal`` (seconds the virtual machine's host took the cores: runs with much of
  it are not comparable); ``compute_busy``: the fraction of those seconds the initial servers' compute
  threads computed (CPU seconds per second, mean over the servers): where tokens/s falls and ``idle`` grows, the
  servers wait on the links; where ``idle`` stays near 0 and the other kinds grow, the machine's CPU is short.

Needs root for the lab profiles (without it they are skipped, saying why). Takes about 5 minutes per profile.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import procstat  # noqa: E402
from bench.wanlab import OBSERVER_IP, Lab, Profile  # noqa: E402
from bench.wanlab.probe import measure_between  # noqa: E402
from coordinator.demo import start_servers, summary  # noqa: E402
from coordinator.launch import LocalSwarm, on_loopback  # noqa: E402
from coordinator.status import snapshot  # noqa: E402
from swarm.config import RunSpec  # noqa: E402
from swarm.settings import PeerSettings  # noqa: E402
from swarm.data import prepare_dataset  # noqa: E402
from swarm.host import usable_cores  # noqa: E402
from swarm.net.dht import connect_run  # noqa: E402
from swarm.net.directory import AsyncRunDirectory  # noqa: E402
from swarm.model import build_stage  # noqa: E402
from swarm.trainer.pipeline import RemotePipeline, validation_loss, validation_samples  # noqa: E402
from swarm.net.timeouts import state_bytes as averaged_state_bytes  # noqa: E402
from swarm.protocol import ServerState  # noqa: E402

logger = logging.getLogger("swarm.bench.wan")

HOSTS = ["coordinator", "server1", "server2", "server3", "server4", "trainer5", "trainer6", "server7", "dhtprobe"]
"""The lab's hosts, named as :class:`LocalSwarm` names the peers it starts in this order."""
SLOW_HOSTS = ("server3", "server4", "trainer6", "server7")
"""A mixed profile's hosts on its slow link: the second server of each stage (:func:`start_servers` starts them
round-robin), the second trainer and the late joiner."""
PEERS = sum(h.startswith(("server", "trainer")) for h in HOSTS)
"""Servers and trainers of a run, the peers that share this machine's cores (:func:`swarm.host.choose_threads`)."""
PROBES = 10
EVAL_SAMPLES = 128
"""Validation samples scored at the end (the split's first ones: on the lab's links the whole split costs minutes)."""


def parse_profile(text: str) -> tuple[str, Optional[Profile], dict[str, Profile]]:
    """``(name, the lab's profile, the overrides of its slow hosts)`` of ``loopback``, ``lab``,
    ``MBIT:RTT_MS[:LOSS]`` or ``FAST+SLOW``; the profile is None for loopback."""
    if text == "loopback":
        return text, None, {}
    if text == "lab":
        return text, Profile(text), {}
    if "+" in text:
        (fast, profile, _), (slow, slow_profile, _) = (parse_profile(part) for part in text.split("+", 1))
        return f"{fast}+{slow}", profile, {host: slow_profile for host in SLOW_HOSTS}
    mbit, rtt, *loss = text.split(":")
    name = f"{mbit}mbit-{rtt}ms" + (f"-{loss[0]}loss" if loss else "")
    return name, Profile(name, rtt_ms=float(rtt), mbit=float(mbit), loss=float(loss[0]) if loss else 0.0), {}


def dht_probe(address: str) -> None:
    """Inside the probe host: time :data:`PROBES` stores and gets from a client node; print them as JSON."""
    dht, _, _, _ = connect_run(address, PeerSettings(host="0.0.0.0"), client_mode=True)
    try:
        stores, gets = [], []
        for i in range(PROBES):
            key = f"wanprobe-{time.time_ns()}-{i}"
            t0 = time.perf_counter()
            dht.store(key, i, expiration_time=time.time() + 60)
            stores.append(1000 * (time.perf_counter() - t0))
            t0 = time.perf_counter()
            dht.get(key, latest=True)
            gets.append(1000 * (time.perf_counter() - t0))
        print(json.dumps({"dht_store_ms": round(statistics.median(stores), 1),
                          "dht_get_ms": round(statistics.median(gets), 1)}), flush=True)
    finally:
        dht.shutdown()


def measure_loopback() -> dict:
    return measure_between([], [], "127.0.0.1", 5201, 3.0)


def state_bytes(spec: RunSpec, stage: int) -> int:
    """Bytes of a stage's state a joiner downloads (:func:`swarm.net.timeouts.state_bytes`): fp32 parameters and
    AdamW's two moments, or in ``outer`` mode the outer parameters and their momentum."""
    return averaged_state_bytes(spec, sum(p.numel() for p in build_stage(spec.model, stage).parameters()))


class Run:
    """One profile's swarm, its probes and its figures."""

    def __init__(self, swarm: LocalSwarm, lab: Optional[Lab]):
        self.swarm, self.lab = swarm, lab
        address = swarm.start_coordinator(timeout=180)
        observer = OBSERVER_IP if lab else "127.0.0.1"
        self.dht, self.directory, self.spec, _ = connect_run(address, PeerSettings(host=observer), client_mode=True)
        self.figures: dict = {}

    def close(self) -> None:
        self.dht.shutdown()

    def train(self, seconds: float) -> tuple[dict, float]:
        """Start the servers and trainers, train ``seconds`` with the probes; returns the run's snapshot and the
        seconds trained."""
        spec, directory, swarm = self.spec, self.directory, self.swarm
        start_servers(swarm, directory, spec.model.num_stages, 2)
        trainers = [swarm.start_peer("trainer", "--share", str(i)) for i in range(2)]
        started = time.monotonic()
        cpu = CpuWindow(swarm, directory, spec)
        probe = joiner = None
        next_report = 15.0
        while (elapsed := time.monotonic() - started) < seconds:
            time.sleep(0.5)
            if probe is None and elapsed > seconds / 3:
                prefix = self.lab.prefix("dhtprobe") if self.lab else []
                probe = subprocess.Popen([*prefix, sys.executable, __file__, "--dht-probe", swarm.address], cwd=ROOT,
                                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            if joiner is None and elapsed > seconds / 2:
                joiner = swarm.start_peer("server", "--stage", "0")
                joined_at = time.monotonic()
            if joiner is not None and "join_s" not in self.figures and self._online(joiner.peer_id):
                self.figures["join_s"] = round(time.monotonic() - joined_at, 1)
            if elapsed >= next_report:
                next_report += 15.0
                snap = snapshot(directory, spec)
                logger.info("t=%3.0fs epochs=%s loss=%s idle=%.1fs steal=%.1fs", elapsed,
                            [s["epoch"] for s in snap["stages"]], snap["run"]["loss"], *cpu.since_last())
        before = snapshot(directory, spec)
        self.figures.update(cpu.figures(self.lab))
        for p in trainers:
            swarm.stop(p)
        elapsed = time.monotonic() - started
        time.sleep(1.0)
        snap = snapshot(directory, spec)
        snap["peers"] += [p for p in before["peers"] if p["peer_id"] not in {q["peer_id"] for q in snap["peers"]}]
        if probe is not None:
            out, _ = probe.communicate(timeout=120)
            self.figures.update(json.loads(out.strip().splitlines()[-1]) if out.strip() else {})
        if joiner is not None:
            log = swarm.tail(joiner, 400)
            self.figures["state_s"] = _state_seconds(log)
            self.figures["join_phases"] = _join_phases(log)
            self.figures["joiner_timeouts"] = _link_timeouts(log)
        self.figures.update(self._averaging())
        self.figures.update(_recomputed([p.log.read_text() for p in swarm.peers[:4]], spec.training.micro_batch_size))
        steps = [float(x) for p in swarm.peers[:4] for x in re.findall(r"step_s=([\d.]+)", p.log.read_text())]
        if steps:
            self.figures["step_s"] = round(statistics.median(steps), 3)
        return snap, elapsed

    def _online(self, peer_id: str) -> bool:
        return any(s.peer_id == peer_id and s.state == ServerState.ONLINE
                   for g in self.directory.all_servers(self.spec.model.num_stages).values() for s in g)

    def _averaging(self) -> dict:
        """Round time and bytes from the first servers' counters (their last records)."""
        servers = [s for g in self.directory.all_servers(self.spec.model.num_stages).values() for s in g
                   if s.peer_id in {p.peer_id for p in self.swarm.peers[:4]}]
        counters = [s.averaging for s in servers if s.averaging.get("rounds")]
        rounds = sum(c["rounds"] for c in counters)
        if not rounds:
            return {"rounds": 0}
        return {"rounds": rounds, "round_s": round(sum(c["round_ms"] for c in counters) / rounds / 1000, 3),
                "sent_per_round": round(sum(c["sent"] for c in counters) / rounds),
                "round_bytes": round(sum(c["sent"] + c["received"] for c in counters) / rounds),
                "phases_per_round": round(sum(c["phases"] for c in counters) / rounds, 2),
                "failed_rounds": sum(s.averaging.get("failed", 0) for s in servers),
                "dropped": sum(s.samples_dropped for s in servers)}

    def val_loss(self, dataset) -> float:
        async def evaluate() -> float:
            pipeline = RemotePipeline(self.spec, self.directory.run_id, AsyncRunDirectory(self.directory),
                                      await self.dht.replicate_p2p())
            return await validation_loss(pipeline, dataset, EVAL_SAMPLES)

        return asyncio.run(evaluate())


class CpuWindow:
    """Where the machine's CPU went while the swarm trained (:mod:`bench.procstat`), opened when the trainers start:
    ``cpu_s`` by process kind, the lab's ``switch`` (the whole run's), ``idle`` (all cores), ``steal`` (a virtual
    machine's host's) and ``unattributed`` (busy CPU outside the swarm's processes: the kernel's network paths,
    anything else on the machine); and
    ``compute_busy``, the initial servers' compute threads' CPU seconds (their records' ``compute_s``) per
    second per server: 1.0 is a server that computed all the time."""

    def __init__(self, swarm: LocalSwarm, directory, spec: RunSpec):
        self.swarm, self.directory, self.spec = swarm, directory, spec
        self.first = procstat.sample(procstat.swarm_leaders(swarm), time.monotonic())
        self.machine = procstat.machine_cpu()
        self._last = self.machine
        self.compute = self._compute_s()

    def since_last(self) -> tuple[float, float]:
        """The cores' idle and stolen seconds since the last call (since the window opened, on the first)."""
        before, self._last = self._last, procstat.machine_cpu()
        return self._last[1] - before[1], self._last[2] - before[2]

    def _compute_s(self) -> dict[str, float]:
        initial = {p.peer_id for p in self.swarm.peers[:4]}
        return {s.peer_id: s.compute_s for g in self.directory.all_servers(self.spec.model.num_stages).values()
                for s in g if s.peer_id in initial}

    def figures(self, lab: Optional[Lab]) -> dict:
        last = procstat.sample(procstat.swarm_leaders(self.swarm), time.monotonic())
        seconds = last.at - self.first.at
        busy, idle, steal = (b - a for a, b in zip(self.machine, procstat.machine_cpu()))
        cpu = {k: round(v, 1) for k, v in procstat.by_kind(procstat.cpu_between(self.first, last)).items()}
        cpu["switch"] = round(lab.switch_cpu_s(), 1) if lab else 0.0
        cpu["unattributed"] = round(busy - sum(cpu.values()), 1)
        cpu["idle"], cpu["steal"] = round(idle, 1), round(steal, 1)
        now = self._compute_s()
        grown = [now[k] - v for k, v in self.compute.items() if k in now]
        return {"cpu_s": cpu, "cpu_window_s": round(seconds, 1),
                "compute_busy": round(sum(grown) / len(grown) / seconds, 3) if grown else None}


def _recomputed(logs: list[str], micro_batch_size: int) -> dict:
    """``recomputed_share``: of the micro-batches the servers of the first stage trained, the share whose backward
    recomputed its forward (each server's last epoch line: ``recomputed`` over ``samples`` / micro-batch size);
    only the first stages cache a forward's graph for its backward (the last one runs both in one call)."""
    recomputed = micro_batches = 0
    for log in logs:
        last = re.findall(r"stage=0 epoch=\d+\].* samples=(\d+) .*recomputed=(\d+)", log)
        if last:
            micro_batches += int(last[-1][0]) // micro_batch_size
            recomputed += int(last[-1][1])
    return {"recomputed_share": round(recomputed / micro_batches, 3)} if micro_batches else {}


def _state_seconds(log: str) -> Optional[float]:
    """Seconds from the "loading state" line to "online" in a server's log (whole seconds: the log's stamps are
    ``HH:MM:SS``); None if either line is missing."""
    stamps = {}
    for line in log.splitlines():
        m = re.match(r"(\d\d):(\d\d):(\d\d) ", line)
        for what in ("loading state", "] online"):
            if m and what in line and what not in stamps:
                stamps[what] = int(m[1]) * 3600 + int(m[2]) * 60 + int(m[3])
    return float(stamps["] online"] - stamps["loading state"]) if len(stamps) == 2 else None


def _join_phases(log: str) -> Optional[dict]:
    """The late server's ``joined_s=...`` line (:mod:`swarm.server.joinclock`) as ``{key: seconds}``; None if absent."""
    line = next((line for line in log.splitlines() if "joined_s=" in line), None)
    return {k: float(v) for k, v in re.findall(r"(\w+)_s=([\d.]+)", line)} if line else None


def _link_timeouts(log: str) -> Optional[dict]:
    """The late server's ``timeouts from links`` line (:mod:`swarm.net.timeouts`) as ``{key: number or None}``."""
    line = next((line for line in log.splitlines() if "timeouts from links" in line), None)
    return {k: None if v == "none" else float(v) for k, v in re.findall(r"(\w+)=([\d.]+|none)", line)} if line else None


def lab_threads() -> int:
    """torch threads for each peer in the lab: its share of this machine's cores, as on loopback. A peer counts
    the peers it shares the machine with by their sockets in its own network namespace
    (:func:`swarm.host.peers_on_host`), and in the lab each peer has a namespace of its own: each would take every
    core (measured at 20:150 on 2 cores: 2 threads each, stage 1's forward and backward 0.38 s a micro-batch
    against 0.27 s on loopback, and 3195-3370 tokens/s against 3811 with one thread)."""
    return max(1, usable_cores() // PEERS)


def run_profile(name: str, profiles: tuple[Optional[Profile], dict[str, Profile]], spec_path: Path, cache_dir: Path,
                seconds: float, env: dict[str, str], keep: bool = False) -> dict:
    """One profile's figures (see the module docstring); ``profiles``: the lab's profile (None: loopback) and its
    hosts' overrides."""
    profile, overrides = profiles
    if profile:  # (a peer counts the peers beside it in its network namespace: in the lab it would see none)
        env = {"SWARM_THREADS": str(lab_threads()), **env}
    spec = RunSpec.from_toml(spec_path)
    dataset = prepare_dataset(spec, cache_dir)
    lab = Lab(HOSTS, profile, overrides) if profile else contextlib.nullcontext()
    with lab:
        link = lab.measure("server1", "server3" if overrides else "server2") if profile else measure_loopback()
        logger.info("%s: measured %.2f ms round trip, %.1f Mbit/s", name, link["rtt_ms"], link["mbit"])
        placement = (lambda host: (lab.prefix(host), lab.ip(host))) if profile else on_loopback
        workdir = Path(tempfile.mkdtemp(prefix="swarm-wan-"))
        with LocalSwarm(spec_path, workdir, cache_dir, placement=placement, extra_env=env, keep=keep) as swarm:
            if keep:
                logger.info("%s: the peers' logs are in %s", name, workdir / "logs")
            run = Run(swarm, lab if profile else None)
            try:
                snap, elapsed = run.train(seconds)
                val = run.val_loss(dataset)
                traffic = lab.traffic() if profile else {}
                protocols = lab.protocols() if profile else {}
                switch_cpu_s = lab.switch_cpu_s() if profile else 0.0
            finally:
                run.close()
    out = summary(snap, spec, val, elapsed, validation_samples(dataset, EVAL_SAMPLES))
    figures = run.figures
    rtt_s, rate = link["rtt_ms"] / 1000, link["mbit"] * 1e6 / 8
    result = {"name": name, "rtt_ms": link["rtt_ms"], "mbit": link["mbit"], "tokens_per_s": out["tokens_per_s"],
              "epochs": out["epochs"], "val_loss": out["val_loss"], **figures}
    trainers = [p for p in snap["peers"] if p["role"] == "trainer"]
    if tokens := sum(p["tokens"] for p in trainers):
        rpc_bytes = sum(p["bytes_sent"] + p["bytes_received"] for p in trainers)
        result["activation_bytes_per_token"] = round(rpc_bytes / tokens / max(1, spec.model.num_stages - 1), 1)
    if protocols:
        result["wire_bytes_by_protocol"] = protocols
        result["switch_cpu_s"] = round(switch_cpu_s, 1)
    if figures.get("rounds"):
        result["round_bound_s"] = round(figures["sent_per_round"] / rate + 2 * figures["phases_per_round"] * rtt_s, 3)
        if traffic:
            pairs = [("server1", "server3"), ("server3", "server1"), ("server2", "server4"), ("server4", "server2")]
            result["wire_bytes_per_round"] = round(sum(traffic.get(p, 0) for p in pairs) / figures["rounds"] * 2)
    result["join_bound_s"] = round(state_bytes(spec, 0) / rate + 4 * rtt_s, 2)
    return result


def _interrupt(*_) -> None:
    raise KeyboardInterrupt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profiles", default="loopback,lab,100:50,20:150,100:50+20:150",
                        help="comma-separated: loopback, lab (the lab's hosts without delay or rate limit), "
                             "MBIT:RTT_MS[:LOSS] (each host's rate, the round trip), or FAST+SLOW (two of those: SLOW "
                             "for the hosts of SLOW_HOSTS)")
    parser.add_argument("--seconds", type=float, default=150.0, help="training seconds per profile")
    parser.add_argument("--spec", type=Path, default=ROOT / "runs" / "demo.toml")
    parser.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "swarm")
    parser.add_argument("--env", action="append", default=[], metavar="SWARM_X=VALUE",
                        help="a peer setting for every peer (repeatable), e.g. SWARM_QUIC=0 to compare")
    parser.add_argument("--keep", action="store_true", help="keep each profile's peer logs (the path is logged)")
    parser.add_argument("--dht-probe", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.dht_probe:
        logging.basicConfig(level=logging.WARNING)
        return dht_probe(args.dht_probe)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    signal.signal(signal.SIGTERM, _interrupt)  # a SIGTERMed bench cleans up as on Ctrl-C
    results = []
    for text in args.profiles.split(","):
        name, profile, overrides = parse_profile(text)
        if profile is not None and (why := Lab.unavailable()):
            logger.warning("skipping %s: %s", name, why)
            continue
        env = dict(kv.split("=", 1) for kv in args.env)
        result = run_profile(name, (profile, overrides), args.spec, args.cache_dir, args.seconds, env, args.keep)
        base = next((r for r in [*results, result] if r["name"] == "loopback"), None)
        result["ratio_to_loopback"] = round(result["tokens_per_s"] / base["tokens_per_s"], 3) if base else None
        control = next((r for r in results if r["name"] == "lab"), None)
        if control is not None and profile is not None:
            result["ratio_to_lab"] = round(result["tokens_per_s"] / control["tokens_per_s"], 3)
        pure = [r["tokens_per_s"] for r in results if overrides and r["name"] in name.split("+")]
        if len(pure) == 2:
            result["ratio_to_better_pure"] = round(result["tokens_per_s"] / max(pure), 3)
        print(json.dumps(result), flush=True)
        results.append(result)
    print(json.dumps({"profiles": results}), flush=True)


if __name__ == "__main__":
    main()
