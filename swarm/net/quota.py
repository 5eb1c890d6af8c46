"""Per-peer quotas for RPC handlers: how many requests of one libp2p peer a handler serves at once, and how
many it starts per second.

Each request a handler accepts holds a task, a socket and up to its message budget in memory until it is
answered or its deadline passes (:func:`swarm.net.transport.gather`). Without a bound per peer, one peer opening
many streams that never finish holds all of that at once (40 stalled forward streams: +80 MB measured). A
:class:`PeerQuota` counts the requests in flight per remote libp2p id and refuses the one beyond
``max_in_flight`` at once, with :class:`Busy` (a :class:`~swarm.protocol.Refusal`: one log line, no traceback),
so a peer holds at most ``max_in_flight`` times the handler's message budget. Honest clients stay far below
it: a trainer keeps ``concurrency`` micro-batches in flight per stage.

In-flight bounds leave the request *rate* open: requests answered (or refused) at once cost the handler's
decoding and checks each time. Each peer also has a token bucket (``rate_per_s`` requests per second on average,
bursts of ``burst``); a request beyond it is refused with :class:`TooFast`, which says when to retry. A Sybil with
many libp2p ids is not bounded by either; the server's own thread pool and the deadlines bound it.
"""

from __future__ import annotations

import time
from collections import Counter
from contextlib import contextmanager
from typing import Callable, Iterator, Optional

from swarm.protocol import Refusal

MAX_IN_FLIGHT = 32
"""Requests of one peer a stage server serves at once (a trainer keeps ``concurrency`` micro-batches in flight
per stage, forward and backward)."""
MAX_RATE_PER_S = 200.0
"""Requests per second one peer may start at a stage server, on average (a trainer's forwards, backwards and spot
checks of one stage: tens per second on a fast GPU with small micro-batches)."""
BUCKETS_KEPT = 4096
"""Peers whose token buckets are remembered; full buckets (idle peers) are forgotten beyond this (checked at most
once a second), and the oldest beyond four times this."""


class Busy(RuntimeError, Refusal):
    """The peer already has as many requests in flight here as this handler serves at once."""


class TooFast(Busy):
    """The peer started more requests per second here than this handler takes."""


class PeerQuota:
    """Counts one handler group's requests in flight per peer and meters their rate (event-loop only: not
    thread-safe).

    :param max_in_flight: requests of one peer served at once.
    :param rate_per_s: requests one peer may start per second on average (token bucket, Turner 1986).
    :param burst: requests one peer may start at once after being idle (default: 2 x ``rate_per_s``, at least 1).
    :param clock: seconds, monotonic (tests pass a fake one).
    :raises ValueError: a bound below 1 (or a rate <= 0).
    """

    def __init__(self, max_in_flight: int = MAX_IN_FLIGHT, rate_per_s: float = MAX_RATE_PER_S,
                 burst: Optional[float] = None, clock: Callable[[], float] = time.monotonic):
        burst = max(1.0, 2 * rate_per_s) if burst is None else burst
        if max_in_flight < 1 or not rate_per_s > 0 or burst < 1:
            raise ValueError("max_in_flight and burst must be >= 1 and rate_per_s > 0")
        self.max_in_flight, self.rate_per_s, self.burst, self.clock = max_in_flight, rate_per_s, burst, clock
        self.in_flight: Counter[str] = Counter()
        self._buckets: dict[str, tuple[float, float]] = {}  # peer -> (tokens, clock at which they were counted)
        self._pruned_at = float("-inf")

    def _take_token(self, peer: str) -> None:
        now = self.clock()
        tokens, at = self._buckets.get(peer, (self.burst, now))
        tokens = min(self.burst, tokens + (now - at) * self.rate_per_s)
        if tokens < 1:
            self._buckets[peer] = (tokens, now)
            raise TooFast(f"more than {self.rate_per_s:g} requests/s of yours here; retry in "
                          f"{(1 - tokens) / self.rate_per_s:.2f} s (lower the trainer's concurrency)")
        self._buckets[peer] = (tokens - 1, now)
        if len(self._buckets) > BUCKETS_KEPT and now - self._pruned_at >= 1.0:  # at most once a second
            self._pruned_at = now
            self._buckets = {p: (t, a) for p, (t, a) in self._buckets.items()
                             if t + (now - a) * self.rate_per_s < self.burst}
            while len(self._buckets) > 4 * BUCKETS_KEPT:  # many ids, all busy (a Sybil): forget the oldest
                del self._buckets[next(iter(self._buckets))]

    @contextmanager
    def hold(self, peer: str) -> Iterator[None]:
        """Hold one of ``peer``'s slots for the ``with`` block.

        :raises Busy: ``peer`` (a libp2p id) has ``max_in_flight`` requests in flight already.
        :raises TooFast: ``peer`` started more than ``burst`` requests plus ``rate_per_s`` per second since.
        """
        if self.in_flight[peer] >= self.max_in_flight:
            raise Busy(f"this peer already serves {self.max_in_flight} requests of yours at once; wait for their "
                       "replies (lower the trainer's concurrency)")
        self._take_token(peer)
        self.in_flight[peer] += 1
        try:
            yield
        finally:
            self.in_flight[peer] -= 1
            if not self.in_flight[peer]:
                del self.in_flight[peer]
