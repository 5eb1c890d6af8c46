"""The trainer: streams its share of the samples through the swarm and reports its progress.

A trainer claims a data share (the lowest one no other live trainer announces), walks that share of each
pass in a seeded order (:func:`swarm.data.shard_order`), and keeps ``concurrency`` micro-batches in flight
through :class:`~swarm.pipeline.RemotePipeline`. Every ``record_ttl_s / 3`` seconds it publishes a signed
:class:`~swarm.protocol.TrainerInfo` (with its position in the share's stream, which checkpoints record) and
logs one fixed-key line. A trainer that (re)joins a run with checkpoints resumes its share at the position
the newest manifest recorded (:func:`resume_position`).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import time
from pathlib import Path
from typing import Callable, Iterator, Optional

from hivemind.utils import get_dht_time

from swarm import __version__
from swarm.aio import wait_any
from swarm.banlist import BanFollower, PeerBanned
from swarm.config import RunSpec
from swarm.data import TokenDataset, shard_order
from swarm.directory import RunDirectory
from swarm.identity import Identity
from swarm.pipeline import PipelineError, RemotePipeline, validation_loss
from swarm.protocol import TrainerInfo
from swarm.transport import GLOBAL_COUNTER

logger = logging.getLogger(__name__)


def claim_shard(directory: RunDirectory, num_shards: int, peer_id: str) -> int:
    """Lowest data share not announced by another live trainer (a hash of the peer id if all are taken)."""
    taken = {t.shard for t in directory.trainers() if t.peer_id != peer_id}
    free = [s for s in range(num_shards) if s not in taken]
    return free[0] if free else int(peer_id.encode().hex(), 16) % num_shards


def micro_batches(dataset: TokenDataset, spec: RunSpec, shard: int, position: int = 0) -> Iterator[list[int]]:
    """Endless lists of sample indices (``micro_batch_size`` each) of ``shard``, pass after pass, starting
    after the first ``position`` samples of the share's stream (a resumed trainer continues there)."""
    b = spec.training.micro_batch_size
    per_pass = None
    for p in itertools.count(0):
        order = shard_order(dataset.num_samples("train"), shard, spec.data.num_shards, spec.data.seed, p)
        per_pass = per_pass or max(b, len(order) - len(order) % b)
        if position >= per_pass:  # skip whole passes without building their batches
            position -= per_pass
            continue
        for i in range(0, len(order) - b + 1, b):
            if position > 0:
                position -= b
                continue
            yield order[i : i + b]


def resume_position(directory: RunDirectory, shard: int, num_stages: int) -> int:
    """Samples of data share ``shard`` consumed as recorded by the stages' newest checkpoint manifests (the
    largest of them; 0 if none records the share)."""
    newest = [m for k in range(num_stages) for m, _ in directory.manifests(k)[:1]]
    return max((m.data_position.get(shard, 0) for m in newest), default=0)


