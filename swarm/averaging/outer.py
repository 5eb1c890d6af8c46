"""Outer steps (DiLoCo): each server of a stage trains on its own for ``inner_steps`` steps, then the stage averages
how far it moved.

DiLoCo (Douillard et al., "DiLoCo: Distributed Low-Communication Training of Language Models", 2023, Algorithm 1)
as a stage's averaging mode (``[averaging] mode = "outer"``). With ``θ`` the stage's parameters at its last outer
step (the same on every server of the stage) and ``T`` the run's ``target_batch_size``:

1. **inner steps**: a server takes an AdamW step on its own combined gradient (per trainer, clipped, robustly
   combined: :mod:`swarm.averaging.contributions`) every ``T`` samples it processed, with the learning rate of the
   spec's schedule at the current outer epoch; no communication;
2. **outer round**: when the stage's servers together processed ``inner_steps × T`` samples per server counted
   (:attr:`SampleCountTracker.per_server_target`), each computes its *pseudo-gradient* ``Δ = θ - θ_inner``
   (float32, shaped like the parameters), and the stage all-reduces ``Δ`` weighted by the samples behind it,
   through the same robust, audited all-reduce and compressor as gradients in ``per_epoch`` mode;
3. **outer step**: SGD with Nesterov momentum (``outer_lr``, ``outer_momentum``; DiLoCo's 0.7 and 0.9) on ``θ``
   with the averaged ``Δ`` as its gradient; every server continues from the new ``θ``.

With ``overlap_rounds`` (:mod:`swarm.averaging.overlap`) the round of step 2 runs in the background during the next
outer epoch, and step 3 applies it at that epoch's end (the one-step-delayed outer update of "Eager Updates For
Overlapped Communication and Computation in DiLoCo", Kale et al. 2025, with the local progress kept): a server
that sent ``Δ_e`` goes on from ``θ_e - Δ_e`` (its own move, which the round has not applied yet), and its next
pseudo-gradient is measured from there, so no inner step is lost to the delay. At the end of epoch ``e + 1`` the
outer step applies the averaged ``Δ_e`` to ``θ_e``, the round of ``Δ_{e+1}`` starts, and the inner steps go on
from ``θ_{e+1} - Δ_{e+1}``. One server, ``outer_lr`` 1 and no momentum: exactly the non-overlapped run. A server
that loads a state has no pending ``Δ`` and misses one outer step (``_late``, as in per-epoch overlap) until the
next state round.

The *epoch* counts outer steps. hivemind's offloaded optimizer (``offload_optimizer``, on by default) already keeps
``θ`` apart from the module's parameters: the outer optimizer runs on those copies, the inner one on the module,
and the stage's state (checkpoints, the state a joiner downloads, the digests servers compare) is ``θ`` with the
outer momentum. The inner AdamW moments are each server's own: a server that loads a state (joins, restores a
checkpoint, rolls back) starts them afresh, and its inner steps restart from the loaded ``θ``. With one server per
stage and one trainer the swarm follows :func:`swarm.reference.train_reference` in this mode up to float rounding.

Touches hivemind 1.1.12's ``Optimizer`` internals (``_update_global_epoch``, the state averager's offloaded
parameters, the gradient averager's buffers), which is why it lives beside
:class:`~swarm.averaging.optimizer.StageOptimizer`.
"""

from __future__ import annotations

import logging
from typing import Callable, Optional

import torch

from swarm.averaging.schedule import make_torch_optimizer
from swarm.config import RunSpec

logger = logging.getLogger(__name__)


def make_outer_optimizer(spec: RunSpec, params) -> torch.optim.SGD:
    """SGD with Nesterov momentum over ``params`` (the stage's outer parameters), its momentum buffers created up
    front (zeros: the first step then equals a fresh SGD's, and hivemind's state averager finds state to share).
    Without momentum (``outer_momentum = 0``) it holds none: torch's SGD never reads them then, and the stage's
    state (a joiner's download, checkpoints, state rounds) is the parameters alone, half the bytes."""
    avg, keys = spec.averaging, outer_statistics(spec)
    opt = torch.optim.SGD(params, lr=avg.outer_lr, momentum=avg.outer_momentum, nesterov=avg.outer_momentum > 0)
    for group in opt.param_groups if keys else ():
        for p in group["params"]:
            opt.state[p] = {key: torch.zeros_like(p) for key in keys}
    return opt


def outer_statistics(spec: RunSpec) -> tuple[str, ...]:
    """The outer optimizer's state that the stage averages and shares: the momentum, if there is one."""
    return ("momentum_buffer",) if spec.averaging.outer_momentum > 0 else ()


