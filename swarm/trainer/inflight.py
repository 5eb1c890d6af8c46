"""How many micro-batches a trainer keeps in flight: enough to keep its servers busy across the network.

A micro-batch spends its life in ``2S - 1`` calls for ``S`` stages (a forward on each stage, the last one with its
backward, then a backward on each earlier stage); each call costs the server's compute and, over a link, the
round trip, the tensors' transfer each way and TCP's slow start after an idle gap. A trainer with ``N``
micro-batches in flight and a micro-batch latency ``L`` finishes ``N / L`` of them a second (Little's law), so over
a far link it needs more in flight than on loopback for the same rate (SWARM parallelism, Ryabinin et al. 2023,
sec. 3: a trainer keeps enough micro-batches in flight to cover latency x throughput).

How many is the pipeline's bandwidth-delay product, found as BBR finds a TCP flow's (Cardwell et al., "BBR:
Congestion-Based Congestion Control", ACM Queue 2016): the *bottleneck rate* is the highest rate this trainer
finished micro-batches at over the last :data:`RATE_WINDOW` tuning periods, the *unloaded latency* the least
seconds a micro-batch took from its first call to its last over the last :data:`LATENCY_WINDOW` periods (queueing
at a busy server, an epoch's transition and retries only lengthen a micro-batch, so the least one is the
pipeline's own latency), and the target is ``ceil(GAIN x rate x latency)``, between the base concurrency
(``TrainerOptions.concurrency``) and :data:`MOST_IN_FLIGHT`. While the rate follows the target, the target grows
by :data:`GAIN` each period; it settles once the servers' queues, not the network, set the rate. The periods are
short until then (BBR's STARTUP, :data:`STARTUP_EVERY_S`), ten seconds after. The latency's
window is long because the servers' queues, once full, lengthen every micro-batch (servers shared with other
trainers are rarely idle, and this trainer never drains them as BBR's ProbeRTT does): over a 30 s window the
least latency grew with the target (1.2 s to 2.0 s at 20:150, the target 6 to 12). A period in which nothing
finished (the swarm stalled, e.g. every server of a stage between epochs) changes nothing.

The target is never below what the round trips alone ask for, ``base + ceil(rate x (2S - 1) x rtt - 0.1)`` with
``rtt`` the servers' ping round trip (:func:`swarm.net.links.round_trip`): on a machine whose CPU is shared by
many processes the quickest micro-batch of five minutes can be a lucky one, several times quicker than the rest.

Measured in the WAN lab (``bench/wan.py``, 20 Mbit/s and 150 ms, the demo in outer steps with ``lowrank_ternary``
activations, 2 trainers): the rule before this one, ``base + rate x (2S - 1) x rtt`` with the servers' ping round
trip, kept 3-4 micro-batches in flight (a micro-batch spent 0.67-0.74 s outside its servers, the pings said
0.45 s) and the swarm trained 3677-3811 tokens/s; this one keeps 7-11 and trained 4655 (loopback: 5960).
"""

from __future__ import annotations

import math
import time
from collections import deque
from typing import Optional

MOST_IN_FLIGHT = 16
"""Most micro-batches a trainer keeps in flight (each holds its activations, ~B x T x d floats per stage); half of
what a stage server serves one peer at once (:data:`swarm.net.quota.MAX_IN_FLIGHT`), leaving room for spot
checks."""
TUNE_EVERY_S = 10.0
"""Seconds between two tunings (one period), once started up."""
STARTUP_EVERY_S = 2.5
"""Seconds between two tunings while the trainer starts up (:attr:`InFlight.starting`: BBR's STARTUP, which ends
once the pipe is full). The target then follows the rate within seconds instead of tens of seconds: in the WAN lab
at 20:150 the first 30 s of a run, at the base concurrency while the first 10 s periods passed, left the machine's
cores 19.2 s idle (``bench/wan.py``'s ``idle``), none after."""
FULL_PIPE_GROWTH = 1.25
FULL_PIPE_PERIODS = 3
"""Startup ends after :data:`FULL_PIPE_PERIODS` periods in a row whose rate is not :data:`FULL_PIPE_GROWTH` times
the best rate before them (BBR's full-bandwidth detection: three rounds without 25% growth)."""
RATE_WINDOW = 3
"""Periods over which the highest rate is taken (BBR's bandwidth window: a rate lost, e.g. to a server gone, is
forgotten within ``RATE_WINDOW x TUNE_EVERY_S`` seconds)."""
LATENCY_WINDOW = 30
"""Periods over which the least micro-batch latency is taken (module docstring: long, so the servers' queues do
not count as latency; a route that got slower is measured afresh within five minutes)."""
GAIN = 4.0
"""Micro-batches in flight per bandwidth-delay product. BBR keeps 2 (its cwnd gain) for one flow through one
bottleneck; a micro-batch is at the slowest stage for only part of its latency (the demo's stage 1: 0.24 s of
0.9 s at 20:150), on one of several servers picked at random, so with 2 a stage's servers idled while others
queued. Measured in the WAN lab at 20:150: a gain of 2 kept 4 in flight (3909 tokens/s), 4 kept 7-11 (4655); a
fixed 7-9 gave 4767."""


