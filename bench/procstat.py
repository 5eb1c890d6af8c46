"""CPU seconds of a local swarm's processes, by kind, from ``/proc`` (Linux).

Every peer of a :class:`~coordinator.launch.LocalSwarm` runs in its own session, so its processes are those whose
session id is the peer's main pid. Each is one of these kinds:

* ``server``, ``trainer``, ``coordinator``: the peer's main process (its role);
* ``p2pd``: a libp2p daemon (hivemind's ``p2pd`` binary);
* ``dht``: hivemind's DHT process, the Python child that started a ``p2pd``;
* ``averager``: another Python child of a server (hivemind's gradient and state averagers, each its own process);
* ``other``: anything else in the session (``torch_shm_manager``, a trainer's or coordinator's other children).

:func:`sample` reads the table once; :func:`cpu_between` turns two samples into CPU seconds per peer and kind.
A process that exited between the samples is missing from the second one and its last CPU seconds are lost (its
parent reaps it into ``cutime``, which is not read): the window should hold the processes that live through it.
"""

from __future__ import annotations

import os
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")
KINDS = ("server", "trainer", "coordinator", "dht", "averager", "p2pd", "other")


@dataclass(frozen=True)
class Proc:
    pid: int
    ppid: int
    sid: int
    comm: str
    cpu_s: float
    """User + system CPU seconds of the process (all its threads) since it started."""
    start: int = 0
    """When it started (clock ticks since boot): a pid reused by a new process is told apart by it."""


def read_table(root: Path = Path("/proc")) -> dict[int, Proc]:
    """Every process visible in ``root``, by pid (one that exits while it is read is skipped)."""
    table = {}
    for entry in root.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            raw = (entry / "stat").read_text()
        except OSError:
            continue
        # "pid (comm) state ppid pgrp session ...": comm may hold spaces and parentheses, so split at the last ')'
        head, _, tail = raw.rpartition(")")
        comm = head.partition("(")[2]
        fields = tail.split()
        ppid, sid = int(fields[1]), int(fields[3])
        utime, stime, start = int(fields[11]), int(fields[12]), int(fields[19])
        table[int(entry.name)] = Proc(int(entry.name), ppid, sid, comm, (utime + stime) * TICK_S, start)
    return table


def classify(table: dict[int, Proc], leaders: dict[int, str]) -> dict[int, tuple[int, str]]:
    """pid -> (its peer's leader pid, kind) for the processes of the sessions led by ``leaders`` (leader pid ->
    role), kinds as the module docstring says."""
    spawned_p2pd = {p.ppid for p in table.values() if p.comm == "p2pd"}
    out = {}
    for p in table.values():
        role = leaders.get(p.sid)
        if role is None:
            continue
        if p.pid == p.sid:
            kind = role
        elif p.comm == "p2pd":
            kind = "p2pd"
        elif p.pid in spawned_p2pd:
            kind = "dht"
        elif role == "server" and p.comm.startswith("python"):
            kind = "averager"
        else:
            kind = "other"
        out[p.pid] = (p.sid, kind)
    return out


@dataclass(frozen=True)
class Sample:
    """CPU seconds of every process of the watched sessions at monotonic time ``at``."""

    at: float
    table: dict[int, Proc]
    kinds: dict[int, tuple[int, str]]


def swarm_leaders(swarm) -> dict[int, str]:
    """Main pid (= session id) -> role, for every live peer and the coordinator of a
    :class:`~coordinator.launch.LocalSwarm`."""
    peers = swarm.peers + ([swarm.coordinator] if swarm.coordinator else [])
    return {p.proc.pid: p.role for p in peers if p.alive()}


def sample(leaders: dict[int, str], at: float) -> Sample:
    """Read ``/proc`` now (``at``: the caller's ``time.monotonic()``) for the sessions of ``leaders``."""
    table = read_table()
    kinds = classify(table, leaders)
    return Sample(at, {pid: table[pid] for pid in kinds}, kinds)


