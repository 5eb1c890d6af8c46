"""A WAN lab on one machine: every host in its own network namespace, joined by a user-space link emulator.

    with Lab(["coordinator", "server1", "trainer1"], Profile("wan", rtt_ms=50, mbit=100)) as lab:
        figures = lab.measure("server1", "trainer1")           # {'rtt_ms': 50.4, 'mbit': 95.1, ...}
        subprocess.run([*lab.prefix("server1"), "python", ...])  # runs inside server1's namespace
        lab.ip("server1")                                     # '10.213.0.2'

Each host gets a namespace ``swarmwan-<pid>-<i>`` with loopback up, IPv6 off, and a TUN device ``wan0`` holding
``10.213.0.<i+1>/16``; the lab's switch process (:mod:`bench.wanlab.switch`) owns every ``wan0`` and carries
packets between them with the profile's delay, loss and download rate; a ``tbf`` qdisc on each ``wan0`` caps its
upload. The initial namespace gets a TUN device ``swl<pid>`` holding :data:`OBSERVER_IP` with no delay or cap,
so the process that runs the lab (a benchmark, a test) reaches every host as a monitor would.

Needs root, ``ip`` and ``tc`` (iproute2), ``/dev/net/tun`` and the ``tbf`` qdisc; :meth:`Lab.unavailable` says
which is missing, for a skip. :meth:`Lab.close` (also on error and Ctrl-C, at the end of a ``with`` block)
kills every process left in the namespaces, stops the switch (its TUN devices go with it) and deletes the
namespaces; :func:`leftovers` lists anything of a lab still on the machine, and :func:`sweep` removes what
labs of dead processes left behind. Only addresses inside the namespaces this lab creates are ever targets.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

from bench.wanlab.probe import measure_between

ROOT = Path(__file__).resolve().parents[2]
PREFIX = "swarmwan-"
SUBNET = "10.213"
OBSERVER_IP = f"{SUBNET}.255.254"
PROBE_PORT = 5201


class LabError(RuntimeError):
    """A lab command failed (the message has the command and its output)."""


@dataclass(frozen=True)
class Profile:
    """One kind of link: every host's in a lab, but those of the hosts it overrides (:class:`Lab`).

    :param rtt_ms: round trip between two hosts (milliseconds); each host adds half of it.
    :param mbit: each host's upload and download rate (megabits per second; 0: not capped).
    :param loss: each host's packet loss probability per direction (a pair loses about twice it).
    :param mtu: bytes per packet on ``wan0`` (1500, as on the internet).
    :param queue_ms: the longest a packet waits in a rate limiter before it is dropped (milliseconds).
    """

    name: str
    rtt_ms: float = 0.0
    mbit: float = 0.0
    loss: float = 0.0
    mtu: int = 1500
    queue_ms: float = 100.0


def _run(*args: str, timeout: float = 15) -> str:
    done = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise LabError(f"{' '.join(args)}: {done.stderr.strip() or done.stdout.strip()}")
    return done.stdout


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def _namespaces() -> list[str]:
    try:
        return [line.split()[0] for line in _run("ip", "netns", "list").splitlines() if line.strip()]
    except (LabError, FileNotFoundError):
        return []


def leftovers() -> list[str]:
    """Everything of any lab still on this machine: its namespaces, its observer devices, its switches, its
    folders."""
    found = [f"namespace {n}" for n in _namespaces() if n.startswith(PREFIX)]
    try:
        links = _run("ip", "-o", "link", "show")
    except (LabError, FileNotFoundError):
        links = ""
    found += [f"device {m}" for m in re.findall(r"^\d+: (swl\d+)[:@]", links, re.M)]
    out = subprocess.run(["pgrep", "-f", "bench.wanlab.switch"], capture_output=True, text=True).stdout.split()
    found += [f"switch process {p}" for p in out if int(p) != os.getpid()]
    return found + [f"folder {d}" for d in _folders()]


def _folders() -> list[Path]:
    """The labs' folders (switch configuration, stats, log): ``<tmp>/swarmwan-<pid of the lab's owner>-*``."""
    return [d for d in Path(tempfile.gettempdir()).glob(f"{PREFIX}*") if re.match(rf"{PREFIX}\d+-", d.name)]


def sweep() -> list[str]:
    """Delete the namespaces and folders of labs whose process is gone (a lab killed with SIGKILL), ending the
    switch that still writes there; returns their names."""
    removed = []
    for name in _namespaces():
        m = re.fullmatch(rf"{PREFIX}(\d+)-\d+", name)
        if m and not _pid_alive(int(m.group(1))):
            _kill_namespace_processes(name)
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=15)
            removed.append(name)
    for folder in _folders():
        if not _pid_alive(int(folder.name[len(PREFIX):].split("-")[0])):
            subprocess.run(["pkill", "-KILL", "-f", f"bench.wanlab.switch {folder}/"], capture_output=True, timeout=15)
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(str(folder))
    return removed


def _kill_namespace_processes(ns: str) -> None:
    try:
        pids = [int(p) for p in _run("ip", "netns", "pids", ns).split()]
    except LabError:
        return
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@dataclass
class Lab:
    """Hosts on emulated internet links (see the module docstring). ``hosts``: their names, in order;
    ``profile``: their link; ``overrides``: another link for some of them (a mixed swarm: two hosts of profiles
    ``a`` and ``b`` then see ``(a.rtt_ms + b.rtt_ms) / 2`` of round trip, and each its own rates and loss; the MTU
    and the queue are ``profile``'s for all)."""

    hosts: Sequence[str]
    profile: Profile
    overrides: dict[str, Profile] = field(default_factory=dict)
    _ns: dict[str, str] = field(default_factory=dict, init=False)
    _switch: Optional[subprocess.Popen] = field(default=None, init=False)
    _dir: Optional[Path] = field(default=None, init=False)

    @staticmethod
    def unavailable() -> Optional[str]:
        """Why a lab cannot run on this machine, or None."""
        if os.geteuid() != 0:
            return "the WAN lab needs root (network namespaces, TUN devices, tc)"
        for tool in ("ip", "tc"):
            if shutil.which(tool) is None:
                return f"the WAN lab needs iproute2's {tool}"
        if not os.path.exists("/dev/net/tun"):
            return "the WAN lab needs /dev/net/tun (the tun kernel module)"
        probe = f"{PREFIX}{os.getpid()}-probe"
        try:
            _run("ip", "netns", "add", probe)
            _run("tc", "-n", probe, "qdisc", "add", "dev", "lo", "root", "tbf", "rate", "1mbit", "burst", "16kb",
                 "latency", "50ms")
        except (LabError, FileNotFoundError, subprocess.TimeoutExpired) as e:
            return f"this machine cannot make network namespaces with tbf links: {e}"
        finally:
            subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=15)
        return None

    # ---- lifecycle ------------------------------------------------------------------------------------
    def __enter__(self) -> "Lab":
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> None:
        sweep()
        if len(self.hosts) > 250:
            raise LabError(f"{len(self.hosts)} hosts: a lab holds at most 250")
        if unknown := set(self.overrides) - set(self.hosts):
            raise LabError(f"overrides for hosts the lab does not have: {sorted(unknown)}")
        routes = _run("ip", "route", "show")
        if re.search(rf"^{re.escape(SUBNET)}\.", routes, re.M):
            raise LabError(f"the subnet {SUBNET}.0.0/16 is already routed here (another lab?):\n{routes}")
        self._dir = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-"))  # its owner's pid, for sweep()
        for i, host in enumerate(self.hosts):
            ns = self._ns[host] = f"{PREFIX}{os.getpid()}-{i}"
            _run("ip", "netns", "add", ns)
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            _run("ip", "netns", "exec", ns, "sysctl", "-q", "-w", "net.ipv6.conf.all.disable_ipv6=1")
        self._start_switch()
        for host, ns in self._ns.items():
            _run("ip", "-n", ns, "addr", "add", f"{self.ip(host)}/16", "dev", "wan0")
            _run("ip", "-n", ns, "link", "set", "wan0", "mtu", str(self.profile.mtu), "up")
            if (mbit := self.link(host).mbit) > 0:
                burst = max(16 * 1024, int(mbit * 1e6 / 8 * 0.004), 2 * self.profile.mtu)
                _run("tc", "-n", ns, "qdisc", "add", "dev", "wan0", "root", "tbf", "rate", f"{mbit}mbit",
                     "burst", str(burst), "latency", f"{self.profile.queue_ms:g}ms")
        _run("ip", "addr", "add", f"{OBSERVER_IP}/16", "dev", self.observer_device)
        _run("ip", "link", "set", self.observer_device, "mtu", str(self.profile.mtu), "up")

    @property
    def observer_device(self) -> str:
        return f"swl{os.getpid()}"

    def link(self, host: str) -> Profile:
        """The profile of ``host``'s link (its override, else the lab's)."""
        return self.overrides.get(host, self.profile)

    def _start_switch(self) -> None:
        p = self.profile
        hosts = [dict(name=h, device="wan0", netns=f"/var/run/netns/{ns}", ip=self.ip(h), rtt_ms=self.link(h).rtt_ms,
                      mbit=self.link(h).mbit, loss=self.link(h).loss) for h, ns in self._ns.items()]
        hosts.append(dict(name="observer", device=self.observer_device, netns=None, ip=OBSERVER_IP, rtt_ms=0.0,
                          mbit=0.0, loss=0.0))
        config = self._dir / "switch.json"
        config.write_text(json.dumps(dict(hosts=hosts, queue_ms=p.queue_ms, stats_path=str(self.stats_path))))
        errors = self._dir / "switch.log"  # (a file, not a pipe nobody reads that could fill and block it)
        with open(errors, "w") as err:
            self._switch = subprocess.Popen([sys.executable, "-m", "bench.wanlab.switch", str(config)], cwd=ROOT,
                                            stdout=subprocess.PIPE, stderr=err, text=True)
        line = self._switch.stdout.readline().strip()
        if line != "ready":
            self._switch.kill()
            self._switch.wait()
            raise LabError(f"the lab's switch did not start: {line} {errors.read_text()[-2000:]}")

    def switch_cpu_s(self) -> float:
        """CPU seconds the switch process used so far (user and system; 0 once it stopped)."""
        if self._switch is None or self._switch.poll() is not None:
            return 0.0
        try:
            fields = Path(f"/proc/{self._switch.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return 0.0
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def close(self) -> None:
        """Kill what runs in the namespaces, stop the switch, delete the namespaces (idempotent)."""
        for ns in self._ns.values():
            _kill_namespace_processes(ns)
        if self._switch is not None:
            if self._switch.poll() is None:
                self._switch.send_signal(signal.SIGTERM)
                try:
                    self._switch.wait(10)
                except subprocess.TimeoutExpired:
                    self._switch.kill()
                    self._switch.wait()
            self._switch = None
        for ns in self._ns.values():
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=15)
        self._ns.clear()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    # ---- using it -------------------------------------------------------------------------------------
    def ip(self, host: str) -> str:
        """The host's address on the lab's subnet."""
        return f"{SUBNET}.0.{list(self.hosts).index(host) + 1}"

    def place(self, host: str) -> tuple[list[str], str]:
        """``(command prefix, address)`` of a host: a :data:`coordinator.launch.Placement` for
        :class:`~coordinator.launch.LocalSwarm`, whose peer names are the lab's host names."""
        return self.prefix(host), self.ip(host)

    def prefix(self, host: str) -> list[str]:
        """The command prefix that runs a program inside ``host``'s namespace."""
        return ["ip", "netns", "exec", self._ns[host]]

    @property
    def stats_path(self) -> Path:
        return self._dir / "switch-stats.json"

    def _stats(self) -> dict:
        """The switch's counters as it last wrote them (every half second); empty before the first write."""
        try:
            return json.loads(self.stats_path.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return {}

    def traffic(self) -> dict[tuple[str, str], int]:
        """IP bytes the switch carried so far per (source host, destination host) (half a second old at most)."""
        return {tuple(k.split(">", 1)): v for k, v in self._stats().get("bytes", {}).items()}

    def protocols(self) -> dict[str, int]:
        """IP bytes the switch carried so far per transport protocol (``tcp``, ``udp``)."""
        return self._stats().get("protocols", {})

    def measure(self, src: str, dst: str, seconds: float = 3.0) -> dict:
        """TCP round trip (ms) and throughput (Mbit/s) from ``src`` to ``dst``, measured now (:mod:`.probe`)."""
        try:
            return measure_between(self.prefix(dst), self.prefix(src), self.ip(dst), PROBE_PORT, seconds)
        except RuntimeError as e:
            raise LabError(f"measuring the link {src} -> {dst}: {e}") from None


__all__ = ["Lab", "LabError", "OBSERVER_IP", "Profile", "leftovers", "sweep"]
