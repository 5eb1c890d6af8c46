"""Differential tests against ByzFL (EPFL's library of robust aggregators and attacks, PyPI ``byzfl``) for every
rule and attack both implement with the same definition: the mean, the coordinate-wise median, the trimmed mean,
CenteredClip from the same start and radius, NNM, ALIE and IPM.

ByzFL's top-level package imports its federated framework, which needs torchvision; only its ``aggregators``
and ``attacks`` subpackages are loaded here (numpy and scipy), under a bare ``byzfl`` package. Bucketing is
left out: ByzFL shuffles with its own random generator, ours with a seed from the parts' contents (an auditor
must recompute the same buckets), so the two agree only in distribution.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types

import numpy as np
import pytest
import torch

from swarm.attacks import make_attack
from swarm.averaging.aggregation import (CenteredClipAggregator, assumed_byzantine, coordinate_median, make_aggregator,
                                         spread)


@pytest.fixture(scope="module")
def byzfl():
    """ByzFL's ``aggregators`` and ``attacks`` modules, without its torchvision-bound top level."""
    spec = importlib.util.find_spec("byzfl")
    if spec is None:
        pytest.fail("byzfl is not installed: `make test` installs it (pip install --no-deps byzfl==0.0.11)")
    saved = {k: v for k, v in sys.modules.items() if k == "byzfl" or k.startswith("byzfl.")}
    package = types.ModuleType("byzfl")
    package.__path__ = list(spec.submodule_search_locations)
    sys.modules["byzfl"] = package
    try:
        yield types.SimpleNamespace(agg=importlib.import_module("byzfl.aggregators"),
                                    attacks=importlib.import_module("byzfl.attacks"))
    finally:
        for k in [k for k in sys.modules if k == "byzfl" or k.startswith("byzfl.")]:
            del sys.modules[k]
        sys.modules.update(saved)


def _parts(n: int, d: int = 300, seed: int = 0, attackers: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    honest = torch.randn(d, generator=gen) + 0.5 * torch.randn(n - attackers, d, generator=gen)
    bad = -4 * honest[:attackers] + 3 * torch.randn(attackers, d, generator=gen)
    return torch.cat([honest, bad])


def _close(ours: torch.Tensor, theirs, rtol: float = 1e-5) -> None:
    theirs = torch.as_tensor(np.asarray(theirs), dtype=torch.float64)
    assert float((ours.double() - theirs).norm()) <= rtol * float(theirs.norm()) + 1e-6


CASES = [(n, f, seed) for n, f in [(3, 1), (5, 1), (6, 2), (7, 2), (7, 3), (10, 3)] for seed in (0, 1)]


@pytest.mark.parametrize("n,f,seed", CASES)
def test_mean_median_and_trimmed_mean_equal_byzfl(byzfl, n, f, seed):
    parts = _parts(n, seed=seed, attackers=f)
    x, w = parts.numpy().astype(np.float64), torch.ones(n)
    _close(make_aggregator("mean").aggregate(parts, w), byzfl.agg.Average()(x))
    _close(make_aggregator("median").aggregate(parts, w), byzfl.agg.Median()(x))
    trim = f / n
    assert assumed_byzantine(n, trim) == f
    _close(make_aggregator("trimmed_mean", trim=trim).aggregate(parts, w), byzfl.agg.TrMean(f=f)(x))


@pytest.mark.parametrize("n,f,seed", CASES)
def test_nnm_equals_byzfl(byzfl, n, f, seed):
    parts = _parts(n, seed=seed, attackers=f)
    x, w = parts.numpy().astype(np.float64), torch.ones(n)
    fraction = f / n
    assert assumed_byzantine(n, fraction) == f
    mixed = byzfl.agg.NNM(f=f)(x)
    _close(make_aggregator("mean", pre="nnm", byzantine_fraction=fraction).aggregate(parts, w), byzfl.agg.Average()(mixed))
    _close(make_aggregator("median", pre="nnm", byzantine_fraction=fraction).aggregate(parts, w),
           byzfl.agg.Median()(mixed))


@pytest.mark.parametrize("n,f,seed", CASES)
def test_centered_clip_equals_byzfl_from_the_same_start_and_radius(byzfl, n, f, seed):
    parts = _parts(n, seed=seed, attackers=f)
    start = coordinate_median(parts)
    tau = float(spread((parts - start).norm(dim=1)))
    ours = CenteredClipAggregator(tau_ratio=1.0, iterations=50).aggregate(parts, torch.ones(n))
    theirs = byzfl.agg.CenteredClipping(L=50, tau=tau)
    theirs.m = start.double().numpy()  # ByzFL's constructor refuses any m (its type check needs both types at once)
    _close(ours, theirs(parts.double().numpy()), rtol=1e-4)  # ours stops once a step is below 1e-6 of the centre


@pytest.mark.parametrize("n,f", [(5, 1), (7, 2), (7, 3), (10, 3)])
def test_alie_and_ipm_equal_byzfl(byzfl, n, f):
    honest = _parts(n - f, seed=n)
    x = honest.double().numpy()
    alie = make_attack("alie", n=n, f=f)
    _close(alie.corrupt_part(honest[0], 0, honest=honest), byzfl.attacks.ALittleIsEnough(tau=-alie.z)(x))
    ipm = make_attack("ipm")
    _close(ipm.corrupt_part(honest[0], 0, honest=honest), byzfl.attacks.InnerProductManipulation(tau=ipm.eps)(x))
