"""Capture a stage's training state into a :class:`StageShard` and restore it, bit for bit.

Tensor names: ``param/<parameter name>`` and ``opt/<parameter name>/<state key>`` (AdamW: ``step``,
``exp_avg``, ``exp_avg_sq``). The optimizer's scalar hyper-parameters are not stored: they come from the
run spec, and the learning rate from the schedule at ``epoch``. ``meta`` carries what else a resumed
stage needs (schedule position, data position, ...), as the caller decides.
"""

from __future__ import annotations

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


def capture_stage_state(run_id: str, stage: int, epoch: int, module: torch.nn.Module,
                        optimizer: torch.optim.Optimizer, meta: dict | None = None) -> StageShard:
    """Copy the parameters the optimizer updates and its per-parameter state (CPU tensors, cloned)."""
    names = _optimizer_names(module, optimizer)
    tensors = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            tensors[f"param/{names[id(p)]}"] = p.detach().cpu().clone()
            for key, value in optimizer.state.get(p, {}).items():
                if torch.is_tensor(value):
                    tensors[f"opt/{names[id(p)]}/{key}"] = value.detach().cpu().clone()
                else:
                    tensors[f"opt/{names[id(p)]}/{key}"] = torch.tensor(float(value))
    return StageShard(run_id, stage, epoch, tensors, dict(meta or {}))


def restore_stage_state(shard: StageShard, module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Load ``shard`` into ``module``'s parameters, the optimizer's copies of them (if any) and its state.

    :raises ShardError: a parameter is missing or has another shape or dtype (the shard is of another model).
    """
    params = dict(module.named_parameters())
    missing = [n for n in params if f"param/{n}" not in shard.tensors]
    if missing:
        raise ShardError(f"shard lacks parameters {missing[:3]}...; it was written for another model or stage")
    for n, p in params.items():
        t = shard.tensors[f"param/{n}"]
        if t.shape != p.shape or t.dtype != p.dtype:
            raise ShardError(f"parameter {n} is {t.dtype}{tuple(t.shape)} in the shard, {p.dtype}{tuple(p.shape)} here")
    names = _optimizer_names(module, optimizer)
    with torch.no_grad():
        for n, p in params.items():
            p.copy_(shard.tensors[f"param/{n}"])
        for group in optimizer.param_groups:
            for p in group["params"]:
                p.copy_(shard.tensors[f"param/{names[id(p)]}"])
    for group in optimizer.param_groups:
        for p in group["params"]:
            prefix = f"opt/{names[id(p)]}/"
            state = {k[len(prefix):]: v for k, v in shard.tensors.items() if k.startswith(prefix)}
            if state:
                optimizer.state[p] = {k: v.clone().to(p.device) if v.dim() else v.clone() for k, v in state.items()}
