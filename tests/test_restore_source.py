"""Where a starting server's state comes from (a load from live servers that brought nothing is refused), and which
checkpoint it descends from."""

import asyncio
import logging
import time
from types import SimpleNamespace

from swarm.checkpoint.commit import StageCommits
from swarm.checkpoint.restore import Lineage, StageRestore
from swarm.config import RunSpec
from swarm.protocol import CheckpointManifest


class _Optimizer:
    """The stage optimizer's surface that a load from peers touches: it sets the epoch to the donor's epoch (the
    next of ``donor_epochs`` at each load, where several are given) and counts the stage at ``stage_epoch``."""

    def __init__(self, donor_epoch, stage_epoch: int = 0, donor_epochs=()):
        self.epoch, self.donor_epoch, self.stage_epoch = 0, donor_epoch, stage_epoch
        self.donor_epochs, self.loads = list(donor_epochs), 0

    def load_state_from_peers(self) -> int:
        self.loads += 1
        if self.donor_epochs:
            self.donor_epoch = self.donor_epochs.pop(0)
        if self.donor_epoch is not None:
            self.epoch = self.donor_epoch
        return self.epoch


def _checkpoints(spec, donor_epoch, manifests=()):
    async def listed(stage):
        return list(manifests)

    keeper = SimpleNamespace(spec=spec, directory=SimpleNamespace(manifests=listed), me="me")
    return StageRestore(keeper, _Optimizer(donor_epoch), compute=None, stage=0, lineage=Lineage(),
                        log=logging.getLogger(__name__))


def test_a_load_from_peers_that_brought_no_state_is_refused(tiny_spec: RunSpec):
    # every donor record was stale: hivemind returns without loading, the epoch stays 0
    ck = _checkpoints(tiny_spec, donor_epoch=None)
    ck.peer_epoch = 12
    assert asyncio.run(ck.load_from_peers()) is False
    assert ck.lineage.current == ("", -1)


def test_a_load_from_peers_counts_when_the_epoch_reaches_the_live_servers(tiny_spec: RunSpec):
    manifest = CheckpointManifest.model_construct(epoch=10, shard_sha256="ab" * 32)
    ck = _checkpoints(tiny_spec, donor_epoch=11, manifests=[(manifest, b"")])
    ck.peer_epoch = 12  # records lag the servers: one epoch behind what they announced is a load
    assert asyncio.run(ck.load_from_peers()) is True
    assert ck.lineage.current == ("ab" * 32, 10)  # the state descends from the stage's newest checkpoint
    fresh = _checkpoints(tiny_spec, donor_epoch=None)  # a stage that never finished an epoch: nothing to load
    assert asyncio.run(fresh.load_from_peers()) is True


def test_a_state_the_stage_stepped_past_while_it_downloaded_is_loaded_again_before_serving(tiny_spec: RunSpec):
    ck = _checkpoints(tiny_spec, donor_epoch=None)
    ck.holder = _Optimizer(None, stage_epoch=3, donor_epochs=[2, 3])  # the stage ended epoch 2 during the download
    ck.peer_epoch = 2
    assert asyncio.run(ck.load_from_peers()) is True
    assert ck.holder.loads == 2 and ck.holder.epoch == 3
    again = _checkpoints(tiny_spec, donor_epoch=None)
    again.holder = _Optimizer(None, stage_epoch=9, donor_epochs=[2, 3, 4])  # epochs quicker than a download
    again.peer_epoch = 2
    assert asyncio.run(again.load_from_peers()) is True
    assert again.holder.loads == 2, "it loaded again more than once: the catch-up after serving takes over"
    current = _checkpoints(tiny_spec, donor_epoch=None)
    current.holder = _Optimizer(None, stage_epoch=2, donor_epochs=[2, 3])
    assert asyncio.run(current.load_from_peers()) is True and current.holder.loads == 1


def test_a_loaded_state_descends_from_the_newest_checkpoint_at_or_before_its_epoch(tiny_spec: RunSpec):
    older = CheckpointManifest.model_construct(epoch=10, shard_sha256="ab" * 32)
    newer = CheckpointManifest.model_construct(epoch=14, shard_sha256="cd" * 32)  # committed while the state loaded
    ck = _checkpoints(tiny_spec, donor_epoch=13, manifests=[(newer, b""), (older, b"")])
    ck.peer_epoch = 13
    assert asyncio.run(ck.load_from_peers()) is True
    assert ck.lineage.current == ("ab" * 32, 10)


def test_a_commit_takes_the_lineage_seen_before_as_its_parent_when_the_dht_read_misses_it():
    lineage = Lineage(current=("ab" * 32, 10))
    assert lineage.parent([], 12) == ("ab" * 32, 10)  # the stage's manifests did not come back this time
    newer = CheckpointManifest.model_construct(epoch=11, shard_sha256="cd" * 32, time=1.0)
    assert lineage.parent([newer], 12) == ("cd" * 32, 11)  # a newer commit of a stage-mate is the parent
    assert lineage.parent([newer], 11) == ("ab" * 32, 10)  # never the commit of its own epoch or later
    lineage.skipped.add("ab" * 32)  # a rollback skipped it: the state does not descend from it
    assert lineage.parent([], 12) == ("", -1)


def _commits(manifests_after: dict[float, list], ttl: float = 3.0):
    """A StageCommits whose keeper lists ``manifests_after[t]`` once ``t`` seconds passed since it was made, and
    counts its reads in ``reads``."""
    made, reads = time.monotonic(), []

    async def known(stage):
        passed = time.monotonic() - made
        reads.append(passed)
        return next((found for t, found in sorted(manifests_after.items(), reverse=True) if passed >= t), [])

    keeper = SimpleNamespace(spec=None, directory=SimpleNamespace(ttl=ttl), me="me", known_manifests=known)
    return StageCommits(keeper, authority=None, holder=None, stage=0, lineage=Lineage(),
                        log=logging.getLogger(__name__)), reads


def test_a_writer_waits_for_a_stage_mate_s_commit_of_the_previous_checkpoint_before_naming_its_parent():
    # epochs quicker than a commit: the previous checkpoint's manifest appears 1 s after this one's was placed
    previous = CheckpointManifest.model_construct(epoch=2, shard_sha256="ab" * 32, time=1.0)
    commits, reads = _commits({0.0: [], 1.0: [previous]})
    commits._others = (2, time.monotonic())  # another server was the writer of epoch 2
    assert asyncio.run(commits._parent(6)) == ("ab" * 32, 2)
    assert reads[-1] >= 1.0
    # that commit failed: the wait ends three keeper ticks (3 x ttl / 3 = 3 s) after epoch 2 ended, with no parent
    commits, reads = _commits({0.0: [], 60.0: [previous]})
    commits._others = (2, time.monotonic() - 2.5)
    assert asyncio.run(commits._parent(6)) == ("", -1)
    assert len(reads) >= 2 and reads[-1] >= 0.5
    # this server wrote the previous one itself (or no other server wrote one): one read, no wait
    commits, reads = _commits({0.0: []})
    assert asyncio.run(commits._parent(6)) == ("", -1) and len(reads) == 1
    commits._others = (6, time.monotonic())  # a stage-mate's commit of this epoch or later is never awaited
    assert asyncio.run(commits._parent(6)) == ("", -1) and len(reads) == 2
