"""Sybil keys that attack a run through its records only: well-formed, signed, announced by keys that do no work
(an outsider with fresh keys, or the keys of servers that once worked; ``bench/sybil.py`` starts them).

:class:`RecordSybils` re-announces, every ``period_s`` seconds and for each key it holds on a stage, everything a
key may say about itself that steers a decision other peers make:

* a server record (``ServerInfo``) of that stage, online, claiming a throughput (on one stage a false one, to steer
  rebalancing and a joiner's stage choice away from it; elsewhere the honest servers' mean), every honest server of the stage listed as ``excluded`` (a trainer's routing), the stage's other
  Sybil keys as ``vouches``, and a ``rollback_generation`` one above the honest servers' (the "most servers
  already rolled back" rule);
* a progress entry at the stage's next epoch with ``10**9`` samples (hivemind's progress tracker: ends epochs);
* on the last stage, a rollback order of that generation with the learning-rate scale it implies, to the stage's
  first epoch;
* a checkpoint manifest one epoch past the stage's newest when the attack began, written by one Sybil key and endorsed by another (of
  the same stage if it has two, else as a witness from another stage); its fragment names a holder that has none.

Keys come from the caller: fresh ones (idle Sybils) or the keys of servers that did honest work before
(patient Sybils, which then carry the standing they earned). Nothing in the library knows of this class.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from dataclasses import dataclass
from typing import Optional

from hivemind.utils import get_dht_time
from hivemind.utils.crypto import RSAPrivateKey

from swarm.averaging.progress import SampleCountTracker
from swarm.identity import Identity
from swarm.net.directory import RunDirectory
from swarm.protocol import (MAX_VOUCHES, MIN_LR_SCALE, CheckpointManifest, Endorsement, FragmentEntry, RollbackOrder,
                            ServerInfo, ServerState, rollback_key, seal)

logger = logging.getLogger(__name__)

PULL_SAMPLES = 10**9
"""Samples each Sybil's progress entry claims at the stage's next epoch."""


@dataclass(frozen=True)
class SybilPlan:
    """Which of the record attacks :class:`RecordSybils` makes (all by default).

    :param announce: announce server records (off for keys whose own server process announces them).
    :param throughput: samples/s each Sybil server record of stage ``inflate`` claims (the others claim the honest
        servers' mean).
    """

    announce: bool = True
    throughput: float = 1e4
    inflate: int = 0
    exclude_honest: bool = True
    pull: bool = True
    rollback: bool = True
    manifest: bool = True


def _digest(*parts: object) -> str:
    return hashlib.sha256(repr(parts).encode()).hexdigest()


class RecordSybils:
    """Announce Sybil records for ``keys`` (stage -> identities) through ``directory`` until :meth:`close`.

    :param directory: a directory on a DHT node of the attacker's own (it needs a node that stores values).
    :param lr_factor: the run's ``[rollback] lr_factor`` (an order's scale must be ``lr_factor ** generation``).
    """

    def __init__(self, directory: RunDirectory, keys: dict[int, list[Identity]], *, num_stages: int,
                 lr_factor: float, plan: SybilPlan = SybilPlan(), period_s: float = 1.0):
        self.directory, self.keys, self.num_stages, self.lr_factor = directory, keys, num_stages, lr_factor
        self.plan, self.period_s = plan, period_s
        self.sybil_ids = {who.peer_id for ids in keys.values() for who in ids}
        self.trackers: dict[str, SampleCountTracker] = {}
        if plan.pull:
            for stage, ids in keys.items():
                for who in ids:
                    self.trackers[who.peer_id] = SampleCountTracker(
                        dht=directory.dht, prefix=f"{directory.run_id}-stage{stage}", target_batch_size=10**6,
                        private_key=RSAPrivateKey(), min_refresh_period=0.2, max_refresh_period=1.0, start=True)
        self.manifests: dict[int, CheckpointManifest] = {}  # stage -> the manifest published
        self.orders: list[RollbackOrder] = []
        self.rounds = 0
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True, name="record-sybils")
        self.thread.start()

    def _run(self) -> None:
        while not self.stopped.is_set():
            try:
                self.announce_once()
            except Exception as e:  # a DHT hiccup: try again next period
                logger.warning("Sybil announcements failed: %s", e)
            self.stopped.wait(self.period_s)

    def honest(self, stage: int) -> list[ServerInfo]:
        return [s for s in self.directory.servers(stage) if s.peer_id not in self.sybil_ids]

    def announce_once(self) -> None:
        """One period's records, on every stage."""
        everyone = {k: self.honest(k) for k in range(self.num_stages)}
        generation = 1 + max((s.rollback_generation for g in everyone.values() for s in g), default=0)
        for stage, ids in self.keys.items():
            honest = everyone.get(stage, [])
            epoch = max((s.epoch for s in honest), default=0)
            mean = sum(s.throughput for s in honest) / len(honest) if honest else 1.0
            for who in ids if self.plan.announce else ():
                try:
                    self._announce_server(who, stage, epoch, honest, ids, generation, mean)
                except ValueError as e:  # a record out of the schema's bounds: the next key's still goes out
                    logger.warning("Sybil record of %s refused: %s", who.peer_id, e)
            if self.plan.manifest:
                self._publish_manifest(stage, epoch + 1)
        if self.plan.rollback and (self.num_stages - 1) in self.keys:
            for who in self.keys[self.num_stages - 1]:
                self._order(who, generation)
        self.rounds += 1

    def _announce_server(self, who: Identity, stage: int, epoch: int, honest: list[ServerInfo],
                         mates: list[Identity], generation: int, mean: float) -> None:
        tracker = self.trackers.get(who.peer_id)
        if tracker is not None:
            tracker.report_local_progress(epoch + 1, PULL_SAMPLES)
        self.directory.announce_server(ServerInfo(
            run_id=self.directory.run_id, peer_id=who.peer_id, time=get_dht_time(), stage=stage,
            state=ServerState.ONLINE, throughput=self.plan.throughput if stage == self.plan.inflate else mean,
            p2p_id=who.p2p_id, epoch=epoch,
            progress_key=tracker.progress_key.hex() if tracker is not None else "",
            excluded={s.p2p_id: "a wrong aggregate" for s in honest[:32]} if self.plan.exclude_honest else {},
            vouches={m.p2p_id: 1.0 for m in [m for m in mates if m is not who][:MAX_VOUCHES]},
            rollback_generation=generation if self.plan.rollback else 0,
            rollback_issuer=self.keys[self.num_stages - 1][0].peer_id
            if self.plan.rollback and (self.num_stages - 1) in self.keys else "",
        ), who)

    def _order(self, who: Identity, generation: int) -> None:
        order = RollbackOrder(run_id=self.directory.run_id, peer_id=who.peer_id, time=get_dht_time(), epoch=0,
                              detected_epoch=0, lr_scale=max(self.lr_factor ** generation, MIN_LR_SCALE),
                              generation=generation, reason="loss spike")
        if self.directory.announce(rollback_key(self.directory.run_id), order, who):
            self.orders.append(order)

    def _endorser(self, stage: int) -> tuple[Optional[Identity], str]:
        ids = self.keys[stage]
        if len(ids) > 1:
            return ids[1], "same_state"
        others = [who for k, g in self.keys.items() if k != stage for who in g]
        return (others[0], "witness") if others else (None, "")

    def _publish_manifest(self, stage: int, epoch: int) -> None:
        """Publish (the first time) or store again (it lives a record's lifetime) the stage's manifest."""
        writer = self.keys[stage][0]
        if stage in self.manifests:
            self.directory.publish_manifest(self.manifests[stage], seal(self.manifests[stage], writer))
            return
        endorser, basis = self._endorser(stage)
        if endorser is None:
            return
        state, shard = _digest("state", stage, epoch), _digest("shard", stage, epoch)
        endorsement = seal(Endorsement(run_id=self.directory.run_id, peer_id=endorser.peer_id, time=get_dht_time(),
                                       stage=stage, epoch=epoch, state_sha256=state, writer=writer.peer_id,
                                       basis=basis), endorser)
        manifest = CheckpointManifest(
            run_id=self.directory.run_id, peer_id=writer.peer_id, time=get_dht_time(), stage=stage, epoch=epoch,
            shard_sha256=shard, size=1, k=1, n=1,
            fragments=[FragmentEntry(index=0, sha256=_digest("fragment", stage, epoch), holders=[writer.peer_id])],
            state_sha256=state, endorsements=[endorsement])
        if self.directory.publish_manifest(manifest, seal(manifest, writer)):
            self.manifests[stage] = manifest

    def stop(self) -> None:
        """Stop announcing (what was stored lives out its expiry)."""
        self.stopped.set()
        self.thread.join(timeout=30)

    def close(self) -> None:
        self.stop()
        for tracker in self.trackers.values():
            tracker.shutdown()
        self.trackers.clear()
