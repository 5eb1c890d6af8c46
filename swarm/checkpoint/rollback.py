"""Loss-spike detection for automatic rollback.

The OPT-175B logbook (Zhang et al., 2022, "OPT: Open Pre-trained Transformer Language Models", sec. 2.5 and
the published chronicles) records the manual remedy for loss divergences: restart from the last good
checkpoint with a lower learning rate. Here it is automatic. A last-stage server, which sees every
micro-batch's loss, keeps an exponential moving average of its per-epoch mean training loss
(``alpha = 2 / (window_epochs + 1)``); an epoch whose mean exceeds ``(1 + margin) x`` the average after
``warmup_epochs`` epochs is a spike. The server then publishes a signed
:class:`~swarm.protocol.RollbackOrder` naming the newest epoch still good (the one before the spike) and the
new cumulative learning-rate multiplier; every server of every stage restores its newest checkpoint at or
before that epoch and scales its learning rate (:class:`Rollbacks`).
Epoch counters keep increasing (hivemind's collaborative epoch never goes back); the hash chain records the
jump, as the next checkpoint's parent is the restored one.

Anyone can sign a record, so an order counts only when it is *in force* (:func:`order_in_force`): its
learning-rate scale is the one its generation implies, and the run's coordinator signed it, or most of the last
stage's online servers issued that generation, or most of the swarm's online servers already applied it.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Callable, Optional, Sequence

from hivemind.utils import get_dht_time

from swarm.checkpoint.erasure import FragmentError
from swarm.checkpoint.restore import StageRestore
from swarm.checkpoint.shard import ShardError
from swarm.checkpoint.state import Compute, StateHolder
from swarm.config import RollbackSpec
from swarm.identity import Identity, peer_id_of
from swarm.protocol import MIN_LR_SCALE, RollbackOrder, ServerInfo, rollback_key


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
                   applied: int, lr_factor: float, authority: Optional[str] = None,
                   weight: Optional[Callable[[ServerInfo], float]] = None, me: str = "", weighs: bool = False
                   ) -> Optional[tuple[RollbackOrder, bytes]]:
    """The rollback order to apply next, or None: of the newest generation above ``applied`` that is in force.

    An order of generation ``g`` is in force when its ``lr_scale`` is ``lr_factor ** g`` (each rollback scales
    the learning rate by ``lr_factor`` once, so a forged scale or generation shows) and one of:

    1. it is signed by ``authority`` (the peer id of the run key: the coordinator);
    2. it was issued by one of the last stage's online servers, and a strict majority of them issued orders of
       generation ``g`` (they see the loss; a stage of one server is its own majority): for a deciding server
       that gives some of them a ``weight`` (a last-stage server: itself, and the mates whose averaging work it
       verified, :mod:`swarm.trust.standing`, and those the run key recognizes: a server of another stage weighs
       them by the recognition alone), a majority of those; else of them all (neither);
    3. a strict majority of all online servers already applied generation ``g`` or later
       (:attr:`ServerInfo.rollback_generation`) and some applied this very order
       (:attr:`ServerInfo.rollback_issuer`): the swarm rolled back, a server that missed it follows. Of the other
       servers (``me``: the deciding server's peer id) that ``weight`` gives a weight, if it gives any (its own
       standing, and the run key's recognition, :mod:`swarm.trust.recognition`: keys that only announce that they
       rolled back are no majority).

    Of the orders in force, the one naming the earliest good epoch is returned (the most cautious). An
    outsider's order is none of these. Keys that run most of the last stage's servers without doing the stage's
    averaging work carry no weight with an honest server of that stage, nor, while the run key recognizes some of
    the stage's servers, with a server of another stage; else they count by head there (docs/threat-model.md).

    :param orders: verified ``(order, sealed)`` pairs (:meth:`~swarm.net.directory.RunDirectory.rollback_orders`).
    :param online: stage -> its servers announced online now (the last stage is the highest key).
    :param applied: the generation this server applied.
    :param weighs: the deciding server weighs the last stage's servers (its standing or the run key's recognition
        names some: :meth:`~swarm.server.served.PeerContext.weighs`): a read of ``online`` where none of those it
        weighs shows is then no majority, never a head count (a read that missed the honest servers' records, late
        on a loaded host, left six fresh keys' orders counted by head: ``bench/sybil.py`` lazy keys at 6).
    """
    last_servers = online.get(max(online), []) if online else []
    last = {s.peer_id for s in last_servers}
    everyone = [s for servers in online.values() for s in servers]
    others = [s for s in everyone if s.peer_id != me]
    electorate = [s for s in others if weight is not None and weight(s) > 0] or ([] if weighs else others)
    for generation in sorted({o.generation for o, _ in orders if o.generation > applied}, reverse=True):
        same = [(o, b) for o, b in orders
                if o.generation == generation and math.isclose(o.lr_scale, lr_factor ** generation, rel_tol=1e-9)]
        by_last = [(o, b) for o, b in same if o.peer_id in last]
        went = [s for s in electorate if s.rollback_generation >= generation]
        followed = {s.rollback_issuer for s in went if s.rollback_generation == generation}
        chosen = [(o, b) for o, b in same if authority is not None and o.peer_id == authority]
        if not chosen and _majority({o.peer_id for o, _ in by_last}, last_servers, weight, weighs):
            # of a weighed majority, only the orders of servers with weight: a weightless key's order of the
            # same generation could name an earlier epoch, the one chosen
            voices = {s.peer_id for s in last_servers if weight is None or weight(s) > 0}
            chosen = [(o, b) for o, b in by_last if o.peer_id in voices] or by_last
        if not chosen and electorate and 2 * len(went) > len(electorate):
            chosen = [(o, b) for o, b in same if o.peer_id in followed]
        if chosen:
            return min(chosen, key=lambda ob: (ob[0].epoch, ob[0].peer_id))
    return None


def _majority(voters: set[str], servers: Sequence[ServerInfo],
              weight: Optional[Callable[[ServerInfo], float]], weighs: bool = False) -> bool:
    """Whether ``voters`` (peer ids) are a strict majority of ``servers``' electorate: those to which ``weight``
    gives a positive weight (each one vote: a barely verified server is a full voter), or, unless the decider
    ``weighs`` (:func:`order_in_force`), every server if it gives none (or ``weight`` is None)."""
    electorate = {s.peer_id for s in servers if weight is not None and weight(s) > 0} or (
        set() if weighs else {s.peer_id for s in servers})
    return bool(electorate) and 2 * len(voters & electorate) > len(electorate)


class Rollbacks:
    """A stage server's part in rollbacks: a last-stage server judges each epoch's loss (:meth:`is_spike`) and
    issues a signed order on a spike (:meth:`issue`); every server follows orders in force (:meth:`follow`),
    restoring the checkpoint through ``restore`` and scaling the learning rate of ``holder`` (on the compute thread,
    ``compute``).

    :param is_last: this server serves the last stage (it sees the loss).
    :param log: the stage's log.
    :param weight: a server's vote in :func:`order_in_force` (its standing with this server); None counts heads.
    :param weighs: ``weighs(stage, serves=)``: whether this server (serving ``stage`` or not) weighs ``stage``'s
        servers (``order_in_force``'s ``weighs``, asked of the last stage at each look); None: never.
    """

    def __init__(self, restore: StageRestore, holder: StateHolder, compute: Compute, identity: Identity, *,
                 is_last: bool, log: logging.Logger | logging.LoggerAdapter,
                 weight: Optional[Callable[[ServerInfo], float]] = None,
                 weighs: Optional[Callable[..., bool]] = None):
        self.restore, self.holder, self.compute, self.identity = restore, holder, compute, identity
        self.directory, self.spec, self.stage = restore.directory, restore.spec, restore.stage
        self.run_id, self.is_last, self.log = restore.directory.run_id, is_last, log
        self.weighs = weighs if weighs is not None else (lambda stage, serves=False: False)
        self.generation, self.order_sealed = 0, None
        self._issued = (0, 0.0)  # (generation, time.monotonic()) of the last rollback order this server issued
        self._order_scale, self.order_issuer, self.order_subkey = 1.0, "", ""
        self.detector = LossSpikeDetector(self.spec.rollback)
        self.weight = weight

    def meta(self) -> dict:
        """What a checkpoint of this server's state records of its rollbacks (its shard's metadata)."""
        return {"lr_scale": self.holder.lr_scale, "rollback_generation": self.generation}

    def resume(self, meta: dict) -> None:
        """(compute thread) After restoring a checkpoint at start-up: take up its rollback generation (``meta``, its
        shard's metadata), unless this server already follows an order, and the learning-rate scale that
        generation implies, ``lr_factor ** generation``: a scale the metadata states otherwise (a checkpoint's
        writer could state 1e-300 and freeze training) is not taken, nor a generation whose scale is below
        :data:`MIN_LR_SCALE`; either is logged."""
        generation = meta.get("rollback_generation")
        if self.generation != 0 or not generation:
            return
        scale = self.spec.rollback.lr_factor ** generation if type(generation) is int and generation > 0 else 0.0
        if scale < MIN_LR_SCALE or not math.isclose(float(meta.get("lr_scale", scale)), scale, rel_tol=1e-9):
            self.log.warning("ignored the rollback state of the restored checkpoint: generation %r with learning-rate "
                             "scale %r (lr_factor ** generation is %.3g)", generation, meta.get("lr_scale"), scale)
            return
        self.generation = generation
        self.holder.set_lr_scale(scale)

    def reapply(self) -> None:
        """After loading the state from live servers: the learning-rate scale of the order this server follows."""
        if self.order_sealed is not None:
            self.holder.set_lr_scale(self._order_scale)

    def is_spike(self, loss: Optional[float]) -> bool:
        """(compute thread) Judge ``loss``, the mean training loss of the epoch that ended (last stage, rollback
        enabled): True on a spike, which the caller answers with :meth:`issue`; False on the later spikes of a
        streak while this server's order is alive (a record TTL) and not yet applied: the first spike names the
        epoch to return to, a later one would name an epoch already trained on the bad data."""
        if not (self.spec.rollback.enabled and self.is_last and loss is not None):
            return False
        if not self.detector.update(loss):
            return False
        self.log.warning("loss spike: epoch mean %.4f > (1 + %.2f) x moving average %.4f", loss,
                         self.spec.rollback.margin, self.detector.average)
        generation, issued_at = self._issued
        if generation > self.generation and time.monotonic() - issued_at < self.directory.ttl:
            return False  # its order is out, alive and not yet applied: the first spike names the epoch to return to
        self._issued = (self.generation + 1, time.monotonic())
        return True

    def _adopt(self, order: RollbackOrder, sealed: bytes) -> None:
        self.generation, self.order_sealed = order.generation, sealed
        self._order_scale, self.order_issuer, self.order_subkey = order.lr_scale, order.peer_id, order.dht_subkey()
        self.holder.set_lr_scale(order.lr_scale)

    async def issue(self, detected_epoch: int, loss: float) -> None:
        """Publish a signed order to return every stage to its checkpoint before ``detected_epoch``, with the
        learning rate scaled by ``rollback.lr_factor``."""
        scale = self.holder.lr_scale * self.spec.rollback.lr_factor
        if scale < MIN_LR_SCALE:  # (a record refuses it: the run's rollbacks brought nothing for ~40 generations)
            self.log.warning("loss spike at epoch %d, but rollback #%d would scale the learning rate to %.3g, below "
                             "%.0e: not issued (the spikes are not the learning rate's: check the data and the spec)",
                             detected_epoch, self.generation + 1, scale, MIN_LR_SCALE)
            return
        order = RollbackOrder(run_id=self.run_id, peer_id=self.identity.peer_id, time=get_dht_time(),
                              epoch=max(0, detected_epoch - 1), detected_epoch=detected_epoch,
                              lr_scale=scale,
                              generation=self.generation + 1,
                              reason=f"epoch {detected_epoch} mean loss {loss:.4f} > (1 + {self.spec.rollback.margin}) "
                                     f"x moving average {self.detector.average:.4f}")
        if not await self.directory.announce(rollback_key(self.run_id), order, self.identity):
            self._issued = (self.generation, 0.0)  # not stored: the next spike issues it again
            self.log.warning("could not store rollback #%d in the DHT; it is issued again at the next spike",
                             order.generation)
            return
        self.log.warning("issued rollback #%d to epoch <= %d, lr scale %.3g: %s", order.generation, order.epoch,
                         order.lr_scale, order.reason)

    async def adopt_in_force(self) -> None:
        """Before restoring at start-up: take up the rollback order in force, if any (the restore that follows
        then loads the checkpoint the swarm returned to or a later one)."""
        order = await self._in_force()
        if order is not None:
            self._adopt(*order)

    async def follow(self) -> None:
        """Apply a rollback order newer than the last one applied that is in force (:func:`order_in_force`), and
        keep the applied one published (one look; the stage calls it periodically)."""
        order = await self._in_force()
        if order is not None:
            await self.apply(*order)
        if self.order_sealed is not None:
            await self.directory.store_sealed(rollback_key(self.run_id), self.order_subkey, self.order_sealed)

    async def _in_force(self) -> Optional[tuple[RollbackOrder, bytes]]:
        """The rollback order newer than the one applied that is in force (:func:`order_in_force`), or None."""
        orders = await self.directory.rollback_orders()
        if not orders or orders[0][0].generation <= self.generation:
            return None
        online = {k: await self.directory.fresh_servers(k) for k in range(self.spec.model.num_stages)}
        run_key = self.directory.run_key
        return order_in_force(orders, online, applied=self.generation, lr_factor=self.spec.rollback.lr_factor,
                              authority=peer_id_of(run_key) if run_key is not None else None, weight=self.weight,
                              me=self.identity.peer_id,
                              weighs=self.weighs(self.spec.model.num_stages - 1, serves=self.is_last))

    async def apply(self, order: RollbackOrder, sealed: bytes) -> None:
        """Restore the newest checkpoint at or before ``order.epoch`` and scale the learning rate."""
        view = await self.restore.newest_checkpoint(max_epoch=order.epoch)
        self.log.warning("rollback #%d (%s): restoring %s, lr scale %.3g", order.generation, order.reason,
                         f"checkpoint epoch {view.manifest.epoch}" if view else "nothing (no checkpoint at or before "
                         "that epoch; lowering the learning rate only)", order.lr_scale)
        if view is not None:
            try:
                await self.restore.restore_from(view, set_epoch=False)
            except (FragmentError, ShardError) as e:
                self.log.error("rollback restore failed (%s); lowering the learning rate only", e)
        await self.compute(self._adopt, order, sealed)
        self.detector.reset()


__all__ = ["LossSpikeDetector", "Rollbacks", "order_in_force"]
