"""How often a stage server reads its stage's server records and the run's rollback orders
(:meth:`ServedStage._roster_tick`, :meth:`ServedStage._orders_tick`): at every tick while the stage trains, every
``quiet_period_s`` while it is quiet, and the records at the next tick after a push from a stage-mate it does not
count yet (perhaps one that just joined). The ban follower reuses the records the roster read last."""

import asyncio
import time
from types import SimpleNamespace

import pytest

from swarm.protocol import ProgressPush
from swarm.server.compute import StageError
from swarm.server.served import ServedStage, quiet_period_s, roster_period_s
from tests.conftest import TINY


class _Directory:
    def __init__(self):
        self.reads = 0

    async def servers(self, stage: int) -> list:
        self.reads += 1
        return [f"record {self.reads}"]


def _stage(quiet: bool) -> SimpleNamespace:
    """What of a :class:`ServedStage` its ticks use; ``reads`` counts the roster's reads, ``orders`` the looks at
    the rollback orders."""
    stage = SimpleNamespace(spec=TINY, stage=0, optimizer=SimpleNamespace(stage_quiet=quiet), _mates={},
                            _roster_due=False, _ran_at={}, _servers_read=(float("-inf"), []),
                            directory=_Directory(), reads=[], orders=[], ctx=SimpleNamespace(recognition=None))

    async def read_roster() -> None:
        stage.reads.append(1)

    async def follow() -> None:
        stage.orders.append(1)

    stage._read_roster, stage.rollbacks = read_roster, SimpleNamespace(follow=follow)
    stage._quiet_skip = lambda duty: ServedStage._quiet_skip(stage, duty)
    for name in ("_roster_tick", "_orders_tick", "stage_servers"):
        setattr(stage, name.strip("_"), lambda name=name: getattr(ServedStage, name)(stage))
    return stage


def _ticks(stage: SimpleNamespace, n: int) -> None:
    for _ in range(n):
        asyncio.run(stage.roster_tick())
        asyncio.run(stage.orders_tick())


def test_a_training_stage_reads_at_every_tick_and_a_quiet_one_once_per_quiet_period():
    assert quiet_period_s(TINY) >= 4 * roster_period_s(TINY)
    busy, quiet = _stage(quiet=False), _stage(quiet=True)
    _ticks(busy, 3)
    _ticks(quiet, 3)
    assert len(busy.reads) == len(busy.orders) == 3
    assert len(quiet.reads) == len(quiet.orders) == 1, "a quiet stage read again before quiet_period_s"
    quiet._ran_at = {duty: t - quiet_period_s(TINY) for duty, t in quiet._ran_at.items()}
    _ticks(quiet, 1)
    assert len(quiet.reads) == len(quiet.orders) == 2
    quiet.optimizer.stage_quiet = False  # a sample: the stage trains again, both are read at every tick
    _ticks(quiet, 1)
    assert len(quiet.reads) == len(quiet.orders) == 3


def test_a_push_from_a_server_not_counted_is_refused_and_makes_a_quiet_stage_read_its_records_at_the_next_tick():
    quiet = _stage(quiet=True)
    asyncio.run(quiet.roster_tick())
    push = ProgressPush(run_id="r", stage=0, epoch=0, samples=4, samples_per_s=1.0, client_mode=False, time=0.0)
    with pytest.raises(StageError, match="not one of the stage 0 servers"):
        ServedStage._progress_pushed(quiet, "12D3KooWnewcomer", push)
    asyncio.run(quiet.roster_tick())
    assert len(quiet.reads) == 2, "the refused push did not make the next tick read the records"
    asyncio.run(quiet.roster_tick())
    assert len(quiet.reads) == 2, "one refused push makes one read, not a read at every tick"


def test_the_ban_follower_reuses_the_records_the_roster_read_within_a_quiet_period():
    stage = _stage(quiet=False)
    assert asyncio.run(stage.stage_servers()) == ["record 1"], "nothing read yet: it reads"
    stage._servers_read = (time.monotonic(), ["the roster's"])  # as _read_roster keeps them
    assert asyncio.run(stage.stage_servers()) == ["the roster's"] and stage.directory.reads == 1
    stage._servers_read = (time.monotonic() - quiet_period_s(TINY) - 1, ["stale"])
    assert asyncio.run(stage.stage_servers()) == ["record 2"]


def test_a_training_stage_of_many_servers_is_read_less_often_and_a_push_still_makes_it_read_at_once():
    """A stage of 100 servers (tiny spec: ticks every 1 s, re-announcements every 5 s) is read every 100 /
    RECORDS_READ_PER_S seconds, capped at the re-announce period; an unknown stage-mate's push still reads at the
    next tick."""
    from swarm.net.directory import read_period_s

    stage = _stage(quiet=False)

    async def read_roster() -> None:
        stage.reads.append(1)
        stage._servers_read = (time.monotonic(), ["a record"] * 100)

    stage._read_roster = read_roster
    period = read_period_s(100, roster_period_s(TINY), quiet_period_s(TINY))
    assert roster_period_s(TINY) < period <= quiet_period_s(TINY)
    _ticks(stage, 3)
    assert len(stage.reads) == 1, "a large stage was read again before its read period"
    stage._servers_read = (time.monotonic() - period, stage._servers_read[1])
    _ticks(stage, 1)
    assert len(stage.reads) == 2
    stage._roster_due = True  # (what a refused push sets)
    _ticks(stage, 1)
    assert len(stage.reads) == 3
