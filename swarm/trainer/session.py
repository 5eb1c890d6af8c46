"""The trainer: joins a run, streams its share of the samples through the swarm and reports its progress.

A :class:`Trainer` is what ``swarm-peer join --role trainer`` runs (the app only parses, configures logging and
wires signals and ``swarm-peer pause|resume|drain``); a test starts one in-process the same way::

    trainer = Trainer(address, PeerSettings(host="127.0.0.1"), TrainerOptions(max_samples=256))
    await trainer.run()            # until trainer.stop() or max_samples

It joins the run's DHT in client mode (works behind NAT), prepares the run's dataset, claims a data share (the
lowest one no other live trainer announces), and resumes it at the position the newest checkpoint manifest
recorded (:func:`resume_position`). It walks that share of each pass in a seeded order
(:func:`swarm.data.share_order`), keeping micro-batches in flight through
:class:`~swarm.trainer.pipeline.RemotePipeline` (``concurrency`` of them at least, as many as the pipeline's
bandwidth-delay product asks, :mod:`swarm.trainer.inflight`). Every ``record_ttl_s / 3`` seconds it publishes
a signed :class:`~swarm.protocol.TrainerInfo` (with its position in the share's stream, which checkpoints record)
and logs one fixed-key line; every ``SWARM_VAL_EVERY_S`` seconds it measures the validation loss through the
swarm.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional

from hivemind.p2p import P2P
from hivemind.utils import get_dht_time

from swarm import __version__
from swarm.aio import sleep_or_stop, wait_any
from swarm.config import RunSpec
from swarm.settings import PeerSettings
from swarm.data import TokenDataset, prepare_dataset, share_order
from swarm.host import ThreadShare
from swarm.identity import Identity, claim_local_state
from swarm.logs import PeerLog
from swarm.net.dht import close_dht, connect_run
from swarm.trust.invites import join_admission
from swarm.trust.recognition import follow_recognition
from swarm.trust.tickets import RunTickets
from swarm.net.directory import AsyncRunDirectory
from swarm.net.transport import GLOBAL_COUNTER
from swarm.protocol import TrainerInfo
from swarm.trainer.inflight import InFlight
from swarm.net.links import measure_links, round_trip
from swarm.net.timeouts import derive_timeouts
from swarm.trainer.pipeline import PipelineError, RemotePipeline, validation_loss
from swarm.trust.banlist import PeerBanned, RunBans
from swarm.trust.spotcheck import SpotChecker

logger = logging.getLogger(__name__)

PipelineFactory = Callable[..., RemotePipeline]
"""Builds the trainer's pipeline: ``(spec, run_id, directory, p2p, bans=..., log=..., listener=...)`` (tests pass a
Byzantine one, :mod:`swarm.attacks`)."""


async def claim_share(directory: AsyncRunDirectory, num_shares: int, peer_id: str) -> int:
    """Lowest data share not announced by another live trainer (a hash of the peer id if all are taken)."""
    taken = {t.share for t in await directory.trainers() if t.peer_id != peer_id}
    free = [s for s in range(num_shares) if s not in taken]
    return free[0] if free else int(peer_id.encode().hex(), 16) % num_shares


def micro_batches(dataset: TokenDataset, spec: RunSpec, share: int, position: int = 0) -> Iterator[list[int]]:
    """Endless lists of sample indices (``micro_batch_size`` each) of ``share``, pass after pass, starting
    after the first ``position`` samples of the share's stream (a resumed trainer continues there)."""
    b = spec.training.micro_batch_size
    per_pass = None
    for p in itertools.count(0):
        order = share_order(dataset.num_samples("train"), share, spec.data.num_shares, spec.data.seed, p)
        per_pass = per_pass or max(b, len(order) - len(order) % b)
        if position >= per_pass:  # skip whole passes without building their batches
            position -= per_pass
            continue
        for i in range(0, len(order) - b + 1, b):
            if position > 0:
                position -= b
                continue
            yield order[i : i + b]


async def resume_position(directory: AsyncRunDirectory, share: int, num_stages: int) -> int:
    """Samples of data share ``share`` consumed as recorded by the stages' newest checkpoint manifests (the
    largest of them; 0 if none records the share)."""
    newest = [m for k in range(num_stages) for m, _ in (await directory.manifests(k))[:1]]
    return max((m.data_position.get(share, 0) for m in newest), default=0)


@dataclass(frozen=True)
class TrainerOptions:
    """What a trainer does beyond the run spec (the flags of ``swarm-peer join --role trainer``).

    :param share: data share to train on (default: the lowest one no live trainer announces).
    :param concurrency: the least micro-batches in flight; the trainer keeps as many as the pipeline's measured
        bandwidth-delay product asks (:mod:`swarm.trainer.inflight`), up to
        :data:`~swarm.trainer.inflight.MOST_IN_FLIGHT`.
    :param max_samples: stop after this many samples (default: train until stopped).
    :param loss_log: append every micro-batch's loss and sample indices here (JSON lines).
    """

    share: Optional[int] = None
    concurrency: int = 2
    max_samples: Optional[int] = None
    loss_log: Optional[Path] = None


