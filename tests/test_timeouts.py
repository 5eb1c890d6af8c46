"""Timeouts derived from measured links (swarm.net.timeouts): floors on fast links, longer on slow ones, never
above the spec's ceilings, and always a spec its peers could have loaded."""

from __future__ import annotations

import tomllib

import pytest
from hypothesis import given, settings, strategies as st

from swarm.config import AveragingSpec, RunSpec, TimeoutSpec
from swarm.model import build_stage
from swarm.net.links import LinkMeasurement
from swarm.net.timeouts import FLOORS, derive_timeouts, state_bytes
from tests.conftest import ROOT, TINY

DEMO = RunSpec.from_toml(ROOT / "runs" / "demo.toml")
KEYS = ("matchmaking_time", "averaging_timeout", "next_chunk_timeout", "forward_s", "backward_s")
LOOPBACK = LinkMeasurement(round_trip_s=0.0008, rate=2e9, servers=3)
HOME = LinkMeasurement(round_trip_s=0.152, rate=16.3e6 / 8, servers=3)  # the WAN lab's 20:150 as measured
STAGE0 = sum(p.numel() for p in build_stage(DEMO.model, 0).parameters())


def _values(derived) -> dict[str, float]:
    return {k: getattr(derived, k) for k in KEYS}


def _ceilings(spec: RunSpec) -> dict[str, float]:
    return {**{k: getattr(spec.averaging, k) for k in KEYS[:3]}, **{k: getattr(spec.timeouts, k) for k in KEYS[3:]}}


def test_the_demo_without_timeout_settings_takes_the_floors_on_loopback_and_more_on_a_home_link():
    raw = tomllib.loads((ROOT / "runs" / "demo.toml").read_text())
    assert not set(KEYS) & {*raw["averaging"], *raw["timeouts"]}, "the demo hand-tunes no timeout"
    fast, home = derive_timeouts(DEMO, LOOPBACK, STAGE0), derive_timeouts(DEMO, HOME, STAGE0)
    assert _values(fast) == FLOORS
    state = state_bytes(DEMO, STAGE0)  # fp32 parameters and AdamW's two moments
    assert state == 12 * STAGE0 and 15e6 < state < 30e6
    # a state round's part (half the state) three times over; the round
    assert home.matchmaking_time == FLOORS["matchmaking_time"]  # 10 round trips: 1.5 s
    assert home.next_chunk_timeout == pytest.approx(3 * (0.152 + state / 2 / HOME.rate))
    assert home.averaging_timeout == pytest.approx(home.matchmaking_time + 3 * (4 * 0.152 + 2 * state / HOME.rate))
    assert home.next_chunk_timeout > FLOORS["next_chunk_timeout"]
    assert home.averaging_timeout > 3 * FLOORS["averaging_timeout"], "the demo's old 20 s could not move a state round"
    assert home.forward_s == FLOORS["forward_s"], "a demo micro-batch's activations cross a home link in 0.2 s"
    assert all(home_v <= ceiling for home_v, ceiling in zip(_values(home).values(), _ceilings(DEMO).values()))


def test_a_spec_value_is_a_ceiling_even_below_the_floor_and_nothing_measured_takes_the_ceilings():
    assert _values(derive_timeouts(TINY, HOME, STAGE0)) == _ceilings(TINY)  # tiny.toml's values are below the floors
    assert _values(derive_timeouts(DEMO, None, STAGE0)) == _ceilings(DEMO)
    pinged_only = derive_timeouts(DEMO, LinkMeasurement(0.352, None, 2), STAGE0)  # older servers answer no probe
    assert pinged_only.matchmaking_time == pytest.approx(10 * 0.352)
    assert {k: v for k, v in _values(pinged_only).items() if k != "matchmaking_time"} == {
        k: v for k, v in _ceilings(DEMO).items() if k != "matchmaking_time"}


def test_applied_timeouts_change_only_the_peers_copy_and_say_what_was_measured():
    home = derive_timeouts(DEMO, HOME, STAGE0)
    local = home.apply(DEMO)
    assert _values(home) == _ceilings(local) and _ceilings(DEMO) != _ceilings(local)
    assert local.model_dump(exclude={"averaging", "timeouts"}) == DEMO.model_dump(exclude={"averaging", "timeouts"})
    RunSpec.model_validate(local.model_dump())  # what a peer could have loaded (averaging_timeout > matchmaking)
    line = home.describe()
    assert line.startswith("timeouts from links round_trip_ms=152.0 rate_MBps=2.04 servers=3 ")
    assert all(f" {k}=" in line for k in KEYS), line


@settings(max_examples=300, deadline=None)
@given(rtt=st.floats(0, 5), rate=st.one_of(st.none(), st.floats(1e3, 1e10)), parameters=st.integers(0, 10**9),
       matchmaking=st.floats(0.1, 60), averaging=st.floats(0.2, 3600), chunk=st.floats(0.1, 600),
       call=st.floats(0.1, 3600))
def test_derived_timeouts_stay_between_floor_and_ceiling_and_grow_as_links_slow(rtt, rate, parameters, matchmaking,
                                                                                 averaging, chunk, call):
    averaging = max(averaging, matchmaking * 1.01)
    spec = DEMO.model_copy(update=dict(
        averaging=AveragingSpec(**{**DEMO.averaging.model_dump(), "matchmaking_time": matchmaking,
                                   "averaging_timeout": averaging, "next_chunk_timeout": chunk}),
        timeouts=TimeoutSpec(**{**DEMO.timeouts.model_dump(), "forward_s": call, "backward_s": call})))
    link = LinkMeasurement(rtt, rate, 1)
    derived = _values(derive_timeouts(spec, link, parameters))
    for key, value in derived.items():
        assert min(FLOORS[key], _ceilings(spec)[key]) <= value <= _ceilings(spec)[key], key
    assert derived["averaging_timeout"] > derived["matchmaking_time"]
    slower = _values(derive_timeouts(spec, LinkMeasurement(2 * rtt, rate and rate / 2, 1), parameters))
    assert all(slower[k] >= derived[k] for k in KEYS), (derived, slower)
