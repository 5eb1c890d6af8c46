"""A small fluent helper for multi-process swarm tests: start peers, wait on conditions, inject faults, and check
that the servers of a stage hold the same state.

    sc = Scenario(swarm).servers(per_stage=2).trainers(2).until_epoch(3)
    sc.faults().kill(sc.server(stage=0)).at_epoch(5).freeze(sc.server(stage=1), seconds=8).run(until_epoch=8)
    sc.stage_in_sync(0)

Faults (in the spirit of torchft's ``EventInjector().fail_at(rank, step)``) fire at an epoch every stage
reached or a number of seconds into :meth:`Faults.run`: ``kill`` (SIGKILL, a crash), ``stop`` (SIGTERM, a
drain), ``freeze`` (SIGSTOP then SIGCONT: a peer that stops answering, as a hung machine or one cut off by a
partition would), ``pause`` (the operator's ``swarm-peer pause``, then resume), ``byzantine`` (an attacking
server joins), ``slow`` and ``partition`` (its link, :mod:`tests.links`; root only). Waits poll a condition;
no test sleeps for a fixed time.
"""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional

from hivemind.utils import get_dht_time

from coordinator.launch import LocalSwarm, Peer, Placement, on_loopback
from peer.control import send
from swarm.config import RunSpec
from swarm.settings import PeerSettings
from swarm.net.dht import connect_run
from swarm.protocol import ServerState
from tests.conftest import write_spec

LIFECYCLE = ("joining", "] online", "rebalancing", "draining", "restor", "loading state", "left the stage",
             "stopped", "paused", "resumed", "rollback", "banned", "excluded", "ERROR", "Error:",
             "evidence", "spot check convicted")
"""Substrings of the log lines :meth:`Scenario.story` keeps."""


