"""Faults injected into a live swarm with the fluent helper: a frozen server, an operator's pause, a Byzantine
server joining, and (root only) a server cut off by a partition and a trainer on a slow link. Training goes on
through them, and afterwards the honest servers of every stage hold the same full state."""

import pytest

from swarm.protocol import ServerState
from tests.links import LoopbackLinks
from tests.scenario import Scenario, make_swarm

pytestmark = [pytest.mark.scenario, pytest.mark.timeout(900)]


def test_training_goes_on_through_faults_and_every_stage_ends_in_sync(tiny_spec, tmp_path, cache_dir, tiny_dataset):
    with make_swarm(tiny_spec, tmp_path, cache_dir) as sw, Scenario(sw) as sc:
        sc.servers(per_stage=2).trainers(2).until_epoch(2)
        first, second = sc.server(stage=0), sc.server(stage=1)
        trainer = next(p for p in sw.peers if p.role == "trainer")
        samples = sc.trainer_samples()
        plan = (sc.faults()
                .at_epoch(3).freeze(first, seconds=8)
                .at_epoch(5).pause(second, seconds=10)
                .at_epoch(7).byzantine("noise", stage=0))
        links = LoopbackLinks.unavailable() is None
        if links:
            other = next(p for p in sw.peers if sc.stage_of.get(p.name) == 1 and p is not second)
            plan.at_epoch(9).partition(other, seconds=12).slow(trainer, mbit=20)
        log = plan.run(until_epoch=13, timeout=600)
        assert len(log) == (8 if links else 5), log  # every fault fired, and every lasting one ended
        after = min(sc.epochs())
        assert sc.trainer_samples() > samples and all(p.alive() for p in sw.peers), sc.story()
        assert any(s.state == ServerState.ONLINE for s in sc.directory.servers(1) if s.peer_id == second.peer_id)
        byzantine = {p.peer_id for p in sw.peers if p.name.startswith("byzantine")}
        for k in range(sc.num_stages):  # at an epoch after every fault ended
            sc.stage_in_sync(k, exclude=byzantine, min_epoch=after)
