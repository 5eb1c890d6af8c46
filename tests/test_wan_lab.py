"""The WAN lab (bench/wanlab): its links have the round trip and rate asked for, and it leaves nothing behind,
also when the process that made it fails, is interrupted or is killed."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from bench.wanlab import Lab, LabError, Profile, leftovers, sweep
from tests.conftest import ROOT

WHY = Lab.unavailable()
"""Why this machine cannot run a WAN lab (None if it can)."""
pytestmark = pytest.mark.skipif(bool(WHY), reason=str(WHY))

HOLDER = """
import signal, sys, time
signal.signal(signal.SIGINT, signal.default_int_handler)  # (a pytest process that ran averagers ignores SIGINT)
sys.path.insert(0, {root!r})
from bench.wanlab import Lab, Profile
with Lab(["a", "b"], Profile("t", rtt_ms=20, mbit=50)) as lab:
    sleeper = __import__("subprocess").Popen([*lab.prefix("a"), "sleep", "600"])
    print("ready", flush=True)
    time.sleep(600)
"""


def _wait_clean(timeout: float = 20.0) -> list[str]:
    deadline = time.monotonic() + timeout
    while (left := leftovers()) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


@pytest.fixture(autouse=True)
def clean_machine():
    sweep()
    assert _wait_clean() == [], "a lab of an earlier run is still on this machine"
    yield
    left = _wait_clean()
    sweep()  # leave the machine clean even when the test failed (a holder that died holding its lab)
    assert left == [], "the test left a lab behind"


def test_links_have_the_round_trip_and_rate_asked_for_and_traffic_is_counted():
    with Lab(["a", "b", "c"], Profile("t", rtt_ms=40, mbit=20)) as lab:
        ab = lab.measure("a", "b", seconds=2.0)
        ca = lab.measure("c", "a", seconds=2.0)
        deadline = time.monotonic() + 10  # the switch writes its counters every half second
        while (traffic := lab.traffic()).get(("c", "a"), 0) < ca["bytes"] and time.monotonic() < deadline:
            time.sleep(0.1)
        prefixes = [lab.prefix(h)[-1] for h in ("a", "b", "c")]
        assert len(set(prefixes)) == 3 and len({lab.ip(h) for h in ("a", "b", "c")}) == 3
    for figures in (ab, ca):
        assert 40 <= figures["rtt_ms"] < 120, figures  # the switch adds 20 ms each way; never less
        assert 2 <= figures["mbit"] <= 20 * 1.05, figures  # tbf caps the upload at 20 Mbit/s
    assert traffic[("a", "b")] >= ab["bytes"] and traffic[("c", "a")] >= ca["bytes"], traffic
    assert traffic.get(("b", "c"), 0) < 10_000, traffic  # b and c never talked


def test_a_mixed_lab_gives_each_host_its_own_link():
    """Host b on a slow, far link among hosts on a fast, near one (bench/wan.py's mixed profile): a pair with b
    sees the mean of the two round trips and b's rate; a pair without b, the lab's link."""
    slow = Profile("slow", rtt_ms=100, mbit=5)
    with Lab(["a", "b", "c"], Profile("t", rtt_ms=20, mbit=40), overrides={"b": slow}) as lab:
        assert lab.link("b") == slow and lab.link("a").mbit == 40
        to_slow = lab.measure("a", "b", seconds=2.0)
        from_slow = lab.measure("b", "c", seconds=2.0)
        fast = lab.measure("c", "a", seconds=2.0)
    for figures in (to_slow, from_slow):
        assert 60 <= figures["rtt_ms"] < 140, figures  # (20 + 100) / 2 ms, never less
        assert 1 <= figures["mbit"] <= 5 * 1.05, figures  # b's download (switch) and upload (tbf) rate
    assert 20 <= fast["rtt_ms"] < 60 and 8 <= fast["mbit"] <= 40 * 1.05, fast
    with pytest.raises(LabError, match="does not have.*nobody"):
        Lab(["a"], Profile("t"), overrides={"nobody": slow}).start()


def test_an_address_no_host_holds_times_out_and_a_failed_block_cleans_up():
    with pytest.raises(RuntimeError, match="boom"):
        with Lab(["a", "b"], Profile("t")) as lab:
            dial = "import socket; socket.create_connection(('10.213.0.200', 5201), timeout=2)"
            done = subprocess.run([*lab.prefix("a"), sys.executable, "-c", dial], capture_output=True, text=True,
                                  timeout=60)
            assert "timed out" in done.stderr  # no host there: nothing answers, nothing crashes
            raise RuntimeError("boom")
    with pytest.raises(ValueError):
        Lab(["a"], Profile("t")).ip("nobody")


def test_ctrl_c_and_sigkill_of_the_lab_owner_leave_nothing():
    for sig in (signal.SIGINT, signal.SIGKILL):
        holder = subprocess.Popen([sys.executable, "-c", HOLDER.format(root=str(ROOT))], stdout=subprocess.PIPE,
                                  text=True)
        try:
            assert holder.stdout.readline().strip() == "ready"
            assert any(x.startswith("namespace") for x in leftovers())
            holder.send_signal(sig)
            holder.wait(30)
        finally:
            holder.kill()
            holder.wait()
        if sig == signal.SIGKILL:  # no chance to clean up: the next lab (or sweep) removes what is left
            sweep()
        assert _wait_clean() == [], f"after {sig.name}"


def test_a_lab_refuses_a_subnet_in_use():
    with Lab(["a"], Profile("t")):
        with pytest.raises(LabError, match="already routed"):
            Lab(["b"], Profile("t")).start()
