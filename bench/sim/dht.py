"""DHT traffic, counted from the peers' cadences: calls, messages and bytes per peer, and the load on the nodes
that hold a stage's records.

A call (a read or a store) is a Kademlia lookup: about ``log2(N) / log2(bucket)`` rounds of requests to
``beam`` nodes (Maymounkov and Mazieres, "Kademlia", IPTPS 2002, sec. 2.3; hivemind's bucket of 20 and our beam
of 5, :class:`swarm.net.dht.ReplicaLookupDHT`), the last round reaching the key's ``REPLICAS`` nodes; a read's value
comes back from each of them (an upper bound: hivemind's ``latest=True`` read may stop earlier), a store's value
goes to each. Every request and reply without a value weighs ``REQUEST_BYTES``. The averagers' matchmaking makes
``MATCHMAKING_CALLS`` calls per hop (declaring under the lane's key and looking for its leader: 127 calls in 21 s
of one server of a 2 x 2 + 1 swarm making about 1.5 rounds a second, read with ``strace``, docs/scaling.md).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

REPLICAS = 5
BUCKET = 20
REQUEST_BYTES = 200
MATCHMAKING_CALLS = 4


def lookup_messages(nodes: int) -> int:
    """Requests (each with its reply) of one lookup among ``nodes`` DHT nodes."""
    rounds = max(1, math.ceil(math.log2(max(nodes, 2)) / math.log2(BUCKET)))
    return rounds * min(REPLICAS, nodes)


@dataclass
class Traffic:
    """Totals per role (``server``, ``trainer``) and the hottest key's readers."""

    record_bytes: float  # one sealed server record
    calls: Counter = field(default_factory=Counter)
    messages: Counter = field(default_factory=Counter)
    bytes: Counter = field(default_factory=Counter)
    key_bytes: Counter = field(default_factory=Counter)  # stage -> value bytes the nodes of its hottest key served

    def read(self, role: str, count: float, records: int, nodes: int) -> float:
        """``count`` reads of a key holding ``records`` server records; returns the value bytes served."""
        served = count * min(REPLICAS, nodes) * records * self.record_bytes
        self.calls[role] += count
        self.messages[role] += count * lookup_messages(nodes)
        self.bytes[role] += served + 2 * count * lookup_messages(nodes) * REQUEST_BYTES
        return served

    def store(self, role: str, count: float, value_bytes: float, nodes: int) -> None:
        self.calls[role] += count
        self.messages[role] += count * lookup_messages(nodes)
        self.bytes[role] += count * (min(REPLICAS, nodes) * value_bytes + 2 * lookup_messages(nodes) * REQUEST_BYTES)

    def matchmaking(self, role: str, hops: float, nodes: int) -> None:
        self.store(role, hops * MATCHMAKING_CALLS, REQUEST_BYTES, nodes)
