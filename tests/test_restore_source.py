"""Where a starting server's state comes from: a load from live servers that brought nothing is refused."""

import asyncio
import logging
from types import SimpleNamespace

from swarm.checkpoint.restore import Lineage, StageRestore
from swarm.config import RunSpec
from swarm.protocol import CheckpointManifest


class _Optimizer:
    """The stage optimizer's surface that a load from peers touches: it sets the epoch to the donor's epoch."""

    def __init__(self, donor_epoch):
        self.epoch, self.donor_epoch = 0, donor_epoch

    def load_state_from_peers(self) -> int:
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
