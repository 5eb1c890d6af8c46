"""A swarm over links like the internet's (the WAN lab, bench/wanlab): every peer on its own host in a network
namespace, 100 Mbit/s each way and 50 ms of round trip between any two. It trains for several epochs with a
falling loss, routes around a server SIGKILLed mid-run, and the servers of each stage end holding the same full
state (the check the loopback scenarios make)."""

from __future__ import annotations

import re

import pytest

from bench.wanlab import Lab, Profile, leftovers
from swarm.protocol import ServerState
from tests.conftest import TINY
from tests.scenario import Scenario, make_swarm

WHY = Lab.unavailable()
"""Why this machine cannot run a WAN lab (None if it can)."""
pytestmark = [pytest.mark.scenario, pytest.mark.timeout(900),
              pytest.mark.skipif(bool(WHY), reason=str(WHY))]

SPEC = TINY.updated(name="wan", checkpoint={"interval_epochs": 4, "fragments_needed": 2, "fragments_total": 3})
HOSTS = ["coordinator", "server1", "server2", "server3", "server4", "server5", "trainer6", "trainer7"]
"""The lab's hosts, named as the swarm names its peers in the order the test starts them."""
PROFILE = Profile("wan", rtt_ms=50, mbit=100)


def _run_loss(sc) -> float:
    losses = [t.loss for t in sc.directory.trainers() if t.loss is not None]
    return sum(losses) / len(losses) if losses else float("inf")


def test_a_swarm_over_100mbit_50ms_links_trains_routes_around_a_killed_server_and_ends_in_sync(tmp_path, cache_dir,
                                                                                                tiny_dataset):
    with Lab(HOSTS, PROFILE) as lab:
        link = lab.measure("server1", "trainer6", seconds=2.0)
        assert link["rtt_ms"] >= PROFILE.rtt_ms, link  # the lab delays every packet: the swarm runs on far links
        with make_swarm(SPEC, tmp_path, cache_dir, placement=lab.place) as sw, Scenario(sw) as sc:
            sc.servers(per_stage=2)
            third = sw.start_peer("server", "--stage", "0")  # stage 0 keeps two servers after the kill
            sc.stage_of[third.name] = 0
            sc.wait(lambda: sum(s.state == ServerState.ONLINE for s in sc.directory.servers(0)) >= 3, 180,
                    "three online servers on stage 0")
            sc.trainers(2).until_epoch(3, timeout=300)
            sc.wait(lambda: _run_loss(sc) < float("inf"), 60, "the trainers' first loss records")
            early = _run_loss(sc)
            victim = sc.server(stage=0)
            fired = sc.faults().at_epoch(4).kill(victim).run(until_epoch=10, timeout=420)
            assert not victim.alive() and len(fired) == 1, fired
            assert all(p.alive() for p in sw.peers if p is not victim), sc.story()
            late = _run_loss(sc)
            assert late < early, f"the loss did not fall over the link: {early:.3f} -> {late:.3f}\n{sc.story()}"
            for stage in range(sc.num_stages):
                sc.stage_in_sync(stage, exclude=[victim.peer_id], min_epoch=6)
            traffic = lab.traffic()
            trainer_logs = "\n".join(p.log.read_text(errors="replace") for p in sw.peers if p.role == "trainer")
            third_log = third.log.read_text(errors="replace")
        # every stage's servers talked over the lab's links (nothing took a shortcut through the host)
        assert traffic.get(("server1", "server3"), 0) > 0 and traffic.get(("trainer6", "server2"), 0) > 0, traffic
        # the trainers measured the round trip and kept more micro-batches in flight to cover it
        raised = [int(n) for n in re.findall(r"micro-batches in flight: (\d+)", trainer_logs)]
        assert raised and max(raised) > 2, raised
        # the trainers and the server that joined a running stage timed the lab's links (swarm.net.links) as the
        # lab's own probe did: the round trip at least the lab's, a rate the link's 100 Mbit/s caps
        timed = re.findall(r"timeouts from links round_trip_ms=([\d.]+) rate_MBps=([\d.]+) servers=(\d+)",
                           trainer_logs + third_log)
        assert len(timed) == 3, timed
        for rtt_ms, rate, servers in timed:
            assert PROFILE.rtt_ms <= float(rtt_ms) < 4 * link["rtt_ms"] and int(servers) >= 1, timed
            assert 0.2 < float(rate) <= 1.05 * PROFILE.mbit / 8, timed
    assert leftovers() == []