class Trainer:
    """Trains through the swarm until ``stop`` is set or ``max_samples`` were processed.

    :param loss_log: if set, every micro-batch's loss and sample indices are appended there as JSON lines.
    """

    def __init__(self, spec: RunSpec, run_id: str, directory: RunDirectory, identity: Identity,
                 pipeline: RemotePipeline, dataset: TokenDataset, shard: int, *, concurrency: int = 1,
                 max_samples: Optional[int] = None, loss_log: Optional[Path] = None, position: int = 0,
                 on_report: Optional[Callable[[TrainerInfo], None]] = None, name: str = "", p2p_id: str = "",
                 val_every_s: float = 0.0, bans: Optional[BanFollower] = None):
        self.spec, self.run_id, self.directory, self.identity = spec, run_id, directory, identity
        self.pipeline, self.dataset, self.shard = pipeline, dataset, shard
        self.concurrency, self.max_samples, self.loss_log = concurrency, max_samples, loss_log
        self.samples = self.tokens = self.steps = 0
        self.start_position = position
        self.on_report = on_report  # called with each TrainerInfo published (the app's heartbeat)
        self.first_losses: list[float] = []  # the first few, for initial_loss
        self.loss_ema: Optional[float] = None
        self._started = time.monotonic()
        self.name, self.p2p_id, self.val_every_s, self.bans = name, p2p_id, val_every_s, bans
        self.val_loss: Optional[float] = None
        self.val_time = 0.0
        self.running = asyncio.Event()  # cleared while paused (:meth:`pause`)
        self.running.set()
        self.draining = False
        self.error: Optional[Exception] = None  # why the trainer stopped itself (e.g. it was banned)

    @property
    def state(self) -> str:
        return "draining" if self.draining else ("training" if self.running.is_set() else "paused")

    def pause(self) -> None:
        """Stop starting micro-batches (those in flight finish); :meth:`resume` goes on from the same position."""
        self.running.clear()

    def resume(self) -> None:
        self.running.set()

    @property
    def initial_loss(self) -> Optional[float]:
        first = self.first_losses
        return sum(first) / len(first) if first else None

    async def _worker(self, batches: Iterator[list[int]], stop: asyncio.Event) -> None:
        while not stop.is_set():
            if not self.running.is_set():
                await wait_any(self.running, stop)
                continue
            if self.max_samples is not None and self.samples >= self.max_samples:
                stop.set()
                return
            indices = next(batches)
            try:
                loss = await self.pipeline.forward_loss(self.dataset.batch(indices), train=True)
            except PipelineError as e:
                logger.warning("[%s trainer] micro-batch dropped: %s", self.identity.peer_id, e)
                continue
            except Exception:
                logger.exception("[%s trainer] unexpected error; stopping", self.identity.peer_id)
                stop.set()
                raise
            self.steps += 1
            if len(self.first_losses) < 5:
                self.first_losses.append(loss)
            if self.loss_log is not None:
                with open(self.loss_log, "a") as f:
                    f.write(json.dumps({"step": self.steps, "loss": loss, "indices": indices}) + "\n")
            self.loss_ema = loss if self.loss_ema is None else 0.9 * self.loss_ema + 0.1 * loss
            self.samples += len(indices)
            self.tokens += len(indices) * self.spec.data.seq_len

    def info(self) -> TrainerInfo:
        elapsed = max(time.monotonic() - self._started, 1e-6)
        return TrainerInfo(
            run_id=self.run_id, peer_id=self.identity.peer_id, time=get_dht_time(), shard=self.shard,
            loss=self.loss_ema, initial_loss=self.initial_loss, samples=self.samples,
            position=self.start_position + self.samples, tokens=self.tokens,
            samples_per_s=self.samples / elapsed, failures=self.pipeline.failures,
            bytes_sent=GLOBAL_COUNTER.sent, bytes_received=GLOBAL_COUNTER.received, version=__version__,
            name=self.name, p2p_id=self.p2p_id, state=self.state, val_loss=self.val_loss, val_time=self.val_time,
        )

    async def _validate(self, stop: asyncio.Event, batches: int = 4) -> None:
        """Measure the validation loss through the swarm every ``val_every_s`` seconds (first after one period)."""
        while self.val_every_s > 0:
            try:
                await asyncio.wait_for(stop.wait(), self.val_every_s)
                return
            except asyncio.TimeoutError:
                pass
            if not self.running.is_set():
                continue
            try:
                self.val_loss, self.val_time = await validation_loss(self.pipeline, self.dataset, batches), get_dht_time()
                logger.info("[%s trainer] val_loss=%.4f", self.identity.peer_id, self.val_loss)
            except (PipelineError, ValueError) as e:
                logger.warning("[%s trainer] validation loss not measured: %s", self.identity.peer_id, e)

    async def _report(self, stop: asyncio.Event) -> None:
        loop = asyncio.get_running_loop()
        period = self.spec.timeouts.record_ttl_s / 3
        while True:
            if self.bans is not None:
                try:
                    await loop.run_in_executor(None, self.bans.refresh)
                    self.bans.check(self.identity.peer_id)
                except PeerBanned as e:
                    self.error = e
                    stop.set()
                    return
            info = self.info()
            await loop.run_in_executor(None, self.directory.announce_trainer, info, self.identity)
            if self.on_report is not None:
                self.on_report(info)
            stages = [await self.pipeline.servers(k) for k in range(self.spec.model.num_stages)]
            epochs = [max((s.epoch for s in group), default=0) for group in stages]
            total = await loop.run_in_executor(None, self._swarm_samples_per_s)
            logger.info(
                "[%s trainer epoch=%s] loss=%s samples=%d samples/s=%.2f share=%s failures=%d servers=%s state=%s",
                self.identity.peer_id, min(epochs), f"{info.loss:.4f}" if info.loss is not None else "-",
                info.samples, info.samples_per_s, f"{100 * info.samples_per_s / total:.0f}%" if total else "-",
                info.failures, "/".join(str(len(g)) for g in stages), info.state,
            )
            try:
                await asyncio.wait_for(stop.wait(), period)
                await loop.run_in_executor(None, self.directory.announce_trainer, self.info(), self.identity)
                return
            except asyncio.TimeoutError:
                pass

    def _swarm_samples_per_s(self) -> float:
        """Samples/s of every trainer of the run (this one's share of it is its contribution)."""
        others = sum(t.samples_per_s for t in self.directory.trainers() if t.peer_id != self.identity.peer_id)
        return others + self.info().samples_per_s

    async def run(self, stop: asyncio.Event, grace_s: float = 5.0) -> None:
        """Train until ``stop`` is set; micro-batches still in flight ``grace_s`` seconds later are abandoned.

        :raises PeerBanned: the run's coordinator banned this trainer (it stopped at once).
        """
        self._started = time.monotonic()
        batches = micro_batches(self.dataset, self.spec, self.shard, self.start_position)
        reporter = asyncio.create_task(self._report(stop))
        validator = asyncio.create_task(self._validate(stop))
        workers = [asyncio.create_task(self._worker(batches, stop)) for _ in range(self.concurrency)]
        try:
            await stop.wait()
            self.draining = True
            _, pending = await asyncio.wait(workers, timeout=grace_s)
            for task in pending:
                task.cancel()
            await asyncio.gather(*workers, return_exceptions=True)
        finally:
            stop.set()
            validator.cancel()
            await asyncio.gather(reporter, validator, return_exceptions=True)
        if self.error is not None:
            raise self.error

