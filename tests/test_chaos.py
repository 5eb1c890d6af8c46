"""A short run of bench/chaos.py: random SIGKILLs of servers, trainers and the coordinator, stage wipes, and a
final kill of every peer; no committed epoch may be lost and the final state must come back bit-exact."""

import pytest

# imported as part of the ``bench`` package: putting ``bench/`` itself on ``sys.path`` at collection would make its
# ``kernels.py`` shadow the PyPI package ``kernels``, which transformers (5.25 on) imports when it finds one
from bench.chaos import SPEC, run_chaos

pytestmark = [pytest.mark.scenario, pytest.mark.timeout(900)]


def test_short_chaos_loses_no_committed_epoch(cache_dir, tiny_dataset):
    spec = SPEC.updated(training={"target_batch_size": 32}, checkpoint={"interval_epochs": 2})
    result = run_chaos(90, seed=1, cache_dir=cache_dir, spec=spec, min_gap=8.0, max_gap=14.0)
    assert result["kills"] >= 6, result  # the first four events cover a server, a stage wipe, the coordinator, a trainer
    # how many epochs 90 s of chaos allow is a figure of the bench (17 to 50 on a 2-core box, 2026-12-04); the test
    # needs a committed checkpoint of each stage, which the final kill-all must come back from
    assert result["committed_checkpoints"] >= 2 and result["epochs"] >= 2, result
    assert result["lost_epochs"] == 0, result
    assert result["restored_bit_exact"] is True, result
    assert len(result["recoveries"]) >= 3 and result["recovery_s_max"] < 120, result  # a wipe + the final kill-all
