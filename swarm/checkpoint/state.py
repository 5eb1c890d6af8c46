"""Capture a stage's training state into a :class:`StageShard` and restore it, bit for bit.

Tensor names: ``param/<parameter name>`` and ``opt/<parameter name>/<state key>`` (AdamW: ``step``,
``exp_avg``, ``exp_avg_sq``). The optimizer's scalar hyper-parameters are not stored: they come from the
run spec, and the learning rate from the schedule at ``epoch``. ``meta`` carries what else a resumed
stage needs (schedule position, data position, ...), as the caller decides.
"""

from __future__ import annotations

import hashlib
from typing import Awaitable, Callable, Protocol

import torch

from swarm.checkpoint.shard import ShardError, StageShard


def _optimizer_names(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[int, str]:
    """Parameter name of every tensor the optimizer updates (by id).

    The optimizer may hold the module's parameters themselves, or copies of them in the same order
    (hivemind's offloaded optimizer, whose steps are then copied into the module's parameters).

    :raises ShardError: the optimizer's tensors are neither, so they cannot be named.
    """
    named = list(module.named_parameters())
    flat = [p for group in optimizer.param_groups for p in group["params"]]
    by_id = {id(p): n for n, p in named}
    if all(id(p) in by_id for p in flat):
        return {id(p): by_id[id(p)] for p in flat}
    if len(flat) != len(named) or any(p.shape != q.shape for p, (_, q) in zip(flat, named)):
        raise ShardError("the optimizer's tensors do not match the module's parameters (count or shapes)")
    return {id(p): n for p, (n, _) in zip(flat, named)}


def named_state(module: torch.nn.Module, optimizer: torch.optim.Optimizer,
                copy: bool = True) -> dict[str, torch.Tensor]:
    """The parameters the optimizer updates and its per-parameter state, by name: ``param/<name>`` and
    ``opt/<name>/<key>`` (a non-tensor value becomes a float64 scalar). CPU copies, unless ``copy`` is False
    (then the tensors themselves, detached: to read, not to keep)."""
    names = _optimizer_names(module, optimizer)
    take = (lambda t: t.detach().cpu().clone()) if copy else (lambda t: t.detach())
    tensors = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            tensors[f"param/{names[id(p)]}"] = take(p)
            for key, value in optimizer.state.get(p, {}).items():
                value = value if torch.is_tensor(value) else torch.tensor(float(value))
                tensors[f"opt/{names[id(p)]}/{key}"] = take(value)
    return tensors


def load_named_state(tensors: dict[str, torch.Tensor], module: torch.nn.Module,
                     optimizer: torch.optim.Optimizer) -> None:
    """Load :func:`named_state` into ``module``'s parameters, the optimizer's copies of them (if any) and its
    state. State tensors the optimizer already holds are overwritten in place (others are set): hivemind's state
    averager averages those very tensors, in shared memory, and would otherwise go on averaging stale copies.

    :raises ShardError: a parameter is missing or has another shape or dtype (the state is of another model).
    """
    params = dict(module.named_parameters())
    missing = [n for n in params if f"param/{n}" not in tensors]
    if missing:
        raise ShardError(f"the state lacks parameters {missing[:3]}...; it was written for another model or stage")
    for n, p in params.items():
        t = tensors[f"param/{n}"]
        if t.shape != p.shape or t.dtype != p.dtype:
            raise ShardError(f"parameter {n} is {t.dtype}{tuple(t.shape)} in the state, {p.dtype}{tuple(p.shape)} here")
    names = _optimizer_names(module, optimizer)
    with torch.no_grad():
        for n, p in params.items():
            p.copy_(tensors[f"param/{n}"])
        for group in optimizer.param_groups:
            for p in group["params"]:
                p.copy_(tensors[f"param/{names[id(p)]}"])
    for group in optimizer.param_groups:
        for p in group["params"]:
            prefix = f"opt/{names[id(p)]}/"
            loaded = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
            if loaded:
                optimizer.state[p] = {k: _into(optimizer.state.get(p, {}).get(k), v, p.device)
                                      for k, v in loaded.items()}


def _into(held, value: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``value`` written into the tensor ``held`` if it has the same shape and dtype (in place), else a copy."""
    if torch.is_tensor(held) and held.shape == value.shape and held.dtype == value.dtype:
        with torch.no_grad():
            return held.copy_(value)
    return value.clone().to(device) if value.dim() else value.clone()


def state_digest(tensors: dict[str, torch.Tensor]) -> str:
    """SHA-256 (hex) of a :func:`named_state`: names, dtypes, shapes and bytes in name order. Two servers of a
    stage hold the same state exactly when their digests match."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        if t.numel():
            h.update(t.view(-1).view(torch.uint8).numpy())  # the tensor's own bytes, not a copy
    return h.hexdigest()


def capture_stage_state(run_id: str, stage: int, epoch: int, module: torch.nn.Module,
                        optimizer: torch.optim.Optimizer, meta: dict | None = None) -> StageShard:
    """A shard of the parameters the optimizer updates and its per-parameter state (CPU tensors, cloned)."""
    return StageShard(run_id, stage, epoch, named_state(module, optimizer), dict(meta or {}))


def restore_stage_state(shard: StageShard, module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Load ``shard`` into ``module``'s parameters, the optimizer's copies of them (if any) and its state.

    :raises ShardError: a parameter is missing or has another shape or dtype (the shard is of another model).
    """
    load_named_state(shard.tensors, module, optimizer)


class StateHolder(Protocol):
    """What a stage's checkpoint duties need of its state: the stage's optimizer
    (:class:`~swarm.averaging.optimizer.StageOptimizer`) satisfies it. Its methods run on the stage server's compute
    thread, between micro-batches, except :meth:`load_state_from_peers` (blocking, on any thread but the loop's)."""

    @property
    def epoch(self) -> int:
        """The stage's epoch as this server knows it."""

    @property
    def lr_scale(self) -> float:
        """The rollback learning-rate multiplier (1.0 until a rollback)."""

    def state(self) -> dict[str, torch.Tensor]:
        """A copy of the state: parameters and optimizer state by name (:func:`named_state`)."""

    def load_state(self, tensors: dict[str, torch.Tensor]) -> None:
        """Load a state of the same names, shapes and dtypes."""

    def jump_to_epoch(self, epoch: int) -> int:
        """Set the epoch to ``epoch`` or, if later, the stage's collaborative epoch; returns the epoch set."""

    def set_lr_scale(self, scale: float) -> None:
        """Set the rollback multiplier and apply it to the current learning rate."""

    def load_state_from_peers(self) -> int:
        """Load the state of a live server of the stage; returns the epoch after it."""

    @property
    def stage_epoch(self) -> int:
        """The epoch of the stage's other servers as this server counts their progress (0 while it counts none)."""


Compute = Callable[..., Awaitable]
"""Runs ``fn(*args)`` on the stage server's compute thread, between micro-batches: ``await compute(fn, *args)``
(:meth:`swarm.server.compute.StageCompute.compute`)."""
