"""The single-process reference: the same stage modules, data order and optimizer as the swarm, in one loop.

A swarm with one trainer (one micro-batch in flight) and one server per stage must follow this loss curve up
to float rounding; larger swarms track it within the tolerance their tests state. Also the local baseline
of ``bench/swarm_vs_local.py``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from swarm.averaging.outer import make_outer_optimizer
from swarm.averaging.schedule import lr_at_epoch, make_scheduler, make_torch_optimizer, schedule_moves_quietly
from swarm.config import RunSpec
from swarm.data import TokenDataset
from swarm.kernels import REFERENCE, KernelBackend
from swarm.model import build_stage
from swarm.trainer.pipeline import validation_samples
from swarm.trainer.session import micro_batches


@dataclass
class ReferenceResult:
    losses: list[float] = field(default_factory=list)
    """Loss (nats/token) of every micro-batch, in order."""
    stages: list[torch.nn.Module] = field(default_factory=list)
    """The stage modules as trained (their parameters after the last optimizer step)."""
    optimizer: Optional[torch.optim.Optimizer] = None
    """The AdamW that trained them (its state after the last step)."""
    epochs: int = 0
    seconds: float = 0.0
    tokens: int = 0


def train_reference(spec: RunSpec, dataset: TokenDataset, *, share: int = 0, max_samples: int,
                    delayed: Optional[bool] = None,
                    between_stages: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
                    kernels: KernelBackend = REFERENCE) -> ReferenceResult:
    """Train the chained stages on data share ``share``'s micro-batches for ``max_samples`` samples.

    An epoch is ``target_batch_size / micro_batch_size`` micro-batches (rounded up): gradients of their mean
    losses are averaged, then AdamW steps and the schedule advances, as each stage's collaborative optimizer
    does. ``delayed`` (default: the spec's ``averaging.overlap_rounds``) applies each epoch's gradients at the end
    of the next epoch instead, with that epoch's learning rate (:mod:`swarm.averaging.overlap`): ``E`` epochs
    take ``E - 1`` steps. In ``outer`` mode (``averaging.mode``) the AdamW steps are DiLoCo's inner steps, and every
    ``inner_steps`` of them an outer SGD-Nesterov step moves the outer parameters by the pseudo-gradient
    (:mod:`swarm.averaging.outer`); an epoch is an outer step, ``optimizer`` the outer optimizer and the stages end
    at the last outer step's parameters if ``max_samples`` ends on one (``delayed``: each outer step applies the
    previous epoch's pseudo-gradient, the inner steps go on from the outer parameters minus the pending one, and
    the stages end there). ``between_stages`` is applied to the
    activations each stage hands to the next (``bench/activations.py`` puts a wire codec there). The stages
    compute in the spec's ``training.precision`` with ``kernels`` (:mod:`swarm.kernels`; default the reference).
    """
    delayed = spec.averaging.overlap_rounds if delayed is None else delayed
    stages = [build_stage(spec.model, k, precision=spec.training.precision, kernels=kernels)
              for k in range(spec.model.num_stages)]
    params = [p for m in stages for p in m.parameters()]
    opt = make_torch_optimizer(spec.optim, params)
    sched = make_scheduler(spec.optim, opt)
    outer = _OuterLoop(spec, params, opt, delayed) if spec.averaging.mode == "outer" else None
    b = spec.training.micro_batch_size
    per_epoch = -(-spec.training.target_batch_size // b)
    result = ReferenceResult(stages=stages, optimizer=outer.optimizer if outer else opt)
    start, count = time.perf_counter(), 0
    pending: Optional[list[torch.Tensor]] = None
    for indices in micro_batches(dataset, spec, share):
        if count * b >= max_samples:
            break
        batch = dataset.batch(indices)
        h = batch[:, :-1]
        for k, m in enumerate(stages):
            if k > 0 and between_stages is not None:
                h = between_stages(h)
            h = m.loss(h, batch[:, 1:]) if m.last else m(h)
        loss = h
        (loss / per_epoch).backward()
        result.losses.append(loss.item())
        count += 1
        if count % per_epoch == 0 and outer is not None:
            opt.step()
            opt.zero_grad()
            result.epochs += outer.after_inner_step()
        elif count % per_epoch == 0:
            if delayed:
                pending = _step_delayed(opt, params, pending)
            else:
                opt.step()
            with schedule_moves_quietly():  # a delayed first epoch moves the schedule before any step
                sched.step()
            opt.zero_grad()
            result.epochs += 1
    result.seconds = time.perf_counter() - start
    result.tokens = count * b * spec.data.seq_len
    return result


def reference_validation_loss(stages: list[torch.nn.Module], dataset: TokenDataset,
                              max_samples: Optional[int] = None, batch_size: int = 32) -> float:
    """Mean loss (nats/token) of the chained ``stages`` (e.g. :attr:`ReferenceResult.stages`) over the validation
    split: all of it, or its first ``max_samples`` samples, in batches of ``batch_size`` samples, each weighted by
    its samples; the in-process counterpart of :func:`swarm.trainer.pipeline.validation_loss`.

    :raises ValueError: no validation sample to score.
    """
    n = validation_samples(dataset, max_samples)
    if n < 1:
        raise ValueError("the validation split holds no sample; raise data.val_fraction")
    total = 0.0
    with torch.no_grad():
        for start in range(0, n, batch_size):
            rows = list(range(start, min(n, start + batch_size)))
            batch = dataset.batch(rows, "val")
            h = batch[:, :-1]
            for m in stages:
                h = m.loss(h, batch[:, 1:]) if m.last else m(h)
            total += len(rows) * float(h)
    return total / n


class _OuterLoop:
    """DiLoCo's outer loop over the reference's AdamW (its inner optimizer), as one server per stage runs it."""

    def __init__(self, spec: RunSpec, params: list[torch.nn.Parameter], inner: torch.optim.Optimizer,
                 delayed: bool = False):
        self.spec, self.params, self.inner, self.steps, self.epoch = spec, params, inner, 0, 0
        self.outer_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
        self.optimizer = make_outer_optimizer(spec, self.outer_params)
        self.delayed = delayed
        self.pending: Optional[list[torch.Tensor]] = None  # delayed: the last epoch's pseudo-gradient
        self._set_inner_lr()

    def _set_inner_lr(self) -> None:
        for group in self.inner.param_groups:
            group["lr"] = self.spec.optim.lr * lr_at_epoch(self.spec.optim, self.epoch)

    @torch.no_grad()
    def after_inner_step(self) -> int:
        """Count an inner step; every ``inner_steps``, the outer step. Returns the outer epochs it ended (0 or 1)."""
        self.steps += 1
        if self.steps < self.spec.averaging.inner_steps:
            return 0
        delta = [o.detach() - p.detach() for o, p in zip(self.outer_params, self.params)]
        if self.pending is not None:  # delayed: the inner steps began at θ - pending
            delta = [d - own for d, own in zip(delta, self.pending)]
        applied = self.pending if self.delayed else delta
        if applied is not None:  # (delayed: the first epoch takes no outer step)
            for o, g in zip(self.outer_params, applied):
                o.grad = g
            with torch.enable_grad():
                self.optimizer.step()
        for o, p, d in zip(self.outer_params, self.params, delta):
            p.copy_(o - d if self.delayed else o)
        self.pending = delta if self.delayed else None
        self.steps, self.epoch = 0, self.epoch + 1
        self._set_inner_lr()
        return 1


def _step_delayed(opt: torch.optim.Optimizer, params: list[torch.Tensor],
                  pending: Optional[list[torch.Tensor]]) -> list[torch.Tensor]:
    """Step on the previous epoch's gradients (``pending``; none at the first epoch) and return this epoch's."""
    current = [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for p in params]
    if pending is not None:
        for p, g in zip(params, pending):
            p.grad = g
        opt.step()
    return current
