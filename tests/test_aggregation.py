import pytest
import torch

from swarm.averaging.aggregation import (CenteredClipAggregator, MeanAggregator, bound_weights, coordinate_median,
                                         make_aggregator)
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


def test_centered_clip_still_clips_when_duplicates_sit_on_the_median():
    # mimic: three attackers copy one honest part, so four of seven parts are the coordinate median and their
    # distance to it is 0; the radius then comes from the other parts instead of being 0 (the copied part alone)
    _, honest = _honest(n=4)
    copied = honest[0]
    parts = torch.cat([honest, copied.repeat(3, 1)])
    out = make_aggregator("centered_clip").aggregate(parts, torch.ones(7))
    assert not torch.equal(out, copied)
    assert (out - honest.mean(0)).norm() < (copied - honest.mean(0)).norm()


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
