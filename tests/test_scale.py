"""A swarm larger than one averaging group: 16 real peers (2 stages x 7 servers, 2 trainers), each its own process
with its own p2pd, averaging in bounded groups (swarm.averaging.groups), through the kill of a quarter of a stage."""

from __future__ import annotations

import pytest

from tests.scenario import Scenario, make_swarm

PER_STAGE = 7
GROUP_SIZE = 4  # 7 servers of a stage: two hops, groups of at most 4 voters


@pytest.mark.scenario
@pytest.mark.timeout(1500)
def test_sixteen_peers_average_in_bounded_groups_and_survive_losing_a_quarter_of_a_stage(tiny_spec, tmp_path,
                                                                                         cache_dir):
    # 16 peers' DHT lookups on 2 cores take seconds (bench/scale.py, docs/scaling.md): the tiny spec's 1.5 s window
    # let lanes miss each other until rounds kept failing and a stage never agreed again (seen here twice on one
    # day, at this commit and the one before); the field's doc says to raise it when groups come up short. 3 s is a
    # ceiling now: servers derive their window from their links, at least the 2 s floor (swarm/net/timeouts.py)
    spec = tiny_spec.updated(averaging={"group_size": GROUP_SIZE, "matchmaking_time": 3.0},
                             training={"target_batch_size": 64})
    with make_swarm(spec, tmp_path, cache_dir) as sw, Scenario(sw) as sc:
        sc.servers(per_stage=PER_STAGE, timeout=180).trainers(2).until_epoch(4, timeout=300)
        for k in range(sc.num_stages):
            epoch, _ = sc.stage_in_sync(k, min_epoch=2)
            # a record is re-announced every record_ttl_s / 3: wait for the servers' counters to show their rounds (on
            # 2 cores a server that joined last had completed none 60 s after the stage agreed, twice in four runs:
            # its rounds ran out of averaging_timeout; it completes one a few epochs later)
            sc.wait(lambda k=k: sum(s.averaging.get("rounds", 0) >= 1 for s in sc.directory.servers(k)) >= PER_STAGE - 1,
                    180, f"the rounds of stage {k}'s servers announced")
            servers = sc.directory.servers(k)
            assert len(servers) == PER_STAGE
            hops = [s.averaging.get("groups", 0) / max(1, s.averaging.get("rounds", 0)) for s in servers]
            sizes = [s.averaging.get("group_members", 0) / max(1, s.averaging.get("groups", 0)) for s in servers]
            assert sum(h >= 1.5 for h in hops) >= PER_STAGE - 1, hops  # two groups per round: bounded, not one of 7
            assert all(size <= GROUP_SIZE for size in sizes), sizes
        reached = max(sc.epochs())
        victims = [p for p in sw.peers if p.role == "server" and sc.stage_of.get(p.name) == 0][:2]
        rounds = {s.peer_id: s.averaging.get("rounds", 0)
                  for k in range(sc.num_stages) for s in sc.directory.servers(k)}
        for peer in victims:  # a quarter of stage 0 (2 of 7), killed at once
            sc.kill(peer)
        sc.until_epoch(reached + 3, timeout=300)
        for k in range(sc.num_stages):
            sc.stage_in_sync(k, min_epoch=reached + 1)
            # and the stage still averages: equal digests alone do not show it (servers that step alone on equal
            # gradients from the same state stay equal for a while; before, no gradient round of either stage
            # completed after the kill's first failed round, and this test passed). Two rounds: the counters read
            # before the kill may be a re-announcement period (record_ttl_s / 3) old
            left = PER_STAGE - (2 if k == 0 else 0)
            sc.wait(lambda k=k: sum(s.averaging.get("rounds", 0) >= rounds.get(s.peer_id, 1 << 30) + 2
                                    for s in sc.directory.servers(k)) >= left - 1,
                    180, f"rounds of stage {k}'s servers completed after the kill")
        sc.until_loss_falls(0.25, trainers=2)
