"""A real multi-process swarm with a Byzantine server: it is rejected, excluded, shown excluded, and routed
around."""

import json
import subprocess
import sys

import pytest
from hivemind.utils import get_dht_time

from swarm.averaging.membership import QUANTUM, SETTLE
from swarm.protocol import ServerState
from tests.conftest import TINY
from tests.scenario import Scenario, make_swarm

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

ONE_STAGE = TINY.updated(model={"stage_layers": [2]},
                         averaging={"aggregator": "centered_clip", "compression": "blockwise8bit"})


@pytest.mark.scenario  # ~150 s; the exclusion logic is checked in the default suite by tests/test_robust_allreduce.py
def test_a_noisy_server_is_excluded_by_its_stage_and_routed_around(tmp_path, cache_dir, tiny_dataset):
    with make_swarm(ONE_STAGE, tmp_path, cache_dir) as sw, Scenario(sw) as sc:
        sc.servers(per_stage=3, byzantine="noise")
        # the noisy server must be in its mates' rounds to be rejected: started last, it became an averaging member
        # (swarm.averaging.membership) after the first epochs of 2 s had ended without it, each of its rounds then
        # blocked it averaging_timeout and it fell behind, and loaded its mates' state epoch after epoch (7 of 10
        # runs; it was in rounds before only because its first failed round, with no deadline, kept retrying its
        # matchmaking into later ones). So every server is a member before the trainer starts the first epoch
        settled = ONE_STAGE.timeouts.record_ttl_s * (SETTLE + QUANTUM)
        sc.wait(lambda: sum(s.state == ServerState.ONLINE and s.online_since <= get_dht_time() - settled
                            for s in sc.directory.servers(0)) == 3, 120, "the three servers to be averaging members")
        sc.trainers(1, "--concurrency", "2")
        bad = next(p for p in sw.peers if p.name.startswith("byzantine"))
        bad_p2p = lambda: next(s.p2p_id for s in sc.directory.servers(0) if s.peer_id == bad.peer_id)

        def honest_exclude_it():
            honest = [s for s in sc.directory.servers(0) if s.peer_id != bad.peer_id and s.state == ServerState.ONLINE]
            return len(honest) == 2 and all(bad_p2p() in s.excluded for s in honest)

        sc.wait(honest_exclude_it, 300, "both honest servers to exclude the noisy one")
        reasons = [s.excluded[bad_p2p()] for s in sc.directory.servers(0) if bad_p2p() in s.excluded]
        assert all("exceeds" in r for r in reasons), reasons  # rejected for its norm, scored, excluded
        honest = [s for s in sc.directory.servers(0) if s.peer_id != bad.peer_id]
        assert all(s.averaging.get("rejected", 0) >= 3 for s in honest)
        assert not any(h.p2p_id in s.excluded for s in honest for h in honest), "an honest server was excluded"
        # standing (swarm.trust.standing): each honest server vouches for the other's verified averaging work,
        # and neither for the noisy one, whose parts it rejected
        sc.wait(lambda: all(sum(h.p2p_id in s.vouches for h in sc.directory.servers(0)) == 1
                            for s in sc.directory.servers(0) if s.peer_id != bad.peer_id), 120,
                "each honest server to vouch for the other")
        assert not any(bad_p2p() in s.vouches for s in sc.directory.servers(0))
        # ... and says at which of its epochs it last did (ServerInfo.last_verified: rebalancing counts a recognized
        # server's throughput only while its work is verified lately, swarm.server.served.still_working)
        mates = [s for s in sc.directory.servers(0) if s.peer_id != bad.peer_id]
        assert all(0 <= s.last_verified.get(m.p2p_id, -1) <= s.epoch for s in mates for m in mates if m is not s)
        assert not any(bad_p2p() in s.last_verified for s in mates)

        done = subprocess.run([sys.executable, "-m", "coordinator", "status", sw.address, "--json"],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        peers = {p["peer_id"]: p for p in json.loads(done.stdout)["peers"]}
        assert peers[bad.peer_id]["excluded"] is True and peers[bad.peer_id]["excluded_by"] == 2
        assert all(not p["excluded"] for pid, p in peers.items() if p["role"] == "server" and pid != bad.peer_id)

        # the trainer routes around it: its sample count stops growing while training goes on
        frozen = next(s.samples for s in sc.directory.servers(0) if s.peer_id == bad.peer_id)
        before = sc.trainer_samples()
        sc.wait(lambda: sc.trainer_samples() >= before + 64, 180, "training to go on")
        after = next(s.samples for s in sc.directory.servers(0) if s.peer_id == bad.peer_id)
        assert after - frozen <= 8, "the trainer kept routing to an excluded server"

        sc.until_loss_falls(0.15, trainers=1, timeout=240)  # the honest servers keep training


@pytest.mark.scenario
def test_a_server_lying_to_trainers_is_convicted_listed_by_every_server_and_excluded(tmp_path, cache_dir, tiny_dataset):
    """Real processes: a stage-0 server answers half of its training forwards and backwards with noise. A
    trainer's spot checks convict it; every honest server verifies the evidence and lists it; its stage-mates
    exclude it from averaging; the trainer stops routing to it."""
    spec = TINY.updated(spot_checks={"rate": 0.2})
    with make_swarm(spec, tmp_path, cache_dir) as sw, Scenario(sw) as sc:
        sc.servers(per_stage=2)
        bad = sc.byzantine_server("lying_server", 0, name="liar")
        sc.wait(lambda: any(s.peer_id == bad.peer_id and s.state == ServerState.ONLINE for s in sc.directory.servers(0)),
                120, "the liar online")
        sc.trainers(1, "--concurrency", "2")
        sc.wait(lambda: any(bad.peer_id in t.convicted for t in sc.directory.trainers()), 300,
                "the trainer to convict the liar")
        convicted_at = max(t.time for t in sc.directory.trainers() if bad.peer_id in t.convicted)
        honest = lambda: [s for k in range(2) for s in sc.directory.servers(k) if s.peer_id != bad.peer_id]  # noqa: E731
        sc.wait(lambda: len(honest()) == 4 and all(bad.peer_id in s.convicted for s in honest()), 120,
                "every honest server to list the conviction")
        bad_p2p = next(s.p2p_id for s in sc.directory.servers(0) if s.peer_id == bad.peer_id)
        sc.wait(lambda: all(bad_p2p in s.excluded for s in honest() if s.stage == 0), 120,
                "the liar's stage-mates to exclude it from averaging")
        assert not any(s.convicted.keys() - {bad.peer_id} for s in honest()), "an honest server was convicted"
        trainer = sc.directory.trainers()[0]
        assert trainer.convicted.keys() == {bad.peer_id} and trainer.spot_checks["agreed"] > 0

        liar = lambda: next(s for s in sc.directory.servers(0) if s.peer_id == bad.peer_id)  # noqa: E731
        # its count as of a record announced after the conviction (an older record misses micro-batches it got
        # before it was convicted)
        sc.wait(lambda: liar().time > convicted_at + 1.0, 60, "a record of the liar announced after its conviction")
        frozen = liar().samples
        before = sc.trainer_samples()
        sc.wait(lambda: sc.trainer_samples() >= before + 64, 180, "training to go on")
        assert liar().samples - frozen <= 8, "the trainer kept routing to a convicted server"