class Scenario:
    def __init__(self, swarm: LocalSwarm):
        self.swarm = swarm
        swarm.start_coordinator()
        self.dht, self.directory, self.spec, _ = connect_run(swarm.address, PeerSettings(host="127.0.0.1"))
        self.num_stages = self.spec.model.num_stages
        self.stage_of: dict[str, int] = {}
        self.links = None  # a tests.links.LoopbackLinks, once a fault shapes a link

    def close(self) -> None:
        if self.links is not None:
            self.links.close()
        self.dht.shutdown()

    # ---- waiting --------------------------------------------------------------------------------------
    def wait(self, predicate: Callable[[], bool], timeout: float, what: str) -> "Scenario":
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}\n{self.story()}")
            time.sleep(0.5)
        return self

    def settle(self, value: Callable[[], Any], for_s: float, timeout: float, what: str,
               accept: Callable[[Any], bool] = lambda v: True) -> Any:
        """The value of ``value()`` once it stayed the same for ``for_s`` seconds and ``accept`` takes it
        (polled every second)."""
        deadline, last, since = time.monotonic() + timeout, object(), time.monotonic()
        while True:
            now = value()
            if now != last:
                last, since = now, time.monotonic()
            elif time.monotonic() - since >= for_s and accept(now):
                return now
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what} never held still for {for_s:.0f}s (last: {now})\n{self.story()}")
            time.sleep(1.0)

    def holds(self, predicate: Callable[[], bool], for_s: float, what: str) -> "Scenario":
        """Assert that ``predicate()`` stays true for ``for_s`` seconds (checked every second; a false reading is
        read again a second later before it counts: one DHT lookup may miss a record that is there)."""
        deadline = time.monotonic() + for_s
        while time.monotonic() < deadline:
            if not predicate():
                time.sleep(1.0)
                assert predicate(), f"{what} stopped holding\n{self.story()}"
            time.sleep(1.0)
        return self

    def epochs(self) -> list[int]:
        """Highest epoch announced by an online server of each stage."""
        return [max((s.epoch for s in g if s.state == ServerState.ONLINE), default=-1)
                for g in self.directory.all_servers(self.num_stages).values()]

    def until_epoch(self, epoch: int, timeout: float = 240.0) -> "Scenario":
        return self.wait(lambda: min(self.epochs()) >= epoch, timeout, f"every stage at epoch {epoch}")

    def until_loss_falls(self, by: float, trainers: int, timeout: float = 90.0) -> "Scenario":
        """Wait until ``trainers`` trainers announce a loss ``by`` nats below their first losses. A trainer's loss
        is an EMA announced every ``record_ttl_s / 3``, so it lags the stages' epochs (CI read 6.233 -> 6.011 right
        at the epoch a test waited for); training goes on meanwhile.

        :raises AssertionError: the losses did not fall by ``by`` within ``timeout`` seconds (they are listed)."""
        def fell() -> bool:
            ts = self.directory.trainers()
            return len(ts) == trainers and all(t.loss is not None and t.initial_loss is not None
                                               and t.loss < t.initial_loss - by for t in ts)

        try:
            return self.wait(fell, timeout, f"{trainers} trainers' losses {by} below their first")
        except TimeoutError:
            losses = [f"{t.peer_id}: {t.initial_loss} -> {t.loss}" for t in self.directory.trainers()]
            raise AssertionError(f"the loss did not fall by {by} in {timeout:.0f} s: {losses}") from None

    # ---- peers ----------------------------------------------------------------------------------------
    def servers(self, per_stage: int, timeout: float = 120.0, byzantine: Optional[str] = None) -> "Scenario":
        """Start ``per_stage`` servers per stage, one after another; with ``byzantine`` (an attack name of
        :mod:`swarm.attacks`) the last server of each stage attacks the run."""
        for i in range(per_stage * self.num_stages):  # one after another, as volunteers join
            stage = i % self.num_stages
            if byzantine is not None and i >= (per_stage - 1) * self.num_stages:
                peer = self.byzantine_server(byzantine, stage, name=f"byzantine{i}")
            else:
                peer = self.swarm.start_peer("server", "--stage", str(stage))
            self.stage_of[peer.name] = stage
            self.wait(lambda pid=peer.peer_id, k=stage: any(s.peer_id == pid and s.state == ServerState.ONLINE
                                                            for s in self.directory.servers(k)),
                      timeout, f"{peer.name} online")
        return self.wait(
            lambda: all(sum(s.state == ServerState.ONLINE for s in g) >= per_stage
                        for g in self.directory.all_servers(self.num_stages).values()),
            timeout, f"{per_stage} online servers per stage")

    def byzantine_server(self, attack: str, stage: int, name: Optional[str] = None) -> Peer:
        """Start a server of ``stage`` that runs ``attack`` (``tests/byzantine_peer.py``)."""
        peer = self.swarm.start_peer("server", "--stage", str(stage), name=name or f"byzantine{len(self.swarm.peers)}",
                                     entry=("tests.byzantine_peer", attack))
        self.stage_of[peer.name] = stage
        return peer

    def trainers(self, count: int, *args: str) -> "Scenario":
        for i in range(count):
            self.swarm.start_peer("trainer", "--share", str(i), *args)
        return self

    def byzantine_trainer(self, attack: str, *args: str) -> Peer:
        """Start a trainer that runs ``attack`` (a trainer attack of :mod:`swarm.attacks`)."""
        return self.swarm.start_peer("trainer", *args, entry=("tests.byzantine_peer", attack))

    def server(self, stage: int, alive: bool = True) -> Peer:
        return next(p for p in self.swarm.peers
                    if p.role == "server" and self.stage_of.get(p.name) == stage and p.alive() == alive)

    def kill(self, peer: Peer, sig: int = signal.SIGKILL) -> "Scenario":
        self.swarm.kill(peer, sig)
        return self

    def faults(self) -> "Faults":
        """A fault plan for this swarm (:class:`Faults`)."""
        return Faults(self)

    def trainer_samples(self) -> int:
        return sum(t.samples for t in self.directory.trainers())

    # ---- state -------------------------------------------------------------------------------------------
    def stage_in_sync(self, stage: int, timeout: float = 240.0, exclude: Iterable[str] = (),
                      min_epoch: int = 0) -> tuple[int, str]:
        """Wait until every online server of ``stage`` (but those in ``exclude``, peer ids) published the same
        full-state digest (parameters and optimizer state) for a common epoch of at least ``min_epoch``, the
        newest one they share; returns ``(epoch, digest)``.

        Servers publish a digest after every epoch's step (their last 8); a server that missed a round differs
        until the next state-averaging round (every ``average_state_every``) re-syncs it, so this waits for
        agreement.
        :raises AssertionError: they never agreed within ``timeout`` seconds (the digests seen are listed).
        """
        seen: dict[str, dict[int, str]] = {}
        left_out = set(exclude)

        def agree() -> Optional[tuple[int, str]]:
            servers = [s for s in self.directory.servers(stage)
                       if s.state == ServerState.ONLINE and s.peer_id not in left_out]
            seen.clear()
            seen.update({s.peer_id: s.state_digests for s in servers})
            if len(servers) < 2:
                return None
            common = {e for e in set.intersection(*(set(d) for d in seen.values())) if e >= min_epoch}
            for epoch in sorted(common, reverse=True):
                digests = {d[epoch] for d in seen.values()}
                if len(digests) == 1:
                    return epoch, digests.pop()
            return None

        found: list = [None]

        def agreed() -> bool:
            found[0] = agree()
            return found[0] is not None

        try:
            self.wait(agreed, timeout, f"the servers of stage {stage} to hold the same state")
        except TimeoutError:
            raise AssertionError(f"the servers of stage {stage} never held the same state: {seen}\n"
                                 f"{self.story()}") from None
        return found[0]

    # ---- reading what happened ---------------------------------------------------------------------------
    def story(self, lines: int = 14) -> str:
        """What happened, for assertion messages (a log's tail is a screen of per-epoch lines): each peer's
        lifecycle and error lines (the last ``lines``), and every server record this test process sees."""
        out = []
        for p in self.swarm.peers + ([self.swarm.coordinator] if self.swarm.coordinator else []):
            try:
                text = p.log.read_text(errors="replace").splitlines()
            except FileNotFoundError:
                text = []
            picked = [line[:240] for line in text if any(w in line for w in LIFECYCLE)]
            state = "alive" if p.alive() else "exited"
            out.append(f"--- {p.name} ({p.peer_id}, {state})\n" + "\n".join(picked[-lines:]))
        names = {p.peer_id: p.name for p in self.swarm.peers}
        try:
            now = get_dht_time()
            for k, group in self.directory.all_servers(self.num_stages).items():
                rows = ", ".join(f"{names.get(s.peer_id, s.peer_id)} {s.state.value} epoch {s.epoch} "
                                 f"{now - s.time:.0f}s ago" for s in group)
                out.append(f"--- stage {k} records: {rows or 'none'}")
        except Exception as e:  # the test's own DHT node is the problem: say so
            out.append(f"--- reading the directory failed: {e!r}")
        return "\n".join(out)

    def log_warnings(self) -> str:
        """Warning and error lines of every peer's log, for assertion messages."""
        out = []
        for p in self.swarm.peers:
            lines = [line for line in p.log.read_text(errors="replace").splitlines()
                     if any(w in line for w in ("WARN", "ERROR", "epoch="))]
            out.append(f"--- {p.name}\n" + "\n".join(lines[-25:]))
        return "\n".join(out)

    def __enter__(self) -> "Scenario":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@dataclass
