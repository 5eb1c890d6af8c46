"""Catching up: a server behind its stage that could keep no state of its stage-mates'.

A server behind most of its stage's other servers loads their state from one of them (a *donor*,
:mod:`swarm.averaging.donors`) and keeps it only if it verifies (:mod:`swarm.trust.statecheck`). Where no donor's
state verifies (the stage's servers all fell out of sync, so none vouches for a donor; or no donor answers), the
server stays at its epoch, and it can take part in none of the stage's rounds. It used to stay an averaging member
all the same, and reloaded on every micro-batch a trainer sent it (its compute thread blocked in the donor check,
the trainers' calls timed out): every lane it belonged to failed, its lane-mates stepped on their own gradients and
fell out of sync, none of them then vouched for a donor, and it never caught up (``tests/test_scale.py``: two
stage-0 servers stuck at epoch 2 while the stage reached 9, seen in CI).

So such a server is *catching up* (:class:`CatchUp`): it announces itself ``joining`` at once (not routed to, and
no averaging member, :mod:`swarm.averaging.membership`; its throughput announced 0), drops the micro-batches still
sent to it, and tries a load again every :data:`~swarm.averaging.donors.RETRY_S` seconds from its idle-epoch tick
(:meth:`swarm.averaging.StageOptimizer.finish_epoch_if_ready`, which also loads for a server behind that no
micro-batch reaches), until one is kept or the stage's epoch no longer leads its own. Back online, it settles as
an averaging member like a newcomer (``ServerInfo.online_since``).
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Optional

from swarm.averaging.donors import RETRY_S

logger = logging.getLogger(__name__)


class CatchUp:
    """Whether a server is catching up (module docstring), and when it tries its next load.

    :param retry_s: seconds between two loads while catching up (default :data:`~swarm.averaging.donors.RETRY_S`,
        how long a donor nobody vouched for is skipped).
    :param on_change: called (from the thread that changed it) when :attr:`active` changes: the server announces
        its new state at once rather than at its next announcement."""

    def __init__(self, retry_s: float = RETRY_S, on_change: Optional[Callable[[], None]] = None):
        self.retry_s, self.on_change = retry_s, on_change
        self.active = False
        self.next_load = 0.0  # time.monotonic() of the next load tried while active

    def loaded(self, kept: bool, epoch: int, stage_epoch: int) -> None:
        """A load from the stage's servers ended at ``epoch``, having ``kept`` a donor's state or not, the stage
        being at ``stage_epoch`` (the lower median of its other servers' epochs): active if it kept none and is
        behind (a state kept behind the stage is followed by the next load at once, as hivemind does)."""
        self.next_load = time.monotonic() + self.retry_s
        stuck = not kept and epoch < stage_epoch
        if stuck and not self.active:
            logger.warning("no state of the stage's servers verified: this server stays at epoch %d, behind the "
                           "stage's %d, and announces itself joining (not routed to, not averaging) until a load "
                           "is kept (tried again every %.0f s)", epoch, stage_epoch, self.retry_s)
        elif self.active and not stuck:
            logger.info("a state was kept: no longer catching up (epoch %d, the stage's %d)", epoch, stage_epoch)
        self._set(stuck)

    def behind(self, epoch: int, stage_epoch: int) -> bool:
        """Whether still catching up at ``epoch``, the stage being at ``stage_epoch``; it ends once the stage's epoch
        no longer leads (the others fell back to it, or left)."""
        if self.active and epoch >= stage_epoch:
            logger.info("caught up with the stage at epoch %d", epoch)
            self._set(False)
        return self.active

    def _set(self, active: bool) -> None:
        changed, self.active = active != self.active, active
        if changed and self.on_change is not None:
            self.on_change()

    def load_due(self) -> bool:
        """Whether the next load is due (:attr:`retry_s` after the last one)."""
        return time.monotonic() >= self.next_load


__all__ = ["CatchUp"]