class Trainer:
    """Trains through the run at ``address`` until :meth:`stop` or ``options.max_samples`` (module docstring).

    :param settings: this peer's settings (identity, cache folder, name, validation period).
    :param pipeline_factory: builds the pipeline (default :class:`RemotePipeline`).
    :param on_announce: called with each :class:`TrainerInfo` published (the app's heartbeat and metrics).

    Call :meth:`run`, :meth:`stop`, :meth:`pause` and :meth:`resume` on the event loop's thread.
    """

    def __init__(self, address: str, settings: PeerSettings, options: TrainerOptions = TrainerOptions(), *,
                 pipeline_factory: PipelineFactory = RemotePipeline,
                 on_announce: Optional[Callable[[TrainerInfo], None]] = None):
        self.address, self.settings, self.options = address, settings, options
        self.pipeline_factory, self.on_announce = pipeline_factory, on_announce
        self.identity = Identity.load_or_create(settings.identity_path())
        self.log = PeerLog(logger, self.identity.peer_id, role="trainer")
        self.spec: Optional[RunSpec] = None
        self.p2p: Optional[P2P] = None  # this process's replica of the DHT's libp2p client, once joined
        self.samples = self.tokens = self.steps = 0
        self.start_position = 0
        self.first_losses: list[float] = []  # the first few, for initial_loss
        self.loss_ema: Optional[float] = None
        self.val_loss: Optional[float] = None
        self.val_time = 0.0
        self._started = time.monotonic()
        self._stop = asyncio.Event()
        self.running = asyncio.Event()  # cleared while paused (:meth:`pause`)
        self.running.set()
        self.draining = False
        self._retire = 0  # workers to stop after their micro-batch (the in-flight target fell)
        self.error: Optional[Exception] = None  # why the trainer stopped itself (e.g. it was banned)
        self.threads = ThreadShare(settings.threads)  # torch's threads: this peer's share of the machine

    # ---- control ---------------------------------------------------------------------------------------
    def stop(self) -> None:
        """Finish the micro-batches in flight (at most a few seconds) and leave."""
        self._stop.set()

    def pause(self) -> None:
        """Stop starting micro-batches (those in flight finish); :meth:`resume` goes on from the same position."""
        self.running.clear()

    def resume(self) -> None:
        self.running.set()

    @property
    def state(self) -> str:
        return "draining" if self.draining else ("training" if self.running.is_set() else "paused")

    @property
    def initial_loss(self) -> Optional[float]:
        first = self.first_losses
        return sum(first) / len(first) if first else None

    # ---- the trainer's life ----------------------------------------------------------------------------
    async def run(self, grace_s: float = 5.0) -> None:
        """Join, train until :meth:`stop` or ``max_samples``; micro-batches still in flight ``grace_s`` seconds
        after that are abandoned.

        :raises PeerBanned: the run's coordinator banned this trainer (it stopped at once).
        :raises SpecError: the run's spec could not be fetched and verified.
        :raises RunUnreachable: none of the run address's peers answered within ``settings.join_timeout_s``.
        :raises IdentityInUse: another process on this machine runs as this peer or uses its state folder.
        """
        claim_local_state(self.identity, self.settings, fragments=False)
        self.threads.update(self.log)
        self.dht, directory, self.spec, _ = await asyncio.to_thread(
            connect_run, self.address, self.settings, client_mode=True, join_timeout_s=self.settings.join_timeout_s,
            identity=self.identity)
        self.directory, self.tickets = AsyncRunDirectory(directory), RunTickets(directory, self.identity, self.spec)
        # the newest manifests it resumes its data position from, and its spot checks' witnesses: by the recognition
        self.recognition = follow_recognition(directory)
        try:
            self.p2p = await self.dht.replicate_p2p()
            await join_admission(self.tickets, self.p2p, self.settings.invite)
            await self._join()
            await self._train(grace_s)
        finally:
            await close_dht(self.dht, self.p2p)
        if self.error is not None:
            raise self.error

    async def _join(self) -> None:
        """Prepare the data, claim a share, follow the ban list, build the pipeline."""
        spec, me = self.spec, self.identity.peer_id
        self.dataset = await asyncio.to_thread(prepare_dataset, spec, self.settings.cache_dir)
        share = self.options.share
        if share is None:
            share = await claim_share(self.directory, spec.data.num_shares, me)
        self.share = share
        self.start_position = await resume_position(self.directory, share, spec.model.num_stages)
        self.log.info("run %s, data share %d/%d, %d samples per pass, resuming at sample %d, tokenizer %s",
                      self.directory.run_id, share, spec.data.num_shares,
                      self.dataset.num_samples() // spec.data.num_shares, self.start_position,
                      self.dataset.tokenizer_sha256[:16])
        self.bans = RunBans(self.directory)
        await self.bans.refresh()
        self.bans.check(me)
        blocking = self.directory.blocking
        self.checker = SpotChecker(spec, self.directory.run_id, self.p2p, log=self.log,
                                   recognized=self.recognition.recognized,
                                   serves=lambda peer_id, stage: blocking.seen_serving(peer_id, stage, read=False))
        self.pipeline = self.pipeline_factory(spec, self.directory.run_id, self.directory, self.p2p, bans=self.bans,
                                              log=self.log, listener=self.checker)

    async def _train(self, grace_s: float) -> None:
        self._started = time.monotonic()
        batches = micro_batches(self.dataset, self.spec, self.share, self.start_position)
        reporter = asyncio.create_task(self._report())
        validator = asyncio.create_task(self._validate())
        self.in_flight = InFlight(self.options.concurrency, self.spec.model.num_stages)  # (swarm.trainer.inflight)
        workers = {asyncio.create_task(self._worker(batches)) for _ in range(self.options.concurrency)}
        tuner = asyncio.create_task(self._tune_in_flight(workers, batches))
        try:
            await self._stop.wait()
            self.draining = True
            tuner.cancel()
            _, pending = await asyncio.wait(workers, timeout=grace_s)
            for task in pending:
                task.cancel()
            await asyncio.gather(*workers, return_exceptions=True)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.checker.drain(), grace_s)
        finally:
            self._stop.set()
            validator.cancel()
            tuner.cancel()
            await asyncio.gather(reporter, validator, tuner, return_exceptions=True)

    async def _tune_in_flight(self, workers: set[asyncio.Task], batches: Iterator[list[int]]) -> None:
        """Every period (:attr:`~swarm.trainer.inflight.InFlight.period_s`: seconds while starting up, ten after),
        set the micro-batches in flight to :class:`~swarm.trainer.inflight.InFlight`'s target: start workers, or let
        some retire after their micro-batch. The links are timed beside it (:meth:`_time_links`: seconds over a far
        link, on a busy machine), until they answer."""
        tuning, timing = self.in_flight, None
        try:
            while not await sleep_or_stop(self._stop, tuning.period_s):
                servers = [s for k in range(self.spec.model.num_stages) for s in await self.pipeline.servers(k)]
                if timing is None or timing.done() and not _timed(timing):  # (again, until the links answer)
                    timing = asyncio.create_task(self._time_links(servers))
                target = tuning.update(self.steps, await round_trip(self.p2p, servers, self.directory.run_id))
                if target is None:
                    continue
                self.log.info("micro-batches in flight: %d (%.2f micro-batches/s at best, %.0f ms a micro-batch at "
                              "least)", target, tuning.rate, 1000 * tuning.latency_s)
                live = {w for w in workers if not w.done()}
                self._retire = max(0, len(live) - target)
                for _ in range(target - len(live)):
                    workers.add(asyncio.create_task(self._worker(batches)))
        finally:
            if timing is not None:
                timing.cancel()

    async def _time_links(self, servers: list) -> bool:
        """Set the pipeline's forward and backward timeouts from the links to ``servers`` (:mod:`swarm.net.timeouts`,
        logged once); False if none answered (the spec's ceilings stay)."""
        link = await measure_links(self.p2p, servers, self.directory.run_id)
        if link is None:
            return False
        timeouts = derive_timeouts(self.spec, link)
        self.pipeline.timeouts = self.spec.timeouts.model_copy(update=dict(forward_s=timeouts.forward_s,
                                                                           backward_s=timeouts.backward_s))
        self.log.info("%s", timeouts.describe("forward_s", "backward_s"))
        return True

    async def _worker(self, batches: Iterator[list[int]]) -> None:
        while not self._stop.is_set():
            if self._retire > 0:
                self._retire -= 1
                return
            if not self.running.is_set():
                await wait_any(self.running, self._stop)
                continue
            if self.options.max_samples is not None and self.samples >= self.options.max_samples:
                self._stop.set()
                return
            indices = next(batches)
            started = time.monotonic()
            try:
                loss = await self.pipeline.forward_loss(self.dataset.batch(indices), train=True)
            except PipelineError as e:
                self.log.warning("micro-batch dropped: %s", e)
                continue
            except Exception:
                self.log.exception("unexpected error; stopping")
                self._stop.set()
                raise
            self.in_flight.observe(time.monotonic() - started)
            self._count(indices, loss)

    def _count(self, indices: list[int], loss: float) -> None:
        self.steps += 1
        if len(self.first_losses) < 5:
            self.first_losses.append(loss)
        if self.options.loss_log is not None:
            with open(self.options.loss_log, "a") as f:
                f.write(json.dumps({"step": self.steps, "loss": loss, "indices": indices}) + "\n")
        self.loss_ema = loss if self.loss_ema is None else 0.9 * self.loss_ema + 0.1 * loss
        self.samples += len(indices)
        self.tokens += len(indices) * self.spec.data.seq_len

    # ---- reporting -------------------------------------------------------------------------------------
    def info(self) -> TrainerInfo:
        elapsed = max(time.monotonic() - self._started, 1e-6)
        return TrainerInfo(
            run_id=self.directory.run_id, peer_id=self.identity.peer_id, time=get_dht_time(), share=self.share,
            loss=self.loss_ema, initial_loss=self.initial_loss, samples=self.samples,
            position=self.start_position + self.samples, tokens=self.tokens,
            samples_per_s=self.samples / elapsed, failures=self.pipeline.failures,
            bytes_sent=GLOBAL_COUNTER.sent, bytes_received=GLOBAL_COUNTER.received, version=__version__,
            name=self.settings.name, p2p_id=str(self.p2p.peer_id), state=self.state, val_loss=self.val_loss,
            val_time=self.val_time, spot_checks=dict(self.checker.counts),
            convicted={p: r[:200] for p, r in sorted(self.checker.convicted.items())[:32]},
        )

    async def _validate(self, batches: int = 4) -> None:
        """Measure the validation loss through the swarm every ``val_every_s`` seconds (first after one period), on
        the split's first ``batches`` micro-batches (a cheap running estimate; ``swarm-coordinator demo`` scores the
        whole split at its end)."""
        period = self.settings.val_every_s
        while period > 0 and not await sleep_or_stop(self._stop, period):
            if not self.running.is_set():
                continue
            try:
                self.val_loss = await validation_loss(
                    self.pipeline, self.dataset, batches * self.spec.training.micro_batch_size)
                self.val_time = get_dht_time()
                self.log.info("val_loss=%.4f", self.val_loss)
            except (PipelineError, ValueError) as e:
                self.log.warning("validation loss not measured: %s", e)

    async def _report(self) -> None:
        """Announce and log every ``record_ttl_s / 3`` seconds, and once more when stopping; stop if banned."""
        while True:
            try:
                await self.bans.refresh()
                self.bans.check(self.identity.peer_id)
            except PeerBanned as e:
                self.error = e
                self._stop.set()
                return
            self.threads.update(self.log)
            await asyncio.to_thread(self.tickets.refresh)
            await self.recognition.current()  # (read when due: the spot checks' witnesses)
            info = self.info()
            await self.directory.announce_trainer(info, self.identity)
            if self.on_announce is not None:
                self.on_announce(info)
            await self._log_progress(info)
            if await sleep_or_stop(self._stop, self.spec.timeouts.record_ttl_s / 3):
                await self.directory.announce_trainer(self.info(), self.identity)
                return

    async def _log_progress(self, info: TrainerInfo) -> None:
        """The trainer's fixed-key line: the stages' epoch, loss, samples, its contribution (its part of the swarm's
        samples/s)."""
        stages = [await self.pipeline.servers(k) for k in range(self.spec.model.num_stages)]
        epochs = [max((s.epoch for s in group), default=0) for group in stages]
        total = await self._swarm_samples_per_s()
        self.log.info(
            "epoch=%s loss=%s samples=%d samples/s=%.2f contribution=%s failures=%d servers=%s checks=%d/%d "
            "convicted=%d state=%s", min(epochs), f"{info.loss:.4f}" if info.loss is not None else "-", info.samples,
            info.samples_per_s, f"{100 * info.samples_per_s / total:.0f}%" if total else "-", info.failures,
            "/".join(str(len(g)) for g in stages), info.spot_checks.get("agreed", 0),
            info.spot_checks.get("sampled", 0), len(info.convicted), info.state,
        )

    async def _swarm_samples_per_s(self) -> float:
        """Samples/s of every trainer of the run (this one's share of it is its contribution)."""
        others = sum(t.samples_per_s for t in await self.directory.trainers() if t.peer_id != self.identity.peer_id)
        return others + self.info().samples_per_s


def _timed(task: asyncio.Task) -> bool:
    """Whether a finished :meth:`Trainer._time_links` task set the timeouts (not cancelled, not failed)."""
    return not task.cancelled() and task.exception() is None and bool(task.result())


__all__ = ["PipelineFactory", "Trainer", "TrainerOptions", "claim_share", "micro_batches", "resume_position"]
