"""The stage optimizer seam over real hivemind averagers (two servers of one stage, DHT and p2pd on loopback)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from typing import Iterator

import pytest
import torch

from swarm.averaging.optimizer import StageOptimizer
from swarm.model import build_stage
from tests.conftest import TINY, keyed_dhts

MICRO_BATCHES = TINY.training.target_batch_size // TINY.training.micro_batch_size  # per epoch


def _gradients(module: torch.nn.Module, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [0.01 * torch.randn(p.shape, generator=gen) for p in module.parameters()]


def _statistics(optimizer: StageOptimizer) -> dict[tuple[int, str], torch.Tensor]:
    """The optimizer's own state tensors, the very ones hivemind's state averager averages (shared memory)."""
    opt = optimizer._opt.opt
    params = [p for group in opt.param_groups for p in group["params"]]
    return {(i, key): t for i, p in enumerate(params) for key, t in opt.state[p].items()}


@contextlib.contextmanager
def _two_servers(run: str, spec=TINY) -> Iterator[tuple[StageOptimizer, StageOptimizer]]:
    """Two servers of stage 0 of run ``run`` (of ``spec``), each with its DHT node; shut down on exit."""
    (first_key, first), (second_key, second) = keyed_dhts(2)
    optimizers = []
    try:
        for key, node in ((first_key, first), (second_key, second)):
            optimizers.append(StageOptimizer(spec, run, 0, node, build_stage(spec.model, 0), identity=key))
        yield optimizers[0], optimizers[1]
    finally:
        for o in optimizers:
            o.shutdown()
        second.shutdown()
        first.shutdown()


def _differing(a: StageOptimizer, b: StageOptimizer) -> list[str]:
    """The names of the state tensors (:meth:`StageOptimizer.state`) that differ between ``a`` and ``b``."""
    mine, theirs = a.state(), b.state()
    return sorted(k for k in theirs if not torch.equal(mine[k], theirs[k]))


@pytest.mark.timeout(180)
def test_a_server_out_of_sync_loads_the_stages_state_into_the_tensors_that_are_averaged():
    """The second server joins two epochs late: a micro-batch finds it out of sync and it loads the stage's state
    inside ``step`` (hivemind ``load_state_from_peers``, which replaces the optimizer's state tensors). The loaded
    values must land in the original tensors, or its Adam moments are never averaged with the stage again."""
    (first_key, first), (second_key, second) = keyed_dhts(2)
    modules = [build_stage(TINY.model, 0), build_stage(TINY.model, 0)]
    optimizers = []
    try:
        optimizers.append(StageOptimizer(TINY, "seam", 0, first, modules[0], identity=first_key))
        ahead = optimizers[0]
        ahead.jump_to_epoch(0)
        for i in range(2 * MICRO_BATCHES):  # two epochs alone
            ahead.step(_gradients(modules[0], i), TINY.training.micro_batch_size, "trainer0")
        assert ahead.epoch == 2
        optimizers.append(StageOptimizer(TINY, "seam", 0, second, modules[1], identity=second_key))
        late = optimizers[1]
        held = _statistics(late)
        late.announce_progress()
        late._opt.synced = False  # as after a failed round: the accepted load re-syncs it
        deadline = time.monotonic() + 60
        # until its tracker has read the ahead server's epoch-2 record, the late one takes an older record for
        # the stage's epoch and (hivemind) steps on its own gradients to catch up instead of loading the state
        while late._opt.tracker.global_epoch < 2:
            assert time.monotonic() < deadline, "the late server's tracker never saw the stage's epoch"
            time.sleep(0.1)
        while late.epoch < 2:  # once its tracker saw the stage's epoch, a micro-batch finds it out of sync
            assert time.monotonic() < deadline, "the late server never loaded the stage's state"
            late.step(_gradients(modules[1], 999), TINY.training.micro_batch_size, "trainer1")
            time.sleep(0.2)
        now = _statistics(late)
        assert now.keys() == held.keys() and all(now[k] is held[k] for k in held), "the loaded state replaced them"
        mine = late.state()
        differ = _differing(late, ahead)
        assert not differ, f"the loaded state differs from the donor's: {differ[:6]}"
        assert any(float(t.abs().max()) > 0 for k, t in mine.items() if k.endswith("/exp_avg"))  # a real state
        assert late.synced and ahead.synced, "stepping alone in the stage, or on a loaded state, is in sync"
    finally:
        for o in optimizers:
            o.shutdown()
        second.shutdown()
        first.shutdown()


class _StarvedEvent(threading.Event):
    """A progress reporter's wake-up event whose waiter runs ``delay_s`` late, as on a busy 2-core machine."""

    def __init__(self, delay_s: float = 0.5):
        super().__init__()
        self.delay_s = delay_s

    def wait(self, timeout=None):
        woken = super().wait(timeout)
        time.sleep(self.delay_s)
        return woken


@pytest.mark.timeout(120)
def test_a_servers_progress_entry_is_stored_at_every_report_even_without_samples():
    """A fresh server's announced epoch reaches the DHT, and so do the epochs a lone server ends faster than its
    reporter thread wakes: hivemind stored an entry only after samples in the last two epochs, so a server joining
    read epoch 0 for as long as the older entry lived (CI failure of the test above)."""
    (first_key, first), (second_key, second) = keyed_dhts(2)
    module = build_stage(TINY.model, 0)
    optimizers = []
    try:
        optimizers.append(StageOptimizer(TINY, "seam", 0, first, module, identity=first_key))
        alone = optimizers[0]
        tracker = alone._opt.tracker
        idle, tracker.should_report_progress = tracker.should_report_progress, _StarvedEvent()
        idle.set()  # (the reporter waits on the event it found at start: it now waits on the starved one)
        alone.announce_progress()
        assert _wait_until(lambda: _stored_epoch(first, tracker) == 0, 20), "the announced epoch was never stored"
        alone.jump_to_epoch(0)
        for i in range(2 * MICRO_BATCHES):  # two epochs alone, each ended at once
            alone.step(_gradients(module, i), TINY.training.micro_batch_size, "trainer0")
        assert alone.epoch == 2
        optimizers.append(StageOptimizer(TINY, "seam", 0, second, build_stage(TINY.model, 0), identity=second_key))
        joiner = optimizers[1]
        assert _wait_until(lambda: joiner._opt.tracker.global_epoch == 2, 20), \
            f"a joiner read epoch {joiner._opt.tracker.global_epoch}, the lone server is at 2"
    finally:
        for o in optimizers:
            o.shutdown()
        second.shutdown()
        first.shutdown()


def _stored_epoch(node, tracker):
    """The epoch of ``tracker``'s own entry as DHT node ``node`` reads it (None: no entry)."""
    found = node.get(tracker.training_progress_key, latest=True)
    entry = found.value.get(tracker.progress_key) if found is not None else None
    return entry.value["epoch"] if entry is not None and entry.value is not None else None


def _entry(epoch: int, samples: int, expiration: float = 1e12):
    from hivemind.utils import ValueWithExpiration
    return ValueWithExpiration(dict(peer_id=b"x", epoch=epoch, samples_accumulated=samples, samples_per_second=1e12,
                                    time=0.0, client_mode=False), expiration)


def _foreign_progress(trackers: list, node, prefix: str, epoch: int, samples: int) -> bytes:
    """Another peer's progress entry under ``prefix`` (hivemind's own tracker, a fresh RSA key) on DHT ``node``, at
    ``epoch`` with ``samples``; the tracker joins ``trackers`` (the caller shuts them down). Returns its sub-key."""
    from hivemind.optim.progress_tracker import ProgressTracker
    from hivemind.utils.crypto import RSAPrivateKey

    other = ProgressTracker(dht=node, prefix=prefix, target_batch_size=10**6, private_key=RSAPrivateKey(),
                            min_refresh_period=0.1, max_refresh_period=0.5, start=True)
    trackers.append(other)
    other.report_local_progress(epoch, samples)
    return other._local_public_key


def test_progress_counts_only_the_stages_servers_and_at_most_one_epoch_ahead_of_them():
    """(swarm.averaging.progress) A stranger's entry far ahead is dropped, one epoch ahead of the others' median
    still counts (the stage moved on), samples and throughput are capped, and with a roster only its sub-keys
    and this server's own entry count."""
    from swarm.averaging.progress import trusted_progress
    from swarm.protocol import MAX_SAMPLES_PER_S

    entries = {b"own": _entry(5, 3), b"a": _entry(5, 4), b"b": _entry(6, 10**9), b"liar": _entry(10**8, 1)}
    kept = trusted_progress(entries, b"own", 5, target=64)
    assert set(kept) == {b"own", b"a", b"b"}
    assert kept[b"b"].value["samples_accumulated"] == 64 and kept[b"b"].value["samples_per_second"] == MAX_SAMPLES_PER_S
    assert kept[b"b"].expiration_time == 1e12
    # a lagging server sees that the stage moved on: the median of the others is ahead of it
    assert set(trusted_progress({b"own": _entry(0, 0), b"a": _entry(43, 1), b"b": _entry(43, 2)}, b"own", 0, 64)) \
        == {b"own", b"a", b"b"}
    # a minority cannot push the stage further: the lower median of {43, 10**8} is 43
    assert set(trusted_progress({b"own": _entry(43, 0), b"a": _entry(43, 1), b"liar": _entry(10**8, 2)},
                                b"own", 43, 64)) == {b"own", b"a"}
    # with a roster: only its sub-keys, and this server's own entry
    assert set(trusted_progress(entries, b"own", 5, 64, roster=frozenset({b"a"}))) == {b"own", b"a"}


def test_unverified_progress_neither_pulls_a_server_on_nor_counts_past_its_share():
    """(swarm.averaging.progress, Standing) One fresh key announced as a server, at the stage's epoch + 1 with 10**9
    samples, ended every epoch at once. A server that verified a stage-mate counts the others as unverified: an
    entry ahead counts as one that finished this epoch, and the unverified entries count at most half the target
    together, whatever client_mode it claims; a server that verified nobody in a stage where nobody vouches for
    anybody counts every entry in full, as before; a follower (new to an established stage) is pulled only by the
    servers its stage-mates vouch for."""
    from swarm.averaging.progress import UNVERIFIED_SHARE, ProgressTrust, trusted_progress

    entries = {b"own": _entry(5, 10), b"mate": _entry(5, 12), b"sybil": _entry(6, 10**9), b"new": _entry(5, 20)}
    roster = frozenset(entries) - {b"own"}
    before = trusted_progress(entries, b"own", 5, 64, roster)  # nobody verified: hivemind's rule with the caps
    assert before[b"sybil"].value["epoch"] == 6 and before[b"sybil"].value["samples_accumulated"] == 64

    kept = trusted_progress(entries, b"own", 5, 64, roster, ProgressTrust(frozenset({b"mate"})))
    assert {k: (v.value["epoch"], v.value["samples_accumulated"]) for k, v in kept.items()} == {
        b"own": (5, 10), b"mate": (5, 12), b"sybil": (5, 64 * 32 // 84), b"new": (5, 20 * 32 // 84)}
    assert sum(kept[k].value["samples_accumulated"] for k in (b"sybil", b"new")) <= UNVERIFIED_SHARE * 64
    assert kept[b"sybil"].value["samples_per_second"] == 0.0 and kept[b"mate"].value["samples_per_second"] > 0
    # an unverified entry claiming client_mode (hivemind counts a client's samples, never its epoch) is a server's
    client = _entry(5, 10**9)
    client.value["client_mode"] = True
    kept = trusted_progress({b"own": _entry(5, 0), b"mate": _entry(5, 0), b"c": client}, b"own", 5, 64,
                            None, ProgressTrust(frozenset({b"mate"})))
    assert not kept[b"c"].value["client_mode"] and kept[b"c"].value["samples_accumulated"] == 32
    # within the share, an unverified server's samples count as they are
    few = trusted_progress({b"own": _entry(5, 1), b"new": _entry(5, 9)}, b"own", 5, 64, frozenset({b"new"}),
                           ProgressTrust(frozenset({b"gone"})))
    assert few[b"new"].value["samples_accumulated"] == 9
    # unverified entries far ahead stay dropped, and they do not move the ceiling of the verified ones
    many = {b"own": _entry(5, 0), b"mate": _entry(5, 0)} | {bytes([i]): _entry(6 + i, 1) for i in range(5)}
    kept = trusted_progress(many, b"own", 5, 64, None, ProgressTrust(frozenset({b"mate"})))
    assert set(kept) == {b"own", b"mate", bytes([0])} and kept[bytes([0])].value["epoch"] == 5
    # a follower: the vouched server one epoch ahead pulls it; another key ahead counts as unverified
    ahead = {b"own": _entry(5, 40), b"mate": _entry(6, 0), b"other": _entry(6, 0)}
    kept = trusted_progress(ahead, b"own", 5, 64, None, ProgressTrust(vouched=frozenset({b"mate"}), follower=True))
    assert kept[b"mate"].value["epoch"] == 6 and kept[b"other"].value["epoch"] == 5
    assert kept[b"own"].value["samples_accumulated"] == 40  # its own in full (its mates cap it, it waits for them)


def test_a_servers_progress_trust_follows_its_standing_and_its_stage_mates_vouches():
    """(swarm.server.served.progress_trust) Verified: the mates with standing here; vouched: the mates some mate
    vouches for; a follower: a server that verified none of them while some vouch for others."""
    from types import SimpleNamespace

    from swarm.averaging.progress import ProgressTrust
    from swarm.server.served import progress_trust

    def mate(p2p: str, key: str, vouches=()):
        return SimpleNamespace(p2p_id=p2p, progress_key=key, vouches={v: 1.0 for v in vouches})

    weight = {"a": 0.5, "b": 0.0}.get
    fresh = progress_trust([mate("a", "0a"), mate("b", "0b")], lambda p: weight(p, 0.0))
    assert fresh.verified == frozenset({b"\x0a"}) and not fresh.follower and not fresh.vouched
    established = [mate("a", "0a", vouches=["b"]), mate("b", "0b", vouches=["a"])]
    newcomer = progress_trust(established, lambda p: 0.0)
    assert newcomer.follower and newcomer.vouched == frozenset({b"\x0a", b"\x0b"})
    assert not progress_trust(established, lambda p: weight(p, 0.0)).follower  # it verified a
    assert not progress_trust([mate("a", "0a", vouches=["me"])], lambda p: 0.0).follower  # only itself vouched for
    # unvouched: it verified a, but its mates vouch only for each other (they count it within the share: by its own
    # count it stepped before them, alone, every epoch); vouched for, or in a stage where nobody vouches, it is not
    me = mate("me", "01")
    assert progress_trust(established, lambda p: weight(p, 0.0), own=me).unvouched
    assert not progress_trust(established, lambda p: weight(p, 0.0)).unvouched  # (its own record not read yet)
    assert not progress_trust([mate("a", "0a", vouches=["b", "me"]), mate("b", "0b", vouches=["a"])],
                              lambda p: weight(p, 0.0), own=me).unvouched
    assert not progress_trust([mate("a", "0a"), mate("b", "0b", vouches=["gone"])], lambda p: 0.5, own=me).unvouched
    # bounded groups (more servers than group_size): every entry in full (a server verifies its group only)
    assert progress_trust(established, lambda p: weight(p, 0.0), group_size=2) == ProgressTrust()
    assert progress_trust(established, lambda p: weight(p, 0.0), group_size=3).verified == frozenset({b"\x0a"})


def test_where_the_run_key_recognizes_stage_mates_their_progress_alone_counts_and_a_fresh_keys_not_at_all():
    """(swarm.server.served.progress_trust, swarm.averaging.progress) With the run key's recognition naming some of
    a server's stage-mates, every server of the stage counts the same entries in full (the recognized mates' and
    its own), bounded groups included, and the others' samples not at all: a fresh key's 10**9 samples one epoch
    ahead neither pull nor end the epoch (with standing alone they still counted half the target); nor does a
    recognized key's that stopped working."""
    from types import SimpleNamespace

    from swarm.averaging.progress import UNVERIFIED_SHARE, ProgressTrust, trusted_progress
    from swarm.server.served import progress_trust

    from swarm.protocol import ServerState

    def mate(peer: str, key: str, state=ServerState.ONLINE, verified=None):
        return SimpleNamespace(peer_id=peer, p2p_id="p" + peer, progress_key=key, vouches={}, state=state, epoch=5,
                               last_verified=verified or {})

    mates = [mate("a", "0a"), mate("b", "0b"), mate("sybil", "0c"), mate("p", "0d", ServerState.PAUSED)]
    named = frozenset({"a", "b", "p", "gone"})
    trust = progress_trust(mates, lambda p: 0.0, group_size=2, recognized=named | {"me"}, me=("me", b"\x01"))
    assert trust == ProgressTrust(frozenset({b"\x0a", b"\x0b", b"\x01"}), share=0.0)  # online mates and its own
    # a server the recognition does not name (a newcomer) counts as the recognized ones count: their entries in
    # full, its own not at all, so it ends the epoch with them and meets them in their round (a follower, pulled
    # on once they had stepped, came to each of their rounds after it ended: tests/test_scale.py, kept logs)
    newcomer = progress_trust(mates, lambda p: 0.0, recognized=named, me=("new", b"\x02"))
    assert newcomer == ProgressTrust(frozenset({b"\x0a", b"\x0b"}), share=0.0, unvouched=True)
    seen = {b"\x01": _entry(5, 20), b"\x0a": _entry(5, 30), b"\x0b": _entry(5, 14), b"\x02": _entry(5, 40)}

    def counted(trust: ProgressTrust, own: bytes) -> int:
        return sum(v.value["samples_accumulated"] for v in trusted_progress(seen, own, 5, 64, None, trust).values())

    beside = progress_trust([*mates, mate("me", "01")], lambda p: 0.0, recognized=named | {"me"}, me=("new", b"\x02"))
    assert counted(beside, b"\x02") == counted(trust, b"\x01") == 64  # one view: both end epoch 5 now
    # recognized alone (its founding mate left): still only its own samples, not every key's
    assert progress_trust(mates[2:], lambda p: 0.0, group_size=2, recognized=named | {"me"},
                          me=("me", b"\x01")) == ProgressTrust(frozenset({b"\x01"}), share=0.0)
    # a recognized key that stopped working (patient: nobody verified its parts within 2 epochs, while the others
    # verified one another's) counts no more: its entry one epoch ahead pulled every epoch of its stage
    working = [mate("a", "0a", verified={"pb": 5, "pme": 5}), mate("b", "0b", verified={"pa": 4}),
               mate("s", "0e", verified={"pa": 5})]
    own = mate("me", "01", verified={"pa": 5})
    assert progress_trust(working, lambda p: 0.0, recognized=frozenset({"a", "b", "s", "me"}), me=("me", b"\x01"),
                          own=own) == ProgressTrust(frozenset({b"\x0a", b"\x0b", b"\x01"}), share=0.0)
    # the recognition names neither it nor an online mate (a stage not founded yet): the rules without it
    assert progress_trust(mates[2:], lambda p: 0.0, recognized=named, me=("new", b"\x02")) == ProgressTrust()
    assert progress_trust(mates, lambda p: 1.0, recognized=None).share == UNVERIFIED_SHARE
    entries = {b"own": _entry(5, 10), b"\x0a": _entry(5, 12), b"\x0c": _entry(6, 10**9), b"new": _entry(5, 20)}
    kept = trusted_progress(entries, b"own", 5, 64, None, trust)
    assert {k: (v.value["epoch"], v.value["samples_accumulated"]) for k, v in kept.items()} == {
        b"own": (5, 10), b"\x0a": (5, 12), b"\x0c": (5, 0), b"new": (5, 0)}


@pytest.mark.timeout(180)
def test_a_strangers_progress_record_neither_moves_the_stages_epoch_nor_ends_it():
    """A peer with nothing but a fresh RSA key stores progress under the stage's key (hivemind lets anyone):
    at epoch 10**8 it does not make the server believe it is out of sync; once the server counts only the
    progress keys its stage's records name, the stranger's samples do not count either."""

    (key, dht), (_, stranger_dht), (_, mate_dht), (_, other_dht) = keyed_dhts(4)
    module = build_stage(TINY.model, 0)
    optimizer, trackers = None, []
    try:
        optimizer = StageOptimizer(TINY, "seam", 0, dht, module, identity=key)
        tracker = optimizer._opt.tracker

        def report(node, epoch: int, samples: int) -> bytes:
            return _foreign_progress(trackers, node, "seam-stage0", epoch, samples)

        def counted(samples: int) -> None:
            deadline = time.monotonic() + 60
            while tracker.global_progress.samples_accumulated != samples:
                assert time.monotonic() < deadline, f"the tracker never counted {samples} samples " \
                                                    f"({tracker.global_progress})"
                time.sleep(0.1)

        report(stranger_dht, 10**8, 5)
        mate = report(mate_dht, 0, 7)  # a stage-mate's entry
        deadline = time.monotonic() + 60
        while len(getattr(dht.get("seam-stage0_progress", latest=True), "value", None) or {}) < 2:
            assert time.monotonic() < deadline, "the stranger's and the mate's entries never reached the DHT"
            time.sleep(0.1)
        trackers[-1].report_local_progress(0, 8)
        counted(8)  # a fetch that read the stranger's entry too (hivemind alone would take epoch 10**8 from it)
        assert tracker.global_epoch == 0 and optimizer.epoch == 0
        report(other_dht, 0, 20)  # a stranger within one epoch of the stage, and 20 more samples
        counted(28)
        optimizer.set_progress_roster(lambda: frozenset({mate}))
        counted(8)
        assert not tracker.ready_to_update_epoch
    finally:
        for t in trackers:
            t.shutdown()
        if optimizer is not None:
            optimizer.shutdown()
        for d in (other_dht, mate_dht, stranger_dht, dht):
            d.shutdown()


def test_an_unvouched_server_ends_its_epoch_when_pulled_or_at_the_followers_patience():
    """A server that verified its mates while none of them vouches for it (a noisy server, its parts rejected)
    counted its own samples in full, they counted them within the share: with most of the trainer's samples it
    ended its epochs before them (up to 34 s in tests/test_byzantine_swarm.py), alone, and met none of their rounds
    again, so it was never excluded. Now it counts its own entry as they do, within the share, and its local count
    alone ends an epoch only at FOLLOWER_PATIENCE x the target; a mate counted in full that moved on still pulls
    it."""
    from types import SimpleNamespace

    from swarm.averaging.progress import (FOLLOWER_PATIENCE, UNVERIFIED_SHARE, ProgressTrust, SampleCountTracker,
                                          trusted_progress)

    def ready(trust: ProgressTrust, local: int, total: int, epoch: int = 3) -> bool:
        tracker = SimpleNamespace(target_batch_size=64, trust=lambda: trust, global_epoch=epoch,
                                  global_progress=SimpleNamespace(samples_accumulated=total),
                                  local_progress=SimpleNamespace(epoch=3, samples_accumulated=local))
        return SampleCountTracker.ready_to_update_epoch.fget(tracker)

    vouched, unvouched = ProgressTrust(frozenset({b"mate"})), ProgressTrust(frozenset({b"mate"}), unvouched=True)
    assert ready(vouched, 50, 70) and ready(vouched, 64, 64)
    assert ready(unvouched, 50, 70) and not ready(unvouched, 64, 40)  # the count, as its mates count, ends it
    assert ready(unvouched, 0, 0, epoch=4)  # a mate counted in full moved on: it is pulled on
    assert ready(unvouched, FOLLOWER_PATIENCE * 64, 40)  # mates that never move cost it that much
    # its own entry counts as its mates count it: within the unverified share
    entries = {b"own": _entry(3, 60), b"mate": _entry(3, 10)}
    assert trusted_progress(entries, b"own", 3, 64, None, vouched)[b"own"].value["samples_accumulated"] == 60
    kept = trusted_progress(entries, b"own", 3, 64, None, unvouched)
    assert kept[b"own"].value["samples_accumulated"] == int(UNVERIFIED_SHARE * 64)
    assert kept[b"mate"].value["samples_accumulated"] == 10


def test_an_unvouched_servers_new_samples_join_the_stages_count_only_at_the_next_count():
    """report_local_progress (hivemind's) added a server's new samples to the stage's count at once, until the next
    count: an unvouched server (its own entry within the share: 0 where the recognition decides) reached the target
    on its own samples before its mates' count did. They join at once only where its own entry counts in full."""
    import threading
    from types import SimpleNamespace

    from swarm.averaging.progress import ProgressTrust, SampleCountTracker

    def counted_after_report(trust: ProgressTrust) -> int:
        tracker = SimpleNamespace(
            target_batch_size=64, trust=lambda: trust, _local_public_key=b"own", reading_slowly=False,
            global_progress=SimpleNamespace(epoch=3, samples_accumulated=10),
            local_progress=SimpleNamespace(epoch=3, samples_accumulated=5),
            _get_local_progress=lambda epoch, samples: SimpleNamespace(epoch=epoch, samples_accumulated=samples),
            performance_ema=SimpleNamespace(update=lambda task_size: None, reset_timer=lambda: None),
            push=lambda progress: True, min_refresh_period=0.25, max_refresh_period=1.0,
            _last_report=time.monotonic(), _flush=SimpleNamespace(is_alive=lambda: True),
            should_report_progress=threading.Event())
        SampleCountTracker.report_local_progress(tracker, 3, 9)
        assert tracker.local_progress.samples_accumulated == 9
        return tracker.global_progress.samples_accumulated

    assert counted_after_report(ProgressTrust()) == 14  # every entry in full: its 4 new samples at once
    assert counted_after_report(ProgressTrust(frozenset({b"mate"}))) == 14
    assert counted_after_report(ProgressTrust(frozenset({b"mate"}), share=0.0, unvouched=True)) == 10


@pytest.mark.timeout(180)
def test_one_fresh_keys_progress_at_the_next_epoch_no_longer_ends_a_verified_servers_epochs():
    """The finding: one fresh key announced as a server, its progress entry at the stage's epoch + 1 with 10**9
    samples, ended every epoch of its stage at once. A server that verified its stage-mate's averaging work counts
    that key as unverified: not pulled to the next epoch, its samples within the unverified share; the same entry
    still pulls a server that verified nobody (as hivemind's tracker would)."""

    from swarm.averaging.progress import UNVERIFIED_SHARE, ProgressTrust

    (key, dht), (_, sybil_dht), (_, mate_dht) = keyed_dhts(3)
    optimizer, trackers = None, []
    try:
        optimizer = StageOptimizer(TINY, "pulled", 0, dht, build_stage(TINY.model, 0), identity=key)
        tracker, target = optimizer._opt.tracker, optimizer._opt.tracker.target_batch_size

        def report(node, epoch: int, samples: int) -> bytes:
            return _foreign_progress(trackers, node, "pulled-stage0", epoch, samples)

        sybil, mate = report(sybil_dht, 1, 10**9), report(mate_dht, 0, 1)
        roster = frozenset({sybil, mate})
        optimizer.set_progress_roster(lambda: roster, trust=lambda: ProgressTrust(frozenset({mate})))
        deadline = time.monotonic() + 60
        while tracker.global_progress.num_peers < 3:  # the entries reached the DHT and a read found them all
            assert time.monotonic() < deadline, f"the tracker never counted the three entries ({tracker.global_progress})"
            optimizer.read_progress_soon()
            time.sleep(0.2)
        assert tracker.global_epoch == 0 and not tracker.ready_to_update_epoch, tracker.global_progress
        assert tracker.global_progress.samples_accumulated == 1 + int(UNVERIFIED_SHARE * target)
        # a follower (it verified nobody; its stage-mates vouch for the mate): not pulled by the key either, and it
        # would end the epoch by its own count only at FOLLOWER_PATIENCE x the target
        optimizer.set_progress_roster(lambda: roster, trust=lambda: ProgressTrust(vouched=frozenset({mate}),
                                                                                  follower=True))
        optimizer.read_progress_soon()
        until = time.monotonic() + 1.5  # it holds through the next counts
        while time.monotonic() < until:
            assert tracker.global_epoch == 0 and not tracker.ready_to_update_epoch, tracker.global_progress
            time.sleep(0.1)
        optimizer.set_progress_roster(lambda: roster)  # a server that verified nobody: pulled on, as before
        deadline = time.monotonic() + 30
        while not tracker.ready_to_update_epoch:
            assert time.monotonic() < deadline, f"the unverified entry never pulled ({tracker.global_progress})"
            optimizer.read_progress_soon()
            time.sleep(0.2)
        assert tracker.global_epoch == 1
    finally:
        for t in trackers:
            t.shutdown()
        if optimizer is not None:
            optimizer.shutdown()
        for d in (mate_dht, sybil_dht, dht):
            d.shutdown()


@pytest.mark.timeout(180)
def test_a_server_that_rejoins_in_the_same_process_is_counted_and_still_stops_on_ctrl_c():
    """A server that pauses and resumes (or moves) builds a second optimizer on its DHT node. hivemind's node
    signs with the first progress key it was given, so the second one must reuse it (else its progress fails
    every peer's signature check and its stage-mates never count it again); and hivemind sets SIGINT to ignored
    in the calling process when it starts an averager, which made such a server deaf to Ctrl-C."""
    import signal

    (key, node), (mate_key, mate_node) = keyed_dhts(2)
    own_handler = lambda *_: None  # noqa: E731
    previous = signal.signal(signal.SIGINT, own_handler)
    optimizers = []
    try:
        first = StageOptimizer(TINY, "rejoin", 0, node, build_stage(TINY.model, 0), identity=key)
        optimizers.append(first)
        mate = StageOptimizer(TINY, "rejoin", 0, mate_node, build_stage(TINY.model, 0), identity=mate_key)
        optimizers.append(mate)
        assert signal.getsignal(signal.SIGINT) is own_handler, "starting the averagers silenced Ctrl-C"
        first.shutdown()
        optimizers.remove(first)
        second = StageOptimizer(TINY, "rejoin", 0, node, build_stage(TINY.model, 0), identity=key)
        optimizers.append(second)
        mate.step(_gradients(mate.module, 1), TINY.training.micro_batch_size, "trainer")
        second.step(_gradients(second.module, 2), TINY.training.micro_batch_size, "trainer")  # progress is stored
        assert mate.wait_until_counted(2, timeout=30), "the stage-mate never counted the rejoined server"
        assert signal.getsignal(signal.SIGINT) is own_handler
    finally:
        signal.signal(signal.SIGINT, previous)
        for o in optimizers:
            o.shutdown()
        mate_node.shutdown()
        node.shutdown()


@pytest.mark.timeout(180)
def test_a_server_whose_gradient_round_failed_says_it_is_out_of_sync():
    """Two servers of a stage, the second counted but never averaging: the first's round finds no group and it
    steps on its own gradient, so its parameters are no longer the stage's (``synced`` False, which its receipts
    then say: :mod:`swarm.trust.spotcheck`), and its round ends there: hivemind left it retrying its matchmaking
    with no deadline, and no later round of that server found a group. A jump to the stage's epoch (a restore) is
    out of sync too."""
    with _two_servers("failed") as (alone, idle):
        micro = TINY.training.micro_batch_size
        idle.step(_gradients(idle.module, 99), micro, "trainer1")  # its progress is stored, then it idles
        alone.step(_gradients(alone.module, 0), micro, "trainer0")
        assert alone.wait_until_counted(2, timeout=30), "the first server never counted the second"
        assert alone.synced
        for i in range(1, 4 * MICRO_BATCHES):
            if alone.step(_gradients(alone.module, i), micro, "trainer0"):
                break
        assert alone.epoch == 1 and not alone.synced, "it stepped on its own gradient while the stage had two"
        round_ = alone._opt.scheduled_grads
        assert round_ is not None and round_.done(), "the failed round still runs (and holds the averager's search)"
        assert round_.deadline < float("inf"), "a gradient round has a deadline"
        assert idle.synced and idle.jump_to_epoch(5) == 5 and not idle.synced


@pytest.mark.timeout(180)
def test_a_server_out_of_sync_takes_the_stages_state_in_a_state_round_and_moves_no_one_elses():
    """The second server's parameters are off by 1.0 and it knows (``synced`` False, as after a failed round).
    At the transition into epoch 2 (a state round, ``average_state_every = 2``) it averages with weight 0: it ends
    with the first server's state, in sync, and the first server's parameters moved by its own step only, not
    halfway to the other's (with weight 1 they did: a stage-mate that missed that round then kept the old state,
    both said "in sync", and spot checks could convict an honest server)."""
    with _two_servers("weight0") as (busy, off):
        micro = TINY.training.micro_batch_size
        off.step(_gradients(off.module, 99), micro, "trainer1")
        busy.step(_gradients(busy.module, 0), micro, "trainer0")
        assert busy.wait_until_counted(2, timeout=30), "the busy server never counted the other one"
        _fill_epoch(busy, off, 1)  # into epoch 1: a gradient round, no state round
        assert busy.epoch == off.epoch == 1 and busy.synced and off.synced and not _differing(busy, off)
        off.load_state({k: v + 1.0 if k.startswith("param/") else v for k, v in off.state().items()})
        off._opt.synced = False
        before = {k: v for k, v in busy.state().items() if k.startswith("param/")}
        _fill_epoch(busy, off, 100)  # into epoch 2: its gradient round, then the state round
        assert busy.epoch == off.epoch == 2 and busy.synced and off.synced
        assert not _differing(busy, off), "the state round gave the out-of-sync server the stage's state"
        moved = max((busy.state()[k] - v).abs().max().item() for k, v in before.items())
        assert moved < 0.1, f"the server in sync moved {moved:.3f} toward the out-of-sync one's parameters"


def _fill_epoch(busy: StageOptimizer, other: StageOptimizer, seed: int) -> None:
    """``busy`` steps micro-batches (on a thread) until its epoch ends, while ``other`` takes none and joins the
    round through ``finish_epoch_if_ready``, as a server's epoch watcher does."""
    import threading

    stepped = threading.Event()

    def train() -> None:
        for i in range(4 * MICRO_BATCHES):
            if busy.step(_gradients(busy.module, seed + i), TINY.training.micro_batch_size, "trainer0"):
                break
        stepped.set()

    epoch, worker = other.epoch, threading.Thread(target=train, daemon=True)
    worker.start()
    deadline = time.monotonic() + 60
    while not other.finish_epoch_if_ready():
        assert time.monotonic() < deadline, f"the other server never joined the round of epoch {epoch}"
        time.sleep(0.1)
    assert stepped.wait(60) and other.epoch == epoch + 1
    worker.join(5)


@pytest.mark.timeout(180)
def test_a_server_that_computed_nothing_joins_its_stage_mates_round_with_weight_0():
    """Two servers of a stage; in epoch 1 the trainers send every micro-batch to the first. The second, with no
    sample, still joins the round once the stage reached the target (weight 0: no vote), so the round succeeds
    and both step to the same state; it used to wait for a micro-batch, and the first's round timed out."""
    with _two_servers("empty") as (busy, empty):
        micro = TINY.training.micro_batch_size
        empty.step(_gradients(empty.module, 99), micro, "trainer1")  # epoch 0: one micro-batch here
        busy.step(_gradients(busy.module, 0), micro, "trainer0")
        assert busy.wait_until_counted(2, timeout=30), "the busy server never counted the other one"
        _fill_epoch(busy, empty, 1)
        assert busy.synced and empty.synced and empty.samples_dropped == 0
        assert not empty.finish_epoch_if_ready(), "nothing to join yet"
        _fill_epoch(busy, empty, 100)  # epoch 1: no micro-batch here
        assert busy.epoch == empty.epoch == 2
        assert busy.synced and empty.synced, "the round failed: a server stepped on its own gradient"
        differ = _differing(busy, empty)
        assert not differ, f"the two servers stepped to different states: {differ[:6]}"


@pytest.mark.timeout(120)
def test_samples_discarded_before_a_step_are_counted_as_dropped_and_matchmaking_requests_time_out_first():
    """``samples_dropped``: samples accumulated and then discarded by a load of the stage's state or by leaving
    mid-epoch. And both averagers' matchmaking requests time out before matchmaking itself does (hivemind warns
    in every server's log otherwise: rounds may deadlock)."""
    ((key, node),) = keyed_dhts(1)
    optimizer = None
    try:
        module = build_stage(TINY.model, 0)
        optimizer = StageOptimizer(TINY, "drops", 0, node, module, identity=key)
        for averager in (optimizer._opt.grad_averager, optimizer._opt.state_averager):
            kw = averager.matchmaking_kwargs
            assert kw["request_timeout"] < kw["min_matchmaking_time"], type(averager).__name__
        micro = TINY.training.micro_batch_size
        optimizer.step(_gradients(module, 0), micro, "trainer")
        optimizer.step(_gradients(module, 1), micro, "trainer")
        assert optimizer.samples_dropped == 0
        optimizer.load_state(optimizer.state())  # a restore: the accumulated gradients were for other parameters
        assert optimizer.samples_dropped == 2 * micro
        optimizer.step(_gradients(module, 2), micro, "trainer")
        optimizer.shutdown()  # leaving mid-epoch
        assert optimizer.samples_dropped == 3 * micro
        optimizer = None
    finally:
        if optimizer is not None:
            optimizer.shutdown()
        node.shutdown()


@pytest.mark.timeout(180)
def test_outer_mode_state_is_the_outer_parameters_and_momentum_and_a_load_restarts_the_inner_loop():
    """mode = "outer" (swarm.averaging.outer) on one server: inner steps move the module, not the stage's state
    (θ, the outer momentum); after inner_steps of them the outer step moves θ and the module starts from it. The
    state is what a checkpoint captures and a joiner downloads: loading one (a restore or a rollback) puts θ into
    both copies and restarts the inner AdamW."""
    spec = TINY.updated(averaging={"mode": "outer", "inner_steps": 2})
    ((key, dht),) = keyed_dhts(1)
    module = build_stage(spec.model, 0)
    optimizer = None
    try:
        optimizer = StageOptimizer(spec, "outer-seam", 0, dht, module, identity=key)
        optimizer.jump_to_epoch(0)
        start = optimizer.state()
        assert {k.rsplit("/", 1)[-1] for k in start if k.startswith("opt/")} == {"momentum_buffer"}
        for i in range(MICRO_BATCHES):  # one inner step: the module moved, the state did not
            assert not optimizer.step(_gradients(module, i), spec.training.micro_batch_size, "trainer0")
        assert all(torch.equal(start[k], t) for k, t in optimizer.state().items())
        name, first = next(iter(module.named_parameters()))
        assert not torch.equal(first.detach(), start[f"param/{name}"])
        ended = [optimizer.step(_gradients(module, 100 + i), spec.training.micro_batch_size, "trainer0")
                 for i in range(MICRO_BATCHES)]
        assert ended[-1] and optimizer.epoch == 1  # the second inner step ended the outer epoch
        after = optimizer.state()
        assert not torch.equal(after[f"param/{name}"], start[f"param/{name}"])
        assert torch.equal(first.detach(), after[f"param/{name}"])  # the module starts from the new θ
        assert float(after[f"opt/{name}/momentum_buffer"].abs().max()) > 0
        optimizer.step(_gradients(module, 999), spec.training.micro_batch_size, "trainer0")
        optimizer.load_state(start)  # e.g. a rollback to the initial checkpoint
        assert all(torch.equal(start[k], t) for k, t in optimizer.state().items())
        assert torch.equal(first.detach(), start[f"param/{name}"])
        assert optimizer._opt.inner.samples == 0 and not optimizer._opt.inner.optimizer.state
    finally:
        if optimizer is not None:
            optimizer.shutdown()
        dht.shutdown()


def _end_epoch_on_both(servers: list[StageOptimizer], seed: int) -> None:
    """Each server steps its own trainer's micro-batches (on a thread) until its epoch ends."""
    def train(k: int, server: StageOptimizer) -> None:
        for i in range(4 * MICRO_BATCHES):
            if server.step(_gradients(server.module, seed + 1000 * k + i), TINY.training.micro_batch_size,
                           f"trainer{k}"):
                return

    epochs = [s.epoch for s in servers]
    threads = [threading.Thread(target=train, args=(k, s), daemon=True) for k, s in enumerate(servers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    assert [s.epoch for s in servers] == [e + 1 for e in epochs], "a server did not end its epoch"


@pytest.mark.timeout(240)
def test_overlapped_outer_steps_apply_the_previous_rounds_average_and_keep_each_servers_pending_move():
    """mode = "outer" with overlap_rounds (swarm.averaging.outer) on two servers: the first transition takes no
    outer step (θ stays) and each server keeps its inner progress; at the second, θ moves by the samples-weighted
    mean of the two first pseudo-gradients (outer_lr 1, no momentum, mean, uncompressed), equal on both, and each
    server goes on from θ minus its own pending pseudo-gradient."""
    spec = TINY.updated(averaging={"mode": "outer", "inner_steps": 1, "overlap_rounds": True, "outer_lr": 1.0,
                                   "outer_momentum": 0.0, "aggregator": "mean", "compression": "none",
                                   "average_state_every": 100})
    with _two_servers("outer-overlap", spec) as (a, b):
        servers = [a, b]
        for k, server in enumerate(servers):
            server.step(_gradients(server.module, 10 + k), TINY.training.micro_batch_size, f"trainer{k}")
        assert a.wait_until_counted(2, timeout=30) and b.wait_until_counted(2, timeout=30)
        names = [f"param/{n}" for n, _ in a.module.named_parameters()]
        start = a.state()
        assert not _differing(a, b), "the two servers began apart"
        assert not [k for k in start if k.startswith("opt/")], "no outer momentum: the state is the parameters"
        _end_epoch_on_both(servers, 100)
        assert all(torch.equal(start[k], t) for s in servers for k, t in s.state().items() if k in names), \
            "the first overlapped transition took an outer step"
        moves, weights = [], []
        for s in servers:
            inner, pending = list(s.module.parameters()), s._opt.inner.pending
            assert pending is not None and all(torch.allclose(start[n] - d, p.detach(), atol=1e-6)
                                               for n, d, p in zip(names, pending, inner)), "its progress was lost"
            moves.append([d.clone() for d in pending])
            weights.append(s._opt._pending_samples)
        _end_epoch_on_both(servers, 200)
        assert a.synced and b.synced, "the round of the first pseudo-gradients failed"
        assert not _differing(a, b), "the two servers stepped to different states"
        theta = a.state()
        for i, n in enumerate(names):
            mean = (weights[0] * moves[0][i] + weights[1] * moves[1][i]) / sum(weights)
            assert torch.allclose(theta[n], start[n] - mean, atol=1e-6), f"θ of {n} is not θ0 - mean(Δ0)"
        assert any(not torch.equal(theta[n], start[n]) for n in names)
        for s in servers:
            assert all(torch.allclose(theta[n] - d, p.detach(), atol=1e-6) for n, d, p in
                       zip(names, s._opt.inner.pending, s.module.parameters())), "not θ - its own pending Δ"


@pytest.mark.timeout(240)
def test_an_overlapped_server_one_epoch_behind_its_stage_mate_joins_their_round_instead_of_reloading():
    """With overlapped rounds a stage-mate's transition no longer waits for the round, so it pushes the next epoch
    while this server's last micro-batches of the epoch still arrive. Its next micro-batch ends its epoch and
    joins the mate's round (the stage ends equal), where it used to load the mate's state and drop its samples."""
    spec = TINY.updated(averaging={"mode": "outer", "inner_steps": 1, "overlap_rounds": True,
                                   "average_state_every": 100})
    with _two_servers("overlap-behind", spec) as (ahead, behind):
        servers = [ahead, behind]
        micro = TINY.training.micro_batch_size
        for k, server in enumerate(servers):
            server.step(_gradients(server.module, 10 + k), micro, f"trainer{k}")
        assert ahead.wait_until_counted(2, timeout=30) and behind.wait_until_counted(2, timeout=30)
        for i in range(4 * MICRO_BATCHES):
            if ahead.step(_gradients(ahead.module, 100 + i), micro, "trainer0"):
                break
        assert ahead.epoch == 1 and behind.epoch == 0
        assert _wait_until(lambda: behind.stage_epoch == 1, 10), "the mate's epoch never reached this server"
        reloads = behind.reloads
        assert behind.step(_gradients(behind.module, 500), micro, "trainer1"), "its epoch did not end"
        assert behind.reloads == reloads and behind.samples_dropped == 0, "it loaded the mate's state instead"
        _end_epoch_on_both(servers, 1000)  # the round of epoch 0 (both pseudo-gradients) is applied here
        assert ahead.synced and behind.synced, "the round of epoch 0 did not hold both servers"
        assert not _differing(ahead, behind), "the two servers stepped to different states"


@pytest.mark.timeout(240)
def test_an_overlapped_server_that_loads_the_state_at_epoch_0_is_not_a_step_late():
    """A server that loads its stage-mate's state at epoch 0 (it joined before the first transition) misses no
    round: the first epoch takes no step anywhere. It used to count itself a step late, out of sync until the
    next state round, and vouched for no donor meanwhile (a joiner of the WAN lab refused an honest one)."""
    spec = TINY.updated(averaging={"mode": "outer", "inner_steps": 1, "overlap_rounds": True,
                                   "average_state_every": 100})
    with _two_servers("overlap-load0", spec) as (first, joiner):
        micro = TINY.training.micro_batch_size
        first.step(_gradients(first.module, 1), micro, "trainer0")
        assert first.wait_until_counted(2, timeout=30) and joiner.wait_until_counted(2, timeout=30)
        assert joiner.load_state_from_peers() == 0 and not _differing(first, joiner)
        for seed in (100, 200):
            _end_epoch_on_both([first, joiner], seed)
        assert first.synced and joiner.synced, "a server counted itself out of sync"
        assert not _differing(first, joiner), "the two servers stepped to different states"


def test_matchmaking_lookups_start_a_gap_after_the_last_one_ended():
    """(swarm.averaging.matchmaking.paced) hivemind's matchmaking looks its group up again as soon as the last lookup
    answered; paced, the next one waits until ``gap_s`` after the last one ended, and one after a longer pause
    waits for nothing."""
    from swarm.averaging.matchmaking import paced

    now, waits, calls = [100.0], [], []

    async def sleep(s):
        waits.append(round(s, 6))
        now[0] += s

    async def lookup(key):
        calls.append((key, now[0]))
        now[0] += 0.05  # the lookup itself takes 50 ms
        return key

    async def main():
        look = paced(lookup, 0.2, clock=lambda: now[0], sleep=sleep)
        assert await look("a") == "a" and await look("b") == "b"
        now[0] += 1.0
        await look("c")

    asyncio.run(main())
    assert waits == [0.2]
    assert [k for k, _ in calls] == ["a", "b", "c"] and calls[1][1] - calls[0][1] == pytest.approx(0.25)


def _wait_until(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.05)
    return predicate()


@pytest.mark.timeout(120)
def test_progress_is_published_at_most_once_per_refresh_period_and_nothing_is_lost():
    """(swarm.averaging.progress.SampleCountTracker) Micro-batch counts reported faster than the stage's servers
    read them are held back and published once the period is over, with the latest count; a new epoch is
    published without waiting for the period."""
    from swarm.averaging.progress import SampleCountTracker

    ((key, dht),) = keyed_dhts(1)
    published = []
    store = dht.store
    dht.store = lambda *a, **kw: published.append(kw["value"]) or store(*a, **kw)
    tracker = SampleCountTracker(dht=dht, prefix="pace", target_batch_size=1000, min_refresh_period=3.0,
                                 max_refresh_period=6.0, default_refresh_period=3.0, start=True)
    try:
        tracker.report_local_progress(0, 8)
        assert _wait_until(lambda: published, 10)
        for samples in range(16, 88, 8):  # nine micro-batches over ~1 s, inside one period: held back
            tracker.report_local_progress(0, samples)
            time.sleep(0.1)
        assert _wait_until(lambda: published[-1]["samples_accumulated"] == 80, 10)  # then published, the latest
        assert [v["samples_accumulated"] for v in published] == [8, 80]
        before = len(published)
        tracker.report_local_progress(1, 0)  # a new epoch, right after a publication: not held back 3 s
        assert _wait_until(lambda: published[-1]["epoch"] == 1, 2.0)
        assert len(published) == before + 1
    finally:
        tracker.shutdown()
        dht.shutdown()


@pytest.mark.timeout(120)
def test_a_quiet_stage_is_read_half_as_often_until_this_server_counts_a_sample():
    """(swarm.averaging.progress.SampleCountTracker) A stage where no server holds a sample is read every half
    window, not every quarter (an idle server's main cost); its own first sample ends that at once."""
    from hivemind.utils import get_dht_time

    from swarm.averaging.progress import QUIET_SLOWDOWN, SampleCountTracker

    ((key, dht),) = keyed_dhts(1)
    reads = []
    get = dht.get
    dht.get = lambda *a, **kw: reads.append(time.monotonic()) or get(*a, **kw)
    tracker = SampleCountTracker(dht=dht, prefix="quiet", target_batch_size=1000, min_refresh_period=0.1,
                                 max_refresh_period=0.2, default_refresh_period=0.2, start=True)
    try:
        assert _wait_until(lambda: tracker.reading_slowly, 20)
        next_in = tracker.global_progress.next_fetch_time - get_dht_time()
        assert next_in > tracker.max_refresh_period  # scheduled at QUIET_SLOWDOWN x the period
        assert next_in <= QUIET_SLOWDOWN * tracker.max_refresh_period + 0.05
        before = len(reads)
        tracker.report_local_progress(0, 8)
        assert not tracker.reading_slowly
        assert _wait_until(lambda: len(reads) > before, 5)  # read again at once, not a slow period later
        assert _wait_until(lambda: tracker.global_progress.samples_accumulated == 8, 5)
        assert not tracker.reading_slowly  # this server holds samples: the stage is not quiet
    finally:
        tracker.shutdown()
        dht.shutdown()


@pytest.mark.timeout(120)
def test_a_pushed_count_is_counted_without_a_dht_read_and_slows_the_dht_while_pushes_reach_everyone():
    """(swarm.averaging.progress, pushed progress) A stage-mate's pushed count is counted at once, without reading
    the DHT; while every other server's count arrives by push, the DHT is read only every PUSHED_SLOWDOWN x
    max_refresh_period, and while this server's pushes reach every stage-mate its own count is published no more
    often. A newer DHT entry of the same server (by its clock) replaces an older push."""
    from hivemind.optim.progress_tracker import LocalTrainingProgress
    from hivemind.utils import ValueWithExpiration, get_dht_time

    from swarm.averaging.progress import PUSHED_SLOWDOWN, SampleCountTracker
    from swarm.protocol import ProgressPush

    ((key, dht),) = keyed_dhts(1)
    stores, pushed = [], []
    store = dht.store
    dht.store = lambda *a, **kw: stores.append(time.monotonic()) or store(*a, **kw)
    tracker = SampleCountTracker(dht=dht, prefix="pushed", target_batch_size=1000, min_refresh_period=10.0,
                                 max_refresh_period=20.0, default_refresh_period=20.0, start=True)
    mate = b"the stage-mate's progress key"

    def count(samples: int, at: float) -> ProgressPush:
        return ProgressPush(run_id="r", stage=0, epoch=0, samples=samples, samples_per_s=1.0, time=at)
    try:
        tracker.set_roster(lambda: frozenset({tracker.progress_key, mate}))
        tracker.push = lambda progress: pushed.append(progress.samples_accumulated) or True
        reads = tracker.reads  # hivemind's read at start; the next is 10 s away or more
        tracker.receive(mate, count(5, get_dht_time()))
        assert _wait_until(lambda: tracker.global_progress.samples_accumulated == 5, 5)
        assert tracker.reads == reads, "a push was counted through a DHT read"
        next_read = tracker.global_progress.next_fetch_time - tracker._read_at
        assert next_read >= PUSHED_SLOWDOWN * tracker.max_refresh_period - 1e-6
        # a newer DHT entry of the mate (by its own clock) is counted instead of the older push
        newer = LocalTrainingProgress(peer_id=b"", epoch=0, samples_accumulated=9, samples_per_second=1.0,
                                      time=get_dht_time() + 1, client_mode=False)
        entries = {mate: ValueWithExpiration(newer.dict(), get_dht_time() + 60)}
        assert tracker._count(entries, read=False).samples_accumulated == 9
        assert tracker._count(None, read=False).samples_accumulated == 5
        tracker.set_roster(lambda: frozenset({tracker.progress_key}))  # the mate left the roster: its push goes
        assert tracker._count(None, read=False).samples_accumulated == 0 and mate not in tracker._pushed
        tracker.set_roster(lambda: frozenset({tracker.progress_key, mate}))
        tracker.receive(mate, count(5, get_dht_time()))

        before = len(stores)
        tracker.report_local_progress(0, 3)  # the first report goes out at once, pushed and to the DHT
        assert pushed == [3] and _wait_until(lambda: len(stores) > before, 5)
        tracker.report_local_progress(0, 4)  # pushed at once; the DHT's copy waits the slow period
        assert pushed == [3, 4]
        assert tracker._flush is not None and tracker._flush.interval > tracker.min_refresh_period
        before = len(stores)
        tracker.push = lambda progress: False  # a stage-mate that does not count this server: the DHT at full rate
        tracker.report_local_progress(1, 0)  # a new epoch is published at once again
        assert _wait_until(lambda: len(stores) > before, 5)
    finally:
        tracker.shutdown()
        dht.shutdown()


class _Round:
    """A hivemind ``StepControl`` as :func:`finish_running_round` sees it: its stage, and what each wait gives."""

    def __init__(self, stage, outcomes):
        self.stage, self.outcomes, self.waits, self.cancelled, self.ended = stage, list(outcomes), [], False, False

    def result(self, timeout):
        self.waits.append(timeout)
        outcome = self.outcomes.pop(0)
        self.ended = not isinstance(outcome, TimeoutError)
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    def done(self):
        return self.ended or self.cancelled

    def cancel(self):
        self.cancelled = True


def test_a_round_whose_all_reduce_runs_at_the_timeout_is_waited_for_and_one_still_matching_is_cancelled():
    from hivemind.averaging.control import AveragingStage

    from swarm.averaging.overlap import finish_running_round

    running = _Round(AveragingStage.RUNNING_ALLREDUCE, [TimeoutError(), "group"])
    finish_running_round(running, 15.0, 20.0)
    assert running.waits == [15.0, 20.0] and not running.cancelled, "the group's result is used, not given up"
    matching = _Round(AveragingStage.LOOKING_FOR_GROUP, [TimeoutError(), "never"])
    finish_running_round(matching, 15.0, 20.0)
    assert matching.waits == [15.0] and matching.cancelled, "a round still matching at the timeout stops retrying"
    failed = _Round(AveragingStage.FINISHED, [RuntimeError("hop 1: no group formed")])
    finish_running_round(failed, 15.0, 20.0)
    assert failed.waits == [15.0] and not failed.cancelled


def test_a_round_still_gathering_its_group_when_it_was_missed_is_cancelled_at_once():
    """(swarm.averaging.overlap.finish_running_round) ``missed`` is asked between short waits while the round
    gathers its group; once it says the stage-mates ended the round without this server, the round is cancelled
    without waiting out the timeout. A round whose all-reduce runs is never judged missed."""
    from hivemind.averaging.control import AveragingStage

    from swarm.averaging.overlap import finish_running_round

    class Waited(_Round):  # a wait that times out takes its time
        def result(self, timeout):
            if isinstance(self.outcomes[0], TimeoutError):
                time.sleep(timeout)
            return super().result(timeout)

    asked = []
    gathering = Waited(AveragingStage.LOOKING_FOR_GROUP, [TimeoutError()] * 10)
    assert finish_running_round(gathering, 15.0, 20.0, lambda: asked.append(1) or len(asked) >= 3, poll_s=0.05)
    assert gathering.cancelled and gathering.waits == [0.05] * 3, "it waited on after the round was missed"
    running = Waited(AveragingStage.RUNNING_ALLREDUCE, [TimeoutError(), "group"])
    assert not finish_running_round(running, 0.5, 20.0, lambda: True, poll_s=0.05)
    assert running.ended and not running.cancelled, "a running all-reduce was given up"
    never = Waited(AveragingStage.LOOKING_FOR_GROUP, [TimeoutError()] * 10)
    assert not finish_running_round(never, 0.3, 20.0, lambda: False, poll_s=0.25)
    assert never.cancelled and len(never.waits) == 2 and sum(never.waits) <= 0.3 + 1e-6


def test_a_stage_mate_that_pushed_a_later_epoch_moves_the_median_only_with_most_of_them():
    """(SampleCountTracker.mates_moved_past) The stage-mates' pushed epochs, read without the tracker's lock: the
    lower median of those of the roster that count in full."""
    from hivemind.utils import get_dht_time

    from swarm.averaging.progress import ProgressTrust, SampleCountTracker
    from swarm.protocol import ProgressPush

    ((key, dht),) = keyed_dhts(1)
    tracker = SampleCountTracker(dht=dht, prefix="moved", target_batch_size=1000, start=True)
    mates = [b"mate-a", b"mate-b", b"mate-c"]

    def push(mate: bytes, epoch: int) -> None:
        tracker.receive(mate, ProgressPush(run_id="r", stage=0, epoch=epoch, samples=0, samples_per_s=1.0,
                                           time=get_dht_time()))
    try:
        tracker.set_roster(lambda: frozenset({tracker.progress_key, *mates}))
        assert not tracker.mates_moved_past(3), "no push: nothing is known"
        push(mates[0], 4)
        assert tracker.mates_moved_past(3) and not tracker.mates_moved_past(4)
        push(mates[1], 3)
        assert not tracker.mates_moved_past(3), "one of two mates ahead is not most of them"
        push(mates[2], 4)
        assert tracker.mates_moved_past(3)
        tracker.set_roster(lambda: frozenset({tracker.progress_key, *mates}),
                           lambda: ProgressTrust(verified=frozenset({mates[1]})))
        assert not tracker.mates_moved_past(3), "mates that do not count in full moved it"
        tracker.set_roster(lambda: frozenset({tracker.progress_key, mates[1]}))
        assert not tracker.mates_moved_past(3), "mates out of the roster moved it"
        tracker.receive(mates[1], ProgressPush(run_id="r", stage=0, epoch=3, samples=8, samples_per_s=1.0,
                                               time=get_dht_time()))
        assert tracker.pushed_working(3) == {mates[1]} and not tracker.pushed_working(4), "(MemberTable.working)"
    finally:
        tracker.shutdown()
        dht.shutdown()


@pytest.mark.timeout(180)
def test_a_server_whose_stage_mates_ended_its_round_without_it_stops_waiting_and_loads_their_state():
    """A server still gathering its round's group when its stage-mate pushes a later epoch (their round ended
    without it: it joined, or saw the epoch's end, after their group formed) cancels the round instead of waiting
    out ``averaging_timeout`` with its compute thread held (a late joiner of the demo held it 42 s, and the
    trainers' micro-batches with it), steps, and loads the stage's state at its next micro-batch."""
    from hivemind.averaging.control import AveragingStage
    from hivemind.utils import get_dht_time

    from swarm.protocol import ProgressPush

    with _two_servers("missed") as (late, mate):
        micro = TINY.training.micro_batch_size
        mate.step(_gradients(mate.module, 99), micro, "trainer1")  # counted, then it never ends its epoch
        late.step(_gradients(late.module, 0), micro, "trainer0")
        assert late.wait_until_counted(2, timeout=30), "the server never counted its stage-mate"
        pushed = threading.Event()

        def push_once_gathering() -> None:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                round_ = late._opt.scheduled_grads
                if round_ is not None and round_.stage == AveragingStage.LOOKING_FOR_GROUP:
                    late.receive_progress(mate._opt.tracker.progress_key, ProgressPush(
                        run_id="missed", stage=0, epoch=1, samples=0, samples_per_s=1.0, time=get_dht_time()))
                    pushed.set()
                    return
                time.sleep(0.05)

        pusher = threading.Thread(target=push_once_gathering, daemon=True)
        pusher.start()
        for i in range(1, 4 * MICRO_BATCHES):
            if late.step(_gradients(late.module, i), micro, "trainer0"):
                break
        pusher.join(5)
        assert pushed.is_set() and late.epoch == 1, "the server never ended its epoch with a round gathering"
        assert late._opt.missed_round, "the round was waited out, not given up as missed"
        assert late._opt.scheduled_grads.done(), "the missed round still runs"
        reloads = late.reloads
        late.step(_gradients(late.module, 500), micro, "trainer0")
        assert late.reloads == reloads + 1 and not late._opt.missed_round, "it did not load the stage's state"
