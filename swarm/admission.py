"""Per-peer admission for RPC handlers: how many requests of one libp2p peer a handler serves at once.

Each request a handler accepts holds a task, a socket and up to its message budget in memory until it is
answered or its deadline passes (:func:`swarm.transport.gather`). Without a bound per peer, one peer opening
many streams that never finish holds all of that at once (issue 11: 40 stalled forward streams, +80 MB). A
:class:`PeerAdmission` counts the requests in flight per remote libp2p id and refuses the one beyond
``max_in_flight`` at once, with :class:`Busy` (a :class:`~swarm.protocol.Refusal`: one log line, no traceback),
so a peer holds at most ``max_in_flight`` times the handler's message budget. Honest clients stay far below
it: a trainer keeps ``concurrency`` micro-batches in flight per stage. A Sybil with many libp2p ids is not
bounded by this; the server's own thread pool and the deadlines bound it.
"""

from __future__ import annotations

from collections import Counter
from contextlib import contextmanager
from typing import Iterator

from swarm.protocol import Refusal

MAX_IN_FLIGHT = 32
"""Requests of one peer a stage server serves at once (a trainer keeps ``concurrency`` micro-batches in flight
per stage, forward and backward)."""


class Busy(RuntimeError, Refusal):
    """The peer already has as many requests in flight here as this handler serves at once."""


class PeerAdmission:
    """Counts one handler group's requests in flight per peer (event-loop only: not thread-safe)."""

    def __init__(self, max_in_flight: int = MAX_IN_FLIGHT):
        if max_in_flight < 1:
            raise ValueError("max_in_flight must be >= 1")
        self.max_in_flight = max_in_flight
        self.in_flight: Counter[str] = Counter()

    @contextmanager
    def admit(self, peer: str) -> Iterator[None]:
        """Hold one of ``peer``'s slots for the ``with`` block.

        :raises Busy: ``peer`` (a libp2p id) has ``max_in_flight`` requests in flight already.
        """
        if self.in_flight[peer] >= self.max_in_flight:
            raise Busy(f"this peer already serves {self.max_in_flight} requests of yours at once; wait for their "
                       "replies (lower the trainer's concurrency)")
        self.in_flight[peer] += 1
        try:
            yield
        finally:
            self.in_flight[peer] -= 1
            if not self.in_flight[peer]:
                del self.in_flight[peer]
