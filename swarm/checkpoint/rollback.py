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

Anyone can sign a record, so an order counts only when it is *in force* (:func:`order_in_force`): its
learning-rate scale is the one its generation implies, and the run's coordinator signed it, or most of the last
stage's online servers issued that generation, or most of the swarm's online servers already applied it.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

from swarm.config import RollbackSpec
from swarm.protocol import RollbackOrder, ServerInfo


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


def order_in_force(orders: Sequence[tuple[RollbackOrder, bytes]], online: dict[int, list[ServerInfo]], *,
                   applied: int, lr_factor: float, authority: Optional[str] = None
                   ) -> Optional[tuple[RollbackOrder, bytes]]:
    """The rollback order to apply next, or None: of the newest generation above ``applied`` that is in force.

    An order of generation ``g`` is in force when its ``lr_scale`` is ``lr_factor ** g`` (each rollback scales
    the learning rate by ``lr_factor`` once, so a forged scale or generation shows) and one of:

    1. it is signed by ``authority`` (the peer id of the run key: the coordinator);
    2. it was issued by one of the last stage's online servers, and a strict majority of them issued orders of
       generation ``g`` (they see the loss; a stage of one server is its own majority);
    3. a strict majority of all online servers already applied generation ``g`` or later
       (:attr:`ServerInfo.rollback_generation`) and some applied this very order
       (:attr:`ServerInfo.rollback_issuer`): the swarm rolled back, a server that missed it follows.

    Of the orders in force, the one naming the earliest good epoch is returned (the most cautious). An
    outsider's order is none of these; a Sybil that runs most of the last stage's servers is out of reach.

    :param orders: verified ``(order, sealed)`` pairs (:meth:`~swarm.net.directory.RunDirectory.rollback_orders`).
    :param online: stage -> its servers announced online now (the last stage is the highest key).
    :param applied: the generation this server applied.
    """
    last = {s.peer_id for s in online.get(max(online), [])} if online else set()
    everyone = [s for servers in online.values() for s in servers]
    for generation in sorted({o.generation for o, _ in orders if o.generation > applied}, reverse=True):
        same = [(o, b) for o, b in orders
                if o.generation == generation and math.isclose(o.lr_scale, lr_factor ** generation, rel_tol=1e-9)]
        by_last = [(o, b) for o, b in same if o.peer_id in last]
        went = [s for s in everyone if s.rollback_generation >= generation]
        followed = {s.rollback_issuer for s in went if s.rollback_generation == generation}
        chosen = [(o, b) for o, b in same if authority is not None and o.peer_id == authority]
        if not chosen and 2 * len({o.peer_id for o, _ in by_last}) > len(last):
            chosen = by_last
        if not chosen and 2 * len(went) > len(everyone):
            chosen = [(o, b) for o, b in same if o.peer_id in followed]
        if chosen:
            return min(chosen, key=lambda ob: (ob[0].epoch, ob[0].peer_id))
    return None
