"""``swarm-peer check``: can this machine join a run? Each failed check says how to fix it.

Local checks: Python and torch build, compute device and memory, the device and kernel backend a server would
use (``SWARM_DEVICE``, ``SWARM_KERNELS``), the cache folder, the identity file, disk for checkpoint fragments, the
listen port. With a run address also: the run's spec verifies and speaks this
peer's protocol version, whether the address this peer would announce can be dialled from outside its
network, and the clock skew against the run's records.
"""

from __future__ import annotations

import ipaddress
import os
import shutil
import socket
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

from swarm.config import PROTOCOL_VERSION
from swarm.settings import PeerSettings

MIN_FREE_RAM = 2 << 30
"""Bytes of available memory below which a server will struggle (the demo stage needs ~1 GiB)."""


@dataclass
class Check:
    name: str
    ok: bool
    detail: str
    fix: str = ""


def _python() -> Check:
    v = sys.version_info
    ok = (v.major, v.minor) >= (3, 11)
    return Check("python", ok, f"Python {v.major}.{v.minor}.{v.micro}", "" if ok else "install Python 3.11")


def _torch() -> Check:
    try:
        import torch
    except Exception as e:  # a broken install raises more than ImportError
        return Check("torch", False, f"cannot import torch ({type(e).__name__}: {e})",
                     "reinstall: pip install 'torch==2.13.0'")
    build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "CPU build"
    return Check("torch", True, f"torch {torch.__version__} ({build}), {torch.get_num_threads()} threads")


