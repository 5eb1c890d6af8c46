"""The trainer's micro-batches in flight cover its round trips (swarm.trainer.inflight): Little's law, bounded."""

from __future__ import annotations

from swarm.trainer.inflight import MOST_IN_FLIGHT, InFlight, in_flight_target


def test_the_target_covers_the_round_trips_at_the_rate_seen():
    # 2 stages: 3 calls per micro-batch; 50 ms each at 4 micro-batches/s is 0.6 micro-batches more: one more
    assert in_flight_target(2, 3, 0.050, 4.0) == 3
    # 150 ms at 4/s: 1.8 more -> 2 more; 20 ms at 1.5/s: 0.09 more -> none (forgiven), 0.3 -> one
    assert in_flight_target(2, 3, 0.020, 1.5) == 2 and in_flight_target(2, 3, 0.067, 1.5) == 3
    assert in_flight_target(2, 3, 0.150, 4.0) == 4
    # loopback: nothing more
    assert in_flight_target(2, 3, 0.001, 4.0) == 2  # 0.012 more: none
    assert in_flight_target(2, 3, 0.0, 4.0) == 2
    # a long, fast link is capped; the base is never lowered, even above the cap
    assert in_flight_target(2, 3, 2.0, 100.0) == MOST_IN_FLIGHT
    assert in_flight_target(40, 3, 2.0, 100.0) == 40
    # nonsense measurements (negative) add nothing
    assert in_flight_target(2, 3, -1.0, 5.0) == 2 and in_flight_target(2, 3, 0.1, -5.0) == 2


def test_in_flight_follows_the_rate_and_round_trip_and_reports_only_changes():
    tuning = InFlight(base=2, stages=2)
    assert tuning.update(0, 0.05, now=0.0) is None  # the first call only starts the count
    assert tuning.update(40, 0.05, now=10.0) == 3  # 4/s x 3 calls x 50 ms = 0.6 -> 3
    assert tuning.rate == 4.0 and tuning.round_trip_s == 0.05
    assert tuning.update(80, 0.05, now=20.0) is None  # unchanged
    assert tuning.update(120, 0.15, now=30.0) == 4  # a longer round trip: more in flight
    assert tuning.update(120, None, now=40.0) is None  # no server answered a ping: keep the target
    assert tuning.target == 4
    assert tuning.update(120, 0.15, now=50.0) is None  # nothing finished for 10 s: a stall, the target stays
    assert tuning.update(126, 0.15, now=60.0) == 3  # 0.6/s: 0.27 more -> one more
    assert tuning.update(127, 0.15, now=70.0) == 2  # 0.1/s: 0.045 more -> none