def in_flight_target(base: int, rate: float, latency_s: float, most: int = MOST_IN_FLIGHT,
                     gain: float = GAIN) -> int:
    """``ceil(gain x rate x latency_s)``, between ``base`` and ``max(base, most)`` (the base is never lowered).

    :param rate: the bottleneck rate, micro-batches per second.
    :param latency_s: the unloaded latency of a micro-batch (seconds).
    """
    product = max(0.0, rate) * max(0.0, latency_s)
    return max(base, min(max(base, most), math.ceil(gain * product)))


class InFlight:
    """The trainer's in-flight target (module docstring): :meth:`observe` each trained micro-batch's seconds, call
    :meth:`update` every :data:`TUNE_EVERY_S` seconds with the micro-batches finished so far; it returns the new
    target, or None if unchanged (also when nothing finished in the period)."""

    def __init__(self, base: int, stages: int, most: int = MOST_IN_FLIGHT, gain: float = GAIN):
        self.base, self.calls, self.most, self.gain = base, 2 * stages - 1, most, gain
        self.target = base
        self.rate = 0.0  # micro-batches/s: the highest period's rate in its window
        self.latency_s: Optional[float] = None  # the least micro-batch latency in its window
        self._rates: deque[float] = deque(maxlen=RATE_WINDOW)  # per period
        self._latencies: deque[float] = deque(maxlen=LATENCY_WINDOW)  # the least one of each period
        self._least: Optional[float] = None  # the least latency observed in the current period
        self._last: Optional[tuple[float, int]] = None  # (time.monotonic(), micro-batches finished)
        self.starting = True
        """Whether the trainer is starting up (:data:`STARTUP_EVERY_S`); False once the pipe is full."""
        self._full_rate, self._flat = 0.0, 0  # startup: the best rate so far, periods since it grew 25%

    @property
    def period_s(self) -> float:
        """Seconds until the next :meth:`update`: :data:`STARTUP_EVERY_S` while starting, else
        :data:`TUNE_EVERY_S`."""
        return STARTUP_EVERY_S if self.starting else TUNE_EVERY_S

    def observe(self, seconds: float) -> None:
        """A micro-batch took ``seconds`` from its first call to its last answer."""
        if seconds > 0 and (self._least is None or seconds < self._least):
            self._least = seconds

    def update(self, finished: int, round_trip_s: Optional[float] = None, now: Optional[float] = None
               ) -> Optional[int]:
        """The new target after ``finished`` micro-batches in all, or None if unchanged; ``round_trip_s``: the
        servers' ping round trip (seconds; None: none answered), the floor's measure."""
        now = time.monotonic() if now is None else now
        last, self._last = self._last, (now, finished)
        if last is None or now <= last[0] or finished == last[1] or self._least is None:
            return None  # nothing to go on; a period in which nothing finished is a stall, not a slower rate
        self._rates.append((finished - last[1]) / (now - last[0]))
        self._startup(self._rates[-1])
        self._latencies.append(self._least)
        self._least = None
        self.rate, self.latency_s = max(self._rates), min(self._latencies)
        target = in_flight_target(self.base, self.rate, self.latency_s, self.most, self.gain)
        if round_trip_s is not None:  # the floor: the round trips of the last period's rate
            floor = self.base + math.ceil(self._rates[-1] * self.calls * round_trip_s - 0.1)
            target = max(target, min(max(self.base, self.most), floor))
        if target == self.target:
            return None
        self.target = target
        return target

    def _startup(self, rate: float) -> None:
        """Count a period's rate towards the end of startup (:data:`FULL_PIPE_PERIODS`)."""
        if rate >= FULL_PIPE_GROWTH * self._full_rate:
            self._full_rate, self._flat = rate, 0
        else:
            self._flat += 1
            self.starting = self.starting and self._flat < FULL_PIPE_PERIODS


__all__ = ["FULL_PIPE_GROWTH", "FULL_PIPE_PERIODS", "GAIN", "InFlight", "LATENCY_WINDOW", "MOST_IN_FLIGHT",
           "RATE_WINDOW", "STARTUP_EVERY_S", "TUNE_EVERY_S", "in_flight_target"]
