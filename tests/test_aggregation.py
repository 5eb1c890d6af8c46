import math

import pytest
import torch

from swarm.averaging.aggregation import (SORTING_NETWORK_ROWS, CenteredClipAggregator, MeanAggregator,
                                         NonFiniteAggregate, assumed_byzantine, bound_weights, coordinate_median,
                                         kappa_bound, make_aggregator, sorted_rows)
from swarm.attacks import make_attack

ROBUST = ["median", "trimmed_mean", "centered_clip"]


def _honest(n=5, d=2000, seed=0):
    gen = torch.Generator().manual_seed(seed)
    base = torch.randn(d, generator=gen)
    return base, base + 0.3 * torch.randn(n, d, generator=gen)


def test_mean_is_sample_weighted_and_checks_shapes():
    parts = torch.tensor([[1.0, 2.0], [3.0, 6.0]])
    assert torch.allclose(MeanAggregator().aggregate(parts, torch.tensor([1.0, 3.0])), torch.tensor([2.5, 5.0]))
    with pytest.raises(ValueError, match="positive"):
        MeanAggregator().aggregate(parts, torch.zeros(2))
    with pytest.raises(ValueError, match=r"\(n, numel\)"):
        MeanAggregator().aggregate(parts[0], torch.ones(2))
    with pytest.raises(ValueError, match="choose one of"):
        make_aggregator("krum")


def test_median_and_trimmed_mean_on_known_values():
    parts = torch.tensor([[1.0], [2.0], [100.0], [3.0], [-50.0]])
    w = torch.ones(5)
    assert make_aggregator("median").aggregate(parts, w).item() == 2.0
    assert coordinate_median(torch.tensor([[1.0], [2.0], [4.0], [10.0]])).item() == 3.0
    assert make_aggregator("trimmed_mean", trim=0.2).aggregate(parts, w).item() == pytest.approx(2.0)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 7, SORTING_NETWORK_ROWS, SORTING_NETWORK_ROWS + 1])
def test_sorted_rows_are_torch_sort_bit_for_bit(n):
    gen = torch.Generator().manual_seed(n)
    parts = torch.randn(n, 999, generator=gen)
    parts[:, :300] = parts[:, :300].mul(2).round()  # ties (integer-valued gradients)
    parts[:, 300:310] = 0.0
    assert torch.equal(torch.stack(sorted_rows(parts)), parts.sort(dim=0).values)
    median = torch.median(parts, dim=0).values if n % 2 else None
    if median is not None:
        assert torch.equal(coordinate_median(parts), median)


def test_centered_clip_of_two_equal_votes_is_their_exact_midpoint_and_unequal_votes_iterate():
    a, b = torch.randn(2, 500, generator=torch.Generator().manual_seed(1))
    parts = torch.stack([a, b])
    assert torch.equal(CenteredClipAggregator().aggregate(parts, torch.ones(2)), a / 2 + b / 2)
    heavier = CenteredClipAggregator().aggregate(parts, torch.tensor([3.0, 1.0]))
    assert (heavier - a).norm() < (heavier - b).norm()  # the clipped mean leans to the heavier vote


def _centered_clip_over_the_parts(parts, weights, tau_ratio=0.5, iterations=20):
    """CenteredClip iterated over the parts themselves (the module docstring's update), in float64."""
    x, w = parts.double(), (weights / weights.sum()).double()
    v = coordinate_median(parts).double()
    tau = tau_ratio * (x - v).norm(dim=1).median()
    for _ in range(iterations):
        diff = x - v
        step = (w * torch.clamp(tau / diff.norm(dim=1), max=1.0)) @ diff
        v = v + step
        if step.norm() <= 1e-6 * v.norm():
            break
    return v


@pytest.mark.parametrize("n,weights,attackers", [(2, [3.0, 1.0], 0), (4, None, 0), (5, [1, 2, 3, 4, 5], 1),
                                                 (7, None, 3), (9, None, 0)])
def test_centered_clip_on_the_gram_matrix_equals_iterating_over_the_parts(n, weights, attackers):
    """The iterations run on coefficients over the parts' Gram matrix; the aggregate is the one iterating over
    the parts gives, within the stopping rule's 1e-6 (unequal votes and far-off attackers included)."""
    _, parts = _honest(n, d=20000, seed=n)
    parts[:attackers] = 30 * torch.randn(attackers, parts.shape[1], generator=torch.Generator().manual_seed(9))
    w = torch.ones(n) if weights is None else torch.tensor(weights, dtype=torch.float32)
    ours = CenteredClipAggregator().aggregate(parts, w)
    reference = _centered_clip_over_the_parts(parts, w)
    assert float((ours.double() - reference).norm() / reference.norm()) < 1e-5


