"""Timeouts a peer derives from its measured links (:mod:`swarm.net.links`), the run spec's values as ceilings.

A fixed timeout is wrong somewhere: 10 s for an all-reduce part is plenty on a data-centre link and too short for a
state round's part on a 20 Mbit/s home uplink (the demo's 20 MB state needs ~10 s there), and a spec hand-tuned for
the slowest peer makes every fast peer wait that long for a dead one (hivemind's users ask for timeouts that follow
the links: learning-at-home/hivemind#676). Here each peer, when it joins a stage or starts training, times its
links to the swarm's servers (the slowest round trip ``rtt`` and the lowest rate ``r``, bytes/s) and sets

* ``matchmaking_time = 10 rtt``: forming a group takes a DHT lookup (two round trips at 150 ms, measured) and a
  join request, about five round trips, twice over (the window is waited out whenever a stage-mate is late, so
  it is kept short: :data:`MATCHMAKING_ROUND_TRIPS`);
* ``next_chunk_timeout = 3 (rtt + P / r)`` with ``P`` half the stage's state bytes: the largest part a peer of a
  group of two waits for (a state round's; a gradient round's parts are smaller);
* ``averaging_timeout = matchmaking_time + 3 (4 rtt + 2 S / r)`` with ``S`` the state bytes: a butterfly
  all-reduce moves about twice its vector through each peer's link (reduce-scatter, then all-gather);
* ``forward_s = backward_s = 3 (rtt + 2 A / r)`` with ``A`` a micro-batch's fp32 activations (request and
  reply), beside the server's compute, which :data:`FLOORS` covers;

each at least its :data:`FLOORS` value (on fast links a busy CPU's scheduling, not the wire, bounds these: the
floors are the values the demo ran with on 2 cores) and at most the spec's value, the *ceiling*. The run's first
server, with no other server to probe, has a round trip from its DHT peers and no rate; with no rate (also: older
servers answer no probe) the rate-bound timeouts take their ceilings, and with nothing measured all do. The
factor 3 is the margin TCP's retransmission timer keeps over a smoothed round trip (RFC 6298: SRTT + 4 RTTVAR,
about 3x on a steady link).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Optional

from swarm.config import RunSpec
from swarm.net.links import LinkMeasurement

MARGIN = 3.0
"""Times the expected duration a timeout allows (module docstring)."""
MATCHMAKING_ROUND_TRIPS = 10.0
"""Round trips ``matchmaking_time`` allows (module docstring): 1.5 s at 150 ms, so the floor's 2 s, the window the demo
always ran with at 20 Mbit/s and 150 ms. (On that WAN lab profile, ``bench/wan.py``, 150 s, one run each: 20 round
trips, a 3.1 s window, ran 958 and 985 tokens/s, the fixed 2 s 1055, and 10 again 841 with a failed round at a
joiner's arrival: within the runs' spread, no gain from the longer window.)"""
FLOORS = dict(matchmaking_time=2.0, averaging_timeout=20.0, next_chunk_timeout=10.0, forward_s=30.0, backward_s=30.0)
"""Least value of each derived timeout (seconds): what the demo ran with on 2 busy cores, where scheduling, not the
link, sets how long a round or a call may take."""


@dataclass(frozen=True)
class DerivedTimeouts:
    """A peer's timeouts (seconds), derived from ``link`` (None: nothing measured) within the spec's ceilings."""

    matchmaking_time: float
    averaging_timeout: float
    next_chunk_timeout: float
    forward_s: float
    backward_s: float
    link: Optional[LinkMeasurement]

    def apply(self, spec: RunSpec) -> RunSpec:
        """``spec`` with these timeouts in its ``[averaging]`` and ``[timeouts]`` sections: the spec this peer's
        own averagers, optimizer and calls run with (the run's, with its ceilings, stays the one it announces)."""
        return spec.model_copy(update=dict(
            averaging=spec.averaging.model_copy(update=dict(
                matchmaking_time=self.matchmaking_time, averaging_timeout=self.averaging_timeout,
                next_chunk_timeout=self.next_chunk_timeout)),
            timeouts=spec.timeouts.model_copy(update=dict(forward_s=self.forward_s, backward_s=self.backward_s))))

    def describe(self, *keys: str) -> str:
        """The fixed-key log line: the measurement, then each timeout (``key=seconds``; those named in ``keys``,
        default all: a trainer names only its calls')."""
        measured = self.link.describe() if self.link is not None else "round_trip_ms=none rate_MBps=none servers=0"
        values = {k: v for k, v in asdict(self).items() if k != "link" and (not keys or k in keys)}
        return f"timeouts from links {measured} " + " ".join(f"{k}={v:.1f}" for k, v in values.items())


def state_bytes(spec: RunSpec, parameters: int) -> int:
    """Bytes of a stage's averaged state (bytes): fp32 parameters and the optimizer statistics a state round
    averages (AdamW's two moments; in ``outer`` mode the outer optimizer's momentum, if it has one)."""
    avg = spec.averaging
    statistics = (1 if avg.outer_momentum > 0 else 0) if avg.mode == "outer" else 2
    return 4 * parameters * (1 + statistics)


def activation_bytes(spec: RunSpec) -> int:
    """Bytes of one micro-batch's hidden states in fp32 (bytes): a stage call's request or reply, uncompressed."""
    return 4 * spec.training.micro_batch_size * spec.data.seq_len * spec.model.d_model


def derive_timeouts(spec: RunSpec, link: Optional[LinkMeasurement], parameters: int = 0) -> DerivedTimeouts:
    """This peer's timeouts (module docstring) from ``link`` and its stage's ``parameters`` (a count; 0 for a
    trainer, whose averaging timeouts are unused), each between its :data:`FLOORS` value and the spec's (a spec
    value below the floor wins: it is the ceiling)."""
    avg, calls = spec.averaging, spec.timeouts
    ceilings = dict(matchmaking_time=avg.matchmaking_time, averaging_timeout=avg.averaging_timeout,
                    next_chunk_timeout=avg.next_chunk_timeout, forward_s=calls.forward_s, backward_s=calls.backward_s)
    if link is None:
        return DerivedTimeouts(**ceilings, link=None)
    rtt, rate, state = link.round_trip_s, link.rate, state_bytes(spec, parameters)
    wanted = dict(matchmaking_time=MATCHMAKING_ROUND_TRIPS * rtt)
    if rate is not None:
        wanted.update(next_chunk_timeout=MARGIN * (rtt + state / 2 / rate),
                      averaging_timeout=MARGIN * (4 * rtt + 2 * state / rate),
                      forward_s=MARGIN * (rtt + 2 * activation_bytes(spec) / rate))
        wanted["backward_s"] = wanted["forward_s"]

    def bounded(key: str) -> float:
        return min(ceilings[key], max(FLOORS[key], wanted[key])) if key in wanted else ceilings[key]
    matchmaking = bounded("matchmaking_time")
    if "averaging_timeout" in wanted:
        wanted["averaging_timeout"] += matchmaking
    return DerivedTimeouts(matchmaking_time=matchmaking, averaging_timeout=bounded("averaging_timeout"),
                           next_chunk_timeout=bounded("next_chunk_timeout"), forward_s=bounded("forward_s"),
                           backward_s=bounded("backward_s"), link=link)


__all__ = ["DerivedTimeouts", "FLOORS", "MARGIN", "MATCHMAKING_ROUND_TRIPS", "activation_bytes", "derive_timeouts",
           "state_bytes"]
