"""The on-disk fragment store: verified reads, budget, retention, restarts."""

import os
import time

import pytest

from swarm.checkpoint.erasure import FragmentError, split_into_fragments
from swarm.checkpoint.store import FragmentStore, StoreFull


def _fragments(seed=0, size=10_000):
    import random
    rng = random.Random(seed)
    return split_into_fragments(bytes(rng.getrandbits(8) for _ in range(size)), 2, 4)


def test_put_get_and_survive_a_restart(tmp_path):
    store = FragmentStore(tmp_path, max_bytes=1 << 20)
    frags = _fragments()
    for f in frags[:2]:
        store.put("run-x", 1, 5, f)
    again = FragmentStore(tmp_path, max_bytes=1 << 20)  # a restarted peer finds and re-announces them
    held = list(again.held())
    assert [(h.run_id, h.stage, h.epoch, h.index) for h in held] == [("run-x", 1, 5, 0), ("run-x", 1, 5, 1)]
    assert again.get("run-x", 1, 5, 1) == frags[1]
    with pytest.raises(FileNotFoundError):
        again.get("run-x", 1, 5, 3)


def test_corrupt_files_are_detected_and_dropped(tmp_path):
    store = FragmentStore(tmp_path, max_bytes=1 << 20)
    f = _fragments()[0]
    store.put("run-x", 0, 1, f)
    path = tmp_path / "run-x" / "stage0" / "epoch1" / "0.frag"
    path.write_bytes(b"\0" + path.read_bytes()[1:])
    with pytest.raises(FragmentError, match="fragment 0 does not match"):
        store.get("run-x", 0, 1, 0)
    assert not path.exists()


def test_budget_and_retention(tmp_path):
    frags = _fragments()
    store = FragmentStore(tmp_path, max_bytes=len(frags[0].data) * 2, keep_epochs=2)
    store.put("run-x", 0, 1, frags[0])
    store.put("run-x", 0, 2, frags[0])
    store.put("run-x", 0, 3, frags[0])  # epoch 1 is collected first: the budget holds
    assert sorted(h.epoch for h in store.held()) == [2, 3]
    with pytest.raises(StoreFull, match="SWARM_FRAGMENT_MAX_BYTES"):
        store.put("run-x", 0, 3, frags[1])
    with pytest.raises(ValueError, match="bad run id"):
        store.put("../etc", 0, 1, frags[0])


def test_retention_never_drops_a_committed_checkpoint_for_uncommitted_ones(tmp_path):
    frags = _fragments()
    store = FragmentStore(tmp_path, max_bytes=1 << 20, keep_epochs=1)
    store.put("run-x", 0, 10, frags[0])
    store.save_manifest("run-x", 0, 10, b"sealed-10")
    store.put("run-x", 0, 20, frags[0])  # a writer died before committing epoch 20
    store.put("run-x", 0, 30, frags[0])  # ... and 30 is being written: 20 goes, committed 10 stays
    assert sorted(h.epoch for h in store.held()) == [10, 30]
    store.save_manifest("run-x", 0, 30, b"sealed-30")
    assert store.collect("run-x", 0) == [10]
    assert [(s, e, m) for s, e, m in store.committed("run-x")] == [(0, 30, b"sealed-30")]
    with pytest.raises(FileNotFoundError):
        store.save_manifest("run-x", 0, 40, b"sealed-40")


def test_a_checkpoint_pushed_out_recently_stays_while_the_budget_allows(tmp_path):
    frags = _fragments()
    store = FragmentStore(tmp_path, max_bytes=len(frags[0].data) * 2, keep_epochs=1, grace_s=60)
    for epoch in (10, 20):
        store.put("run-x", 0, epoch, frags[0])
        store.save_manifest("run-x", 0, epoch, b"sealed")
    # epoch 10 left the newest keep_epochs a moment ago: a server may be restoring it (or rolling back to it)
    assert store.collect("run-x", 0) == []
    store.put("run-x", 0, 30, frags[0])  # over budget with the grace: epoch 10 goes after all
    assert sorted(h.epoch for h in store.held()) == [20, 30]
    store.save_manifest("run-x", 0, 30, b"sealed")
    assert store.collect("run-x", 0) == []
    long_ago = time.time() - 61  # epoch 30 was committed here more than grace_s ago: 20's grace is over
    os.utime(tmp_path / "run-x" / "stage0" / "epoch30" / "manifest.bin", (long_ago, long_ago))
    assert store.collect("run-x", 0) == [20]


