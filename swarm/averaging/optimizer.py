"""The collaborative optimizer of a stage: hivemind.Optimizer with the run spec's schedule and averaging.

Every server of stage ``k`` joins the hivemind optimizer ``{run_id}-stage{k}``: it accumulates gradients of
the micro-batches it backpropagates (clipped and per trainer, :mod:`swarm.averaging.contributions`); once
the stage's servers together have ``target_batch_size`` samples, they form a group (hivemind matchmaking),
all-reduce the gradients with the spec's compressor and robust aggregator
(:mod:`swarm.averaging.averager`) and each applies the same AdamW step, so the servers of a stage stay equal. Every ``average_state_every`` epochs parameters and
optimizer statistics are averaged too, which re-syncs a server that missed a round. A late joiner downloads
the state from a live server (hivemind ``load_state_from_peers``).
"""

from __future__ import annotations

import logging
import math
from functools import partial

import hivemind
import hivemind.optim.progress_tracker
import torch

from swarm.averaging.aggregation import make_aggregator
from swarm.averaging.averager import RobustGradientAverager, RobustStateAverager
from swarm.averaging.bans import BanPolicy
from swarm.averaging.compression import make_compressor
from swarm.averaging.reducer import ReducePolicy
from swarm.config import OptimSpec, RunSpec


