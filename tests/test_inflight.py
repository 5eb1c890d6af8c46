"""The trainer's micro-batches in flight: GAIN times the pipeline's bandwidth-delay product, its best rate times its
least micro-batch latency, each over a window of periods, as BBR sizes a TCP flow (swarm.trainer.inflight)."""

from __future__ import annotations

from swarm.trainer.inflight import (FULL_PIPE_PERIODS, LATENCY_WINDOW, MOST_IN_FLIGHT, RATE_WINDOW, STARTUP_EVERY_S,
                                    TUNE_EVERY_S, InFlight, in_flight_target)


def test_the_target_is_gain_times_the_bandwidth_delay_product_within_the_base_and_the_cap():
    # loopback: 3.4 micro-batches/s at 0.36 s each: 1.22 in flight, x GAIN 4 -> 4.9 -> 5
    assert in_flight_target(2, 3.4, 0.36) == 5
    # 20 Mbit/s, 150 ms: 2.2/s at 0.9 s (0.37 s of compute, the rest outside the servers): 7.9 -> 8
    assert in_flight_target(2, 2.2, 0.9) == 8
    assert in_flight_target(2, 2.2, 0.9, gain=2.0) == 4  # BBR's gain
    # the base is never lowered, even above the cap
    assert in_flight_target(2, 0.25, 0.4) == 2 and in_flight_target(40, 100.0, 2.0) == 40
    # a long, fast pipeline is capped
    assert in_flight_target(2, 100.0, 2.0) == MOST_IN_FLIGHT
    # nonsense measurements (negative) add nothing
    assert in_flight_target(2, -1.0, 5.0) == 2 and in_flight_target(2, 5.0, -0.1) == 2


def test_the_target_grows_while_the_rate_follows_and_stays_once_the_servers_set_the_rate():
    tuning = InFlight(base=2, stages=2, gain=2.0)  # (BBR's gain: the arithmetic below)
    assert tuning.update(0, now=0.0) is None  # the first call only starts the count
    # a far pipeline: 2 in flight, 1 s a micro-batch -> 2/s; twice the product: 4
    for _ in range(20):
        tuning.observe(1.0)
    assert tuning.update(20, now=10.0) == 4 and tuning.rate == 2.0 and tuning.latency_s == 1.0
    # the rate followed (4/s, nothing queued: still 1 s each) -> 8
    for _ in range(40):
        tuning.observe(1.0)
    assert tuning.update(60, now=20.0) == 8
    # the servers are now the bottleneck: 5/s, and every micro-batch waits in their queues (1.6-2 s): the least
    # latency of the window is still the unloaded 1 s, so twice 5 -> 10, and there it stays
    for period in range(3, 3 + RATE_WINDOW + 4):
        for _ in range(50):
            tuning.observe(1.6 if period == 3 else 2.0)
        assert tuning.update(60 + 50 * (period - 2), now=10.0 * period) == (10 if period == 3 else None)
    assert tuning.target == 10 and tuning.latency_s == 1.0


def test_a_stall_changes_nothing_and_old_measurements_leave_their_windows():
    tuning = InFlight(base=2, stages=2, gain=2.0)  # (BBR's gain: the arithmetic below)
    tuning.update(0, now=0.0)
    tuning.observe(0.5)
    assert tuning.update(60, now=10.0) == 6  # 6/s x 0.5 s x 2
    assert tuning.update(60, now=20.0) is None  # nothing finished for 10 s (every server between epochs)
    assert tuning.target == 6
    # a server gone: 1/s from now on; the fast period leaves the rate's window after RATE_WINDOW periods
    # (1/s x 0.5 s x 2 = 1: the base, 2)
    targets, finished = [], 60
    for period in range(RATE_WINDOW):
        tuning.observe(0.5)
        finished += 10
        targets.append(tuning.update(finished, now=30.0 + 10 * period))
    assert targets == [None] * (RATE_WINDOW - 1) + [2] and tuning.rate == 1.0
    # the route moved to slower servers: 2 s a micro-batch at 3/s; the 0.5 s leave the latency's window after
    # LATENCY_WINDOW periods of their own (the target rises from 2 x 3 x 0.5 = 3 to 2 x 3 x 2 = 12)
    now, targets = 30.0 + 10 * RATE_WINDOW, []
    for period in range(LATENCY_WINDOW):
        tuning.observe(2.0)
        finished += 30
        targets.append(tuning.update(finished, now=now + 10 * period))
    assert targets[0] == 3 and targets[-1] == 12 and set(targets[1:-1]) == {None}
    # a period with no micro-batch timed (all dropped, say) changes nothing either
    assert tuning.update(finished + 10, now=now + 10 * LATENCY_WINDOW) is None and tuning.target == 12


def test_the_target_is_never_below_what_the_pings_round_trips_ask_for():
    # a busy machine: one lucky micro-batch took 0.1 s, the rest ~1 s at 2 in flight -> 2/s; the product says
    # 4 x 2 x 0.1 = 0.8 (the base, 2); 3 calls of 150 ms at 2/s ask for 2 + ceil(0.9 - 0.1) = 3
    tuning = InFlight(base=2, stages=2)
    tuning.update(0, 0.15, now=0.0)
    tuning.observe(0.1)
    assert tuning.update(20, 0.15, now=10.0) == 3
    tuning.observe(0.1)
    assert tuning.update(40, None, now=20.0) == 2  # no server answered a ping: the product alone


def test_startup_tunes_every_few_seconds_until_three_periods_without_25_percent_more_rate():
    """BBR's STARTUP and its full-bandwidth detection: short periods while the rate grows by 25% a period; the
    third period in a row below that ends it. A rate that grows again restarts the count; a stall counts nothing."""
    tuning = InFlight(base=2, stages=2)
    assert tuning.starting and tuning.period_s == STARTUP_EVERY_S
    tuning.update(0, now=0.0)
    clock = {"finished": 0, "now": 0.0}

    def period(micro_batches: int) -> None:
        clock["finished"] += micro_batches
        clock["now"] += STARTUP_EVERY_S
        tuning.observe(0.5)
        tuning.update(clock["finished"], now=clock["now"])

    for micro_batches in (3, 5, 8, 9, 9):  # 1.2, 2.0, 3.2/s (each 25% more), then 3.6 and 3.6 (< 4.0): two flat
        period(micro_batches)
    assert tuning.starting
    clock["now"] += STARTUP_EVERY_S
    assert tuning.update(clock["finished"], now=clock["now"]) is None and tuning.starting  # a stall
    period(12)  # 4.8/s: 25% more than 3.2 again, the count restarts
    period(12)
    period(12)
    assert tuning.starting and tuning.period_s == STARTUP_EVERY_S
    period(12)  # the third flat period in a row: the pipe is full
    assert not tuning.starting and tuning.period_s == TUNE_EVERY_S
    period(100)  # and startup does not come back
    assert not tuning.starting and FULL_PIPE_PERIODS == 3