class InnerLoop:
    """A server's inner optimizer: AdamW on the module's parameters, stepped every ``target`` samples.

    :param params: the module's parameters (the inner ones; float32).
    :param target: samples per inner step (the run's ``target_batch_size``).
    :param lr_at: the inner learning rate at an outer epoch (the spec's ``lr`` times its schedule).
    """

    def __init__(self, spec: RunSpec, params: list[torch.nn.Parameter], target: int,
                 lr_at: Callable[[int], float]):
        self.spec, self.params, self.target, self.lr_at = spec, params, target, lr_at
        self.samples = 0  # accumulated since the last inner step
        self.steps = 0  # inner steps since the last outer step
        self.optimizer = make_torch_optimizer(spec.optim, params)
        self.pending: Optional[list[torch.Tensor]] = None  # overlapped: this server's Δ in the running round

    def reset(self, epoch: int) -> None:
        """Start afresh at outer epoch ``epoch`` (new AdamW moments, no pending Δ; after a state was loaded)."""
        self.optimizer = make_torch_optimizer(self.spec.optim, self.params)
        self.samples = self.steps = 0
        self.pending = None
        self.set_epoch(epoch)

    def set_epoch(self, epoch: int) -> None:
        """Use outer epoch ``epoch``'s learning rate for the following inner steps."""
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr_at(epoch)

    @property
    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    @torch.no_grad()
    def step(self, gradient: list[torch.Tensor]) -> None:
        """One AdamW step on ``gradient`` (one float32 tensor per parameter, shaped like it)."""
        for p, g in zip(self.params, gradient):
            p.grad = g.to(p.device, p.dtype)
        with torch.enable_grad():  # AdamW's step needs no graph; torch only asks grad mode not to be off
            self.optimizer.step()
        for p in self.params:
            p.grad = None
        self.samples, self.steps = 0, self.steps + 1

    def pseudo_gradient(self, outer: list[torch.Tensor]) -> list[torch.Tensor]:
        """``Δ = θ - θ_inner`` per parameter: float32 tensors shaped like the parameters (``outer`` is ``θ``).
        With a :attr:`pending` Δ (overlapped rounds) the inner steps began at ``θ - pending``, and Δ is measured
        from there: ``θ - pending - θ_inner``."""
        delta = [(o.detach() - p.detach().to(o.device)).float() for o, p in zip(outer, self.params)]
        if self.pending is not None:
            delta = [d.sub_(own) for d, own in zip(delta, self.pending)]
        return delta

    @torch.no_grad()
    def keep_local(self, outer: list[torch.Tensor], delta: list[torch.Tensor]) -> None:
        """Overlapped rounds: go on from ``θ - Δ`` (``outer`` is the new ``θ``, ``delta`` this server's Δ in the
        round just started, kept as :attr:`pending`), so the inner steps keep the progress the round has not
        applied yet; the next Δ is measured from there (:meth:`pseudo_gradient`)."""
        for p, o, d in zip(self.params, outer, delta):
            p.copy_((o.detach() - d).to(p.device, p.dtype))
        self.pending = delta


class OuterSteps:
    """Mixin for hivemind's ``Optimizer`` (our :class:`~swarm.averaging.optimizer._CollaborativeOptimizer`): inner
    steps between the outer rounds when ``inner`` is set (the module docstring), hivemind's epochs otherwise."""

    inner: Optional[InnerLoop] = None
    overlap_rounds: bool = False

    def take_inner_step_if_due(self, samples: int) -> None:
        """Count ``samples`` newly accumulated; every ``target`` of them, step on their combined gradient."""
        inner = self.inner
        if inner is None:
            return
        inner.samples += samples
        if inner.samples >= inner.target:
            self._inner_step()

    def _inner_step(self) -> None:
        contributions = self.grad_averager.contributions
        gradient = contributions.combine(self.inner.params)
        contributions.reset()  # the samples stay counted: they weigh this server's pseudo-gradient
        self.inner.step(gradient)

    def _update_global_epoch(self, grad_scaler) -> None:
        inner = self.inner
        if inner is None:
            return super()._update_global_epoch(grad_scaler)
        if inner.samples > 0:  # the outer epoch ended inside an inner batch: step on what it holds
            self._inner_step()
        outer = [p for group in self.opt.param_groups for p in group["params"]]
        delta = inner.pseudo_gradient(outer)
        self.grad_averager.use_local_gradient(delta)
        logger.debug("outer round after %d inner steps", inner.steps)
        super()._update_global_epoch(grad_scaler)  # all-reduce Δ, outer step, θ_inner = θ (offloaded copies)
        if self.overlap_rounds:  # Δ's round runs on: the outer step applied the previous one
            inner.keep_local(outer, delta)
        inner.steps = 0
        inner.set_epoch(self.local_epoch)

    def reset_inner(self) -> None:
        """Restart the inner loop from the parameters just loaded (fresh moments, no samples)."""
        if self.inner is not None:
            self.inner.reset(self.local_epoch)


__all__ = ["InnerLoop", "OuterSteps", "make_outer_optimizer", "outer_statistics"]