@pytest.mark.parametrize("name", ROBUST + ["mean"])
def test_every_rule_returns_the_common_value_when_all_agree(name):
    x = torch.randn(1000)
    out = make_aggregator(name).aggregate(x.repeat(4, 1), torch.ones(4))
    assert torch.allclose(out, x, atol=1e-6)


def test_centered_clip_is_close_to_the_mean_on_honest_parts():
    _, parts = _honest()
    cc = CenteredClipAggregator(tau_ratio=1.0).aggregate(parts, torch.ones(5))
    mean = parts.mean(0)
    assert (cc - mean).norm() / mean.norm() < 0.05


@pytest.mark.parametrize("name", ROBUST)
@pytest.mark.parametrize("attack", ["sign_flip", "noise", "ipm", "alie"])
def test_robust_rules_stay_bounded_under_two_of_seven_attackers(name, attack):
    base, honest = _honest(n=5)
    atk = make_attack(attack, n=7, f=2)
    bad = torch.stack([atk.corrupt_part(honest[i], 0, honest=honest) for i in range(2)])
    parts = torch.cat([honest, bad])
    out = make_aggregator(name).aggregate(parts, torch.ones(7))
    err = float((out - honest.mean(0)).norm() / honest.mean(0).norm())
    assert err < 0.6, f"{name} under {attack}: {err:.2f} off the honest mean"
    if attack in ("sign_flip", "noise"):
        mean_err = float((parts.mean(0) - honest.mean(0)).norm() / honest.mean(0).norm())
        assert mean_err > 1.0 and err < mean_err / 3  # the control fails visibly


def test_weights_are_bounded():
    w = bound_weights(torch.tensor([10.0, 12.0, 1000.0, float("nan"), 11.0]), 4.0)
    assert w[2] == 4.0 * 11.0 and w[3] == 0.0 and w[0] == 10.0


@pytest.mark.parametrize("pre", ["nnm", "bucketing"])
def test_pre_aggregation_changes_nothing_when_all_agree_and_ignores_the_senders_order(pre):
    x = torch.randn(500)
    agg = make_aggregator("centered_clip", pre=pre)
    assert torch.allclose(agg.aggregate(x.repeat(5, 1), torch.ones(5)), x, atol=1e-6)
    _, parts = _honest(n=7)
    parts[5:] = 50 * parts[5:]
    w = torch.tensor([1.0, 2.0, 1.0, 3.0, 1.0, 1.0, 2.0])
    order = torch.randperm(7, generator=torch.Generator().manual_seed(3))
    # an auditor recomputing the partition sees the parts in another order: same result, bit for bit
    assert torch.equal(agg.aggregate(parts, w), agg.aggregate(parts[order], w[order]))


def test_nnm_mixes_each_part_with_its_nearest_and_f_zero_is_the_rule_alone():
    parts = torch.tensor([[0.0], [1.0], [2.0], [10.0], [11.0]])
    mean = make_aggregator("mean", pre="nnm", byzantine_fraction=0.4)  # f = 2: each part with its 2 nearest others
    mixed = torch.tensor([1.0, 1.0, 1.0, 23 / 3, 23 / 3])  # (0,1,2), (0,1,2), (1,2,0), (10,11,2), (11,10,2)
    assert mean.aggregate(parts, torch.ones(5)).item() == pytest.approx(mixed.mean().item())
    _, honest = _honest()
    plain = make_aggregator("centered_clip").aggregate(honest, torch.ones(5))
    assert torch.equal(make_aggregator("centered_clip", pre="nnm", byzantine_fraction=0.0).aggregate(
        honest, torch.ones(5)), plain)
    with pytest.raises(ValueError, match="choose one of"):
        make_aggregator("mean", pre="krum")


def test_centered_clip_returns_the_median_when_most_parts_coincide():
    # half or more of the parts on the coordinate median: the radius would otherwise come from the parts that differ,
    # which may all be the attackers' (these aggregated to 1.43e14 and 428.6 before)
    zeros = torch.zeros(7, 100)
    cc = make_aggregator("centered_clip")
    assert torch.equal(cc.aggregate(torch.cat([zeros, torch.full((1, 100), 1e15)]), torch.ones(8)), torch.zeros(100))
    assert torch.equal(cc.aggregate(torch.cat([zeros[:4], torch.full((3, 100), 1e3)]), torch.ones(7)), torch.zeros(100))
    # mimic: three attackers copy one honest part; four of seven then agree and that honest part is the answer
    _, honest = _honest(n=4)
    out = cc.aggregate(torch.cat([honest, honest[0].repeat(3, 1)]), torch.ones(7))
    assert torch.equal(out, honest[0])


