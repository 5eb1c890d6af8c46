"""bench/harness_hops.py: the in-process harness of bench/robustness.py averages over the project's grid of bounded
groups, places attackers as the bench says, and reports what the hops did."""

import math

import torch

from bench.harness import Books, _all_reduce
from bench.harness_hops import Groups, HopStats, grid, hop_round
from swarm.attacks import make_attack
from swarm.averaging.aggregation import make_aggregator
from swarm.averaging.compression import make_compressor
from swarm.averaging.exclusion import ExclusionPolicy
from swarm.averaging.reducer import ReducePolicy


def _round(peers: int, bad: list[int], group_size: int, placement: str = "random", attack: str = "sign_flip"):
    """One grouped round of plain averaging (no checks) over random gradients, ``bad`` attacking with ``attack``."""
    gen = torch.Generator().manual_seed(1)
    grads = {i: [torch.randn(96, generator=gen), torch.randn(8, 4, generator=gen)] for i in range(peers)}
    attackers = {i: make_attack(attack, n=peers, f=len(bad), seed=i) for i in bad}
    agg, policy = make_aggregator("mean"), ReducePolicy(reject_norm_ratio=1e30, outlier_ratio=1e30)
    book = Books([i for i in range(peers) if i not in attackers], ExclusionPolicy(threshold=math.inf))

    def all_reduce(values, voters, compressors, hop, label):
        return _all_reduce(values, voters, attackers, compressors, agg, policy, book, 0, 0, 0.0, [], {},
                           scored=hop == 0, label=label)

    plan = grid(list(range(peers)), set(attackers), Groups(group_size, placement, tries=100), 0, 0)
    stats = HopStats()
    out, _ = hop_round(all_reduce, grads, attackers, [make_compressor("none") for _ in range(peers)], plan, stats)
    return grads, out, stats, plan


def test_honest_hops_over_equal_groups_average_exactly_and_every_peer_ends_equal():
    grads, out, stats, plan = _round(16, [], 4)
    assert plan.depth == 2 and stats.hops == 2 and stats.sizes == [4, 4, 4, 4]  # 4 groups, then 4 lanes of 4 voters
    for k, tensor in enumerate(out):
        mean = torch.stack([g[k] for g in grads.values()]).mean(0)
        torch.testing.assert_close(tensor, mean, rtol=0, atol=1e-5)
    assert stats.divergent_rounds == 0 and stats.bad_groups == 0


def test_placement_together_puts_the_attackers_in_one_group_and_random_follows_the_seed():
    bad = [13, 14, 15]
    _, _, together, plan = _round(16, bad, 4, "together")
    assert together.bad_groups == 1  # all three in one hop-0 group of four
    assert any({str(i) for i in bad} <= lane.members for lane in plan.hops[0])
    _, _, chance, chance_plan = _round(16, bad, 4, "random")
    assert chance_plan.order == grid(list(range(16)), set(), Groups(4), 0, 0).order  # the seed alone orders it


def test_a_voter_lying_in_its_lane_splits_the_honest_peers_and_the_round_is_counted():
    """A sign-flipping attacker that votes at hop 1 sends another value for its block than its block's honest members
    send in their lanes: with the plain mean the lanes return different values (what the bench counts)."""
    _, _, stats, plan = _round(16, [15], 4)
    assert stats.divergent_rounds == 1
    _, _, stats, _ = _round(4, [3], 3)  # two groups (2 + 2), lanes of 2 voters: the same at hop 1
    assert stats.hops == 2 and stats.divergent_rounds == 1
