"""Overlapped rounds: a stage averages an epoch's gradients while its servers already serve the next epoch.

Without it, the epoch's transition blocks the server's compute thread for the whole gradient round
(matchmaking, then the all-reduce; seconds on a LAN, more on slow links) and every trainer whose micro-batch
waits on the stage idles with it. With ``[averaging] overlap_rounds = true`` the transition at the end of epoch
``e`` (the parameters are θ_e):

1. waits for the round of epoch ``e - 1``'s gradients (started at the end of ``e - 1``; in the background since),
   whose aggregate ḡ_{e-1} is then in the optimizer's gradient buffers; a failed round leaves this
   server's own combined gradient of ``e - 1`` there (hivemind's "proceeding with local gradients");
2. steps: θ_{e+1} = AdamW(θ_e, ḡ_{e-1}) with epoch ``e``'s learning rate;
3. starts the round of epoch ``e``'s gradients (g_e, computed on θ_{e-1}) and does not wait for it. It comes
   after the step because hivemind's ``offload_optimizer`` (on by default) shares the averaged buffers with the
   optimizer as its ``.grad``;
4. every ``average_state_every`` epochs, averages the state (parameters and Adam moments) as without overlap.

So gradients are exactly one epoch stale, the bound of hivemind's ``delay_grad_averaging`` and of the delayed
parameter update of SWARM (Ryabinin et al. 2023, sec. 3.2) and PipeDream-2BW; the first epoch takes no step,
and a run of ``E`` epochs takes ``E - 1`` optimizer steps. Unlike hivemind's ``delay_optimizer_step`` (which
applies the update whenever the background step finishes, mid-epoch), the update is applied at the epoch's
boundary only, so every micro-batch of epoch ``e + 1`` sees the same parameters on every
server of the stage, and one trainer with one server per stage follows the single-process reference with the
same delay (:func:`swarm.reference.train_reference` ``delayed=True``) up to float rounding.

A server that loads a state (from a donor, a checkpoint, a rollback) drops the pending round's result: its
gradients were computed on parameters it no longer holds; its samples count as dropped. The round itself runs
on, so its group is not left waiting. Having no aggregate to apply at its next transition, it then holds the
stage's state one step late until the next state-averaging round re-syncs it; that round averages AdamW's step
count too (``average_opt_statistics`` holds ``step`` in every per-epoch mode), else the late server's bias
correction, and its digest, would differ from the stage's for good. A checkpoint holds no pending gradients:
restoring it loses one epoch's gradients, like a restart mid-epoch.

Touches hivemind 1.1.12's ``Optimizer`` internals (``_update_global_epoch``, ``scheduled_grads``, the progress
tracker and state averager), which is why it lives beside :class:`~swarm.averaging.optimizer.StageOptimizer`.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Optional, Union

from hivemind.averaging.control import AveragingStage, StepControl

from swarm.averaging.schedule import schedule_moves_quietly

logger = logging.getLogger(__name__)

LOCAL = "local"
"""A pending round that never started (this server was alone in its stage): its own gradient is the aggregate."""

Pending = Union[StepControl, str]


class OverlappedRounds:
    """Mixin for hivemind's ``Optimizer`` (our :class:`~swarm.averaging.optimizer._CollaborativeOptimizer`): the
    epoch transition of the module docstring when ``overlap_rounds`` is set, hivemind's otherwise."""

    overlap_rounds: bool = False
    synced: bool = True
    _late: bool = False  # the next transition has no aggregate of the group to apply (read by the optimizer)
    _pending: Optional[Pending] = None
    _pending_samples: int = 0
    _pending_started: float = 0.0  # perf_counter s
    _behind_seen: Optional[tuple[int, float]] = None  # (epoch, monotonic s) its stage-mates were first seen past

    def joins_their_round(self) -> bool:
        """Whether this server, one epoch behind its stage-mates (the lower median, ``others_epoch``), ends its epoch
        and joins their round instead of loading their state: with overlapped rounds their transitions do not wait
        for the round, so a stage-mate pushes the next epoch while this server's last micro-batches of the epoch
        are still arriving (the lab's servers reloaded, and dropped their epoch's samples, at every other epoch).
        Their round waits three matchmaking windows for its group (:meth:`_wait_for_group`); True for two of them
        from when this server first saw them past."""
        if not self.overlap_rounds or self.tracker.others_epoch != self.local_epoch + 1:
            return False
        now = time.monotonic()
        if self._behind_seen is None or self._behind_seen[0] != self.local_epoch:
            self._behind_seen = (self.local_epoch, now)
        return now - self._behind_seen[1] < 2 * self.matchmaking_time

    def _update_global_epoch(self, grad_scaler) -> None:
        if not self.overlap_rounds:
            return super()._update_global_epoch(grad_scaler)
        assert grad_scaler is None, "overlapped rounds run without hivemind's GradScaler"
        began = time.perf_counter()
        with self.tracker.pause_updates():
            pending, self._pending = self._pending, None
            if pending is not None:
                self._wait_for_round(pending)
            average_state, scheduled = self._state_round_due(began)
            # the optimizer reads the averaged buffers (hivemind's offload_optimizer shares them as its .grad): step
            # on the previous epoch's aggregate there before this epoch's gradients go in
            self.state_averager.step(increment_epoch=True, optimizer_step=pending is not None)
            samples, self._pending_started = self.grad_averager.local_samples_accumulated, time.perf_counter()
            self._pending, self._pending_samples = self._start_round(), samples
            # the state round last: every server of the stage has started its gradient round by then
            if average_state:
                self.state_averager.step(averaging_round=True, averaging_control=scheduled,
                                         averaging_opts=dict(timeout=self.averaging_timeout))
            elif scheduled is not None and not scheduled.done():
                scheduled.cancel()
            self._advance()

    def discard_pending_round(self) -> None:
        """Forget the pending round's result (this server's parameters were replaced); its samples count as
        dropped. The round runs on for its group."""
        if self._pending is not None:
            self._late = True  # the next transition has nothing to apply while its stage-mates step
            self.samples_dropped += self._pending_samples
            self._pending, self._pending_samples = None, 0
            self.grad_averager.notify_used_averaged_gradients()  # hivemind warns of unused results otherwise

    def _start_round(self) -> Pending:
        """Start the all-reduce of the accumulated gradients without waiting for it; the accumulators are reset
        for the next epoch. A pre-scheduled group that already formed is used even when the tracker counts no
        other server now (hivemind cancels it then, and the stage-mate that matched with this server waits for its
        parts until its round times out); one still looking for a group is cancelled then, and this server steps
        on its own gradient."""
        scheduled = self.scheduled_grads
        alone = self.tracker.global_progress.num_peers <= 1
        if scheduled is not None and (scheduled.triggered or scheduled.done()
                                      or (alone and scheduled.stage != AveragingStage.AWAITING_TRIGGER)):
            if not (scheduled.done() or scheduled.triggered):
                scheduled.cancel()
            scheduled = self.scheduled_grads = None
        if scheduled is not None or not alone:
            try:
                control = self.grad_averager.step(control=scheduled, timeout=self.averaging_timeout, wait=False)
                self.scheduled_grads = None
                return control
            except Exception as e:  # the averager process is gone or refused: step on this server's own gradient
                logger.warning("could not start a gradient round (%s: %s)", type(e).__name__, e)
                self.scheduled_grads = None
                self._late = not alone  # its stage-mates will step on their aggregate
        self.grad_averager.load_accumulators_into_averager_()  # alone: its own gradient is the aggregate
        self.grad_averager.reset_accumulated_grads_()
        return LOCAL

    def _wait_for_round(self, pending: Pending) -> None:
        """Wait (at most ``averaging_timeout`` s) for the previous epoch's round, whose aggregate is then in the
        averaged buffers; a round still looking for a group three matchmaking windows after it started is given up
        (waiting for it would hold this transition, and with it the stage's state-averaging round, for up to
        ``averaging_timeout``). After a failure the buffers still hold this server's own gradient (our all-reduce
        writes them only once every phase succeeded)."""
        if pending is not LOCAL:
            began = time.perf_counter()
            try:
                self._wait_for_group(pending)
                group = pending.result(self.averaging_timeout)
                logger.debug("averaged the previous epoch's gradients with %d peers (waited %.2f s)",
                             len(group), time.perf_counter() - began)
            except (KeyboardInterrupt, SystemExit):
                raise
            except BaseException as e:  # the round's failure, a timeout, or its cancellation (asyncio's)
                if not pending.done():
                    pending.cancel()
                self.synced = False  # the stage-mates whose round went through step on their aggregate
                logger.warning("averaging the previous epoch's gradients failed (%s: %s): stepping on this "
                               "server's own gradient", type(e).__name__, e)
        self._load_averaged_gradients_into_optimizer_()

    def _wait_for_group(self, pending: StepControl) -> None:
        """Wait until ``pending`` found its group, at most three matchmaking windows after it started (an epoch can
        be shorter than one, and stage-mates start theirs a little apart); raises TimeoutError if it did not."""
        deadline = self._pending_started + 3 * self.matchmaking_time
        while pending.stage in (AveragingStage.IDLE, AveragingStage.LOOKING_FOR_GROUP) and not pending.done():
            if time.perf_counter() > deadline:
                raise TimeoutError(f"no group formed within {3 * self.matchmaking_time:.1f} s, three times "
                                   "[averaging] matchmaking_time")
            time.sleep(0.02)

    def _state_round_due(self, began: float) -> tuple[bool, Optional[StepControl]]:
        """Whether this transition averages the state (every ``average_state_every`` epochs, as hivemind 1.1.12's
        ``_update_global_epoch``), and the pre-scheduled group for it (``began``: the transition's start,
        ``perf_counter`` s)."""
        next_epoch = max(self.local_epoch + 1, self.tracker.global_epoch)
        average_state = (self.tracker.global_progress.num_peers > 1 and next_epoch % self.average_state_every == 0
                         and not self.state_averager.averaging_in_progress)
        scheduled, self.scheduled_state = self.scheduled_state, None
        if scheduled is not None and (scheduled.triggered or scheduled.done()):
            scheduled = None
        if average_state and scheduled is not None:  # what hivemind pre-schedules the next state round by
            self.delay_before_state_averaging.update(task_size=1, interval=time.perf_counter() - began)
        return average_state, scheduled

    def _advance(self) -> None:
        """The new epoch: its learning rate (hivemind moves the schedule after a step only, not after the first
        epoch), the progress tracker, the epoch this server offers its state at."""
        with schedule_moves_quietly():
            self.state_averager._update_scheduler()
        self.tracker.update_epoch(new_epoch=self.state_averager.local_epoch)
        self._should_check_synchronization_on_update = True
        if not self.client_mode:
            self.state_averager.state_sharing_priority = self.local_epoch
            self.grad_averager.state_sharing_priority = self.local_epoch


