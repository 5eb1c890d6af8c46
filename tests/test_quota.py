"""Per-peer quotas: requests in flight and the token bucket that meters each peer's request rate."""

import pytest

from swarm.net.quota import BUCKETS_KEPT, Busy, PeerQuota, TooFast


def _hold(quota: PeerQuota, peer: str, times: int = 1) -> None:
    for _ in range(times):
        with quota.hold(peer):
            pass


def test_the_bucket_refills_at_the_rate_and_never_beyond_the_burst():
    now = [100.0]
    quota = PeerQuota(max_in_flight=8, rate_per_s=10.0, burst=5, clock=lambda: now[0])
    _hold(quota, "a", 5)
    with pytest.raises(TooFast, match=r"more than 10 requests/s of yours here; retry in 0\.10 s"):
        _hold(quota, "a")
    _hold(quota, "b")  # another peer has its own bucket
    now[0] += 0.25  # 2.5 tokens back
    _hold(quota, "a", 2)
    with pytest.raises(TooFast):
        _hold(quota, "a")
    now[0] += 3600  # idle for an hour: the burst, not 36000 tokens
    _hold(quota, "a", 5)
    with pytest.raises(TooFast):
        _hold(quota, "a")
    assert not quota.in_flight  # refused requests hold no slot


def test_in_flight_is_checked_before_the_rate_and_refusals_are_busy():
    quota = PeerQuota(max_in_flight=1, rate_per_s=1.0, burst=2, clock=lambda: 0.0)
    with quota.hold("a"):
        with pytest.raises(Busy, match="already serves 1 requests"):
            with quota.hold("a"):
                pass
    _hold(quota, "a")  # the refused request took no token: one is left
    with pytest.raises(Busy, match="requests/s"):  # TooFast is a Busy: handlers that catch Busy refuse it too
        _hold(quota, "a")


def test_idle_peers_are_forgotten_beyond_the_kept_buckets():
    now = [0.0]
    quota = PeerQuota(rate_per_s=1.0, burst=2, clock=lambda: now[0])
    for i in range(BUCKETS_KEPT):
        _hold(quota, f"idle{i}")
    now[0] += 10  # every bucket refilled
    _hold(quota, "busy")
    _hold(quota, "new")
    assert set(quota._buckets) == {"busy", "new"}


@pytest.mark.parametrize("kwargs", [dict(max_in_flight=0), dict(rate_per_s=0.0), dict(burst=0.5)])
def test_bounds_below_one_are_refused(kwargs):
    with pytest.raises(ValueError):
        PeerQuota(**kwargs)
