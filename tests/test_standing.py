"""swarm.trust.standing: verified work per key, decaying, as the weight of a key's word."""

import pytest

from swarm.trust.standing import MAX_KEYS, Standing


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_standing_grows_with_verified_work_halves_each_half_life_and_caps_at_one_vote():
    clock = Clock()
    standing = Standing(half_life_s=100.0, full=4.0, clock=clock)
    assert standing.weight("new") == 0.0  # a new key has no voice
    for _ in range(2):
        standing.credit("k")
    assert standing.standing("k") == pytest.approx(2.0) and standing.weight("k") == pytest.approx(0.5)
    clock.now = 100.0  # one half-life
    assert standing.standing("k") == pytest.approx(1.0)
    for _ in range(20):
        standing.credit("k")
    assert standing.weight("k") == 1.0  # at most one vote, however much work
    clock.now = 100.0 + 100.0 * 10  # ten half-lives without work: the voice fades
    assert standing.weight("k") < 0.01


def test_a_revoked_key_loses_its_standing_for_good_and_bad_units_are_refused():
    standing = Standing(full=1.0, clock=Clock())
    standing.credit("k", 5.0)
    standing.revoke("k")
    standing.credit("k", 5.0)
    assert standing.weight("k") == 0.0
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError):
            standing.credit("other", bad)
    with pytest.raises(ValueError):
        Standing(half_life_s=0.0)


def test_many_keys_are_bounded_the_least_recently_credited_forgotten_first():
    standing = Standing(clock=Clock())
    for i in range(MAX_KEYS + 10):
        standing.credit(f"k{i}")
    assert standing.standing("k0") == 0.0 and standing.standing(f"k{MAX_KEYS + 9}") == 1.0


def test_an_excluded_key_starts_again_from_zero_and_the_heaviest_keys_are_listed():
    now = [0.0]
    book = Standing(half_life_s=3600.0, full=4.0, clock=lambda: now[0])
    for key, units in (("a", 8.0), ("b", 2.0), ("c", 1.0)):
        book.credit(key, units)
    assert book.heaviest(2) == {"a": 1.0, "b": 0.5}
    assert book.heaviest(5, keys=["c", "unknown"]) == {"c": 0.25}
    book.reset("a")  # excluded from averaging: its work is judged anew, and it can earn standing back
    assert book.weight("a") == 0.0 and "a" not in book.heaviest(5)
    book.credit("a", 2.0)
    assert book.weight("a") == 0.5


def test_standing_is_kept_across_a_restart_decayed_by_the_time_down(tmp_path, monkeypatch, caplog):
    """(Standing.save, load, keep) A server's standing survives a restart: a new Standing on the same path holds the
    same weights, less what they decayed while the peer was down (wall clock); revoked keys stay revoked; a file
    it cannot read is logged and the standing starts anew; a save that fails is logged once."""
    import time

    path = tmp_path / "state" / "standing-run.json"
    clock = [0.0]
    before = Standing(half_life_s=100.0, full=8.0, clock=lambda: clock[0], path=path)
    before.credit("mate", 8.0)
    before.credit("half", 4.0)
    before.revoke("liar")
    before.keep()
    assert path.exists() and not before.changed
    wall = time.time()
    monkeypatch.setattr(time, "time", lambda: wall + 100.0)  # down one half-life
    after = Standing(half_life_s=100.0, full=8.0, clock=lambda: 5.0, path=path)
    assert after.weight("mate") == pytest.approx(0.5, rel=1e-3) and after.weight("half") == pytest.approx(0.25, rel=1e-3)
    after.credit("liar", 8.0)
    assert after.weight("liar") == 0.0  # revoked for good

    path.write_text("{not json")
    with caplog.at_level("WARNING"):
        fresh = Standing(path=path)
    assert fresh.weight("mate") == 0.0 and "starts anew" in caplog.text and "delete it" in caplog.text

    blocked = tmp_path / "a file, not a folder"
    blocked.write_text("")
    unwritable = Standing(path=blocked / "standing.json")
    caplog.clear()
    with caplog.at_level("WARNING"):
        for _ in range(3):
            unwritable.credit("mate")
            unwritable.keep()
    assert caplog.text.count("could not keep this peer's standing") == 1 and unwritable.weight("mate") > 0
