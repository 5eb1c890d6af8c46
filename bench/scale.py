"""A local swarm at the scale this machine holds: many real peers, each its own process with its own p2pd.

    python bench/scale.py [--spec runs/tiny.toml] [--servers-per-stage 20] [--trainers 8] [--group-size 8]
                          [--target-batch-size N] [--set SECTION.FIELD=VALUE ...] [--warmup 60] [--window 120]
                          [--baseline 2] [--logs DIR]

Starts a coordinator, ``--servers-per-stage`` servers per stage (one after another, as volunteers join) and
``--trainers`` trainers on loopback, trains for ``--warmup`` seconds, then measures a ``--window``; with
``--baseline K`` (default 2) it first measures the same bench at K servers per stage and ``--trainers`` scaled
alike, so the last line compares the two (``growth``: large over baseline). Reported per run:

* ``peers``, ``epochs`` (the stages' epochs gained in the window, their minimum), ``tokens_per_s`` (the trainers'
  tokens between their records);
* ``round_success``: averaging attempts that completed over all attempts (the servers' ``rounds`` and ``failed``
  counters; hivemind retries a failed attempt within the round's ``averaging_timeout``), ``rounds_per_server``;
* ``group_size_mean`` (members per group a server averaged in, over its hops), ``hops_per_round``;
* ``round_s_p50``/``p99`` (the epoch lines' ``round_s``: the mean of a server's rounds since its last line);
* ``dht_get_ms_p50``/``p99`` and ``dht_store_ms_p50``/``p99``: this bench's own DHT client reading a stage's
  records and storing a sub-key every ``--probe-every`` seconds through the window;
* ``stage_read_kb``: the sealed server records one read of a stage returns (what every server and trainer reads
  every few seconds), mean;
* ``dht_kb_per_peer_min``: by peer kind, the bytes one peer's DHT process read and wrote per minute through the
  window (``rchar + wchar``: its p2pd socket and the pipe to its peer's main process, so about twice its DHT
  traffic), the peers' mean;
* ``cores``: by process kind (:mod:`bench.procstat`: main processes by role, ``dht``, ``averager``, ``p2pd``), the
  cores all peers' processes of that kind kept busy through the window, and their ``total``: at the machine's
  core count, the bench measures the host's CPU, not the protocol;
* ``bytes_per_server_round``: averaging bytes sent and received over rounds, the servers' mean;
* ``status_s``: seconds of ``swarm-coordinator status --json`` at the window's end, a fresh process (most of it is
  importing torch and hivemind and joining the DHT, the same at any size); ``status_read_s``: of that, the reads and
  the summary (:func:`coordinator.status.snapshot`, timed in this process), which grow with the records;
* ``peak_rss_mb``, ``peak_pss_mb``: by peer kind, the most any peer's processes held at once (sampled every 5 s),
  resident and proportional (shared pages divided among the processes that map them: what the peer count needs).

Prints progress on stderr and one JSON line on stdout (the last line). What limits the peer count on a host is
its memory (``peak_pss_mb``) and cores: every peer runs a main process, a DHT process, a p2pd and (servers) two
averager processes.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import procstat  # noqa: E402
from bench.efficiency import records, spec_written  # noqa: E402
from bench.simulate import spec_with  # noqa: E402
from bench.swarm_vs_local import wait  # noqa: E402
from coordinator.demo import start_servers  # noqa: E402
from coordinator.launch import LocalSwarm  # noqa: E402
from coordinator.status import snapshot  # noqa: E402
from hivemind.utils import get_dht_time  # noqa: E402
from swarm.config import RunSpec  # noqa: E402
from swarm.settings import PeerSettings  # noqa: E402
from swarm.data import prepare_dataset  # noqa: E402
from swarm.host import keep_freed_memory  # noqa: E402
from swarm.net.dht import connect_run  # noqa: E402
from swarm.protocol import stage_key  # noqa: E402

logger = logging.getLogger("bench.scale")
ROUND_S = re.compile(r"^(\d\d:\d\d:\d\d) .* round_s=([0-9.]+) ")


def percentile(values: list[float], q: float) -> float | None:
    """The ``q`` quantile (0-1) of ``values`` by nearest rank, or None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered)) - 1))]


