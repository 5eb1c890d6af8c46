"""What a peer measures of its links to the swarm's servers: the round trip and the rate at which a peer's bytes
reach it, so that it can derive its timeouts from them (:mod:`swarm.net.timeouts`).

* **Round trip** (seconds): the least of :data:`PINGS` ``rpc_ping`` per server (queueing at a busy server is not
  network latency), over at most :data:`SERVERS_PINGED` servers sampled from those given.
* **Rate** (bytes/s): ``rpc_ping`` with ``echo_bytes`` (:class:`~swarm.protocol.PingRequest`) makes the server
  send back that many bytes; the rate is ``echo_bytes / (echo time - round trip)``, the faster of
  :data:`PROBES` probes (the first may run in TCP's slow start, which under-reads the rate: that errs toward
  longer timeouts). Probed from at most :data:`SERVERS_PROBED` servers, those of the longest round trips first
  (the far ones bound the timeouts), so a join costs at most ``SERVERS_PROBED x PROBES x PROBE_BYTES`` of its
  link (1.5 MiB, 0.6 s at 20 Mbit/s).

A peer with no server to measure yet (the run's first) times the round trip with hivemind's DHT ping to the peers
of its DHT routing table instead (:func:`dht_round_trip`: the coordinator, trainers), and has no rate.

A timeout must cover the slowest peer this one waits for, so a measurement keeps the *slowest* figures: the
longest round trip and the lowest rate among the servers that answered (the median would let the one slow
stage-mate of a group time out every round). hivemind 1.1.12 measures nothing of its links (its averagers take
a hand-set ``bandwidth``); the in-flight tuning of a trainer uses the median round trip instead
(:mod:`swarm.trainer.inflight`: there the typical call, not the worst, sets a floor to the pipeline's depth).
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from dataclasses import dataclass
from functools import partial
from typing import Optional, Sequence

from swarm.net.stage_rpc import ping_seconds

PINGS = 3
"""Pings per server per measurement (the least counts)."""
SERVERS_PINGED = 8
"""Most servers pinged per measurement (a random sample: the cost stays flat in big runs)."""
PROBE_BYTES = 256 * 1024
"""Bytes each rate probe asks a server to send back (at most :data:`~swarm.protocol.MAX_ECHO_BYTES`)."""
PROBES = 2
"""Rate probes per probed server (the fastest counts)."""
SERVERS_PROBED = 3
"""Most servers whose rate is probed, the farthest first."""
MAX_RATE = 10e9
"""Highest rate a probe reports (bytes/s): on loopback the echo's time is within the round trip's noise."""


@dataclass(frozen=True)
class LinkMeasurement:
    """The slowest of a peer's measured links: ``round_trip_s`` (seconds, the longest of the servers' least
    pings), ``rate`` (bytes/s, the lowest probed; None if no probe answered), over ``servers`` that answered."""

    round_trip_s: float
    rate: Optional[float]
    servers: int

    def describe(self) -> str:
        """``round_trip_ms=.. rate_MBps=.. servers=..`` (fixed keys, for the log line that uses it)."""
        rate = "none" if self.rate is None else f"{self.rate / 1e6:.2f}"
        return f"round_trip_ms={1000 * self.round_trip_s:.1f} rate_MBps={rate} servers={self.servers}"


async def least_ping(p2p, server, run_id: str, pings: int = PINGS, echo_bytes: int = 0) -> Optional[float]:
    """The least of ``pings`` ``rpc_ping`` times to ``server`` (seconds), or None if none answered."""
    times = [await ping_seconds(p2p, server, run_id, echo_bytes=echo_bytes) for _ in range(pings)]
    answered = [t for t in times if t is not None]
    return min(answered) if answered else None


async def round_trip(p2p, servers: Sequence, run_id: str, pings: int = PINGS,
                     most: int = SERVERS_PINGED) -> Optional[float]:
    """The typical network round trip (seconds) to ``servers`` (ServerInfo): the least of ``pings`` ``rpc_ping``
    per server, the *median* over the servers that answered (at most ``most``, sampled); None if none did."""
    servers = random.sample(list(servers), min(most, len(servers)))
    found = [t for t in await asyncio.gather(*(least_ping(p2p, s, run_id, pings) for s in servers)) if t is not None]
    return statistics.median(found) if found else None


async def measure_links(p2p, servers: Sequence, run_id: str, *, probe_bytes: int = PROBE_BYTES,
                        most: int = SERVERS_PINGED, probed: int = SERVERS_PROBED) -> Optional[LinkMeasurement]:
    """The slowest round trip and rate to ``servers`` (ServerInfo records; see the module docstring), or None if
    none answered a ping. Pings run concurrently across servers; the rate probes follow, one server at a time
    (concurrent probes would share this peer's link and each read a fraction of it)."""
    servers = random.sample(list(servers), min(most, len(servers)))
    pinged = await asyncio.gather(*(least_ping(p2p, s, run_id) for s in servers))
    answered = sorted(((t, s) for t, s in zip(pinged, servers) if t is not None), key=lambda ts: -ts[0])
    if not answered:
        return None
    rates = []
    for rtt, server in answered[:probed] if probe_bytes else []:
        echo = await least_ping(p2p, server, run_id, PROBES, echo_bytes=probe_bytes)
        if echo is not None:
            rates.append(min(MAX_RATE, probe_bytes / max(echo - rtt, probe_bytes / MAX_RATE)))
    return LinkMeasurement(round_trip_s=answered[0][0], rate=min(rates) if rates else None, servers=len(answered))


async def _dht_pings(pings: int, most: int, _dht, node) -> Optional[float]:
    """(in the DHT's process) :func:`dht_round_trip`."""
    async def least(peer) -> Optional[float]:
        times = []
        for _ in range(pings):
            started = time.perf_counter()
            if await node.protocol.call_ping(peer) is not None:
                times.append(time.perf_counter() - started)
        return min(times) if times else None

    peers = list(node.protocol.routing_table.peer_id_to_uid)[:most]
    found = [t for t in await asyncio.gather(*(least(p) for p in peers)) if t is not None]
    return max(found) if found else None


async def dht_round_trip(dht, pings: int = PINGS, most: int = SERVERS_PINGED) -> Optional[float]:
    """The longest of the least of ``pings`` DHT pings (hivemind's ``rpc_ping``, in ``dht``'s process) to each of
    at most ``most`` peers of its routing table (seconds); None if none answered (or it knows no peer)."""
    return await dht.run_coroutine(partial(_dht_pings, pings, most), return_future=True)


__all__ = ["LinkMeasurement", "MAX_RATE", "PINGS", "PROBES", "PROBE_BYTES", "SERVERS_PINGED", "SERVERS_PROBED",
           "dht_round_trip", "least_ping", "measure_links", "round_trip"]
