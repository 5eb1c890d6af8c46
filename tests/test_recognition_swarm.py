"""A real multi-process swarm where a server joins a stage the run key already recognizes (swarm.trust.recognition):
it must meet the recognized servers in their rounds, so that they verify it and the coordinator names it too.

The finding (tests/test_scale.py, kept logs of a failed run): a server the recognition did not name *followed* the
recognized ones, ending an epoch only once one of them had stepped, that is after their round; it came to every
round too late, was never verified, and three of a stage's seven servers stayed unnamed for the whole run while the
stage's rounds (their lanes held the unnamed servers) failed every epoch. Now it counts the stage's progress as the
recognized servers count it (swarm.averaging.progress, *Standing*), and ends each epoch with them."""

from __future__ import annotations

import pytest

from swarm.protocol import ServerState
from swarm.trust.recognition import read_recognition
from tests.conftest import TINY
from tests.scenario import Scenario, make_swarm

ONE_STAGE = TINY.updated(model={"stage_layers": [2]}, training={"target_batch_size": 512})


@pytest.mark.scenario  # ~100 s
@pytest.mark.timeout(900)
def test_a_server_joining_a_recognized_stage_meets_its_rounds_and_is_named(tmp_path, cache_dir, tiny_dataset):
    with make_swarm(ONE_STAGE, tmp_path, cache_dir) as sw, Scenario(sw) as sc:
        sc.servers(per_stage=2).trainers(1)

        def named() -> set[str]:
            recognition = read_recognition(sc.directory)
            return set(recognition.servers.get(0, [])) if recognition is not None else set()

        founders: set[str] = set()

        def both_read() -> bool:  # one DHT read may miss a record that is there
            founders.update(s.peer_id for s in sc.directory.servers(0))
            return len(founders) == 2

        sc.wait(both_read, 60, "both founders' records")
        sc.wait(lambda: founders <= named(), 240, "the recognition to name the stage's two servers")
        joiner = sw.start_peer("server", "--stage", "0")
        sc.stage_of[joiner.name] = 0
        sc.wait(lambda: any(s.peer_id == joiner.peer_id and s.state == ServerState.ONLINE
                            for s in sc.directory.servers(0)), 120, "the joining server online")
        joined_at = max(sc.epochs())
        # it averages with them (its round counter moves) and they vouch for it, so the coordinator names it
        sc.wait(lambda: any(s.peer_id == joiner.peer_id and s.averaging.get("rounds", 0) >= 2
                            for s in sc.directory.servers(0)), 240, "the joining server's rounds with the stage")
        sc.wait(lambda: joiner.peer_id in named(), 120, "the recognition to name the joining server")
        sc.stage_in_sync(0, min_epoch=joined_at + 1)
        assert all(p.alive() for p in sw.peers), sc.story()
