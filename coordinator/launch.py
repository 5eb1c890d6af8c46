"""A local swarm of real processes: a coordinator, stage servers and trainers, on loopback or wherever a
:data:`Placement` puts each of them (the WAN lab, ``bench/wanlab``, gives each its own network namespace).

Used by ``swarm-coordinator demo``, the integration tests and the benchmarks. Every peer runs in its own
session (process group) so that stopping it also stops its DHT, averager and p2pd children; each gets its own
identity file, fragment store (kept across restarts of the same name, as on a real disk) and a private temp folder
(p2pd and torch shared-memory sockets, removed on close), and all share one data cache. :meth:`LocalSwarm.close`
stops everything (SIGTERM, then SIGKILL after a grace period) and reaps it, also on Ctrl-C.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

from swarm.config import RunSpec
from swarm.identity import Identity


Placement = Callable[[str], tuple[Sequence[str], str]]
"""Where a peer runs: its name -> (a command prefix that puts it on its host, e.g. ``ip netns exec NS``; the
address it listens on). The WAN lab (``bench/wanlab``) puts each peer in its own network namespace."""


def on_loopback(name: str) -> tuple[Sequence[str], str]:
    """The default :data:`Placement`: every peer on this machine's loopback."""
    return (), "127.0.0.1"


@dataclass
class Peer:
    name: str
    role: str
    proc: subprocess.Popen
    log: Path
    identity: Identity
    port: int
    """The TCP port its p2pd listens on, and dials out from: every connection of this peer uses it."""

    @property
    def peer_id(self) -> str:
        return self.identity.peer_id

    def alive(self) -> bool:
        return self.proc.poll() is None


