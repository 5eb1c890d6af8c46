"""Capture a stage's training state into a :class:`StageShard` and restore it, bit for bit.

Tensor names: ``param/<parameter name>`` and ``opt/<parameter name>/<state key>`` (AdamW: ``step``,
``exp_avg``, ``exp_avg_sq``). The optimizer's scalar hyper-parameters are not stored: they come from the
run spec, and the learning rate from the schedule at ``epoch``. ``meta`` carries what else a resumed
stage needs (schedule position, data position, ...), as the caller decides.
"""

from __future__ import annotations

import torch

from swarm.checkpoint.shard import ShardError, StageShard


def capture_stage_state(run_id: str, stage: int, epoch: int, module: torch.nn.Module,
                        optimizer: torch.optim.Optimizer, meta: dict | None = None) -> StageShard:
    """Copy ``module``'s parameters and ``optimizer``'s per-parameter state (CPU tensors, cloned)."""
    names = {id(p): n for n, p in module.named_parameters()}
    tensors = {f"param/{n}": p.detach().cpu().clone() for n, p in module.named_parameters()}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in names:
                raise ShardError("the optimizer holds a parameter that is not the module's")
            for key, value in optimizer.state.get(p, {}).items():
                if torch.is_tensor(value):
                    tensors[f"opt/{names[id(p)]}/{key}"] = value.detach().cpu().clone()
                else:
                    tensors[f"opt/{names[id(p)]}/{key}"] = torch.tensor(float(value))
    return StageShard(run_id, stage, epoch, tensors, dict(meta or {}))


def restore_stage_state(shard: StageShard, module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Load ``shard`` into ``module`` and ``optimizer`` in place.

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
    with torch.no_grad():
        for n, p in params.items():
            p.copy_(shard.tensors[f"param/{n}"])
    by_id = {id(p): n for n, p in params.items()}
    for group in optimizer.param_groups:
        for p in group["params"]:
            prefix = f"opt/{by_id[id(p)]}/"
            state = {k[len(prefix):]: v for k, v in shard.tensors.items() if k.startswith(prefix)}
            if state:
                optimizer.state[p] = {k: v.clone().to(p.device) if v.dim() else v.clone() for k, v in state.items()}
