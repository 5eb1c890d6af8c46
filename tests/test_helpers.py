"""The small shared helpers: periodic duties, the log prefix, validated spec variants."""

import asyncio
import gc
import logging
import weakref

import pytest

from hivemind.utils.mpfuture import MPFuture

from swarm.aio import hold_current_task, periodic, sleep_or_stop
from swarm.config import RunSpec, SpecError
from swarm.logs import PeerLog
from tests.conftest import TINY


def test_periodic_ticks_until_stopped_and_survives_a_failing_tick(caplog):
    ticks = []

    async def tick():
        ticks.append(len(ticks))
        if len(ticks) == 2:
            raise RuntimeError("a bad round")
        if len(ticks) == 4:
            stop.set()

    async def main():
        await asyncio.wait_for(periodic(stop, 0.01, tick, "the duty", logging.getLogger("test")), 5)

    stop = asyncio.Event()
    with caplog.at_level(logging.ERROR):
        asyncio.run(main())
    assert ticks == [0, 1, 2, 3] and "the duty failed" in caplog.text and "a bad round" in caplog.text


def test_sleep_or_stop_wakes_on_stop_and_on_a_wake_event():
    async def main():
        stop, wake = asyncio.Event(), asyncio.Event()
        loop = asyncio.get_running_loop()
        loop.call_later(0.05, wake.set)
        started = loop.time()
        assert await sleep_or_stop(stop, 10, wake) is False and loop.time() - started < 5
        loop.call_later(0.05, stop.set)
        assert await sleep_or_stop(stop, 10) is True
        assert await sleep_or_stop(asyncio.Event(), 0.01) is False

    asyncio.run(main())


def test_a_held_task_waiting_on_its_own_mpfuture_survives_a_collection():
    """As hivemind's averager process starts a round: a task nobody references, waiting on an MPFuture made inside
    it. Unheld, a collection destroys it mid-wait (what lost rounds); held, it waits on and then finishes."""
    async def waits(hold: bool, made: list):
        if hold:
            hold_current_task()
        made.append(MPFuture())
        return await made[-1]

    async def run(hold: bool):
        made = []
        task = weakref.ref(asyncio.get_running_loop().create_task(waits(hold, made)))
        await asyncio.sleep(0.05)
        made = [weakref.ref(f) for f in made]  # from here on only the task's own frame holds the future
        gc.collect()
        if task() is None:
            return "destroyed"
        made[0]().set_result("done")
        return await task()

    async def both():
        return await run(hold=False), await run(hold=True)

    assert asyncio.run(both()) == ("destroyed", "done")


def test_peer_log_prefixes_peer_role_stage_and_the_current_epoch(caplog):
    epoch = [3]
    log = PeerLog(logging.getLogger("test"), "abc", stage=1, epoch=lambda: epoch[0])
    with caplog.at_level(logging.INFO):
        log.info("loss=%.1f", 2.5)
        epoch[0] = 4
        log.info("online")
        PeerLog(logging.getLogger("test"), "xyz", role="trainer").warning("dropped")
    assert caplog.messages == ["[abc stage=1 epoch=3] loss=2.5", "[abc stage=1 epoch=4] online", "[xyz trainer] dropped"]


def test_spec_variants_are_validated_and_round_trip_through_toml():
    variant = TINY.updated(training={"target_batch_size": 64}, name="tiny-b")
    assert variant.training.target_batch_size == 64 and variant.training.micro_batch_size == 4
    assert variant.name == "tiny-b" and TINY.training.target_batch_size == 32
    assert RunSpec.parse_toml(variant.to_toml()) == variant
    with pytest.raises(SpecError, match="training.target_batch_sise"):
        TINY.updated(training={"target_batch_sise": 64})  # a typo fails loudly instead of doing nothing
    with pytest.raises(SpecError, match="section 'trainig'"):
        TINY.updated(trainig={"target_batch_size": 64})
    with pytest.raises(SpecError, match="target_batch_size"):
        TINY.updated(training={"target_batch_size": 1})  # below micro_batch_size