@pytest.mark.parametrize("k", [10.0, 100.0, 1000.0])
def test_nnm_with_centered_clip_holds_when_the_mixed_honest_parts_coincide(k):
    # integer-valued honest parts that agree: after mixing the four honest rows are equal (the median), and the
    # attackers' rows, however far, do not move the aggregate (the error grew with k before)
    honest = torch.randint(-3, 4, (1, 500), generator=torch.Generator().manual_seed(1)).float().repeat(4, 1)
    parts = torch.cat([honest, -k * honest[:3]])
    out = make_aggregator("centered_clip", pre="nnm", byzantine_fraction=0.3).aggregate(parts, torch.ones(7))
    assert torch.equal(out, honest[0])


def test_parts_of_weight_zero_carry_no_vote_in_any_rule():
    _, honest = _honest(n=3)
    attackers = torch.full((4, honest.shape[1]), 50.0)
    parts, w = torch.cat([honest, attackers]), torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0])
    for name in ("mean", "median", "trimmed_mean", "centered_clip"):
        for pre in ("none", "nnm", "bucketing"):
            agg = make_aggregator(name, pre=pre)
            assert torch.equal(agg.aggregate(parts, w), agg.aggregate(honest, torch.ones(3))), (name, pre)


def test_an_aggregate_that_overflows_float32_is_refused_with_its_cause():
    signs = torch.randint(0, 2, (7, 64), generator=torch.Generator().manual_seed(0)).float() * 2 - 1
    parts = 3e38 * signs  # finite, but any difference of two of them is not
    with pytest.raises(NonFiniteAggregate, match="overflow float32"):
        make_aggregator("centered_clip").aggregate(parts, torch.ones(7))
    assert torch.isfinite(make_aggregator("mean").aggregate(parts, torch.ones(7))).all()  # normalized weights first


def test_small_groups_assume_an_attacker():
    assert [assumed_byzantine(n, 0.3) for n in (1, 2, 3, 4, 5, 7, 10, 20)] == [0, 0, 1, 1, 2, 3, 3, 6]
    assert [assumed_byzantine(n, 0.1) for n in (3, 7, 11)] == [1, 1, 2]
    parts = torch.tensor([[0.0], [1.0], [90.0]])
    assert make_aggregator("trimmed_mean").aggregate(parts, torch.ones(3)).item() == 1.0  # one trimmed each end
    nnm = make_aggregator("mean", pre="nnm")  # each part mixed with its nearest other: (0,1), (1,0), (90,1)
    assert nnm.aggregate(parts, torch.ones(3)).item() == pytest.approx((0.5 + 0.5 + 45.5) / 3)


def test_kappa_bounds_follow_the_published_table():
    assert kappa_bound("trimmed_mean", 7, 2) == pytest.approx(6 * 2 / 3 * (1 + 2 / 3))
    assert kappa_bound("median", 7, 3) == pytest.approx(4 * (1 + 3) ** 2)
    assert kappa_bound("nnm+median", 7, 2) == pytest.approx(8 * 2 / 5 * (4 * (5 / 3) ** 2 + 1))
    assert kappa_bound("mean", 7, 1) == math.inf and kappa_bound("mean", 7, 0) == 0.0
    assert kappa_bound("centered_clip", 7, 2) is None and kappa_bound("median", 6, 3) == math.inf
    assert kappa_bound("trimmed_mean", 7, 2, assumed=3) is None and kappa_bound("median", 7, 2, assumed=3) > 0


@pytest.mark.parametrize("pre", ["none", "nnm"])  # bucketing (s = 2) needs f * s < n / 2: at 3 of 7 it fails
@pytest.mark.parametrize("attack", ["sign_flip", "noise", "ipm", "alie", "mimic", "minmax"])
def test_centered_clip_stays_bounded_under_three_of_seven_attackers(pre, attack):
    _, honest = _honest(n=4)
    atk = make_attack(attack, n=7, f=3)
    parts = torch.cat([honest, torch.stack([atk.corrupt_part(honest[i], 0, honest=honest) for i in range(3)])])
    out = make_aggregator("centered_clip", pre=pre, byzantine_fraction=0.43).aggregate(parts, torch.ones(7))
    err = float((out - honest.mean(0)).norm() / honest.mean(0).norm())
    assert err < 0.8, f"centered_clip with {pre} under {attack}: {err:.2f} off the honest mean"


def test_bucketing_holds_one_attacker_of_seven():
    _, honest = _honest(n=6)
    sign_flip = make_attack("sign_flip")
    one = torch.cat([honest, sign_flip.corrupt_part(honest[0], 0)[None]])
    out = make_aggregator("centered_clip", pre="bucketing").aggregate(one, torch.ones(7))
    assert float((out - honest.mean(0)).norm() / honest.mean(0).norm()) < 0.5
