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
