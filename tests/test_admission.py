"""Per-peer admission: requests in flight and the token bucket that meters each peer's request rate."""

import pytest

from swarm.admission import BUCKETS_KEPT, Busy, PeerAdmission, TooFast


def test_the_bucket_refills_at_the_rate_and_never_beyond_the_burst():
    now = [100.0]
    admission = PeerAdmission(max_in_flight=8, rate_per_s=10.0, burst=5, clock=lambda: now[0])
    for _ in range(5):
        with admission.admit("a"):
            pass
    with pytest.raises(TooFast, match=r"more than 10 requests/s of yours here; retry in 0\.10 s"):
        with admission.admit("a"):
            pass
    with admission.admit("b"):  # another peer has its own bucket
        pass
    now[0] += 0.25  # 2.5 tokens back
    for _ in range(2):
        with admission.admit("a"):
            pass
    with pytest.raises(TooFast):
        with admission.admit("a"):
            pass
    now[0] += 3600  # idle for an hour: the burst, not 36000 tokens
    for _ in range(5):
        with admission.admit("a"):
            pass
    with pytest.raises(TooFast):
        with admission.admit("a"):
            pass
    assert not admission.in_flight  # refused requests hold no slot


def test_in_flight_is_checked_before_the_rate_and_refusals_are_busy():
    admission = PeerAdmission(max_in_flight=1, rate_per_s=1.0, burst=2, clock=lambda: 0.0)
    with admission.admit("a"):
        with pytest.raises(Busy, match="already serves 1 requests"):
            with admission.admit("a"):
                pass
    with admission.admit("a"):  # the refused request took no token: one is left
        pass
    with pytest.raises(Busy, match="requests/s"):  # TooFast is a Busy: handlers that catch Busy refuse it too
        with admission.admit("a"):
            pass


def test_idle_peers_are_forgotten_beyond_the_kept_buckets():
    now = [0.0]
    admission = PeerAdmission(rate_per_s=1.0, burst=2, clock=lambda: now[0])
    for i in range(BUCKETS_KEPT):
        with admission.admit(f"idle{i}"):
            pass
    now[0] += 10  # every bucket refilled
    with admission.admit("busy"):
        pass
    with admission.admit("new"):
        pass
    assert set(admission._buckets) == {"busy", "new"}


@pytest.mark.parametrize("kwargs", [dict(max_in_flight=0), dict(rate_per_s=0.0), dict(burst=0.5)])
def test_bounds_below_one_are_refused(kwargs):
    with pytest.raises(ValueError):
        PeerAdmission(**kwargs)