MISSED_POLL_S = 0.25
"""Seconds between two looks at whether a round still gathering its group was missed (:func:`finish_running_round`)."""


def finish_running_round(control, timeout: float, allreduce_timeout: float,
                         missed: Optional[Callable[[], bool]] = None, poll_s: float = MISSED_POLL_S) -> bool:
    """Wait for ``control``'s round (a hivemind ``StepControl``) ``timeout`` seconds, and up to
    ``allreduce_timeout`` more if its all-reduce is running by then; cancel it if it did not complete (hivemind's
    own wait on it then returns at once). Its failure is left for hivemind to read.

    ``missed`` (polled every ``poll_s`` seconds while the round still gathers its group) says the group it looks
    for is gone: the stage-mates it would average with ended this epoch's round without it (its matchmaking began
    after their group formed, as a server that just joined may). The round is then cancelled at once instead of
    waiting out ``timeout`` (``averaging_timeout``: 42 s measured, with the server's compute thread and the
    trainers' micro-batches held all along). Returns True if it was cancelled so."""
    deadline, left = time.monotonic() + timeout, timeout
    while True:
        try:
            control.result(max(0.0, min(left, poll_s)) if missed is not None else left)
        except TimeoutError:
            gathering = control.stage in (AveragingStage.IDLE, AveragingStage.LOOKING_FOR_GROUP)
            if missed is not None and gathering and missed():
                control.cancel()
                return True
            left = deadline - time.monotonic()
            if missed is not None and left > 0:
                continue
            if control.stage == AveragingStage.RUNNING_ALLREDUCE:
                _wait_quietly(control, allreduce_timeout)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException:  # the round's failure (hivemind reads it next)
            pass
        break
    if not control.done():
        control.cancel()
    return False


def _wait_quietly(control, timeout: float) -> None:
    """``control.result(timeout)``, its timeout or failure left for hivemind to read."""
    try:
        control.result(timeout)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException:
        pass


__all__ = ["MISSED_POLL_S", "OverlappedRounds", "finish_running_round"]