def free_port() -> int:
    """A TCP port on loopback that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def socket_files() -> set[str]:
    """hivemind's Unix socket files present now (``/tmp/hivemind-p2pd-*.sock``, ``hivemind-p2pclient-*.sock``:
    hivemind puts them in /tmp whatever ``TMPDIR`` says)."""
    return {str(p) for p in Path("/tmp").glob("hivemind-p2p*.sock")}


def leaked_socket_files(before: set[str]) -> list[str]:
    """Socket files that appeared since ``before`` (:func:`socket_files`) and that no live socket is bound to any
    more (absent from ``/proc/net/unix``): left behind by a process that exited without closing them (killed).
    Empty where that table cannot be read (not Linux): nothing then tells a dead file from a live one."""
    new = socket_files() - before  # listed before the table is read: a file bound meanwhile is in the table
    try:
        table = Path("/proc/net/unix").read_text()
    except OSError:
        return []
    bound = {line.split()[-1] for line in table.splitlines()[1:] if len(line.split()) > 7}
    return sorted(new - bound)


class LocalSwarm:
    """Start and stop a run's processes under ``workdir`` (created; removed on close unless ``keep``).

    :param cache_dir: shared data cache (corpus, tokenizer, tokens).
    :param placement: where each peer runs and listens (default: all on loopback).
    """

    def __init__(self, spec_path: Path, workdir: Path, cache_dir: Path, *, keep: bool = False,
                 extra_env: Optional[dict[str, str]] = None, placement: Placement = on_loopback):
        self.spec_path, self.workdir, self.cache_dir, self.keep = Path(spec_path), Path(workdir), Path(cache_dir), keep
        self.spec = RunSpec.from_toml(self.spec_path)
        self.workdir.mkdir(parents=True, exist_ok=True)
        (self.workdir / "logs").mkdir(exist_ok=True)
        self.extra_env = extra_env or {}
        self.placement = placement
        # unix socket paths (p2pd, torch_shm_manager) must stay short: keep the peers' temp folders in /tmp
        self._tmp = Path(tempfile.mkdtemp(prefix="swarm-"))
        self._sockets = socket_files()  # those of other processes, before any peer of this swarm made its own
        self.peers: list[Peer] = []
        self.coordinator: Optional[Peer] = None
        self.address: Optional[str] = None
        self._count = 0

    def _env(self, name: str, port: int) -> dict[str, str]:
        tmp = self._tmp / name
        tmp.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ)
        env.update(
            SWARM_CACHE_DIR=str(self.cache_dir), SWARM_HOST=self.placement(name)[1], SWARM_PORT=str(port),
            SWARM_IDENTITY_FILE=str(self.workdir / "keys" / f"{name}.key"), TMPDIR=str(tmp),
            SWARM_FRAGMENT_DIR=str(self.workdir / "fragments" / name), SWARM_STATE_DIR=str(self.state_dir(name)),
            PYTHONUNBUFFERED="1", OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"),
        )
        env.update(self.extra_env)
        return env

    def state_dir(self, name: str) -> Path:
        """A peer's heartbeat and control folder (``SWARM_STATE_DIR``)."""
        return self.workdir / "state" / name

    def _spawn(self, name: str, role: str, module: str, args: list[str], env: Optional[dict[str, str]] = None,
               port: int = 0) -> Peer:
        identity = Identity.load_or_create(self.workdir / "keys" / f"{name}.key")
        log = self.workdir / "logs" / f"{name}.log"
        port = port or free_port()
        prefix, _ = self.placement(name)
        with open(log, "ab") as fh:
            proc = subprocess.Popen([*prefix, sys.executable, "-m", module, *args], stdout=fh, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, env=self._env(name, port) | (env or {}),
                                    start_new_session=True)
        return Peer(name, role, proc, log, identity, port)

    def start_coordinator(self, timeout: float = 60.0, peers: Sequence[str] = ()) -> str:
        """Start ``swarm-coordinator serve`` (joining the live swarm through ``peers``, multiaddrs, when it is a
        restart); returns the run address once it is published."""
        key = self.workdir / "keys" / "coordinator.key"
        Identity.load_or_create(key)
        addr_file = self.workdir / "run_address"
        addr_file.unlink(missing_ok=True)
        port = free_port()
        args = ["serve", str(self.spec_path), "--key", str(key), "--host", self.placement("coordinator")[1],
                "--port", str(port),
                "--address-file", str(addr_file)]
        for maddr in peers:
            args += ["--peer", maddr]
        self.coordinator = self._spawn("coordinator", "coordinator", "coordinator", args, port=port)
        deadline = time.monotonic() + timeout
        while not addr_file.exists():
            if not self.coordinator.alive() or time.monotonic() > deadline:
                raise RuntimeError(f"coordinator did not start; see {self.coordinator.log}:\n{self.tail(self.coordinator)}")
            time.sleep(0.2)
        self.address = addr_file.read_text().strip()
        return self.address

    def start_peer(self, role: str, *extra: str, name: Optional[str] = None, env: Optional[dict[str, str]] = None,
                   entry: Sequence[str] = ("peer", "join")) -> Peer:
        """Start ``swarm-peer join <address> --role <role> <extra...>`` (``env``: extra SWARM_* settings).

        :param entry: the module to run and its arguments before the run address (tests start peers that attack
            the run with ``("tests.byzantine_peer", "<attack>")``).
        """
        if self.address is None:
            raise RuntimeError("start the coordinator first")
        self._count += 1
        module, *head = entry
        peer = self._spawn(name or f"{role}{self._count}", role, module,
                           [*head, self.address, "--role", role, *extra], env)
        self.peers.append(peer)
        return peer

    def kill(self, peer: Peer, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to the peer's whole process group (SIGKILL: no goodbye, as a crash)."""
        _signal_group(peer.proc, sig)
        if sig == signal.SIGKILL:
            peer.proc.wait()

    def stop(self, peer: Peer, grace: float = 15.0) -> None:
        """SIGTERM the peer's main process (it stops its own DHT, averagers and p2pd), SIGKILL what is left."""
        if peer.alive():
            peer.proc.send_signal(signal.SIGTERM)
        try:
            peer.proc.wait(grace)
        except subprocess.TimeoutExpired:
            pass
        _signal_group(peer.proc, signal.SIGKILL)  # children (DHT, averagers, p2pd) may outlive the main process
        peer.proc.wait()

    @staticmethod
    def tail(peer: Peer, lines: int = 30) -> str:
        try:
            return "\n".join(peer.log.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return ""

    def close(self) -> None:
        everyone = self.peers + ([self.coordinator] if self.coordinator else [])
        for p in everyone:
            if p.alive():
                p.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 15.0
        for p in everyone:
            try:
                p.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            _signal_group(p.proc, signal.SIGKILL)
            p.proc.wait()
        shutil.rmtree(self._tmp, ignore_errors=True)
        for path in leaked_socket_files(self._sockets):  # those of peers killed with SIGKILL (no chance to clean up)
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)
        if not self.keep:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> "LocalSwarm":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