class Probe(threading.Thread):
    """Times this bench's DHT gets (a stage's records) and stores (a sub-key of its own) until stopped."""

    def __init__(self, dht, run_id: str, every_s: float):
        super().__init__(daemon=True)
        self.dht, self.key, self.every_s = dht, stage_key(run_id, 0), every_s
        self.gets: list[float] = []
        self.stores: list[float] = []
        self.read_bytes: list[int] = []  # the sealed records one read of the stage returned, bytes
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(self.every_s):
            began = time.perf_counter()
            found = self.dht.get(self.key, latest=True)
            self.gets.append(1000 * (time.perf_counter() - began))
            if found is not None and isinstance(found.value, dict):
                self.read_bytes.append(sum(len(item.value) for item in found.value.values()))
            began = time.perf_counter()
            self.dht.store(f"{self.key}/bench-probe", b"x", get_dht_time() + 30, subkey=b"probe")
            self.stores.append(1000 * (time.perf_counter() - began))


class Memory(threading.Thread):
    """The peak resident and proportional bytes of each peer's processes (:func:`bench.procstat.memory_by_session`),
    sampled every ``every_s`` seconds until stopped."""

    def __init__(self, swarm: LocalSwarm, every_s: float = 5.0):
        super().__init__(daemon=True)
        self.swarm, self.every_s = swarm, every_s
        self.peak: dict[int, tuple[int, int]] = {}  # leader pid -> (peak RSS, peak PSS), bytes
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(self.every_s):
            roles = {p.proc.pid: p.role for p in self.swarm.peers if p.alive()}
            for pid, (rss, pss) in procstat.memory_by_session(roles).items():
                had = self.peak.get(pid, (0, 0))
                self.peak[pid] = (max(had[0], rss), max(had[1], pss))

    def by_role(self, which: int) -> dict[str, float]:
        """Peer kind -> the most MiB one peer of that kind held (``which``: 0 RSS, 1 PSS)."""
        roles = {p.proc.pid: p.role for p in self.swarm.peers}
        out: dict[str, float] = {}
        for pid, peak in self.peak.items():
            role = roles.get(pid, "other")
            out[role] = max(out.get(role, 0.0), round(peak[which] / 2**20, 1))
        return out


def dht_io(swarm: LocalSwarm) -> tuple[dict[int, tuple[str, int]], procstat.Sample]:
    """Peer (leader pid) -> (role, bytes its DHT process read and wrote so far: :func:`bench.procstat.io_bytes`),
    and the CPU sample of the same read of ``/proc``."""
    leaders = {p.proc.pid: p.role for p in swarm.peers if p.alive()}
    cpu = procstat.sample(leaders, time.monotonic())
    dht = {pid: leader for pid, (leader, kind) in cpu.kinds.items() if kind == "dht"}
    return {dht[pid]: (leaders[dht[pid]], n) for pid, n in procstat.io_bytes(dht).items()}, cpu


def cores_by_kind(first: procstat.Sample, last: procstat.Sample) -> dict[str, float]:
    """Process kind -> cores its processes kept busy between the samples, all peers together (``total``: every
    kind; the machine has ``os.cpu_count()``)."""
    used = procstat.by_kind(procstat.cpu_between(first, last))
    seconds = max(1e-9, last.at - first.at)
    out = {kind: round(cpu / seconds, 2) for kind, cpu in used.items() if cpu}
    return dict(out, total=round(sum(used.values()) / seconds, 2))


def dht_kb_per_min(before: dict, after: dict, seconds: float) -> dict[str, float]:
    """Role -> KiB per minute one peer's DHT process moved in the window, the mean over the peers of that role."""
    rates: dict[str, list[float]] = {}
    for leader, (role, n) in after.items():
        if leader in before and seconds > 0:
            rates.setdefault(role, []).append((n - before[leader][1]) / 1024 / (seconds / 60))
    return {role: round(statistics.mean(r), 1) for role, r in rates.items()}


def round_times(logs: Path, since: str) -> list[float]:
    """Every ``round_s`` of the servers' epoch lines at or after wall-clock ``since`` (``HH:MM:SS``)."""
    out = []
    for log in logs.glob("server*.log"):
        for line in log.read_text(errors="replace").splitlines():
            found = ROUND_S.match(line)
            if found and found.group(1) >= since:
                out.append(float(found.group(2)))
    return out


