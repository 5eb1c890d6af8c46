"""Loss-spike detection for automatic rollback.

The OPT-175B logbook (Zhang et al., 2022, "OPT: Open Pre-trained Transformer Language Models", sec. 2.5 and
the published chronicles) records the manual remedy for loss divergences: restart from the last good
checkpoint with a lower learning rate. Here it is automatic. A last-stage server, which sees every
micro-batch's loss, keeps an exponential moving average of its per-epoch mean training loss
(``alpha = 2 / (window_epochs + 1)``); an epoch whose mean exceeds ``(1 + margin) x`` the average after
``warmup_epochs`` epochs is a spike. The server then publishes a signed
:class:`~swarm.protocol.RollbackOrder` naming the newest epoch still good (the one before the spike) and the
new cumulative learning-rate multiplier; every server of every stage restores its newest checkpoint at or
before that epoch and scales its learning rate (:class:`~swarm.checkpoint.lifecycle.StageCheckpoints`).
Epoch counters keep increasing (hivemind's collaborative epoch never goes back); the hash chain records the
jump, as the next checkpoint's parent is the restored one.
"""

from __future__ import annotations

import math
from typing import Optional

from swarm.config import RollbackSpec


class LossSpikeDetector:
    """Judges each epoch's mean training loss (nats/token) against its moving average."""

    def __init__(self, spec: RollbackSpec):
        self.spec = spec
        self.alpha = 2.0 / (spec.window_epochs + 1)
        self.average: Optional[float] = None
        self.seen = 0

    def reset(self) -> None:
        """Forget the average (after a rollback the loss restarts from the checkpoint's level)."""
        self.average, self.seen = None, 0

    def update(self, loss: float) -> bool:
        """Add one epoch's mean loss; True if it is a spike (it is then not added to the average).

        A non-finite loss after warm-up is a spike; before warm-up it is ignored.
        """
        if not math.isfinite(loss):
            return self.seen >= self.spec.warmup_epochs
        if self.average is not None and self.seen >= self.spec.warmup_epochs \
                and loss > (1 + self.spec.margin) * self.average:
            return True
        self.average = loss if self.average is None else (1 - self.alpha) * self.average + self.alpha * loss
        self.seen += 1
        return False
