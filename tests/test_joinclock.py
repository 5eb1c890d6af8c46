"""The join clock (swarm.server.joinclock): one fixed-key line whose phases add up to the join."""

import re
import time

import pytest

from swarm.server.joinclock import PHASES, JoinClock, process_age_s


def _parse(line: str) -> dict[str, float]:
    return {k: float(v) for k, v in re.findall(r"(\w+)_s=([\d.]+)", line)}


def test_the_line_names_every_phase_once_and_they_add_up_to_the_join():
    clock = JoinClock(first=False)
    clock.enter("connect")
    time.sleep(0.05)
    clock.enter("state")
    time.sleep(0.1)
    clock.enter("connect")  # a phase entered twice counts both spells
    time.sleep(0.05)
    figures = _parse(clock.line())
    assert list(figures) == ["joined", "start", *PHASES]
    assert figures["start"] == 0.0 and figures["setup"] == 0.0
    assert figures["connect"] >= 0.09 and figures["state"] >= 0.09
    assert figures["joined"] == pytest.approx(sum(v for k, v in figures.items() if k != "joined"), abs=0.02)


def test_a_first_join_counts_the_process_s_life_before_it():
    age = process_age_s()
    assert 0.0 < age < 24 * 3600  # this test's interpreter started a while ago, not never
    figures = _parse(JoinClock().line())
    assert figures["start"] >= age - 0.005 and figures["joined"] >= figures["start"]  # (the line rounds to 0.01 s)


def test_an_unknown_phase_is_refused_naming_the_known_ones():
    with pytest.raises(ValueError, match="unknown join phase 'download'.*connect"):
        JoinClock().enter("download")
