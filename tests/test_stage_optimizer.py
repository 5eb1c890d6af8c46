"""The stage optimizer seam over real hivemind averagers (two servers of one stage, DHT and p2pd on loopback)."""

from __future__ import annotations

import time

import pytest
import torch

from swarm.averaging.optimizer import StageOptimizer
from swarm.model import build_stage
from tests.conftest import TINY, keyed_dhts

MICRO_BATCHES = TINY.training.target_batch_size // TINY.training.micro_batch_size  # per epoch


def _gradients(module: torch.nn.Module, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [0.01 * torch.randn(p.shape, generator=gen) for p in module.parameters()]


def _statistics(optimizer: StageOptimizer) -> dict[tuple[int, str], torch.Tensor]:
    """The optimizer's own state tensors, the very ones hivemind's state averager averages (shared memory)."""
    opt = optimizer._opt.opt
    params = [p for group in opt.param_groups for p in group["params"]]
    return {(i, key): t for i, p in enumerate(params) for key, t in opt.state[p].items()}


@pytest.mark.timeout(180)
def test_a_server_out_of_sync_loads_the_stages_state_into_the_tensors_that_are_averaged():
    """The second server joins two epochs late: a micro-batch finds it out of sync and it loads the stage's state
    inside ``step`` (hivemind ``load_state_from_peers``, which replaces the optimizer's state tensors). The loaded
    values must land in the original tensors, or its Adam moments are never averaged with the stage again."""
    (first_key, first), (second_key, second) = keyed_dhts(2)
    modules = [build_stage(TINY.model, 0), build_stage(TINY.model, 0)]
    optimizers = []
    try:
        optimizers.append(StageOptimizer(TINY, "seam", 0, first, modules[0], identity=first_key))
        ahead = optimizers[0]
        ahead.jump_to_epoch(0)
        for i in range(2 * MICRO_BATCHES):  # two epochs alone
            ahead.step(_gradients(modules[0], i), TINY.training.micro_batch_size, "trainer0")
        assert ahead.epoch == 2
        optimizers.append(StageOptimizer(TINY, "seam", 0, second, modules[1], identity=second_key))
        late = optimizers[1]
        held = _statistics(late)
        late.announce_progress()
        deadline = time.monotonic() + 60
        # until its tracker has read the ahead server's epoch-2 record, the late one takes an older record for
        # the stage's epoch and (hivemind) steps on its own gradients to catch up instead of loading the state
        while late._opt.tracker.global_epoch < 2:
            assert time.monotonic() < deadline, "the late server's tracker never saw the stage's epoch"
            time.sleep(0.1)
        while late.epoch < 2:  # once its tracker saw the stage's epoch, a micro-batch finds it out of sync
            assert time.monotonic() < deadline, "the late server never loaded the stage's state"
            late.step(_gradients(modules[1], 999), TINY.training.micro_batch_size, "trainer1")
            time.sleep(0.2)
        now = _statistics(late)
        assert now.keys() == held.keys() and all(now[k] is held[k] for k in held), "the loaded state replaced them"
        mine, theirs = late.state(), ahead.state()
        differ = sorted(k for k in theirs if not torch.equal(mine[k], theirs[k]))
        assert not differ, f"the loaded state differs from the donor's: {differ[:6]}"
        assert any(float(t.abs().max()) > 0 for k, t in mine.items() if k.endswith("/exp_avg"))  # a real state
    finally:
        for o in optimizers:
            o.shutdown()
        second.shutdown()
        first.shutdown()
