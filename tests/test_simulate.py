"""bench/simulate.py drives the project's own decisions on a simulated clock: small runs whose outcome is known."""

import math

import pytest

from bench.sim.run import Options, Simulation, rebalance_s
from bench.simulate import sizes, summarize
from swarm.config import RunSpec

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def spec(tiny_spec: RunSpec) -> RunSpec:
    return tiny_spec.updated(averaging={"group_size": 4})


def _run(spec: RunSpec, **options) -> dict:
    opts = Options(**{"servers": 24, "trainers": 6, "hours": 0.1, "tick_s": 30.0, "server_flops": 1e9, **options})
    sim = Simulation(spec, opts, **sizes(spec))
    sim.run()
    return summarize(sim, opts, 0.0) | {"_sim": sim}


def test_a_steady_swarm_completes_every_round_in_bounded_groups_and_keeps_its_checkpoints(spec):
    out = _run(spec, churn_per_h=0.0, byzantine=0.0)
    assert out["round_success"] == 1.0, out["round_failures"]  # every server plans the same grid: every lane forms
    assert set(out["hops"]) == {2}, out["hops"]  # 12 servers a stage at g = 4: two hops
    assert out["lane_size_mean"] <= 2.5 * 4
    assert out["rounds_corrupted"] == 0.0
    assert out["restorable"] == 1.0 and out["checkpoint_writers"] > 1  # writers take turns
    assert 0.0 < out["throughput_vs_ideal"] <= 1.0 and out["epochs"] > 0
    assert out["failed_picks"] == 0.0


def test_churn_and_byzantine_servers_cost_rounds_the_sim_names(spec):
    out = _run(spec, churn_per_h=3.0, byzantine=0.3, servers=48, trainers=12, hours=0.2, seed=1)  # 30% every 6 min
    assert out["round_success"] < 1.0 and out["round_failures"], out
    assert out["restorable"] > 0.0
    sim = out["_sim"]
    assert sim.tally.rounds_ok > 0
    assert out["failed_picks"] > 0.0  # trainers picked servers that had left, and retried


def test_a_stage_that_loses_servers_is_refilled_by_rebalancing(spec):
    # 10% of all servers leave at once, all from stage 0; the others move there (rebalance.plan_moves)
    out = _run(spec, churn_per_h=0.0, byzantine=0.0, hours=0.3, servers=40, leave_at_s=600.0)
    assert out["moves"] >= 1
    assert out["balance_after_leave"] < out["balance_before"]
    assert out["balance_settled"] > out["balance_after_leave"]  # the moves lifted the bottleneck
    assert 0 < out["rebalance_s"] < 0.3 * 3600 - 600


def test_rebalance_s_reads_the_balance_curve():
    curve = [(t, 1.0) for t in range(0, 100, 10)] + [(100, 0.5), (110, 0.7), (120, 0.96), (130, 1.0)]
    assert rebalance_s(curve, 100) == {"balance_before": 1.0, "balance_after_leave": 0.5, "balance_settled": 1.0,
                                       "rebalance_s": 30}
    assert rebalance_s(curve, math.inf) == {}


def test_attackers_who_grind_keys_for_a_known_epoch_corrupt_more_of_its_rounds(spec):
    # 15% Byzantine servers, each trying 5,000 keys to sit where it corrupts the targeted round's aggregate
    out = _run(spec, churn_per_h=0.0, byzantine=0.15, servers=64, trainers=4, grind=5000, seed=1)
    assert out["rounds_corrupted_targeted"] > 2 * out["rounds_corrupted"], out


def test_stripes_spread_a_stage_over_keys_without_adding_bytes_per_peer(spec):
    """``[records] stage_stripe_bits``: the nodes of the hottest key serve a quarter at 2 bits, and a peer's DHT bytes
    grow only by the extra lookups' requests (each read is one lookup per stripe, the same records in all)."""
    runs = {bits: _run(spec.updated(records={"stage_stripe_bits": bits}), churn_per_h=0.0, byzantine=0.0)
            for bits in (0, 2)}
    hot = {bits: out["hot_node_mb_per_min"] for bits, out in runs.items()}
    assert hot[2] == pytest.approx(hot[0] / 4, rel=0.05), hot
    per_peer = {bits: out["dht_kb_per_peer_min"]["server"] for bits, out in runs.items()}
    assert per_peer[0] <= per_peer[2] <= 1.5 * per_peer[0], per_peer


def test_trainers_read_a_few_stripes_of_a_large_stage_and_route_as_well(spec):
    """``stripes_to_read``: on a striped stage of 200 servers a trainer reads about ROUTING_SERVERS records (6 of 16
    stripes), so its DHT bytes fall, and the swarm's throughput stays what routing over every record gave."""
    runs = {bits: _run(spec.updated(records={"stage_stripe_bits": bits}), churn_per_h=0.0, byzantine=0.0,
                       servers=400, trainers=40, hours=0.05) for bits in (0, 4)}
    trainer = {bits: out["dht_kb_per_peer_min"]["trainer"] for bits, out in runs.items()}
    assert trainer[4] < 0.6 * trainer[0], trainer
    server = {bits: out["dht_kb_per_peer_min"]["server"] for bits, out in runs.items()}
    assert server[4] >= server[0], server  # servers still read every stripe (they need every member)
    speed = {bits: out["throughput_vs_ideal"] for bits, out in runs.items()}
    assert speed[4] >= 0.8 * speed[0], speed


@pytest.mark.parametrize("n, group_size", [(16, 8), (12, 4), (40, 8)])
def test_the_grinders_positions_leave_every_last_hop_lane_half_bad(n, group_size):
    """``corrupting_positions``: attackers at those places of a round's order (what key grinding buys) hold half
    of every hop-0 group they aim at, and those groups' blocks are half the voters of every lane above."""
    from bench.harness_hops import _badness
    from bench.sim.run import corrupting_positions
    from swarm.averaging.groups import GroupPlan

    plan = GroupPlan([f"peer{i}" for i in range(n)], b"seed", group_size)
    assert plan.depth == 2
    positions = corrupting_positions(n, group_size)
    assert sorted(positions) == list(range(n))  # every place, in the order grinders take them
    needed = next(k for k in range(1, n + 1)
                  if _badness(plan, {plan.order[i] for i in positions[:k]})[1] == len(plan.hops[1]))
    assert needed < n / 2  # fewer than half of the stage corrupt every lane of the last hop
