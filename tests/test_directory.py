"""The run directory's DHT calls are bounded: a call hivemind never answers cannot hold a thread (and with it the
peer's exit) forever."""

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
from hivemind import DHT
from hivemind.utils.mpfuture import MPFuture

from swarm.net.directory import RunDirectory
from swarm.identity import Identity
from swarm.protocol import ServerInfo, ServerState

RUN = "tiny-aaaaaaaaaaaaaaaa"


class Unanswered:
    """A DHT whose gets and stores are sent but never answered, as hivemind leaves the calls in flight when its
    DHT process shuts down; liveness is the real node's."""

    def __init__(self, dht: DHT):
        self.dht = dht

    def get(self, *args, **kwargs) -> MPFuture:
        return MPFuture()

    def store(self, *args, **kwargs) -> MPFuture:
        return MPFuture()

    def is_alive(self) -> bool:
        return self.dht.is_alive()


@pytest.fixture
def node():
    dht = DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], use_relay=False, use_auto_relay=False)
    yield dht
    dht.shutdown()


def _info(ident: Identity) -> ServerInfo:
    return ServerInfo(run_id=RUN, peer_id=ident.peer_id, time=time.time(), stage=0, state=ServerState.ONLINE,
                      p2p_id=ident.p2p_id, throughput=1.0, epoch=0)


@pytest.mark.timeout(60)
def test_calls_in_flight_when_the_dht_stops_return_nothing_at_once(node):
    directory, me = RunDirectory(Unanswered(node), RUN), Identity.generate()
    pool = ThreadPoolExecutor(2)
    try:
        reading = pool.submit(directory.servers, 0)
        storing = pool.submit(directory.announce_server, _info(me), me)
        time.sleep(0.5)
        assert not reading.done() and not storing.done()  # in flight: hivemind has not answered
    finally:
        node.shutdown()
        pool.shutdown(wait=False)
    assert reading.result(timeout=10) == [] and storing.result(timeout=10) is False
    # calls made after the DHT stopped (hivemind's pipe is closed) return at once too
    stopped = RunDirectory(node, RUN)
    assert stopped.servers(0) == [] and stopped.announce_server(_info(me), me) is False


@pytest.mark.timeout(60)
def test_a_call_the_live_dht_never_answers_gives_up_after_its_timeout(node, caplog):
    directory = RunDirectory(Unanswered(node), RUN)
    directory.call_timeout_s = 2.0
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="swarm.net.directory"):
        assert directory.trainers() == []
    assert 2.0 <= time.monotonic() - started < 10
    assert "no answer within 2 s" in caplog.text and "call_timeout_s" in caplog.text
    # the real node answers as before
    assert RunDirectory(node, RUN).trainers() == []


@pytest.mark.timeout(60)
def test_the_roster_forgets_servers_not_seen_for_an_hour_and_keeps_at_most_its_cap(node, monkeypatch):
    """The roster entitles manifest writers: it keeps each server a read of the real DHT found for ROSTER_KEEP_S
    after the last read that found it, and at most ROSTER_CAP per stage (those seen longest ago go first)."""
    import swarm.net.directory as directory_module

    directory, old, new = RunDirectory(node, RUN, ttl=3.0), Identity.generate(), Identity.generate()
    clock = [1000.0]
    monkeypatch.setattr(directory_module, "time", SimpleNamespace(monotonic=lambda: clock[0], sleep=time.sleep))
    assert directory.announce_server(_info(old), old)  # (its record expires in 3 s: it leaves)
    assert [s.peer_id for s in directory.servers(0)] == [old.peer_id]
    directory.ttl = 30.0
    assert directory.announce_server(_info(new), new)
    deadline = time.time() + 20
    while old.peer_id in {s.peer_id for s in directory.servers(0)} and time.time() < deadline:
        time.sleep(0.2)
    clock[0] += directory_module.ROSTER_KEEP_S - 1
    assert [s.peer_id for s in directory.servers(0)] == [new.peer_id]
    assert set(directory.roster[0]) == {old.peer_id, new.peer_id}  # an hour, less a second: still entitled
    clock[0] += 2
    directory.servers(0)
    assert set(directory.roster[0]) == {new.peer_id}
    monkeypatch.setattr(directory_module, "ROSTER_CAP", 3)
    for name in "abcd":
        clock[0] += 1
        directory._remember(0, [name])
    assert set(directory.roster[0]) == {"b", "c", "d"}
    clock[0] += 1
    directory.servers(0)  # found again: seen last now, and the longest unseen goes
    assert set(directory.roster[0]) == {"c", "d", new.peer_id}


def test_a_stage_of_many_servers_is_read_less_often_up_to_its_re_announce_period():
    """A peer reads a small stage at its own cadence, a large one so that it reads about RECORDS_READ_PER_S records a
    second, and any stage at least as often as its servers re-announce."""
    from swarm.net.directory import RECORDS_READ_PER_S, read_period_s

    assert read_period_s(0, 2.0, 10.0) == read_period_s(32, 2.0, 10.0) == 2.0
    assert read_period_s(32, 0.0, 10.0) == 0.0 and read_period_s(33, 0.0, 10.0) > 0  # (a caller's 0: every call)
    assert read_period_s(100, 2.0, 10.0) == pytest.approx(100 / RECORDS_READ_PER_S)
    assert read_period_s(10_000, 2.0, 10.0) == 10.0
    periods = [read_period_s(n, 2.0, 10.0) for n in range(0, 400, 8)]
    assert periods == sorted(periods)
    with pytest.raises(ValueError, match="exceeds"):
        read_period_s(5, 11.0, 10.0)