def available_memory() -> int:
    """Bytes of memory available to new processes (Linux ``MemAvailable``; free pages elsewhere)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _device() -> Check:
    import torch

    free = available_memory()
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        detail = f"{p.name}, {p.total_memory / 2**30:.1f} GiB GPU memory; {free / 2**30:.1f} GiB RAM available"
    else:
        detail = f"CPU, {os.cpu_count()} cores; {free / 2**30:.1f} GiB RAM available"
    ok = free >= MIN_FREE_RAM
    return Check("device", ok, detail, "" if ok else "free memory or join as a trainer (--role trainer)")


def _compute(settings: PeerSettings) -> Check:
    """The device and kernel backend a server would compute with (``SWARM_DEVICE``, ``SWARM_KERNELS``)."""
    from swarm.host import DeviceUnavailable, resolve_device
    from swarm.kernels import BackendUnavailable, select_backend

    try:
        device = resolve_device(settings.device)
        kernels = select_backend(settings.kernels, device)
    except (DeviceUnavailable, BackendUnavailable) as e:
        return Check("compute", False, str(e).split(";")[0], "set SWARM_DEVICE=auto and SWARM_KERNELS=auto, or see "
                     "docs/troubleshooting.md#kernels-and-precision")
    return Check("compute", True, f"a server computes on {device} with the {kernels.name!r} kernels", "")


def _writable(name: str, folder: Path, setting: str) -> Check:
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".check-{os.getpid()}"
        probe.write_bytes(b"ok")
        probe.unlink()
        return Check(name, True, f"{folder} is writable")
    except OSError as e:
        return Check(name, False, f"{folder} is not writable ({e.strerror})",
                     f"set {setting} to a folder this user can write (a volume in containers)")


def _identity(settings: PeerSettings) -> Check:
    from swarm.identity import Identity

    path = settings.identity_path()
    try:
        ident = Identity.load_or_create(path)
    except (OSError, ValueError) as e:
        return Check("identity", False, f"{path}: {e}", "remove or fix the file, or set SWARM_IDENTITY_FILE")
    return Check("identity", True, f"peer id {ident.peer_id} ({path})")


def _fragment_disk(settings: PeerSettings) -> Check:
    folder = settings.fragment_path()
    folder.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(folder).free
    budget = settings.fragment_max_bytes
    ok = free >= budget
    return Check("fragment disk", ok, f"{free / 2**30:.1f} GiB free at {folder}, budget {budget / 2**30:.1f} GiB",
                 "" if ok else f"lower SWARM_FRAGMENT_MAX_BYTES below {free} or free disk")


def _port(settings: PeerSettings) -> Check:
    if settings.port == 0:
        return Check("port", True, "SWARM_PORT=0: a free port is picked at start (set one to forward it)")
    with socket.socket() as s:
        try:
            s.bind((settings.host, settings.port))
        except OSError as e:
            return Check("port", False, f"cannot listen on {settings.host}:{settings.port} ({e.strerror})",
                         "pick another SWARM_PORT or stop the process using it")
    return Check("port", True, f"{settings.host}:{settings.port} is free")


def _run_hosts(address: Optional[str]) -> list[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    """The IP addresses of a run address's bootstrap peers (``/ip4/<addr>/...``, ``/ip6/<addr>/...``); [] if
    there is no address or one of them is not an IP (a DNS name: the run is somewhere else)."""
    if not address:
        return []
    hosts = []
    for maddr in address.partition("@")[2].split(","):
        parts = maddr.split("/")
        try:
            hosts.append(ipaddress.ip_address(parts[2]) if len(parts) > 2 and parts[1] in ("ip4", "ip6") else None)
        except ValueError:
            return []
    return [] if None in hosts else hosts


def _reachability(settings: PeerSettings, address: Optional[str] = None) -> Check:
    host = settings.announce_host or settings.host
    if settings.client_mode:
        return Check("reachability", True, "client mode: this peer dials out only and joins as a trainer")
    try:
        addr = ipaddress.ip_address(host if host != "0.0.0.0" else _default_ip())
    except ValueError:
        return Check("reachability", True, f"announcing {host}")
    run_hosts = _run_hosts(address)
    if addr.is_loopback and any(h.is_loopback for h in run_hosts):
        return Check("reachability", True, f"announcing {addr}: the run is served from this machine (its address "
                     "lists loopback), where its peers reach this one; peers on other machines could not",
                     "to let other machines join, serve the run on a routable address (--host 0.0.0.0) and give "
                     "this peer one (SWARM_HOST=0.0.0.0, and SWARM_ANNOUNCE_HOST behind a NAT)")
    if addr.is_private and not addr.is_loopback and settings.relay == "auto":
        return Check("reachability", True, f"private address {addr}: if peers outside its network cannot dial it, "
                     "the swarm reaches this server through a public peer's relay (SWARM_RELAY=auto; slower)",
                     "for a direct link, forward SWARM_PORT and set SWARM_ANNOUNCE_HOST to your public address")
    if addr.is_private or addr.is_loopback:
        return Check("reachability", False, f"this peer would announce {addr}, which peers outside its network "
                     "cannot dial", "forward SWARM_PORT and set SWARM_ANNOUNCE_HOST to your public address, "
                     "set SWARM_RELAY=auto on a non-loopback SWARM_HOST to be reached through a relay, "
                     "or set SWARM_CLIENT_MODE=1 to join as a trainer")
    return Check("reachability", True, f"announcing public address {addr}")


def _default_ip() -> str:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # no packet is sent: this only picks the outgoing interface
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"


def _run(address: str, settings: PeerSettings, timeout: float) -> list[Check]:
    from hivemind.utils import get_dht_time

    from swarm.config import SpecError
    from swarm.net.dht import RunAddressError, connect_run

    try:
        dht, directory, spec, _ = connect_run(address, settings.model_copy(update={"port": 0}), timeout=timeout)
    except RunAddressError as e:
        return [Check("run", False, str(e), "copy the address printed by `swarm-coordinator serve`")]
    except SpecError as e:
        return [Check("run", False, str(e), "check the address, your network, and that you run the same "
                      f"version as the run (this peer speaks protocol {PROTOCOL_VERSION})")]
    try:
        records = [s for k in range(spec.model.num_stages) for s in directory.servers(k)]
        now = get_dht_time()
        checks = [Check("run", True, f"run {directory.run_id}: spec verified, protocol {spec.protocol_version}, "
                        f"{len(records)} servers announced")]
        if records:
            ahead = max(s.time - now for s in records)  # a record from the future: our clock is behind
            behind = min(now - s.time for s in records) - directory.ttl  # all records too old: ours is ahead
            skew = max(ahead, behind, 0.0)
            ok = skew < 5.0
            checks.append(Check("clock", ok, f"skew against the run's records about {skew:.1f} s",
                                "" if ok else "synchronise the clock (NTP): records expire by DHT time"))
        return checks
    finally:
        dht.shutdown()


def run_checks(settings: PeerSettings, address: Optional[str] = None, timeout: float = 30.0) -> list[Check]:
    checks = [_python(), _torch(), _device(), _compute(settings),
              _writable("cache", settings.cache_dir, "SWARM_CACHE_DIR"),
              _identity(settings), _fragment_disk(settings), _port(settings), _reachability(settings, address)]
    if address:
        checks += _run(address, settings, timeout)
    return checks


def as_dict(checks: list[Check]) -> dict:
    return {"ok": all(c.ok for c in checks), "checks": [asdict(c) for c in checks]}
