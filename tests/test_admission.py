"""Per-peer admission: requests in flight and the token bucket that meters each peer's request rate."""

import pytest

from swarm.net.admission import BUCKETS_KEPT, Busy, PeerAdmission, TooFast


def _admit(admission: PeerAdmission, peer: str, times: int = 1) -> None:
    for _ in range(times):
        with admission.admit(peer):
            pass


def test_the_bucket_refills_at_the_rate_and_never_beyond_the_burst():
    now = [100.0]
    admission = PeerAdmission(max_in_flight=8, rate_per_s=10.0, burst=5, clock=lambda: now[0])
    _admit(admission, "a", 5)
    with pytest.raises(TooFast, match=r"more than 10 requests/s of yours here; retry in 0\.10 s"):
        _admit(admission, "a")
    _admit(admission, "b")  # another peer has its own bucket
    now[0] += 0.25  # 2.5 tokens back
    _admit(admission, "a", 2)
    with pytest.raises(TooFast):
        _admit(admission, "a")
    now[0] += 3600  # idle for an hour: the burst, not 36000 tokens
    _admit(admission, "a", 5)
    with pytest.raises(TooFast):
        _admit(admission, "a")
    assert not admission.in_flight  # refused requests hold no slot


def test_in_flight_is_checked_before_the_rate_and_refusals_are_busy():
    admission = PeerAdmission(max_in_flight=1, rate_per_s=1.0, burst=2, clock=lambda: 0.0)
    with admission.admit("a"):
        with pytest.raises(Busy, match="already serves 1 requests"):
            with admission.admit("a"):
                pass
    _admit(admission, "a")  # the refused request took no token: one is left
    with pytest.raises(Busy, match="requests/s"):  # TooFast is a Busy: handlers that catch Busy refuse it too
        _admit(admission, "a")


def test_idle_peers_are_forgotten_beyond_the_kept_buckets():
    now = [0.0]
    admission = PeerAdmission(rate_per_s=1.0, burst=2, clock=lambda: now[0])
    for i in range(BUCKETS_KEPT):
        _admit(admission, f"idle{i}")
    now[0] += 10  # every bucket refilled
    _admit(admission, "busy")
    _admit(admission, "new")
    assert set(admission._buckets) == {"busy", "new"}


@pytest.mark.parametrize("kwargs", [dict(max_in_flight=0), dict(rate_per_s=0.0), dict(burst=0.5)])
def test_bounds_below_one_are_refused(kwargs):
    with pytest.raises(ValueError):
        PeerAdmission(**kwargs)