def cpu_between(first: Sample, last: Sample) -> dict[tuple[int, str], float]:
    """(leader pid, kind) -> CPU seconds its processes used from ``first`` to ``last``; a process born in between
    (a new pid, or a pid reused: another start time) counts from 0."""
    used: dict[tuple[int, str], float] = defaultdict(float)
    for pid, kind in last.kinds.items():
        proc, before = last.table[pid], first.table.get(pid)
        same = before is not None and before.start == proc.start
        used[kind] += max(0.0, proc.cpu_s - (before.cpu_s if same else 0.0))
    return dict(used)


def by_kind(used: dict[tuple[int, str], float], leaders: Iterable[int] | None = None) -> dict[str, float]:
    """Kind -> CPU seconds, summed over the peers (only those led by ``leaders`` if given)."""
    chosen = None if leaders is None else set(leaders)
    totals = {kind: 0.0 for kind in KINDS}
    for (leader, kind), seconds in used.items():
        if chosen is None or leader in chosen:
            totals[kind] += seconds
    return totals


def io_bytes(pids: Iterable[int], root: Path = Path("/proc")) -> dict[int, int]:
    """pid -> bytes it read and wrote through ``read``/``write`` system calls so far (``rchar + wchar`` of
    ``/proc/<pid>/io``: sockets and pipes included, disk reads served from the page cache too); a process whose
    file cannot be read is left out."""
    out = {}
    for pid in pids:
        path = root / str(pid) / "io"
        if path.exists():
            out[pid] = _field(path, "rchar:") + _field(path, "wchar:")
    return out


def memory_by_session(leaders: Iterable[int], root: Path = Path("/proc")) -> dict[int, tuple[int, int]]:
    """Leader pid -> (resident bytes, proportional bytes) of all the processes of its session now.

    Resident (``VmRSS``) counts a shared page in every process that maps it, so it overstates a peer that shares
    memory with its children or other peers (torch's and hivemind's code, forked children's pages);
    proportional (``Pss`` of ``smaps_rollup``: each shared page divided among its mappers) sums to what the
    machine holds, so peers times their PSS is the memory a swarm needs. PSS is 0 where ``smaps_rollup`` cannot
    be read (kernels before 4.14, another user's process)."""
    chosen, out = set(leaders), {}
    for proc in read_table(root).values():
        if proc.sid not in chosen:
            continue
        rss, pss = _field(root / str(proc.pid) / "status", "VmRSS:"), _field(
            root / str(proc.pid) / "smaps_rollup", "Pss:")
        had = out.get(proc.sid, (0, 0))
        out[proc.sid] = (had[0] + rss * 1024, had[1] + pss * 1024)
    return out


def machine_cpu(root: Path = Path("/proc")) -> tuple[float, float, float]:
    """(busy, idle, steal) CPU seconds of the whole machine since boot, summed over its cores (the ``cpu`` line of
    ``/proc/stat``: busy is user, nice, system, irq and softirq; idle is idle and iowait; steal is the time a
    virtual machine's host ran something else while this machine had work: its cores were not this machine's)."""
    fields = [int(x) for x in (root / "stat").read_text().splitlines()[0].split()[1:9]]
    user, nice, system, idle, iowait, irq, softirq, steal = fields
    return (user + nice + system + irq + softirq) * TICK_S, (idle + iowait) * TICK_S, steal * TICK_S


def _field(path: Path, name: str) -> int:
    """The number after ``name`` on the line starting with it in a /proc file (0 if unreadable or absent)."""
    try:
        text = path.read_text()
    except OSError:
        return 0
    for line in text.splitlines():
        if line.startswith(name):
            return int(line.split()[1])
    return 0


__all__ = ["KINDS", "Proc", "Sample", "by_kind", "classify", "cpu_between", "io_bytes", "machine_cpu",
           "memory_by_session", "read_table", "sample", "swarm_leaders"]