def test_a_putters_junk_displaces_only_its_own_uncommitted_epochs_and_expires(tmp_path):
    """A stage server placing fragments for epochs nobody will commit (10**9, 10**9 + 1) must not push out
    another writer's checkpoint in progress (the newest uncommitted epochs used to win), and its junk goes
    after ``pending_s``."""
    frags = _fragments()
    store = FragmentStore(tmp_path, max_bytes=1 << 20, keep_epochs=1, pending_s=600)
    store.put("run-x", 0, 40, frags[0], putter="honest")  # a checkpoint being written
    store.put("run-x", 0, 10**9, frags[0], putter="liar")
    store.put("run-x", 0, 10**9 + 1, frags[0], putter="liar")  # the liar's older junk epoch goes
    assert sorted(h.epoch for h in store.held()) == [40, 10**9 + 1]
    store.put("run-x", 0, 40, frags[1], putter="honest")  # its next fragment: epoch 40 is still there
    store.save_manifest("run-x", 0, 40, b"sealed-40")
    assert sorted((h.epoch, h.index) for h in store.held()) == [(40, 0), (40, 1), (10**9 + 1, 0)]
    long_ago = time.time() - 601
    os.utime(tmp_path / "run-x" / "stage0" / f"epoch{10**9 + 1}", (long_ago, long_ago))
    assert store.collect("run-x", 0) == [10**9 + 1], "junk nobody committed within pending_s is collected"
    assert {h.epoch for h in store.held()} == {40}


def test_one_putters_uncommitted_fragments_take_at_most_its_share_of_the_budget(tmp_path):
    """A stage server filling a holder with fragments of one uncommitted epoch (every index of it, or many
    stages) stops at a quarter of the budget; the others' puts and committed checkpoints still fit."""
    frags = _fragments(size=40_000)  # 4 fragments of 20 kB
    store = FragmentStore(tmp_path, max_bytes=100_000, keep_epochs=2)
    store.put("run-x", 0, 7, frags[0], putter="filler")
    with pytest.raises(StoreFull, match="filler's fragments of uncommitted checkpoints .* share of 25000"):
        store.put("run-x", 0, 7, frags[1], putter="filler")
    with pytest.raises(StoreFull, match="share"):
        store.put("run-x", 1, 7, frags[1], putter="filler")  # another stage: the same putter's share
    store.put("run-x", 0, 8, frags[0], putter="writer")  # another putter has its own share
    store.save_manifest("run-x", 0, 7, b"sealed-7")  # committed: no longer counted against the filler
    store.put("run-x", 0, 7, frags[1], putter="filler")
    assert store.pending_bytes("filler") == 0 and store.pending_bytes("writer") == 20_000


def test_listing_survives_epoch_folders_deleted_while_it_reads(tmp_path):
    # retention (this peer's or a put's collect) deletes epoch folders while the keeper lists what it holds;
    # pathlib's glob raised FileNotFoundError on a folder gone between listing its parent and reading it
    import shutil
    import threading

    store = FragmentStore(tmp_path, max_bytes=1 << 30)
    stop = threading.Event()

    def churn():
        i = 0
        while not stop.is_set():
            folder = tmp_path / "run" / "stage1" / f"epoch{i % 5}"
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "0.frag").write_bytes(b"x")
            shutil.rmtree(folder, ignore_errors=True)
            i += 1

    thread = threading.Thread(target=churn, daemon=True)
    thread.start()
    try:
        for _ in range(1500):
            list(store.held())
            list(store.committed("run"))
            store.collect("run", 1)
    finally:
        stop.set()
        thread.join(timeout=10)
    assert not thread.is_alive()