def lr_at_epoch(optim: OptimSpec, epoch: int) -> float:
    """Learning rate multiplier at ``epoch``: linear warm-up, then cosine decay to ``min_lr_ratio``."""
    if epoch < optim.warmup_epochs:
        return (epoch + 1) / (optim.warmup_epochs + 1)
    progress = min(1.0, (epoch - optim.warmup_epochs) / max(1, optim.total_epochs - optim.warmup_epochs))
    return optim.min_lr_ratio + (1 - optim.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def make_torch_optimizer(optim: OptimSpec, params) -> torch.optim.Optimizer:
    """The local optimizer of the spec (AdamW), also used by the single-process reference."""
    return torch.optim.AdamW(params, lr=optim.lr, betas=optim.betas, eps=optim.eps, weight_decay=optim.weight_decay)


def make_stage_torch_optimizer(optim: OptimSpec, params) -> torch.optim.Optimizer:
    """:func:`make_torch_optimizer` with its state created up front (zero moments, ``step = 0``).

    hivemind's state averager needs optimizer state tensors to exist; if there are none it creates them with
    a "virtual" AdamW step on zero gradients, which applies weight decay once and counts a step, so the
    first real update would differ from plain AdamW's. Creating the same state AdamW would create lazily
    keeps the stage optimizer identical to the single-process reference.
    """
    opt = make_torch_optimizer(optim, params)
    for group in opt.param_groups:
        for p in group["params"]:
            opt.state[p] = {
                "step": torch.tensor(0.0),
                "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
            }
    return opt


class Schedule:
    """The learning-rate multiplier at an epoch: :func:`lr_at_epoch` times ``scale`` (lowered by loss-spike
    rollbacks, :mod:`swarm.checkpoint.rollback`)."""

    def __init__(self, optim: OptimSpec, scale: float = 1.0):
        self.optim, self.scale = optim, scale

    def __call__(self, epoch: int) -> float:
        return lr_at_epoch(self.optim, epoch) * self.scale


def make_scheduler(optim: OptimSpec, opt: torch.optim.Optimizer,
                   schedule: Schedule | None = None) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(opt, schedule or Schedule(optim))


def set_lr_scale(optimizer: "StageOptimizer", scale: float) -> None:
    """Set the rollback learning-rate multiplier and apply it to the current epoch's learning rate now."""
    optimizer.schedule.scale = scale
    scheduler = optimizer.state_averager.scheduler
    for group, base in zip(optimizer.opt.param_groups, scheduler.base_lrs):
        group["lr"] = base * optimizer.schedule(scheduler.last_epoch)


class SampleCountTracker(hivemind.optim.progress_tracker.ProgressTracker):
    """hivemind's progress tracker, but an epoch ends only when ``target_batch_size`` samples were counted.

    hivemind also ends an epoch once its *estimated* time of arrival has passed, which makes epochs with
    fewer samples than the target when trainers slow down; here the epoch is the spec's batch, exactly.
    The local count is read directly, so a lone server steps right after its last micro-batch.
    """

    @property
    def ready_to_update_epoch(self) -> bool:
        return (
            self.global_epoch > self.local_progress.epoch
            or self.global_progress.samples_accumulated >= self.target_batch_size
            or self.local_progress.samples_accumulated >= self.target_batch_size
        )


class StageOptimizer(hivemind.Optimizer):
    """hivemind.Optimizer with our averagers and two fixes for hivemind 1.1.12, through its private seams.

    * :class:`~swarm.averaging.averager.RobustStateAverager` for parameters and optimizer statistics
      (``_make_state_averager``); the gradient averager comes through ``grad_averager_factory``.
    * :class:`SampleCountTracker` as the progress tracker (``_make_progress_tracker``).
    * A pre-scheduled gradient round whose matchmaking already ended (it was scheduled at an estimated time
      that passed) makes hivemind 1.1.12 *skip* averaging and step on local gradients alone, while the other
      servers wait for it until their round times out; the servers then hold different parameters. Here
      such a stale round is dropped and a fresh one is started (``_begin_averaging_gradients``).
    """

    def _begin_averaging_gradients(self, grad_scaler) -> bool:
        stale = self.scheduled_grads
        if stale is not None and (stale.triggered or stale.done()):
            self.scheduled_grads = None
        return super()._begin_averaging_gradients(grad_scaler)

    def __init__(self, *, state_averager_kwargs: dict, schedule: Schedule, **kwargs):
        self._robust_state_kwargs = state_averager_kwargs
        self.schedule = schedule
        super().__init__(**kwargs)

    def _make_state_averager(self, **kwargs) -> RobustStateAverager:
        return RobustStateAverager(
            dht=self.dht, prefix=f"{self.run_id}_state_averager", min_matchmaking_time=self.matchmaking_time,
            allreduce_timeout=self.allreduce_timeout, shutdown_timeout=self.shutdown_timeout,
            offload_optimizer=self.offload_optimizer, custom_gradients=self.offload_optimizer,
            status_loglevel=self.status_loglevel, next_chunk_timeout=self.next_chunk_timeout,
            client_mode=self.client_mode, auxiliary=self.auxiliary, start=True,
            **self._robust_state_kwargs, **kwargs,
        )

    def _make_progress_tracker(self, target_batch_size: int, **kwargs) -> SampleCountTracker:
        return SampleCountTracker(
            dht=self.dht, prefix=self.run_id, target_batch_size=target_batch_size, client_mode=self.client_mode,
            status_loglevel=self.status_loglevel, start=True, **kwargs,
        )


def averaging_components(spec: RunSpec, attack=None, identity=None, run_id: str = "local") -> dict:
    """Keyword arguments of :class:`~swarm.averaging.averager.RobustGradientAverager` from the spec's
    ``[averaging]`` section (the state averager takes the same minus the compressor, attack and clip ratio)."""
    avg = spec.averaging
    return dict(
        compressor=make_compressor(avg.compression, rank=avg.powersgd_rank),
        aggregator=make_aggregator(avg.aggregator, trim=avg.trim, tau_ratio=avg.clip_tau,
                                   iterations=avg.clip_iterations),
        policy=ReducePolicy(reject_norm_ratio=avg.reject_norm_ratio, outlier_ratio=avg.outlier_ratio,
                            max_weight_ratio=avg.max_weight_ratio),
        ban_policy=BanPolicy(threshold=avg.ban_threshold),
        phase_timeout=avg.next_chunk_timeout,
        attack=attack,
        clip_ratio=avg.microbatch_clip_ratio,
        identity=identity,
        run_id=run_id,
        audit_probability=avg.audit_probability,
    )


def build_stage_optimizer(spec: RunSpec, run_id: str, stage: int, dht: hivemind.DHT, module: torch.nn.Module,
                          *, client_mode: bool = False, attack=None, identity=None) -> StageOptimizer:
    """hivemind.Optimizer for ``module`` (stage ``stage``), configured from the spec.

    Gradients and state are averaged by our robust all-reduce (:mod:`swarm.averaging.averager`); ``attack``
    makes this server Byzantine (tests and benchmarks only); ``identity`` (the peer's Ed25519 key) signs its
    averaging commitments, receipts and accusations.
    """
    avg = spec.averaging
    components = averaging_components(spec, attack, identity, run_id)
    state_kwargs = {k: components[k] for k in ("aggregator", "policy", "ban_policy", "phase_timeout", "identity",
                                               "run_id", "audit_probability")}
    schedule = Schedule(spec.optim)
    return StageOptimizer(
        state_averager_kwargs=state_kwargs,
        schedule=schedule,
        dht=dht,
        run_id=f"{run_id}-stage{stage}",
        params=module.parameters(),
        optimizer=partial(make_stage_torch_optimizer, spec.optim),
        scheduler=partial(make_scheduler, spec.optim, schedule=schedule),
        target_batch_size=spec.training.target_batch_size,
        batch_size_per_step=spec.training.micro_batch_size,
        matchmaking_time=avg.matchmaking_time,
        averaging_timeout=avg.averaging_timeout,
        next_chunk_timeout=avg.next_chunk_timeout,
        average_state_every=avg.average_state_every,
        average_opt_statistics=("exp_avg", "exp_avg_sq"),
        delay_state_averaging=False,
        grad_averager_factory=partial(RobustGradientAverager, **components),
        client_mode=client_mode,
        # progress records of a dead server expire after two record TTLs (hivemind: 60 s), so the survivors and
        # its restarted successor stop counting it soon
        tracker_opts=dict(min_refresh_period=0.1, max_refresh_period=0.5, default_refresh_period=0.25,
                          metadata_expiration=2 * spec.timeouts.record_ttl_s),
        averager_opts=dict(request_timeout=1.0, min_vector_size=0),
        verbose=logging.getLogger("hivemind").isEnabledFor(logging.INFO),
    )