def averaging_growth(before: dict, after: dict) -> dict:
    """Sums over the servers present in both reads of their averaging counters' growth, and each server's bytes
    per round."""
    totals = {"rounds": 0, "failed": 0, "groups": 0, "group_members": 0}
    per_round = []
    for key, old in before.items():
        new = after.get(key)
        if new is None:
            continue
        grew = {k: new.averaging.get(k, 0) - old.averaging.get(k, 0) for k in ("rounds", "failed", "groups",
                                                                                 "group_members", "sent", "received")}
        for k in totals:
            totals[k] += max(0, grew[k])
        if grew["rounds"] > 0:
            per_round.append((grew["sent"] + grew["received"]) / grew["rounds"])
    totals["bytes_per_server_round"] = round(statistics.mean(per_round)) if per_round else None
    return totals


def status_seconds(address: str) -> float:
    began = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "coordinator", "status", address, "--json"], capture_output=True,
                          text=True, timeout=300)
    if done.returncode != 0:
        logger.warning("status --json failed: %s", done.stderr[-500:])
    return round(time.monotonic() - began, 2)


def measure(spec_path: Path, spec: RunSpec, per_stage: int, trainers: int, args) -> dict:
    """One swarm of ``per_stage`` servers per stage and ``trainers`` trainers: the module docstring's figures."""
    stages = spec.model.num_stages
    with tempfile.TemporaryDirectory(prefix="swarm-scale-") as workdir, \
            LocalSwarm(spec_path, Path(workdir) / "swarm", PeerSettings().cache_dir) as swarm:
        address = swarm.start_coordinator()
        dht, directory, _, _ = connect_run(address, PeerSettings(host="127.0.0.1"), client_mode=True)
        memory = Memory(swarm)
        memory.start()
        try:
            began = time.monotonic()
            start_servers(swarm, directory, stages, per_stage)
            joined_s = time.monotonic() - began
            logger.info("%d servers online in %.0f s", stages * per_stage, joined_s)
            for share in range(trainers):
                swarm.start_peer("trainer", "--share", str(share % spec.data.num_shares))
            wait(lambda: sum(t.tokens for t in directory.trainers()) > 0, 600, "the trainers' first tokens")
            time.sleep(args.warmup)
            probe = Probe(dht, directory.run_id, args.probe_every)
            since = time.strftime("%H:%M:%S")
            before = records(directory, stages)
            io_before, cpu_before = dht_io(swarm)
            probe.start()
            time.sleep(args.window)
            probe.stop.set()
            probe.join()
            io_after, cpu_after = dht_io(swarm)
            dht_kb = dht_kb_per_min(io_before, io_after, cpu_after.at - cpu_before.at)
            cores = cores_by_kind(cpu_before, cpu_after)
            after = records(directory, stages)
            status_s = status_seconds(address)
            began = time.monotonic()
            snapshot(directory, spec)
            status_s = (status_s, round(time.monotonic() - began, 2))
            times = round_times(swarm.workdir / "logs", since)
        finally:
            memory.stop.set()
            dht.shutdown()
            if args.logs is not None:
                shutil.copytree(swarm.workdir / "logs", args.logs / f"{per_stage}x{stages}", dirs_exist_ok=True)
    return dict(summarize(before, after, stages, per_stage, trainers, probe, times, status_s, memory, joined_s),
                dht_kb_per_peer_min=dht_kb, cores=cores)


