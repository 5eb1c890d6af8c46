"""The collaborative optimizer of a stage: the one door to hivemind's optimizer, progress tracker and averagers.

Every server of stage ``k`` joins the hivemind optimizer ``{run_id}-stage{k}`` through a
:class:`StageOptimizer`. It accumulates the gradients of the micro-batches the server backpropagates (clipped
and per trainer, :mod:`swarm.averaging.contributions`); once the stage's servers together counted
``target_batch_size`` samples (an *epoch*), they form a group (hivemind matchmaking), all-reduce the gradients
with the spec's compressor and robust aggregator (:mod:`swarm.averaging.averager`) and each applies the same
AdamW step, so the servers of a stage stay equal. Every ``average_state_every`` epochs parameters and optimizer
statistics are averaged too, which re-syncs a server that missed a round. A late joiner downloads the state
from a live server (hivemind ``load_state_from_peers`` with our donor choice, :mod:`swarm.averaging.donors`)
and keeps it only if :attr:`StageOptimizer.state_check` accepts it.

Nothing outside this module and the two mixins of its optimizer (:mod:`swarm.averaging.overlap`: overlapped
rounds; :mod:`swarm.averaging.outer`: outer steps, DiLoCo) calls into hivemind's ``Optimizer``,
``ProgressTracker`` or averager internals: :class:`StageOptimizer` is the surface (``step``,
``finish_epoch_if_ready``, ``jump_to_epoch``, ``state`` / ``load_state``, ``load_state_from_peers``, ``report``),
and :class:`_CollaborativeOptimizer` keeps the fixes for hivemind 1.1.12 that need its private seams.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from contextlib import contextmanager
from functools import partial
from typing import Callable, Optional, Sequence

import hivemind
import torch

from swarm.averaging.averager import AveragingRules, RobustGradientAverager, RobustStateAverager
from swarm.averaging.catchup import CatchUp
from swarm.averaging.compression import spec_compressor
from swarm.averaging.donors import REFUSAL_S, RETRY_S
from swarm.averaging.exclusion import AveragingReport
from swarm.averaging.membership import MemberTable
from swarm.averaging.outer import InnerLoop, OuterSteps, make_outer_optimizer, outer_statistics
from swarm.averaging.overlap import OverlappedRounds, finish_running_round
from swarm.averaging.progress import SampleCountTracker, progress_signer, refresh_periods
from swarm.averaging.progress_view import StageProgressView
from swarm.averaging.schedule import Schedule, make_scheduler, make_stage_torch_optimizer, schedule_moves_quietly
from swarm.checkpoint.state import load_named_state, named_state, state_digest
from swarm.config import RunSpec
from swarm.net.directory import RunDirectory
from swarm.trust.statecheck import Verdict
from swarm.trust.tickets import ticket_gate

logger = logging.getLogger(__name__)

StateCheck = Callable[[int, str, str], Verdict]
"""Judges a state loaded from a donor: ``(epoch, SHA-256 of the loaded state, the donor's libp2p id)`` -> a
:class:`~swarm.trust.statecheck.Verdict`: kept (``ok``; ``shared``: as the stage's state, else kept but out of sync)
or refused, why, and whether the stage's checkpoint or servers contradicted it: a contradicted donor is skipped for
:data:`~swarm.averaging.donors.REFUSAL_S`, one nobody vouched for for :data:`~swarm.averaging.donors.RETRY_S`
(blocking; may raise, which refuses it for ``RETRY_S``; :class:`swarm.trust.statecheck.DonorStateCheck`)."""
MAX_DONORS_TRIED = 3
AveragerFactory = Callable[..., RobustGradientAverager]
"""Builds the stage's gradient averager (keyword arguments of :class:`RobustGradientAverager`); tests and
benchmarks pass a Byzantine one (:mod:`swarm.attacks`)."""


def request_timeout(matchmaking_time: float) -> float:
    """Seconds a matchmaking request may wait for its answer: below ``matchmaking_time``, as hivemind's matchmaking
    requires (else it warns that rounds may deadlock), and at most 1 s."""
    return min(1.0, matchmaking_time / 2)


class _CollaborativeOptimizer(OuterSteps, OverlappedRounds, hivemind.Optimizer):
    """hivemind.Optimizer with our averagers and two fixes for hivemind 1.1.12, through its private seams.

    * :class:`~swarm.averaging.averager.RobustStateAverager` for parameters and optimizer statistics
      (``_make_state_averager``); the gradient averager comes through ``grad_averager_factory``.
    * :class:`~swarm.averaging.progress.SampleCountTracker` as the progress tracker (``_make_progress_tracker``).
    * A pre-scheduled gradient round whose matchmaking already ended (it was scheduled at an estimated time
      that passed) makes hivemind 1.1.12 *skip* averaging and step on local gradients alone, while the other
      servers wait for it until their round times out; the servers then hold different parameters. Here
      such a stale round is dropped and a fresh one is started (``_begin_averaging_gradients``).
    * hivemind loads the optimizer statistics from a peer with ``torch.optim.Optimizer.load_state_dict``,
      which replaces the state tensors; its state averager keeps averaging the original ones (shared memory,
      ``reuse_tensors``), so this server's Adam moments would never be averaged with the stage again. Here
      the loaded values are copied into the original tensors, which are put back (``load_state_from_peers``,
      also when ``contribute`` finds the server out of sync).
    * With ``overlap_rounds`` the epoch's transition does not wait for its gradient round
      (:mod:`swarm.averaging.overlap`); in ``outer`` mode inner steps run between the rounds, which average the
      pseudo-gradient (:mod:`swarm.averaging.outer`).
    * When its round fails hivemind steps on the server's own gradient, and its parameters leave the stage's
      until the next state round; ``synced`` says so (set at the transition: ``_update_global_epoch``). Its state
      round then carries weight 0 (:attr:`RobustStateAverager.state_weight`): it receives the stage's state and
      moves no one's.
    """

    def __init__(self, *, state_rules: dict, state_averager_factory=RobustStateAverager, overlap_rounds=False,
                 **kwargs):
        self._state_rules, self._state_averager_factory = state_rules, state_averager_factory
        self.overlap_rounds = overlap_rounds
        self.reload: Callable[[], object] = self.load_state_from_peers  # the out-of-sync path (StageOptimizer's)
        self.samples_dropped = 0  # accumulated here, then discarded before a step (see ServerInfo.samples_dropped)
        super().__init__(**kwargs)

    synced: bool = True
    """Whether this server's parameters are the stage's shared ones (:attr:`StageOptimizer.synced`)."""
    _own_step: bool = False  # this transition stepped on this server's own gradient (hivemind's fallbacks)
    missed_round: bool = False
    """The stage-mates ended this server's last gradient round without it (:func:`finish_running_round`): it steps
    on its own gradient, then loads their state (at its next micro-batch, or in ``finish_epoch_if_ready``)."""

    def _update_global_epoch(self, grad_scaler) -> None:
        """The epoch's transition (hivemind's, or a mixin's), then :attr:`synced` from how its rounds went: its own
        gradient is known here (hivemind's fallbacks below), a completed state round from the state averager's
        count (``rounds_completed``)."""
        states = self.state_averager.rounds_completed
        self.grad_averager.round_epoch = self.local_epoch
        late, self._late, self._own_step = self._late, False, False
        others = self.tracker.global_progress.num_peers > 1
        self.state_averager.state_weight = 1.0 if self.synced else 0.0  # out of sync: it moves no one's state
        super()._update_global_epoch(grad_scaler)
        if self.state_averager.rounds_completed > states:
            self.synced = True  # parameters and statistics averaged with the group: equal to theirs again
        elif others and (late or self._own_step):
            self.synced = False  # it stepped on its own gradient (or, late, on none) while its stage-mates did not

    def _load_local_gradients_into_optimizer(self):
        """hivemind's fallback when its round failed (or it was alone): this server's own gradient. hivemind logs a
        round that did not complete within ``averaging_timeout`` at its status level only (debug): said here once."""
        self._own_step = True
        if self.missed_round:
            logger.warning("epoch %d: the stage's other servers ended this epoch's round without this server (its "
                           "matchmaking began after their group formed): it loads their state next", self.local_epoch)
        elif self.tracker.global_progress.num_peers > 1:
            logger.warning("epoch %d: stepping on this server's own gradient, its gradient round did not complete "
                           "(it failed, or ran past averaging_timeout=%.0f s): out of sync until the next state round",
                           self.local_epoch, self.averaging_timeout)
        super()._load_local_gradients_into_optimizer()

    def drop_accumulated(self) -> None:
        """Count the samples accumulated so far as dropped (their gradients are about to be discarded)."""
        self.samples_dropped += self.grad_averager.local_samples_accumulated

    def contribute(self, gradients: Sequence[torch.Tensor], samples: int, contributor: str) -> None:
        """``hivemind.Optimizer.step(batch_size=samples)`` for this configuration (gradient averaging, not
        auxiliary, no closure or AMP scaler), with the gradients and their trainer passed explicitly."""
        self.state_averager.step(apply_delayed_updates=True)
        if self._should_load_state_from_peers():
            logger.info("this server is out of sync with its stage: loading the state from its peers")
            self.samples_dropped += samples  # the gradients were computed with out-of-sync parameters
            self.reload()
            return
        counted = self.grad_averager.local_samples_accumulated
        self.grad_averager.round_epoch = self.local_epoch  # seeds the round's grid (bounded groups)
        self.grad_averager.accumulate(contributor, gradients, samples)
        self.take_inner_step_if_due(self.grad_averager.local_samples_accumulated - counted)
        self.tracker.report_local_progress(self.local_epoch, self.grad_averager.local_samples_accumulated)
        self._maybe_schedule_gradient_averaging()
        self._maybe_schedule_state_averaging()
        if self.tracker.ready_to_update_epoch:
            self._update_global_epoch(None)

    early_start = False  # ``[averaging] early_start``: no round is scheduled ahead of the epoch's end (below)

    def _maybe_schedule_gradient_averaging(self) -> None:
        """hivemind starts a round's matchmaking ahead of the epoch's estimated end. With :attr:`early_start` a
        round starts when the epoch ends (a complete group at once), so a group holds only servers whose epoch
        ended: one assembled ahead waited for its members' epochs, and held a leaving server in hivemind's
        shutdown (docs/efficiency.md)."""
        if not self.early_start:
            super()._maybe_schedule_gradient_averaging()

    def _maybe_schedule_state_averaging(self) -> None:
        if not self.early_start:  # as _maybe_schedule_gradient_averaging, for the rounds that average the state
            super()._maybe_schedule_state_averaging()

    def _should_load_state_from_peers(self) -> bool:
        """hivemind's rule, and also: this server is behind most of the stage's other servers (the lower median of
        their epochs), unless it joins their overlapped round (:meth:`joins_their_round`). hivemind lets a server
        one epoch behind go on and join the others' next round with the gradients of its own epoch; a server that
        missed the others' round (it joined or resumed meanwhile, or was slow to notice the epoch's end) then
        pairs epoch ``e`` with ``e + 1``, and the state rounds (every ``average_state_every`` epochs) no longer
        meet: each waits ``averaging_timeout`` for the other, epoch after epoch. Loading the state instead costs
        this server the samples it accumulated. The median (not hivemind's maximum) keeps one server that claims
        a later epoch from making the others reload."""
        if self.joins_their_round():  # (hivemind's exact check, once an epoch, would load here too)
            return False
        return (super()._should_load_state_from_peers() or self.local_epoch < self.tracker.others_epoch
                or self.missed_round)

    def load_state_from_peers(self, **kwargs):
        opt = self.opt
        originals = {p: dict(opt.state[p]) for group in opt.param_groups for p in group["params"]}
        self.drop_accumulated()  # hivemind resets the accumulated gradients after the load
        self.discard_pending_round()
        with schedule_moves_quietly():
            super().load_state_from_peers(**kwargs)
        with self.state_averager.lock_averaged_tensors:
            _put_back(opt, originals)
        self.reset_inner()
        self._late = self.overlap_rounds and self.local_epoch > 0  # it missed their pending round (none at epoch 0)
        self.missed_round = False

    def _begin_averaging_gradients(self, grad_scaler) -> bool:
        """hivemind's, with a deadline on the round: a round hivemind starts here (none was scheduled ahead: always
        so with ``early_start``) has none, so one that failed retried its matchmaking for as long as the process
        lived, holding the averager's one search, and no later round of this server found a group (a stage of 7
        servers completed no round after its first failure: tests/test_scale.py, kept logs)."""
        stale = self.scheduled_grads
        if stale is not None and (stale.triggered or stale.done()):
            self.scheduled_grads = None
        if self.scheduled_grads is None and self.tracker.global_progress.num_peers > 1:
            try:
                self.scheduled_grads = self.grad_averager.schedule_step(timeout=self.averaging_timeout)
            except Exception as e:  # the averager process is gone: hivemind's own try below logs it and steps alone
                logger.warning("could not schedule a gradient round (%s: %s)", type(e).__name__, e)
        began = super()._begin_averaging_gradients(grad_scaler)
        self._own_step = self._own_step or not began  # hivemind then steps on the accumulated gradient
        return began

    def _average_gradients_and_load_into_optimizer(self, maybe_step_control) -> None:
        """hivemind's, after waiting out an all-reduce already running at ``averaging_timeout`` (up to
        ``allreduce_timeout`` more: hivemind gave it up, then waited that long anyway for the averaged buffers' lock
        to write this server's own gradient over the group's result, out of sync for nothing); then the round
        cancelled if it did not complete (hivemind leaves it running: retrying its matchmaking, and blocking this
        averager's next search, until its deadline); or once it was missed (:attr:`missed_round`), unless it is an
        overlapped round (the previous epoch's)."""
        if maybe_step_control is not None:
            missed = None if self.overlap_rounds else partial(self.tracker.mates_moved_past, self.local_epoch)
            timeouts = (self.averaging_timeout, self.allreduce_timeout)
            self.missed_round = finish_running_round(maybe_step_control, *timeouts, missed)
        try:
            super()._average_gradients_and_load_into_optimizer(maybe_step_control)
        finally:
            if maybe_step_control is not None and not maybe_step_control.done():
                maybe_step_control.cancel()

    def _make_state_averager(self, **kwargs) -> RobustStateAverager:
        return self._state_averager_factory(
            dht=self.dht, prefix=f"{self.run_id}_state_averager", min_matchmaking_time=self.matchmaking_time,
            allreduce_timeout=self.allreduce_timeout, shutdown_timeout=self.shutdown_timeout,
            offload_optimizer=self.offload_optimizer, custom_gradients=self.offload_optimizer,
            status_loglevel=self.status_loglevel, next_chunk_timeout=self.next_chunk_timeout,
            client_mode=self.client_mode, auxiliary=self.auxiliary, start=True,
            **self._state_rules, **kwargs,
        )

    def _make_progress_tracker(self, target_batch_size: int, **kwargs) -> SampleCountTracker:
        return SampleCountTracker(
            dht=self.dht, prefix=self.run_id, target_batch_size=target_batch_size, client_mode=self.client_mode,
            status_loglevel=self.status_loglevel, start=True, **kwargs,
        )


class StageOptimizer(StageProgressView):
    """The collaborative optimizer of one server of stage ``stage`` (see the module docstring).

    :param module: the stage's parameters (the server's copy; stepped in place once per epoch).
    :param identity: the peer's Ed25519 identity; it signs this server's averaging commitments, receipts and
        accusations.
    :param averager_factory: builds the gradient averager (default :class:`RobustGradientAverager`).
    :param state_check: judges a state loaded from a donor before it is kept (:data:`StateCheck`); None keeps
        any.

    Create it on the event loop's thread (hivemind's averagers install signal handlers). What changes or reads
    the state (``step``, ``finish_epoch_if_ready``, ``state``, ``load_state``, ``jump_to_epoch``,
    ``load_state_from_peers``) runs on the server's compute thread, between micro-batches; the blocking calls
    that only talk to the averager process (``report``, ``exclude``, ``wait_until_counted``) run in any thread
    but the event loop's.
    """

    def __init__(self, spec: RunSpec, run_id: str, stage: int, dht: hivemind.DHT, module: torch.nn.Module, *,
                 identity=None, averager_factory: AveragerFactory = RobustGradientAverager,
                 state_averager_factory: Callable[..., RobustStateAverager] = RobustStateAverager,
                 state_check: Optional[StateCheck] = None):
        self.module, self.stage, self.schedule = module, stage, Schedule(spec.optim)
        self._target = spec.training.target_batch_size
        self.state_check = state_check
        self.donors_refused: dict[str, str] = {}  # libp2p id -> why its state was refused (the last 32)
        self.reloads = 0  # loads of the stage's state from live servers (not epochs this server stepped)
        self.catch_up = CatchUp()  # behind the stage with no state kept (swarm.averaging.catchup)
        with _sigint_kept():
            self._opt = _start_optimizer(self, spec, run_id, dht, identity, (averager_factory, state_averager_factory))
        self._opt.reload = self.load_state_from_peers

    # ---- training ----------------------------------------------------------------------------------------
    @property
    def epoch(self) -> int:
        """The stage's epoch as this server knows it (optimizer steps taken by the stage)."""
        return self._opt.local_epoch

    def step(self, gradients: Sequence[torch.Tensor], samples: int, contributor: str) -> bool:
        """Hand over one micro-batch: ``gradients`` (one float32 tensor per parameter of the module, shaped like
        it) of ``samples`` samples sent by trainer ``contributor`` (its peer id). When the stage's servers
        together reached ``target_batch_size`` samples this averages with them and steps (blocking: matchmaking,
        all-reduce, AdamW; up to ``averaging_timeout`` seconds). With ``overlap_rounds`` it waits for the previous
        epoch's round instead and leaves this one's running (:mod:`swarm.averaging.overlap`); in ``outer`` mode it
        takes an inner step every ``target_batch_size`` samples and an epoch is an outer step
        (:mod:`swarm.averaging.outer`). Returns True if an epoch ended."""
        epoch, reloads = self.epoch, self.reloads
        if self.catch_up.behind(epoch, self.stage_epoch) and not self.catch_up.load_due():
            self._opt.samples_dropped += samples  # computed with parameters behind the stage's: not averaged
            return False
        self._opt.contribute(gradients, samples, contributor)
        return self.epoch != epoch and self.reloads == reloads  # a load from peers moves the epoch without a step

    def finish_epoch_if_ready(self) -> bool:
        """Join the epoch's averaging round if the stage's servers together reached the target, even though no
        micro-batch arrived here to trigger :meth:`step` (its peers' trainers may all be waiting on the round).
        One that computed nothing this epoch joins with weight 0 (no vote, :mod:`swarm.averaging.reducer`);
        waiting for a sample, it let the others' round time out (tests/test_pause_resume.py). True if it ended one."""
        opt = self._opt
        joining = opt.joins_their_round()  # (overlapped: its stage-mates' round of this epoch still waits for it)
        if self.catch_up.behind(self.epoch, self.stage_epoch) or (opt.local_epoch < self.stage_epoch and not joining):
            if self.catch_up.load_due():  # (behind with no micro-batch coming: it would never load, nor catch up)
                self.load_state_from_peers()
            return False
        if opt.missed_round:  # (its stage-mates' round went on without it: their state, not another round apart)
            self.load_state_from_peers()
            return False
        behind = (opt.local_epoch < opt.tracker.others_epoch and not joining) or (
            opt.grad_averager.local_samples_accumulated == 0 and opt.tracker.global_epoch > opt.local_epoch)
        if behind or not opt.tracker.ready_to_update_epoch:  # behind: its next micro-batch reloads the state;
            return False  # joining the others' round now would mix this epoch's gradients (or state) into theirs
        epoch = self.epoch
        opt._update_global_epoch(None)  # hivemind 1.1.12: exactly what step() calls once the epoch is ready
        return self.epoch != epoch

    @property
    def synced(self) -> bool:
        """Whether this server's parameters are the stage's shared ones at :attr:`epoch`. False from an epoch's
        transition that stepped without the group's aggregate while the stage had other servers (its gradient
        round failed, or, with ``overlap_rounds``, right after a state load), until a state-averaging round
        with the group or an accepted load from a donor; stepping alone in the stage keeps it True. Its answers
        say so in their receipts, and spot checks compare only synced answers (:mod:`swarm.trust.spotcheck`)."""
        return self._opt.synced

    @property
    def lr(self) -> float:
        """The learning rate of the current epoch (schedule x rollback scale; in ``outer`` mode the inner one)."""
        return self._opt.inner.lr if self._opt.inner is not None else self._opt.opt.param_groups[0]["lr"]

    @property
    def lr_scale(self) -> float:
        """The rollback learning-rate multiplier (cumulative; 1.0 until a loss-spike rollback)."""
        return self.schedule.scale

    def set_lr_scale(self, scale: float) -> None:
        """Set the rollback multiplier and apply it to the current epoch's learning rate now."""
        self.schedule.scale = scale
        if self._opt.inner is not None:  # outer mode: the schedule is the inner loop's; outer_lr stays
            self._opt.inner.set_epoch(self.epoch)
            return
        scheduler = self._opt.state_averager.scheduler
        for group, base in zip(self._opt.opt.param_groups, scheduler.base_lrs):
            group["lr"] = base * self.schedule(scheduler.last_epoch)

    # ---- state -------------------------------------------------------------------------------------------
    def state(self) -> dict[str, torch.Tensor]:
        """Copies of the parameters the optimizer updates and its AdamW state, by name
        (:func:`swarm.checkpoint.state.named_state`: ``param/<name>``, ``opt/<name>/<key>``)."""
        return named_state(self.module, self._opt.opt)

    def load_state(self, tensors: dict[str, torch.Tensor]) -> None:
        """Load a :meth:`state` into the module, the optimizer's copies and its AdamW state; gradients
        accumulated so far are dropped (they were computed on other parameters).

        :raises ShardError: a tensor is missing or has another shape or dtype.
        """
        with self._opt.state_averager.lock_averaged_tensors:  # peers may be downloading this server's state
            load_named_state(tensors, self.module, self._opt.opt)
        self._opt.drop_accumulated()
        self._opt.discard_pending_round()
        self._opt.grad_averager.reset_accumulated_grads_()
        self._opt.reset_inner()

    def jump_to_epoch(self, epoch: int) -> int:
        """Set the epoch to ``epoch`` or, if later, the stage's collaborative epoch; returns the epoch set.

        Progress records of dead servers outlive them for a while; a server restored at an older epoch would
        otherwise take itself for out of sync and try, forever, to download the state from those dead peers
        (hivemind ``load_state_from_peers``). The learning-rate schedule follows the epoch.
        """
        opt = self._opt
        target = max(epoch, opt.local_epoch, opt.tracker.global_epoch)
        if target != opt.local_epoch:
            opt.synced = False  # the parameters of an older epoch, at the stage's: until the next state round
            opt.state_averager.local_epoch = target
            with schedule_moves_quietly():
                opt.state_averager._update_scheduler()  # hivemind: steps the schedule up to local_epoch
        self.announce_progress()
        if opt.inner is not None:
            opt.inner.set_epoch(target)
        opt.state_averager.state_sharing_priority = target
        opt.grad_averager.state_sharing_priority = target
        return target

    def load_state_from_peers(self) -> int:
        """Download the state of a live server of the stage (the *donor*, :mod:`swarm.averaging.donors`) into the
        tensors the state averager averages (see :class:`_CollaborativeOptimizer`), and keep it only if
        :attr:`state_check` accepts it; a refused donor is skipped and the next one tried (at most
        :data:`MAX_DONORS_TRIED`), and this server's previous state, epoch and schedule are put back. Blocking
        (downloads, and the check's questions to the stage's servers). Returns the epoch after it (unchanged if
        no donor gave a state that verified; behind the stage, it is then catching up: :attr:`catch_up`)."""
        self.reloads += 1
        self.catch_up.loaded(self._load_verified(), self.epoch, self.stage_epoch)
        return self.epoch

    def _load_verified(self) -> bool:
        """:meth:`load_state_from_peers`; True if a donor's state was kept (hivemind may move the epoch without)."""
        if self.state_check is None:
            self._opt.load_state_from_peers()
            self.set_lr_scale(self.schedule.scale)  # the optimizer's settings were reloaded: the schedule's lr
            try:
                kept = bool(self._opt.state_averager.last_donor()[0])
            except Exception as e:  # the averager process is busy: synced again at the next state round
                logger.debug("could not ask the averager for its last donor: %r", e)
                kept = False
            self._opt.synced = self._opt.synced or kept
            return kept
        averager = self._opt.state_averager
        for _ in range(MAX_DONORS_TRIED):
            before = self._snapshot()
            self._opt.load_state_from_peers()
            donor, epoch = averager.last_donor()
            if not donor:
                return False  # no donor answered (or none is left that was not refused)
            if epoch < before[0]:  # hivemind loads no state from a donor behind this server
                verdict = Verdict(False, f"its epoch {epoch} is behind this server's")
            else:
                try:
                    verdict = self.state_check(epoch, self.state_digest(), donor)
                except Exception as e:  # the check itself failed (timeout, DHT): nothing vouched for the state
                    verdict = Verdict(False, f"the check failed ({type(e).__name__}: {e})")
                if verdict.ok:
                    self.set_lr_scale(self.schedule.scale)  # the schedule at the new epoch, with this run's scale
                    self._opt.synced = verdict.shared  # kept on the donor's word alone: maybe its own state
                    return True
            self._restore(before)
            why = verdict.why
            seconds = REFUSAL_S if verdict.contradicted else RETRY_S
            logger.warning("refused the state of donor %s at epoch %d: %s", donor, epoch, why)
            self.donors_refused = dict(list(self.donors_refused.items())[-31:]) | {donor: why[:200]}
            try:
                averager.refuse_donor(donor, why, seconds)
            except Exception as e:  # the averager process is busy: the next try may ask this donor again
                logger.debug("could not tell the averager to skip donor %s: %r", donor, e)
        return False

    def _snapshot(self) -> tuple[int, dict, dict[str, torch.Tensor]]:
        scheduler = self._opt.state_averager.scheduler
        return self.epoch, scheduler.state_dict() if scheduler else {}, self.state()

    def _restore(self, snapshot: tuple[int, dict, dict[str, torch.Tensor]]) -> None:
        """Put back a :meth:`_snapshot`: state, epoch, schedule and the donor priority hivemind declared."""
        epoch, schedule, tensors = snapshot
        self.load_state(tensors)
        averager = self._opt.state_averager
        averager.local_epoch = epoch
        if averager.scheduler is not None:
            averager.scheduler.load_state_dict(schedule)
            self.set_lr_scale(self.schedule.scale)
        averager.state_sharing_priority = self._opt.grad_averager.state_sharing_priority = epoch
        self.announce_progress()

    def state_digest(self) -> str:
        """SHA-256 of :meth:`state` (:func:`swarm.checkpoint.state.state_digest`), read in place, without copies."""
        return state_digest(named_state(self.module, self._opt.opt, copy=False))

    def set_donor_roster(self, p2p_ids: frozenset[str]) -> bool:
        """(blocking, not on the event loop) Download the stage's state from these libp2p ids (its announced servers)
        before any other donor (:mod:`swarm.averaging.donors`); False if the averager did not answer (retry)."""
        return self._ask_averagers("pass the donor roster to the averager", "set_roster", p2p_ids, state_only=True)

    def set_ticket(self, sealed: bytes) -> bool:
        """(blocking, not on the event loop) Hand this peer's renewed ticket to the averager processes, which sign
        with the identity they were started with (:mod:`swarm.averaging.admitted`); False if one did not answer."""
        return self._ask_averagers("pass the renewed ticket to the averagers", "set_ticket", sealed)

    def set_members(self, table: MemberTable) -> bool:
        """(blocking, not on the event loop) The stage's counted servers as read (:mod:`~swarm.averaging.membership`):
        a group holding them all begins its round at once; False if an averager did not answer."""
        return self._ask_averagers("pass the stage's members to the averagers", "set_members", table)

    def trainer_exclusion(self, p2p_id: str) -> Optional[str]:
        """Why this server excluded trainer ``p2p_id``'s gradients (:mod:`swarm.averaging.contributions`), or
        None. Safe from any thread."""
        found = self._opt.grad_averager.contributions.exclusion.exclusions.get(p2p_id)
        return found.reason if found is not None and found.until > time.time() else None

    def exclude(self, p2p_id: str, reason: str) -> bool:
        """Keep libp2p peer ``p2p_id`` out of this server's averaging groups (gradient and state rounds, donors);
        False if an averager process did not answer (busy in a round: try again later)."""
        return self._ask_averagers(f"exclude {p2p_id} in the averager", "exclude", p2p_id, reason)

    def _ask_averagers(self, what: str, method: str, *args, state_only: bool = False) -> bool:
        """Call ``method(*args)`` of the gradient (unless ``state_only``) and state averagers, each of which asks
        its process (blocking); False if one did not answer (busy or gone)."""
        try:
            for averager in ((self._opt.state_averager,) if state_only else
                             (self._opt.grad_averager, self._opt.state_averager)):
                getattr(averager, method)(*args)
            return True
        except Exception as e:  # the averager process is busy or gone
            logger.debug("could not %s: %s", what, e)
            return False

    def counters(self) -> dict[str, int]:
        """The gradient averager's counters (shared memory, no waiting): see :attr:`AveragingReport.wire`."""
        return self._opt.grad_averager.wire.snapshot()

    def report(self, timeout: float = 2.0) -> AveragingReport:
        """Averaging counters and exclusions (asks the averager process, at most ``timeout`` seconds; blocking)."""
        try:
            found = self._opt.grad_averager.report(timeout=timeout)
        except Exception as e:  # the averager process is busy or gone: report counters without exclusions
            logger.debug("could not read exclusions from the averager: %s", e)
            found = {}
        return AveragingReport.of(self.peers, self.counters(), found)

    @property
    def samples_dropped(self) -> int:
        """Samples accumulated here whose gradients were discarded before a step (a load of the stage's state,
        or :meth:`shutdown` mid-epoch); see :attr:`swarm.protocol.ServerInfo.samples_dropped`."""
        return self._opt.samples_dropped

    def shutdown(self) -> None:
        """Stop the averager processes and the progress tracker (the module keeps its parameters); the samples
        accumulated in the unfinished epoch (and, with overlapped rounds, in the pending round) count as dropped."""
        self._opt.drop_accumulated()
        self._opt.discard_pending_round()
        self._opt.shutdown()


def _start_optimizer(owner: StageOptimizer, spec: RunSpec, run_id: str, dht: hivemind.DHT, identity,
                     factories: tuple) -> _CollaborativeOptimizer:
    """hivemind's optimizer for ``owner``'s stage (``factories``: its gradient and state averagers'), with its
    averager processes and progress tracker started; in ``outer`` mode its optimizer is the outer one, on
    hivemind's offloaded copies of the parameters, and the inner loop runs on the module
    (:mod:`swarm.averaging.outer`)."""
    averager_factory, state_averager_factory = factories
    avg, rules = spec.averaging, AveragingRules.from_spec(spec.averaging)
    gate = ticket_gate(spec, RunDirectory(dht, run_id))  # forked into each averager's process (its RPCs' callers)
    outer, target = avg.mode == "outer", spec.training.target_batch_size
    opt = _CollaborativeOptimizer(
        state_rules=dict(rules=rules, identity=identity, run_id=run_id, gate=gate),
        state_averager_factory=state_averager_factory, overlap_rounds=avg.overlap_rounds,
        dht=dht, run_id=f"{run_id}-stage{owner.stage}", params=owner.module.parameters(),
        optimizer=partial(make_outer_optimizer, spec) if outer else partial(make_stage_torch_optimizer, spec.optim),
        scheduler=None if outer else partial(make_scheduler, spec.optim, schedule=owner.schedule),
        target_batch_size=target * (avg.inner_steps if outer else 1),
        batch_size_per_step=spec.training.micro_batch_size,
        matchmaking_time=avg.matchmaking_time, averaging_timeout=avg.averaging_timeout,
        next_chunk_timeout=avg.next_chunk_timeout, average_state_every=avg.average_state_every,
        # AdamW's step count too: a server whose count is off (a reload that lags one step, swarm.averaging.overlap;
        # a restore that caught up by jumping epochs) gets the stage's back at the next state round, else its bias
        # correction and its state digest would differ from the stage's for good
        average_opt_statistics=outer_statistics(spec) if outer else ("exp_avg", "exp_avg_sq", "step"),
        delay_state_averaging=False, offload_optimizer=True,
        grad_averager_factory=partial(
            averager_factory, rules=rules, compressor=spec_compressor(avg),
            identity=identity, run_id=run_id, gate=gate, clip_ratio=avg.microbatch_clip_ratio,
            trainer_outlier_ratio=avg.trainer_outlier_ratio, request_timeout=request_timeout(avg.matchmaking_time),
            allow_state_sharing=False),  # joiners download the state averager's: hivemind would store a donor
        # record for the gradient averager too, at every epoch
        # progress records of a dead server expire after two record TTLs (hivemind: 60 s), so the survivors
        # and its restarted successor stop counting it soon
        tracker_opts=dict(**refresh_periods(avg.matchmaking_time), metadata_expiration=2 * spec.timeouts.record_ttl_s,
                          private_key=progress_signer(dht)),
        averager_opts=dict(request_timeout=request_timeout(avg.matchmaking_time), min_vector_size=0),
        verbose=logging.getLogger("hivemind").isEnabledFor(logging.INFO),
    )
    opt.early_start = avg.early_start
    if outer:
        opt.inner = InnerLoop(spec, list(owner.module.parameters()), target,
                              lr_at=lambda epoch: spec.optim.lr * owner.schedule(epoch))
        opt.inner.set_epoch(opt.local_epoch)
        opt.tracker.per_server_target = target * avg.inner_steps
    return opt


@contextmanager
def _sigint_kept():
    """Keep this process's SIGINT handler: hivemind 1.1.12 sets SIGINT to *ignored* in the calling process when
    it starts an averager's process (``DecentralizedAverager.run_in_background``), so a server's Ctrl-C did
    nothing once it had joined a stage."""
    main = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGINT) if main else None
    try:
        yield
    finally:
        if main and previous is not None:
            signal.signal(signal.SIGINT, previous)


def _put_back(opt: torch.optim.Optimizer, originals: dict) -> None:
    """Copy each optimizer state tensor into the tensor it replaced (same shape and dtype) and use that one again."""
    with torch.no_grad():
        for p, held in originals.items():
            for key, new in list(opt.state[p].items()):
                old = held.get(key)
                if torch.is_tensor(old) and torch.is_tensor(new) and old is not new and old.shape == new.shape \
                        and old.dtype == new.dtype:
                    opt.state[p][key] = old.copy_(new)


__all__ = ["AveragerFactory", "MAX_DONORS_TRIED", "StageOptimizer",
           "StateCheck"]
