"""How many micro-batches a trainer keeps in flight: enough to keep its servers busy across the round trips.

A micro-batch spends its life in ``2S - 1`` calls for ``S`` stages (a forward on each stage, the last one with its
backward, then a backward on each earlier stage), and every call costs one network round trip on top of the
server's compute. On loopback a trainer's base concurrency (``TrainerOptions.concurrency``) keeps the pipeline
fed; over a link with round trip ``rtt`` the same micro-batches finish ``(2S - 1) * rtt`` later each, and the
servers idle meanwhile. By Little's law, keeping the rate ``r`` (micro-batches per second) needs
``r * (2S - 1) * rtt`` more micro-batches in flight (SWARM parallelism, Ryabinin et al. 2023, sec. 3: a trainer
keeps enough micro-batches in flight to cover latency x throughput). :class:`InFlight` measures ``rtt`` with
``rpc_ping`` (:func:`swarm.net.links.round_trip`: the least of a few pings per server, the median over servers:
queueing at a busy server is not network latency) and ``r`` from the micro-batches this trainer finished in the
last period, and sets ``target = base + ceil(r * (2S - 1) * rtt - 0.1)``, at most :data:`MOST_IN_FLIGHT`. The
round trip is measured apart from the compute, so a higher target that only builds queues at the servers does not
raise it further.
"""

from __future__ import annotations

import math
import time
from typing import Optional

MOST_IN_FLIGHT = 16
"""Most micro-batches a trainer keeps in flight (each holds its activations, ~B x T x d floats per stage); half of
what a stage server serves one peer at once (:data:`swarm.net.quota.MAX_IN_FLIGHT`), leaving room for spot
checks."""
TUNE_EVERY_S = 10.0
"""Seconds between two measurements of the round trip and the rate."""


def in_flight_target(base: int, calls: int, round_trip_s: float, rate: float, most: int = MOST_IN_FLIGHT) -> int:
    """``base + ceil(rate * calls * round_trip_s - 0.1)``, between ``base`` and ``max(base, most)``: Little's law
    asks for the whole product, rounded up; a tenth of a micro-batch is forgiven (on loopback the product is
    ~0.01, and adds none).

    :param calls: network round trips per micro-batch (``2S - 1`` for ``S`` stages).
    :param round_trip_s: the network round trip to the servers (seconds).
    :param rate: micro-batches per second this trainer finishes.
    """
    extra = math.ceil(max(0.0, rate) * calls * max(0.0, round_trip_s) - 0.1)
    return max(base, min(max(base, most), base + extra))


class InFlight:
    """The trainer's in-flight target (module docstring): call :meth:`update` every :data:`TUNE_EVERY_S`
    seconds with the micro-batches finished so far; it returns the new target, or None if unchanged (also when no
    server answered a ping, or nothing finished in the period: the swarm stalled, e.g. a stage between epochs)."""

    def __init__(self, base: int, stages: int, most: int = MOST_IN_FLIGHT):
        self.base, self.calls, self.most = base, 2 * stages - 1, most
        self.target = base
        self.round_trip_s: Optional[float] = None
        self.rate = 0.0
        self._last: Optional[tuple[float, int]] = None  # (time.monotonic(), micro-batches finished)

    def update(self, finished: int, round_trip_s: Optional[float], now: Optional[float] = None) -> Optional[int]:
        now = time.monotonic() if now is None else now
        last, self._last = self._last, (now, finished)
        if last is None or now <= last[0] or round_trip_s is None or finished == last[1]:
            return None  # nothing to go on; a period in which nothing finished is a stall, not a slower rate
        self.rate, self.round_trip_s = (finished - last[1]) / (now - last[0]), round_trip_s
        target = in_flight_target(self.base, self.calls, round_trip_s, self.rate, self.most)
        if target == self.target:
            return None
        self.target = target
        return target


__all__ = ["InFlight", "MOST_IN_FLIGHT", "TUNE_EVERY_S", "in_flight_target"]