def summarize(before, after, stages, per_stage, trainers, probe, times, status_s, memory, joined_s) -> dict:
    servers_before, servers_after = before[0], after[0]
    avg = averaging_growth(servers_before, servers_after)
    attempts = avg["rounds"] + avg["failed"]
    epochs = {}
    for s in servers_after.values():
        old = servers_before.get(s.peer_id)
        if old is not None:
            epochs[s.stage] = max(epochs.get(s.stage, 0), s.epoch - old.epoch)
    tokens = sum(max(0, t.tokens - before[1][k].tokens) for k, t in after[1].items() if k in before[1])
    window = max((t.time - before[1][k].time for k, t in after[1].items() if k in before[1]), default=0.0)
    return {
        "peers": stages * per_stage + trainers, "servers_per_stage": per_stage, "trainers": trainers,
        "servers_online_s": round(joined_s, 1),
        "epochs": min(epochs.values(), default=0), "tokens_per_s": round(tokens / window, 1) if window else 0.0,
        "round_success": round(avg["rounds"] / attempts, 3) if attempts else None,
        "rounds_per_server": round(avg["rounds"] / max(1, len(servers_after)), 2),
        "group_size_mean": round(avg["group_members"] / avg["groups"], 2) if avg["groups"] else None,
        "hops_per_round": round(avg["groups"] / avg["rounds"], 2) if avg["rounds"] else None,
        "round_s_p50": percentile(times, 0.5), "round_s_p99": percentile(times, 0.99),
        "dht_get_ms_p50": _ms(percentile(probe.gets, 0.5)), "dht_get_ms_p99": _ms(percentile(probe.gets, 0.99)),
        "dht_store_ms_p50": _ms(percentile(probe.stores, 0.5)),
        "dht_store_ms_p99": _ms(percentile(probe.stores, 0.99)),
        "stage_read_kb": round(statistics.mean(probe.read_bytes) / 1024, 1) if probe.read_bytes else None,
        "bytes_per_server_round": avg["bytes_per_server_round"], "status_s": status_s[0],
        "status_read_s": status_s[1],
        "peak_rss_mb": memory.by_role(0), "peak_pss_mb": memory.by_role(1),
    }


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--spec", type=Path, default=ROOT / "runs" / "tiny.toml")
    parser.add_argument("--servers-per-stage", type=int, default=20)
    parser.add_argument("--trainers", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=None, help="[averaging] group_size (default: the spec's)")
    parser.add_argument("--target-batch-size", type=int, default=None, help="[training] target_batch_size (default: "
                        "the spec's; the tiny spec's 32 makes an epoch, hence an averaging round and its matchmaking, "
                        "every second at 2 x 2 servers, far more often than a real run)")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                        help="change the spec, e.g. --set averaging.matchmaking_time=3")
    parser.add_argument("--warmup", type=float, default=60.0, help="seconds of training before the window")
    parser.add_argument("--window", type=float, default=120.0, help="seconds measured")
    parser.add_argument("--probe-every", type=float, default=1.0, help="seconds between the bench's DHT probes")
    parser.add_argument("--baseline", type=int, default=2, help="servers per stage of the baseline run (0: none)")
    parser.add_argument("--logs", type=Path, default=None, help="copy the peers' logs into this folder")
    args = parser.parse_args()
    keep_freed_memory()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s: %(message)s")
    spec = RunSpec.from_toml(args.spec)
    if args.group_size is not None:
        spec = spec.updated(averaging={"group_size": args.group_size})
    if args.target_batch_size is not None:
        spec = spec.updated(training={"target_batch_size": args.target_batch_size})
    spec = spec_with(spec, args.set)
    prepare_dataset(spec, PeerSettings().cache_dir)
    with tempfile.TemporaryDirectory(prefix="swarm-scale-spec-") as folder:
        path = spec_written(spec, Path(folder))
        runs = []
        if args.baseline:
            scaled = max(1, round(args.trainers * args.baseline / args.servers_per_stage))
            runs.append(measure(path, spec, args.baseline, scaled, args))
            logger.info("baseline: %s", json.dumps(runs[-1]))
        runs.append(measure(path, spec, args.servers_per_stage, args.trainers, args))
        logger.info("large: %s", json.dumps(runs[-1]))
    result = dict(runs[-1], group_size=spec.averaging.group_size,
                  target_batch_size=spec.training.target_batch_size, runs=runs)
    if len(runs) == 2:
        base, large = runs
        result["growth"] = {k: round(large[k] / base[k], 2) for k in (
            "tokens_per_s", "round_s_p50", "dht_get_ms_p99", "bytes_per_server_round", "status_s", "status_read_s")
            if isinstance(base.get(k), (int, float)) and base[k] and isinstance(large.get(k), (int, float))}
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
