"""Catching up (swarm.averaging.catchup): when a server behind its stage is catching up, and that its server hears
of every change at once."""

from __future__ import annotations

from swarm.averaging.catchup import CatchUp


def test_a_load_that_kept_nothing_behind_the_stage_starts_catching_up_until_a_load_is_kept():
    changes: list[bool] = []
    c = CatchUp(retry_s=60.0)
    c.on_change = lambda: changes.append(c.active)
    c.loaded(True, 3, 5)  # kept a state, still behind: hivemind's next load follows at once
    assert not c.active and not c.load_due()
    c.loaded(False, 5, 5)  # kept nothing, but hivemind moved it to the stage's epoch: not behind
    assert not c.active
    c.loaded(False, 3, 5)
    assert c.active and c.behind(3, 5) and not c.load_due()
    c.loaded(False, 3, 6)  # still nothing: no second change
    c.loaded(True, 6, 6)
    assert not c.active and changes == [True, False]


def test_catching_up_ends_once_the_stage_no_longer_leads():
    changes: list[bool] = []
    c = CatchUp(retry_s=0.0, on_change=lambda: changes.append(c.active))
    c.loaded(False, 2, 9)
    assert c.behind(2, 9) and c.load_due()
    assert not c.behind(2, 2)  # the stage's servers fell back (or left): nothing to catch up with
    assert changes == [True, False]