class Fault:
    """One planned fault: what it does (``act``), when (``epoch`` every stage reached, or ``after_s`` seconds
    into :meth:`Faults.run`), and, for faults that last, what ends it ``lasts_s`` seconds later (``undo``)."""

    what: str
    act: Callable[[], None]
    epoch: Optional[int] = None
    after_s: Optional[float] = None
    undo: Optional[Callable[[], None]] = None
    lasts_s: float = 0.0
    fired_at: Optional[float] = None
    undone: bool = False


class Faults:
    """A fluent fault plan: ``at_epoch(e)`` / ``after(s)`` set the moment of the faults that follow."""

    def __init__(self, scenario: Scenario):
        self.sc, self.plan = scenario, []
        self._epoch: Optional[int] = None
        self._after_s: Optional[float] = 0.0
        self.log: list[str] = []  # what fired, when (seconds into run(), epochs)

    # ---- when -------------------------------------------------------------------------------------------
    def at_epoch(self, epoch: int) -> "Faults":
        self._epoch, self._after_s = epoch, None
        return self

    def after(self, seconds: float) -> "Faults":
        self._epoch, self._after_s = None, seconds
        return self

    def _add(self, what: str, act: Callable[[], None], undo: Optional[Callable[[], None]] = None,
             lasts_s: float = 0.0) -> "Faults":
        self.plan.append(Fault(what, act, self._epoch, self._after_s, undo, lasts_s))
        return self

    # ---- what -------------------------------------------------------------------------------------------
    def kill(self, peer: Peer) -> "Faults":
        """SIGKILL the peer's process group: a crash, no goodbye."""
        return self._add(f"kill {peer.name}", lambda: self.sc.swarm.kill(peer))

    def stop(self, peer: Peer) -> "Faults":
        """SIGTERM: the peer drains and leaves."""
        return self._add(f"stop {peer.name}", lambda: peer.proc.send_signal(signal.SIGTERM))

    def freeze(self, peer: Peer, seconds: float) -> "Faults":
        """Stop the peer's processes (SIGSTOP) for ``seconds``: it holds its connections but answers nothing."""
        return self._add(f"freeze {peer.name} {seconds:.0f}s", lambda: self.sc.swarm.kill(peer, signal.SIGSTOP),
                         lambda: self.sc.swarm.kill(peer, signal.SIGCONT), seconds)

    def pause(self, peer: Peer, seconds: float) -> "Faults":
        """The operator pauses the peer (``swarm-peer pause``) and resumes it ``seconds`` later."""
        state = self.sc.swarm.state_dir(peer.name)
        return self._add(f"pause {peer.name} {seconds:.0f}s", lambda: send(state, "pause"),
                         lambda: send(state, "resume"), seconds)

    def byzantine(self, attack: str, stage: int) -> "Faults":
        """A server of ``stage`` that runs ``attack`` joins."""
        return self._add(f"byzantine {attack} joins stage {stage}", lambda: self.sc.byzantine_server(attack, stage))

    def slow(self, peer: Peer, mbit: float) -> "Faults":
        """Cap every connection of the peer at ``mbit`` Mbit/s (its link; needs root, :mod:`tests.links`)."""
        return self._add(f"slow {peer.name} to {mbit:g} Mbit/s", lambda: self._links().shape(peer.port, mbit))

    def partition(self, peer: Peer, seconds: float) -> "Faults":
        """Cut the peer off from everyone for ``seconds`` (its link carries next to nothing; it keeps running)."""
        return self._add(f"partition {peer.name} {seconds:.0f}s", lambda: self._links().cut(peer.port),
                         lambda: self._links().restore(peer.port), seconds)

    def _links(self):
        if self.sc.links is None:
            from tests.links import LoopbackLinks

            self.sc.links = LoopbackLinks().__enter__()
        return self.sc.links

    # ---- running ----------------------------------------------------------------------------------------
    def run(self, until_epoch: Optional[int] = None, timeout: float = 300.0) -> list[str]:
        """Fire each fault when its moment comes and end the lasting ones on time; return when every fault
        fired and ended and (with ``until_epoch``) every stage reached that epoch. Returns what fired, when."""
        started = time.monotonic()

        def step() -> bool:
            now, epochs = time.monotonic() - started, None
            for fault in self.plan:
                if fault.fired_at is None:
                    epochs = epochs if epochs is not None else self.sc.epochs()
                    due = now >= fault.after_s if fault.after_s is not None else min(epochs) >= fault.epoch
                    if due:
                        fault.act()
                        fault.fired_at = now
                        self.log.append(f"{now:6.1f}s epochs {epochs}: {fault.what}")
                elif fault.undo is not None and not fault.undone and now >= fault.fired_at + fault.lasts_s:
                    fault.undo()
                    fault.undone = True
                    self.log.append(f"{now:6.1f}s: {fault.what} ended")
            settled = all(f.fired_at is not None and (f.undo is None or f.undone) for f in self.plan)
            return settled and (until_epoch is None or min(self.sc.epochs()) >= until_epoch)

        try:
            self.sc.wait(step, timeout, f"the faults {[f.what for f in self.plan]} and epoch {until_epoch}")
        except TimeoutError as e:
            for fault in self.plan:  # leave no peer frozen, paused or cut off behind
                if fault.fired_at is not None and fault.undo is not None and not fault.undone:
                    fault.undo()
            raise TimeoutError(f"{e}\nfaults so far:\n" + "\n".join(self.log)) from None
        return self.log


def make_swarm(spec, tmp_path, cache_dir, keep: bool = False, extra_env: Optional[dict] = None,
               placement: Placement = on_loopback) -> LocalSwarm:
    """A :class:`LocalSwarm` under ``tmp_path`` for ``spec`` (a :class:`~swarm.config.RunSpec`, or a TOML path);
    ``placement``: where its peers run (a WAN lab's hosts: ``bench.wanlab.Lab.place``)."""
    if isinstance(spec, RunSpec):
        spec = write_spec(spec, tmp_path / f"{spec.name}.toml")
    return LocalSwarm(spec, tmp_path / "swarm", cache_dir, keep=keep, extra_env=extra_env, placement=placement)
