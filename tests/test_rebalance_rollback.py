"""Rebalancing decisions (hysteresis, no stampede, no empty stage) and loss-spike detection."""

import math

from swarm.checkpoint.rollback import LossSpikeDetector
from swarm.config import RollbackSpec
from swarm.protocol import ServerInfo, ServerState
from swarm.rebalance import plan_move


def _server(peer: str, stage: int, throughput: float, state=ServerState.ONLINE) -> ServerInfo:
    return ServerInfo(run_id="r", peer_id=peer, time=0, stage=stage, state=state, throughput=throughput, p2p_id="x")


def _swarm(*stages):
    return {k: [_server(p, k, t) for p, t in group] for k, group in enumerate(stages)}


def test_the_best_mover_of_a_crowded_stage_moves_to_the_bottleneck():
    servers = _swarm([("a", 10), ("b", 10), ("c", 10)], [("d", 10)])
    # moving any one server doubles the pipeline's throughput (10 -> 20); only the lowest peer id moves now
    assert plan_move("a", 0, servers, min_gain=0.25) == 1
    assert plan_move("b", 0, servers, min_gain=0.25) is None
    assert plan_move("d", 1, servers, min_gain=0.25) is None  # it serves its stage alone


def test_hysteresis_blocks_small_gains_and_the_move_back():
    servers = _swarm([("a", 10), ("b", 10)], [("c", 15)])
    assert plan_move("a", 0, servers, min_gain=0.25) is None  # min 15 -> 10: worse
    servers = _swarm([("a", 4), ("b", 10), ("c", 10)], [("d", 18)])
    assert plan_move("a", 0, servers, min_gain=0.25) is None  # 18 -> 20 is +11%, under the 25% margin
    assert plan_move("a", 0, servers, min_gain=0.05) == 1
    after = _swarm([("b", 10), ("c", 10)], [("d", 18), ("a", 4)])
    assert plan_move("a", 1, after, min_gain=0.05) is None, "the reverse move never passes the same test"


def test_draining_servers_do_not_count_and_strangers_do_not_move():
    servers = _swarm([("a", 10), ("b", 10)], [])
    servers[1] = [_server("z", 1, 50, ServerState.DRAINING)]
    assert plan_move("a", 0, servers, min_gain=0.25) == 1  # stage 1 has no throughput: any server helps
    assert plan_move("x", 0, servers, min_gain=0.25) is None


def test_spike_detector_waits_for_warmup_then_flags_spikes_only():
    det = LossSpikeDetector(RollbackSpec(window_epochs=4, margin=0.5, warmup_epochs=3))
    assert [det.update(x) for x in (8.0, 7.0, 6.5)] == [False, False, False]
    assert not det.update(7.5)  # above average but within the margin
    avg = det.average
    assert det.update(avg * 1.6) and det.average == avg, "a spike does not pollute the average"
    assert det.update(math.nan)
    det.reset()
    assert not det.update(100.0) and not det.update(math.inf)  # after a reset: warm-up again
