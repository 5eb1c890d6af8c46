"""How often a stage server reads its stage's server records (:meth:`ServedStage._roster_tick`): every
``roster_period_s`` while the stage trains, every ``quiet_roster_period_s`` while it is quiet, and at the next tick
after a push from a stage-mate it does not count yet (perhaps one that just joined)."""

import asyncio
import time
from types import SimpleNamespace

import pytest

from swarm.protocol import ProgressPush
from swarm.server.compute import StageError
from swarm.server.served import ServedStage, quiet_roster_period_s, roster_period_s
from tests.conftest import TINY


def _stage(quiet: bool) -> SimpleNamespace:
    reads: list[float] = []

    async def read_roster() -> None:
        reads.append(time.monotonic())

    stage = SimpleNamespace(spec=TINY, stage=0, optimizer=SimpleNamespace(stage_quiet=quiet), _mates={},
                            _roster_due=False, _roster_read_at=float("-inf"), _read_roster=read_roster, reads=reads)
    stage.tick = lambda: ServedStage._roster_tick(stage)
    return stage


def test_a_training_stage_reads_its_records_at_every_tick_and_a_quiet_one_a_few_times_less():
    assert quiet_roster_period_s(TINY) >= 4 * roster_period_s(TINY)
    busy, quiet = _stage(quiet=False), _stage(quiet=True)
    for _ in range(3):
        asyncio.run(busy.tick())
        asyncio.run(quiet.tick())
    assert len(busy.reads) == 3
    assert len(quiet.reads) == 1, "a quiet stage read its records again before quiet_roster_period_s"
    quiet._roster_read_at -= quiet_roster_period_s(TINY)
    asyncio.run(quiet.tick())
    assert len(quiet.reads) == 2
    quiet.optimizer.stage_quiet = False  # a sample: the stage trains again, its records are read at every tick
    asyncio.run(quiet.tick())
    assert len(quiet.reads) == 3


def test_a_push_from_a_server_not_counted_is_refused_and_makes_a_quiet_stage_read_its_records_at_the_next_tick():
    quiet = _stage(quiet=True)
    asyncio.run(quiet.tick())
    push = ProgressPush(run_id="r", stage=0, epoch=0, samples=4, samples_per_s=1.0, client_mode=False, time=0.0)
    with pytest.raises(StageError, match="not one of the stage 0 servers"):
        ServedStage._progress_pushed(quiet, "12D3KooWnewcomer", push)
    asyncio.run(quiet.tick())
    assert len(quiet.reads) == 2, "the refused push did not make the next tick read the records"
    asyncio.run(quiet.tick())
    assert len(quiet.reads) == 2, "one refused push makes one read, not a read at every tick"
