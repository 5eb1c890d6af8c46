"""The compute side of a stage server: the stage's module on its worker thread, forward and backward, gradients
handed to the stage's optimizer, epoch transitions (the RPCs around it: :mod:`swarm.server.stage`).

All compute runs on one worker thread, in arrival order. After each backward the micro-batch's parameter
gradients go to the stage's collaborative optimizer with the trainer that sent it
(:meth:`swarm.averaging.optimizer.StageOptimizer.step`), which averages with the other servers of the stage
and steps once per epoch; when an epoch ends the server reports it to its owner (``on_epoch``, an
:class:`EpochEnd`), still on the compute thread, so the owner sees the state right after the step.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import OrderedDict
from contextlib import contextmanager
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
from hivemind.utils.performance_ema import PerformanceEMA

from swarm.aio import periodic
from swarm.config import RunSpec
from swarm.identity import Identity
from swarm.kernels.reference import all_finite
from swarm.model import build_stage
from swarm.net.stage_rpc import max_batch
from swarm.protocol import Refusal

logger = logging.getLogger(__name__)

DIGESTS_KEPT = 64
"""Epochs whose state digest a server keeps (:attr:`StageServer.state_digests`, asked by ``rpc_state_digest``)."""


class StageError(RuntimeError, Refusal):
    """A request the stage refuses; the message is returned to the caller."""


@dataclass(frozen=True)
class EpochEnd:
    """An epoch transition of a server, reported on its compute thread right after the optimizer stepped.

    :param epoch: the epoch that just began (the optimizer's epoch now).
    :param loss: mean training loss (nats/token) of the micro-batches of the epoch that ended (last stage), or
        None.
    :param samples: samples this server processed in the epoch that ended.
    :param seconds: the transition itself (matchmaking, all-reduce, optimizer step).
    """

    epoch: int
    loss: Optional[float]
    samples: int
    seconds: float


EpochHook = Callable[[EpochEnd], None]
"""Called on the compute thread right after an epoch's step (the server's owner: log line, checkpoint, rollback)."""


@dataclass
class EpochMeter:
    """What a server counts between two epoch transitions, and the transitions themselves."""

    rounds: int = 0
    round_seconds: float = 0.0
    losses: list[float] = field(default_factory=list)
    samples: int = 0

    @property
    def mean_round_s(self) -> float:
        """Mean seconds of an epoch transition (matchmaking, all-reduce, optimizer step)."""
        return self.round_seconds / self.rounds if self.rounds else 0.0

    def close(self, epoch: int, seconds: float) -> EpochEnd:
        """The transition to ``epoch`` took ``seconds``: count it, and start counting the new epoch."""
        self.rounds += 1
        self.round_seconds += seconds
        losses, self.losses = self.losses, []
        samples, self.samples = self.samples, 0
        return EpochEnd(epoch=epoch, loss=sum(losses) / len(losses) if losses else None, samples=samples,
                        seconds=seconds)


@dataclass(frozen=True)
class StageInputs:
    """The checks of what a request hands a stage: a refusal names the stage and the cause (:class:`StageError`)."""

    stage: int
    is_last: bool
    vocab_size: int
    max_batch: int

    def check_inputs(self, module: torch.nn.Module, x: torch.Tensor) -> None:
        try:
            module.check_input(x)
        except ValueError as e:
            raise StageError(f"stage {self.stage}: {e}") from None
        if x.shape[0] > self.max_batch:
            raise StageError(f"stage {self.stage}: micro-batch of {x.shape[0]} samples exceeds {self.max_batch}")

    def check_like(self, name: str, t: torch.Tensor, ref: torch.Tensor) -> None:
        if t.shape != ref.shape or t.dtype != ref.dtype:
            raise StageError(f"stage {self.stage}: {name} must be {ref.dtype} {tuple(ref.shape)}, got {t.dtype} "
                             f"{tuple(t.shape)}")
        if t.is_floating_point() and not all_finite(t):
            raise StageError(f"stage {self.stage}: {name} holds NaN or Inf values")

    def check_forward(self, module: torch.nn.Module, x: torch.Tensor, targets: Optional[torch.Tensor]) -> None:
        self.check_inputs(module, x)
        if self.is_last:
            if targets is None:
                raise StageError("the last stage needs targets (int64, same shape as the token ids)")
            self.check_like("targets", targets, torch.empty(x.shape[:2], dtype=torch.int64))
            if targets.numel() and (int(targets.min()) < 0 or int(targets.max()) >= self.vocab_size):
                raise StageError(f"targets must lie in [0, {self.vocab_size})")


def measure_throughput(module: torch.nn.Module, spec: RunSpec, stage: int, repeats: int = 2) -> float:
    """Samples/s of forward+backward of stage ``stage``'s ``module`` on a random micro-batch (gradients discarded;
    the best of ``repeats``)."""
    m, b, t = spec.model, spec.training.micro_batch_size, spec.data.seq_len
    device = next(module.parameters()).device
    x = torch.randint(0, m.vocab_size, (b, t)) if stage == 0 else torch.randn(b, t, m.d_model)
    targets = torch.randint(0, m.vocab_size, (b, t), device=device)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        leaf = x.to(device)
        leaf = leaf if leaf.dtype == torch.int64 else leaf.detach().requires_grad_(True)
        out = module.loss(leaf, targets) if stage == m.num_stages - 1 else module(leaf).square().mean()
        out.backward()
        out.item()  # waits for the device
        best = min(best, time.perf_counter() - start)
    for p in module.parameters():
        p.grad = None
    return b / best



class StageCompute:
    """The compute side of a stage server: the stage's module on one worker thread (:meth:`compute`), forward and
    backward with the autograd graphs kept between them, the spot checks' answers, the gradients handed to the
    optimizer with their trainer, and the epoch transitions reported to ``on_epoch``. :class:`StageServer` adds the
    RPCs; the parameters are :class:`StageServer`'s (see there)."""

    def __init__(self, spec: RunSpec, run_id: str, stage: int, module: Optional[torch.nn.Module] = None, *,
                 optimizer=None, on_epoch: Optional[EpochHook] = None, bans=None, cache_size: int = 16,
                 identity: Optional[Identity] = None):
        self.spec, self.run_id, self.stage, self.identity = spec, run_id, stage, identity
        self.module = module if module is not None else build_stage(spec.model, stage,
                                                                    precision=spec.training.precision)
        self.device = next(self.module.parameters()).device  # the module's: inputs go there, outputs come back
        self.is_last = stage == spec.model.num_stages - 1
        self.optimizer, self.on_epoch, self.bans, self.cache_size = optimizer, on_epoch, bans, cache_size
        self._cache: OrderedDict[tuple[str, str], tuple[torch.Tensor, torch.Tensor, tuple[int, ...]]] = OrderedDict()
        # results of micro-batches already accumulated, with the (epoch, synced) of the parameters they were computed
        # with: a retried request (the reply was lost) gets the same reply again, labelled as it was the first time,
        # instead of counting the micro-batch twice
        self._done: OrderedDict[tuple[str, str], tuple[tuple, tuple[int, bool]]] = OrderedDict()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix=f"stage{stage}-compute")
        self.throughput = PerformanceEMA(alpha=0.1)
        self.samples = 0
        self.compute_s = 0.0
        """CPU seconds (thread CPU time) the compute thread spent in the stage's training forward and backward: the
        model's useful work, without checks, spot-check answers, recomputed forwards or the optimizer. With torch
        intra-op threads above 1 (on the CPU) their workers' time is not counted."""
        self.recomputed = 0
        """Backwards that recomputed their forward: its graph was stale (a step changed the parameters since) or
        evicted (more than ``cache_size`` micro-batches between forward and backward), or the forward ran elsewhere."""
        self.loss_ema: Optional[float] = None
        self.state_digests: dict[int, str] = {}  # epoch -> digest of the full state after its step (recent ones)
        self.meter = EpochMeter()
        self.leaving = False  # paused or draining: new forward/backward requests are refused
        self.inputs = StageInputs(stage, self.is_last, spec.model.vocab_size, max_batch(spec))

    @property
    def epoch(self) -> int:
        return self.optimizer.epoch if self.optimizer is not None else 0

    # ---- compute (worker thread) -------------------------------------------------------------------
    def _leaf(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (checked, on the CPU) on the module's device, a leaf that collects its gradient if float."""
        x = x.to(self.device)
        return x if x.dtype == torch.int64 else x.detach().requires_grad_(True)

    @staticmethod
    def _host(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """A result for the wire or the averager: on the CPU (no copy if it is there)."""
        return None if t is None else t.detach().cpu()

    def forward(self, key: tuple[str, str], x: torch.Tensor, targets: Optional[torch.Tensor], train: bool):
        """Run the stage on ``x``. Returns ``(outputs or input grad or None, loss or None)``."""
        self.inputs.check_forward(self.module, x, targets)
        if not train:
            with torch.no_grad():
                x = x.to(self.device)
                if self.is_last:
                    return None, self._finite(self.module.loss(x, targets.to(self.device)))
                return self._host(self.module(x)), None
        if self.is_last and key in self._done:
            return self._done[key][0]
        start, params = time.perf_counter(), self._params()
        leaf = self._leaf(x)
        with torch.enable_grad(), self._counted():
            if not self.is_last:
                out = self.module(leaf)
                if key not in self._done:  # (a repeat after its backward: that backward is answered from _done)
                    self._remember(key, leaf, out)
                return self._host(out), None
            loss = self.module.loss(leaf, targets.to(self.device))
            value = self._finite(loss)
            loss.backward()
        self.loss_ema = value if self.loss_ema is None else 0.9 * self.loss_ema + 0.1 * value
        self.meter.losses.append(value)
        grad = self._host(leaf.grad) if leaf.requires_grad else None
        self._accumulate(key[0], x.shape[0], time.perf_counter() - start)
        self._finish(key, (grad, value), params)
        return grad, value

    def backward(self, key: tuple[str, str], grad_out: torch.Tensor, x: Optional[torch.Tensor]):
        """Backpropagate ``grad_out`` for micro-batch ``key``; returns the input gradient (None for stage 0)."""
        if key in self._done:
            return self._done[key][0][0]
        start, params = time.perf_counter(), self._params()
        entry = self._cache.pop(key, None)
        if entry is not None and entry[2] != self._param_versions():
            # an optimizer step changed the parameters in place since the forward: the saved graph is stale,
            # so recompute the forward from the saved inputs with the current parameters
            x, entry = entry[0].detach(), None
        if entry is None:
            if x is None:
                raise StageError(f"stage {self.stage}: micro-batch {key[1]} is not cached here; resend with inputs")
            self.recomputed += 1
            self.inputs.check_inputs(self.module, x)
            leaf = self._leaf(x)
            with torch.enable_grad():
                out = self.module(leaf)
        else:
            leaf, out, _ = entry
        self.inputs.check_like("grad_outputs", grad_out, out)
        with self._counted():
            out.backward(grad_out.to(self.device))
            grad = self._host(leaf.grad) if leaf.requires_grad else None
        self._accumulate(key[0], grad_out.shape[0], time.perf_counter() - start)
        self._finish(key, (grad, None), params)
        return grad

    def _finite(self, loss: torch.Tensor) -> float:
        """``loss`` as a float. :raises StageError: it is NaN or Inf (finite inputs whose values overflow the
        stage, or corrupt ones): the request is refused, nothing accumulated, no receipt signed."""
        value = loss.item()
        if not math.isfinite(value):
            raise StageError(f"stage {self.stage}: the loss is {value} (not finite): the inputs overflow the model "
                             f"or are corrupt; send activations of the stage's usual scale")
        return value

    def check_forward(self, x: torch.Tensor, targets: Optional[torch.Tensor]):
        """A spot check's forward: what a training forward returns — outputs (middle stage) or the input gradient
        and loss (last stage) — with nothing cached or accumulated. Returns ``(tensor or None, loss or None)``."""
        if not self.is_last:
            return self.forward(("", ""), x, None, train=False)
        self.inputs.check_forward(self.module, x, targets)
        leaf = self._leaf(x)
        with torch.enable_grad():
            loss = self.module.loss(leaf, targets.to(self.device))
            value = self._finite(loss)
            grad = torch.autograd.grad(loss, leaf)[0] if leaf.requires_grad else None
        return self._host(grad), value

    def check_backward(self, grad_out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """A spot check's backward: the input gradient for ``grad_out`` recomputed from ``x``, nothing
        accumulated. :raises StageError: stage 0 (its inputs are token ids: it returns nothing to check)."""
        self.inputs.check_inputs(self.module, x)
        leaf = self._leaf(x)
        if not leaf.requires_grad:
            raise StageError(f"stage {self.stage} takes token ids: its backward returns nothing to check")
        with torch.enable_grad():
            out = self.module(leaf)
            self.inputs.check_like("grad_outputs", grad_out, out)
            return self._host(torch.autograd.grad(out, leaf, grad_out.to(self.device))[0])

    @property
    def synced(self) -> bool:
        """Whether the parameters are the stage's shared ones (:attr:`~swarm.averaging.StageOptimizer.synced`)."""
        return self.optimizer.synced if self.optimizer is not None else True

    def _params(self) -> tuple[int, bool]:
        return self.epoch, self.synced

    def _at_epoch(self, fn, *args):
        """(compute thread) ``((epoch, synced) of the parameters fn computes with, fn(*args))``."""
        params = self._params()
        return params, fn(*args)

    def _trained_at(self, fn, key: tuple[str, str], *args):
        """(compute thread) :meth:`_at_epoch` for a call that finishes micro-batch ``key`` (the last stage's training
        :meth:`forward`, :meth:`backward`): a repeat answered from the finished micro-batches carries the
        ``(epoch, synced)`` of its first answer. That micro-batch may have ended the epoch (the optimizer stepped
        inside the call, and a trainer whose call timed out meanwhile retries it): labelled with now's epoch, the
        answer would be compared in a spot check with answers computed on the stepped parameters, and convict an
        honest server."""
        params, out = self._at_epoch(fn, key, *args)
        done = self._done.get(key)
        return (done[1] if done is not None else params), out

    @contextmanager
    def _counted(self):
        """Add the compute thread's CPU time inside the block to :attr:`compute_s`."""
        start = time.thread_time()
        try:
            yield
        finally:
            self.compute_s += time.thread_time() - start

    def _finish(self, key, result, params: tuple[int, bool]) -> None:
        self._done[key] = (result, params)
        while len(self._done) > self.cache_size:
            self._done.popitem(last=False)

    def _param_versions(self) -> tuple[int, ...]:
        return tuple(p._version for p in self.module.parameters())

    def _remember(self, key, leaf, out) -> None:
        self._cache[key] = (leaf, out, self._param_versions())
        while len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)

    def _accumulate(self, trainer: str, batch_size: int, seconds: float) -> None:
        """Count the micro-batch of ``trainer`` and hand its gradients to the optimizer (per-trainer accounts)."""
        self.samples += batch_size
        self.meter.samples += batch_size
        self.throughput.update(task_size=batch_size, interval=seconds)
        grads = [self._host(p.grad) if p.grad is not None else torch.zeros(p.shape, dtype=p.dtype)
                 for p in self.module.parameters()]
        for p in self.module.parameters():
            p.grad = None
        if self.optimizer is None:
            return
        start = time.perf_counter()
        if self.optimizer.step(grads, batch_size, trainer):
            self._epoch_ended(time.perf_counter() - start)

    def finish_epoch_if_ready(self) -> bool:
        """Join the epoch's averaging round as soon as the stage's servers together reached the target.

        The collaborative optimizer only acts when a micro-batch is handed over, which happens after a
        backward. Without this, a server whose peers already entered the round (their trainers' micro-batches
        waiting on them) would get no work to trigger its own step, and the round would wait for its timeout
        without it. Returns True if an epoch ended.
        """
        if self.optimizer is None:
            return False
        start = time.perf_counter()
        if self.optimizer.finish_epoch_if_ready():
            self._epoch_ended(time.perf_counter() - start)
            return True
        return False

    async def watch_epochs(self, stop: asyncio.Event, period_s: float = 0.25) -> None:
        """Run :meth:`finish_epoch_if_ready` on the compute thread every ``period_s`` seconds until ``stop``."""
        async def tick() -> None:
            await self.compute(self.finish_epoch_if_ready)

        await periodic(stop, period_s, tick, f"stage {self.stage}: finishing an idle epoch", logger)

    def _epoch_ended(self, seconds: float) -> None:
        """(compute thread) Record the transition, then report it to the owner (``on_epoch``)."""
        end = self.meter.close(self.optimizer.epoch, seconds)
        self.note_state_digest()
        if self.on_epoch is not None:
            self.on_epoch(end)

    def note_state_digest(self) -> None:
        """(compute thread) Keep the digest of the state at the current epoch, which stage-mates ask for
        (``rpc_state_digest``): after each epoch's step, and once the state a server starts from is in place (the
        initial, restored or downloaded one; without it a stage that has not stepped yet vouches for nobody, and
        every joiner waited out each donor's check, 10 s apiece, measured: 37 s per join at 7 servers a stage).
        Out of sync (:attr:`synced` false) it keeps none for the epoch: its state is its own, not the stage's, so it
        neither vouches for nor contradicts a donor's, and endorses no checkpoint of that epoch (a server whose round
        ran in another group than its stage-mates' contradicted every honest donor of theirs, bench/sybil.py)."""
        if not self.synced:
            self.state_digests.pop(self.optimizer.epoch, None)
            return
        self.state_digests[self.optimizer.epoch] = self.optimizer.state_digest()
        for old in sorted(self.state_digests)[:-DIGESTS_KEPT]:
            del self.state_digests[old]

    def recent_digests(self, n: int) -> dict[int, str]:
        """The state digests of this server's last ``n`` epochs (any thread: the dict is copied at once)."""
        held = dict(self.state_digests)  # one C-level copy: the compute thread may add an epoch meanwhile
        return {e: held[e] for e in sorted(held)[-n:]}

    async def compute(self, fn, *args):
        """Run ``fn(*args)`` on the compute thread, between micro-batches (state changes go through here).

        :raises StageError: the server is shutting down (its compute thread stopped)."""
        try:
            future = asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)
        except RuntimeError:  # the pool is shut down: a request that arrived while the server drains
            raise StageError(f"stage {self.stage} server is shutting down; retry on another server") from None
        return await future

    @property
    def in_flight(self) -> int:
        """Micro-batches whose forward ran here and whose backward has not come yet."""
        return len(self._cache)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


__all__ = ["DIGESTS_KEPT", "EpochEnd", "EpochHook", "EpochMeter", "StageCompute", "StageError", "StageInputs",
           "measure_throughput"]
