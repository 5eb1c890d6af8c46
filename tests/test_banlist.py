"""The coordinator's ban list in a real DHT: only the run key can ban, peers follow the newest list."""

import asyncio

import pytest
from hivemind import DHT
from hivemind.utils import get_dht_time

from swarm.trust.banlist import PeerBanned, RunBans, update_bans
from swarm.net.directory import AsyncRunDirectory, RunDirectory
from swarm.identity import Identity
from swarm.protocol import BanList, bans_key, seal


@pytest.fixture
def run(tiny_spec):
    coordinator = Identity.generate()
    run_id, sealed = RunDirectory.seal_spec(tiny_spec, coordinator)
    dht = DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], use_relay=False, use_auto_relay=False)
    directory = RunDirectory(dht, run_id, ttl=10.0)
    directory.verify_spec(sealed)  # learns the run key, as every peer does when it fetches the spec
    yield directory, coordinator
    dht.shutdown()


def test_only_the_run_key_bans_and_followers_see_the_newest_list(run):
    directory, coordinator = run
    follower = RunBans(AsyncRunDirectory(directory))
    assert _run(follower.refresh()) is None and follower.banned == {}
    follower.check("anyone")  # nothing banned: no error

    with pytest.raises(PermissionError, match="did not create run"):
        update_bans(directory, Identity.generate(), ban=("peerx", "spam", ""))
    # a list signed by another key, stored under its own sub-key, is dropped by every reader
    intruder = Identity.generate()
    forged = BanList(run_id=directory.run_id, peer_id=intruder.peer_id, time=get_dht_time() + 5, banned={"honest": "x"})
    assert directory.publish_bans(forged, seal(forged, intruder))
    assert directory.bans() == (None, None)

    update_bans(directory, coordinator, ban=("peerx", "sent garbage", "12D3KooWX"))
    update_bans(directory, coordinator, ban=("peery", "r" * 300, ""))
    current = _run(follower.refresh(republish=True))
    assert current.banned == {"peerx": "sent garbage", "peery": "r" * 200} and set(follower.banned_p2p_ids) == {"12D3KooWX"}
    assert follower.is_banned("peerx") and not follower.is_banned("honest")
    with pytest.raises(PeerBanned, match="banned from run .* sent garbage.*swarm-coordinator unban"):
        follower.check("peerx")

    update_bans(directory, coordinator, unban="peerx")
    assert set(_run(follower.refresh()).banned) == {"peery"}
    follower.check("peerx")


def test_an_older_list_never_replaces_a_newer_one(run):
    directory, coordinator = run
    follower = RunBans(AsyncRunDirectory(directory))
    update_bans(directory, coordinator, ban=("peerx", "first", ""))
    _run(follower.refresh())
    stale = BanList(run_id=directory.run_id, peer_id=coordinator.peer_id, time=get_dht_time() - 60, banned={})
    # a replay of an older list, kept alive longer than the newest (hivemind keeps, per sub-key, the value that
    # expires last): every version lives under its own sub-key, so it hides nothing
    assert directory.dht.store(bans_key(directory.run_id), seal(stale, coordinator), get_dht_time() + 600,
                               subkey=stale.dht_subkey())
    assert _run(follower.refresh()).banned == {"peerx": "first"}
    newcomer = RunBans(AsyncRunDirectory(directory))
    assert _run(newcomer.refresh()).banned == {"peerx": "first"}, "a newcomer reads the newest list too"


def _run(coro):
    return asyncio.run(coro)
