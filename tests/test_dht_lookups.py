"""A read or a store looks for the nodes that hold a key's record (the replication), not hivemind's beam of 20:
nine real hivemind DHT nodes on loopback, each storing its sub-key of one record; every node reads all nine
sub-keys back, and the reader's lookups are counted (``call_find``, wrapped inside its DHT process)."""

from __future__ import annotations

import pytest
from hivemind.utils import get_dht_time

from swarm.net.dht import LOOKUP_BEAM, ReplicaLookupDHT

pytestmark = pytest.mark.timeout(180)

NODES = 9
"""More nodes than the beam: with hivemind's beam of 20, every read of this swarm visits every other node."""


async def _count_finds(_dht, node) -> None:
    """(inside a DHT process) Count the find RPCs this node sends, in ``node.finds_sent``."""
    node.finds_sent, call_find = 0, node.protocol.call_find

    async def counted(peer, keys):
        node.finds_sent += 1
        return await call_find(peer, keys)

    node.protocol.call_find = counted


async def _finds_sent(_dht, node) -> int:
    return node.finds_sent


def _swarm(count: int) -> list[ReplicaLookupDHT]:
    kwargs = dict(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], use_relay=False, use_auto_relay=False,
                  cache_nearest=0, cache_refresh_before_expiry=0)
    first = ReplicaLookupDHT(**kwargs)
    maddrs = [str(m) for m in first.get_visible_maddrs()]
    return [first] + [ReplicaLookupDHT(initial_peers=maddrs, **kwargs) for _ in range(count - 1)]


def test_reads_find_every_replicas_subkeys_with_a_beam_of_the_replication():
    nodes = _swarm(NODES)
    try:
        until = get_dht_time() + 120
        for i, node in enumerate(nodes):
            assert node.store("progress", {"samples": i}, until, subkey=f"server{i}")
        everyone = {f"server{i}": {"samples": i} for i in range(NODES)}
        for node in nodes:
            found = node.get("progress", latest=True)
            assert found is not None and {k: v.value for k, v in found.value.items()} == everyone

        reader, reads = nodes[1], 10
        reader.run_coroutine(_count_finds)
        for _ in range(reads):
            assert len(reader.get("progress", latest=True).value) == NODES
        narrow = reader.run_coroutine(_finds_sent)
        for _ in range(reads):  # hivemind's own beam, the bucket size, as a caller can still ask
            assert len(reader.get("progress", latest=True, beam_size=20).value) == NODES
        wide = reader.run_coroutine(_finds_sent) - narrow
        assert narrow <= reads * LOOKUP_BEAM < wide, (narrow, wide)
    finally:
        for node in nodes:
            node.shutdown()
