"""A state loaded from a live server (a donor) is kept only if it verifies: the judging rule, and a lying donor
refused over real hivemind averagers (DHT and p2pd on loopback)."""

from __future__ import annotations

import threading
import time
from concurrent import futures

import pytest
import torch

from swarm.attacks import LyingDonorAverager
from swarm.averaging import donors as donors_module
from swarm.averaging import optimizer as optimizer_module
from swarm.averaging.averager import TransitionInFlight
from swarm.averaging.optimizer import StageOptimizer
from swarm.model import build_stage
from swarm.protocol import CheckpointManifest
from swarm.trust.statecheck import Verdict, judge_donor_state
from tests.conftest import TINY, keyed_dhts

A, B = "a" * 64, "b" * 64
MICRO_BATCHES = TINY.training.target_batch_size // TINY.training.micro_batch_size  # per epoch


def _manifest(epoch: int, state: str) -> CheckpointManifest:
    return CheckpointManifest.model_construct(epoch=epoch, state_sha256=state, stage=0)


def test_a_majority_of_the_other_servers_vouches_for_the_state():
    vouched = judge_donor_state(9, A, {"x": (9, A), "y": (10, A), "z": (9, B)}, [])
    assert vouched.ok and vouched.shared
    refused = judge_donor_state(9, A, {"x": (9, B), "y": (10, B), "z": (9, A)}, [])
    assert not refused.ok and refused.contradicted and "2 of the 3 other servers" in refused.why
    tie = judge_donor_state(9, A, {"x": (9, A), "y": (9, B)}, [])
    assert not tie.ok and not tie.contradicted, "a tie is no majority, nor a contradiction"
    # servers that cannot vouch (joined after the epoch) do not count either way
    assert judge_donor_state(9, A, {"x": (9, A), "late": (12, "")}, []).ok


def test_the_run_keys_recognition_weighs_the_answers_only_where_the_servers_standing_knows_none_of_them():
    """A fresh joiner (no standing) weighs the answers by the run key's recognition: two recognized servers outvote
    three fresh keys. A server that reloads and verified the donor but none of the holders keeps the donor's state
    as before the recognition existed: the recognized holders, which differ among themselves between two state
    rounds of a stage in bounded groups, do not stop it re-syncing (a lagging server of tests/test_scale.py never
    re-synced when they did)."""
    recognized = {"r1", "r2", "donor"}
    named = lambda peer: 1.0 if peer in recognized else 0.0  # noqa: E731
    joiner = judge_donor_state(9, A, {"r1": (9, A), "r2": (9, A), "s1": (9, B), "s2": (9, B), "s3": (9, B)}, [],
                               weight=lambda p: 0.0, donor="x", named=named)
    assert joiner.ok and "the run key recognizes" in joiner.why
    C = "c" * 64
    standing = {"donor": 1.0}
    reloading = judge_donor_state(9, A, {"r1": (9, B), "r2": (9, C)}, [], weight=lambda p: standing.get(p, 0.0),
                                  donor="donor", named=named)
    assert reloading.ok and "this server verified the donor" in reloading.why
    assert not reloading.shared, "kept on the donor's word, against holders of other states: out of sync"
    # by the recognition alone those two would leave the donor unverified (no majority either way)
    assert not judge_donor_state(9, A, {"r1": (9, B), "r2": (9, C)}, [], weight=lambda p: 0.0, donor="x",
                                 named=named).ok


def test_holders_that_differ_among_themselves_leave_the_donor_unverified_not_contradicted():
    """Between two state rounds the honest servers of a stage averaging in bounded groups hold different states
    (each group applied its own average): no majority holds the donor's state, nor any one other, so the donor is
    retried soon (RETRY_S) rather than shunned (REFUSAL_S) -- by count and by weight alike."""
    C, D = "c" * 64, "d" * 64
    unsettled = {"x": (9, B), "y": (9, C), "z": (9, D)}
    by_count = judge_donor_state(9, A, unsettled, [])
    assert not by_count.ok and not by_count.contradicted
    by_weight = judge_donor_state(9, A, unsettled, [], weight=lambda p: 1.0, donor="d")
    assert not by_weight.ok and not by_weight.contradicted
    # one other state held by most of them (count or weight) is a contradiction
    assert judge_donor_state(9, A, {"x": (9, B), "y": (9, B), "z": (9, C)}, []).contradicted
    heavy = {"x": 1.0, "y": 0.1, "z": 0.1}
    assert judge_donor_state(9, A, unsettled, [], weight=lambda p: heavy[p], donor="d").contradicted  # B: 1.0 of 1.2
    assert not judge_donor_state(9, A, unsettled | {"w": (9, C)}, [], weight=lambda p: heavy.get(p, 1.0),
                                 donor="d").contradicted  # B: 1.0, C: 1.1 of 2.2


def test_keys_that_never_averaged_with_the_receiver_are_no_majority_for_or_against_a_state():
    """A server that reloads its stage's state weighs the answers by the averaging work it verified each server
    doing (swarm.trust.standing): three fresh keys answering another digest are no majority against an honest donor
    it knows, nor for a lying donor of theirs; a fresh joiner (no standing at all) still counts heads."""
    sybils = {"s1": (9, B), "s2": (9, B), "s3": (9, B)}
    standing = {"honest": 1.0, "mate": 0.5}
    weight = lambda peer: standing.get(peer, 0.0)  # noqa: E731
    # the honest donor it verified, against three weightless keys holding another state
    kept = judge_donor_state(9, A, sybils, [], weight=weight, donor="honest")
    assert kept.ok and "this server verified the donor" in kept.why
    assert not kept.shared  # maybe the donor's own state (its round failed): its receiver says it is out of sync
    alike = judge_donor_state(9, A, {"s1": (9, A), "s2": (9, A), "s3": (9, B)}, [], weight=weight, donor="honest")
    assert alike.ok and alike.shared  # most holders hold the state kept: the stage's
    # ... but a donor's word alone never vouches for an epoch nobody else holds (rule 3), nor outvotes a verified mate
    assert not judge_donor_state(9, A, {"s1": (8, "")}, [], weight=weight, donor="honest").ok
    assert not judge_donor_state(9, A, {"mate": (9, B)}, [], weight=weight, donor="honest").ok
    assert not judge_donor_state(9, A, sybils, []).ok, "by head count the three keys win"
    # a lying donor of theirs (weightless, their digest) is refused by the one mate it verified
    lie = judge_donor_state(9, B, {"s2": (9, B), "s3": (9, B), "mate": (9, A)}, [], weight=weight, donor="s1")
    assert not lie.ok and lie.contradicted and "0.50 of the 0.50 weight" in lie.why
    # standing decides between verified holders: the heavier side wins
    assert judge_donor_state(9, A, {"honest": (9, A), "mate": (9, B)}, [], weight=weight, donor="d").ok
    # nobody verified (a fresh joiner): rule 2 by count, as without weights
    assert judge_donor_state(9, A, {"x": (9, A), "y": (9, A), "z": (9, B)}, [], weight=lambda p: 0.0, donor="d").ok


def test_a_donor_ahead_of_its_stage_or_behind_its_checkpoint_is_refused():
    ahead = judge_donor_state(1_000_000, A, {"x": (9, ""), "y": (9, "")}, [])
    assert not ahead.ok and "none of the 2 other servers vouches" in ahead.why
    old = judge_donor_state(4, A, {"x": (4, A)}, [_manifest(6, B)])
    assert not old.ok and "older than the stage's newest checkpoint (epoch 6)" in old.why


def test_a_checkpoint_of_the_same_epoch_decides():
    assert judge_donor_state(6, A, {"x": (6, B)}, [_manifest(6, A)]).ok
    assert not judge_donor_state(6, A, {"x": (6, A)}, [_manifest(6, B)]).ok


def test_a_donor_alone_in_its_stage_is_kept_unverified():
    verdict = judge_donor_state(9, A, {}, [])
    assert verdict.ok and verdict.why.startswith("unverified")
    # listed servers that do not answer are no proof that the donor is alone
    silent = judge_donor_state(9, A, {}, [], listed=2)
    assert not silent.ok and not silent.contradicted and "0 answered" in silent.why


@pytest.mark.timeout(120)
def test_the_other_servers_are_asked_over_rpc_and_one_behind_is_waited_for(tiny_spec):
    """Three live stage servers answer ``rpc_state_digest``; the donor is not asked; a server one epoch behind
    the donor is asked again until it reaches the epoch; a listed server that does not answer is left out."""
    import asyncio
    from types import SimpleNamespace

    from swarm.protocol import ServerInfo
    from swarm.server.stage import StageServer
    from swarm.trust.statecheck import DonorStateCheck

    nodes = keyed_dhts(5)  # the checker, three servers, and a peer that serves no stage (a stale record)
    servers = [StageServer(tiny_spec, "rpc-run", 0) for _ in range(3)]
    epochs = [5, 5, 4]
    for server, epoch, digest in zip(servers, epochs, (A, B, "")):
        server.optimizer = SimpleNamespace(epoch=epoch)
        if digest:
            server.state_digests[5] = digest
    x, y, z, gone = (str(d.peer_id) for _, d in nodes[1:])
    listed = [ServerInfo.model_construct(p2p_id=p, stage=0, peer_id=p) for p in (x, y, z, gone)]

    async def scenario():
        for server, (_, dht) in zip(servers, nodes[1:4]):
            await server.add_p2p_handlers(await dht.replicate_p2p(), namespace="rpc-run")
        async def listed_servers():
            return listed

        async def no_checkpoints():
            return []

        check = DonorStateCheck(await nodes[0][1].replicate_p2p(), "rpc-run", listed_servers, no_checkpoints,
                                me=str(nodes[0][1].peer_id), wait_s=20, timeout_s=2)

        async def catch_up():  # z reaches epoch 5 a second later, with the stage's state
            await asyncio.sleep(1.0)
            servers[2].state_digests[5] = A
            servers[2].optimizer.epoch = 5

        task = asyncio.create_task(catch_up())
        kept = await check.judge(5, A, donor=y)
        await task
        refused = await check.judge(5, B, donor=x)  # y holds B, z holds A: a tie
        return kept, refused

    try:
        kept, refused = asyncio.run(scenario())
        assert kept.ok and kept.why.startswith("2 of the 2 other servers"), kept
        assert not refused.ok and "1 of the 2 other servers" in refused.why, refused
    finally:
        for server in servers:
            server.shutdown()
        for _, dht in nodes:
            dht.shutdown()


def _gradients(module: torch.nn.Module, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [0.01 * torch.randn(p.shape, generator=gen) for p in module.parameters()]


def _declared(dht, prefix: str) -> dict:
    found = dht.get(f"{prefix}.all_averagers", latest=True)
    return {} if found is None else {k: v.value for k, v in found.value.items()}


@pytest.mark.timeout(240)
def test_a_lying_donor_is_refused_and_the_state_comes_from_an_honest_one():
    """An honest server trains two epochs; a lying donor (a state averager that adds noise to the parameters it
    hands out and declares a priority 1000 epochs ahead, so it is asked first) loads the state from it; a third
    server loads the stage's state with a check: it refuses the liar, takes the honest server's state, and
    names the liar; kept on the donor's word alone (not as the stage's), it says its parameters are out of sync."""
    nodes = keyed_dhts(3)
    modules = [build_stage(TINY.model, 0) for _ in nodes]
    optimizers = []
    try:
        (k0, d0), (k1, d1), (k2, d2) = nodes
        honest = StageOptimizer(TINY, "donors", 0, d0, modules[0], identity=k0)
        optimizers.append(honest)
        honest.jump_to_epoch(0)
        for i in range(2 * MICRO_BATCHES):
            honest.step(_gradients(modules[0], i), TINY.training.micro_batch_size, "trainer0")
        assert honest.epoch == 2
        liar = StageOptimizer(TINY, "donors", 0, d1, modules[1], identity=k1,
                              state_averager_factory=LyingDonorAverager)
        optimizers.append(liar)
        assert liar.load_state_from_peers() == 2  # the liar itself loads honestly
        deadline = time.monotonic() + 60
        while not any(v >= 1000 for v in _declared(d2, "donors-stage0_state_averager").values()):
            assert time.monotonic() < deadline, "the liar never declared itself a donor"
            time.sleep(0.2)
        truth = honest.state_digest()
        asked: list[tuple[int, str]] = []

        def check(epoch: int, digest: str, donor: str):
            asked.append((epoch, donor))
            # kept on the donor's word alone (holders of other states had no standing with the joiner)
            return Verdict(True, "the donor's word", shared=False) if digest == truth else \
                Verdict(False, "another state than the stage's", contradicted=True)

        joiner = StageOptimizer(TINY, "donors", 0, d2, modules[2], identity=k2, state_check=check)
        optimizers.append(joiner)
        assert joiner.load_state_from_peers() >= 2
        assert [donor for _, donor in asked] == [str(d1.peer_id), str(d0.peer_id)], asked
        assert joiner.donors_refused.keys() == {str(d1.peer_id)}
        mine, theirs = joiner.state(), honest.state()
        assert not [k for k in theirs if not torch.equal(mine[k], theirs[k])], "the joiner kept another state"
        assert not joiner.synced, "a state nobody vouched for as the stage's may be its donor's own: out of sync"
    finally:
        for o in optimizers:
            o.shutdown()
        for _, dht in nodes:
            dht.shutdown()


@pytest.mark.timeout(240)
def test_a_refused_state_is_undone_when_no_donor_verifies(monkeypatch):
    """The only donor lies: the joiner refuses it and keeps the state, epoch and schedule it had. Behind the stage,
    it is catching up: it drops micro-batches instead of reloading on each, tries a load again after ``RETRY_S``
    from its idle-epoch tick, and is no longer catching up once a load is kept."""
    monkeypatch.setattr(optimizer_module, "RETRY_S", 2.0)
    monkeypatch.setattr(donors_module, "RETRY_S", 1.0)  # (the averagers fork after this: a failed download's skip)
    nodes = keyed_dhts(2)
    modules = [build_stage(TINY.model, 0) for _ in nodes]
    optimizers = []
    try:
        (k0, d0), (k1, d1) = nodes
        liar = StageOptimizer(TINY, "alone", 0, d0, modules[0], identity=k0, state_averager_factory=LyingDonorAverager)
        optimizers.append(liar)
        liar.jump_to_epoch(0)
        for i in range(2 * MICRO_BATCHES):
            liar.step(_gradients(modules[0], i), TINY.training.micro_batch_size, "trainer0")
        deadline = time.monotonic() + 60
        while not _declared(d1, "alone-stage0_state_averager"):
            assert time.monotonic() < deadline, "the liar never declared itself a donor"
            time.sleep(0.2)
        verdicts = [Verdict(False, "nobody vouches for it")]  # (not contradicted: retried after RETRY_S)
        joiner = StageOptimizer(TINY, "alone", 0, d1, modules[1], identity=k1,
                                state_check=lambda epoch, digest, donor: verdicts[0])
        optimizers.append(joiner)
        joiner.catch_up.retry_s = 2.0
        deadline = time.monotonic() + 60
        while joiner.stage_epoch < 2:
            assert time.monotonic() < deadline, "the joiner never counted the stage's progress"
            time.sleep(0.2)
        before, lr = joiner.state(), joiner.lr
        deadline = time.monotonic() + 60
        while not joiner.donors_refused:  # a download that failed on a busy machine (a timeout) is tried again
            assert time.monotonic() < deadline, "the joiner never downloaded the liar's state"
            assert joiner.load_state_from_peers() == 0
            after = joiner.state()
            assert all(torch.equal(before[k], after[k]) for k in before) and joiner.lr == lr
            time.sleep(0.2)
        assert list(joiner.donors_refused) == [str(d0.peer_id)]
        assert joiner.catch_up.active, "behind the stage with no state kept: catching up"
        dropped, reloads = joiner.samples_dropped, joiner.reloads
        assert joiner.step(_gradients(modules[1], 0), TINY.training.micro_batch_size, "trainer0") is False
        assert (joiner.samples_dropped - dropped, joiner.reloads) == (TINY.training.micro_batch_size, reloads)
        verdicts[0] = Verdict(True, "vouched for", shared=True)
        deadline = time.monotonic() + 60
        while joiner.catch_up.active:
            assert time.monotonic() < deadline, "the joiner never loaded the state again from its idle-epoch tick"
            joiner.finish_epoch_if_ready()
            time.sleep(0.2)
        assert joiner.epoch == 2 and joiner.reloads > reloads
    finally:
        for o in optimizers:
            o.shutdown()
        for _, dht in nodes:
            dht.shutdown()


def test_the_stages_announced_servers_are_tried_as_donors_before_declared_strangers():
    """Anyone can declare itself a donor under hivemind's ``all_averagers`` key, at the highest priority: junk
    there must not use up a joining server's tries before it reaches the stage's announced servers."""
    from types import SimpleNamespace

    from hivemind.p2p import PeerID
    from hivemind.utils.timed_storage import ValueWithExpiration

    from swarm.averaging.donors import DonorChoice
    from swarm.averaging.exclusion import ExclusionBook
    from swarm.identity import Identity

    me, server, stranger = (PeerID.from_base58(Identity.generate().p2p_id) for _ in range(3))
    declared = {p.to_bytes(): ValueWithExpiration(priority, 1e12)
                for p, priority in ((me, 5), (server, 40), (stranger, 10**9))}
    choice = DonorChoice()
    choice._init_donors()
    choice.peer_id, choice.exclusions = me, ExclusionBook()
    choice.dht = SimpleNamespace(get=lambda key, latest: ValueWithExpiration(declared, 1e12))
    choice._matchmaking = SimpleNamespace(group_key_manager=SimpleNamespace(prefix="run-stage0_state_averager"))
    assert choice._donor_candidates() == [stranger, server]  # hivemind's order: the highest priority first
    choice._roster = frozenset({str(server)})
    assert choice._donor_candidates() == [server, stranger]


@pytest.mark.timeout(120)
def test_a_peer_downloads_a_servers_whole_state_only_a_few_times_a_minute():
    """hivemind's rpc_download_state streams the whole state to anyone who asks: a stranger asking again and
    again is refused past three downloads at once and one per 10 s (each costs the server its state's bytes)."""
    import asyncio

    from hivemind.p2p import PeerID
    from hivemind.proto import averaging_pb2

    from swarm.averaging.averager import RobustStateAverager

    (k0, d0), (_, stranger) = keyed_dhts(2)
    server = StageOptimizer(TINY, "download", 0, d0, build_stage(TINY.model, 0), identity=k0)
    try:
        server.jump_to_epoch(0)

        async def download(stub) -> int:
            return sum([len(msg.tensor_part.buffer) async for msg in await stub.rpc_download_state(
                averaging_pb2.DownloadRequest())])

        async def main():
            p2p = await stranger.replicate_p2p()
            stub = RobustStateAverager.get_stub(p2p, PeerID.from_base58(k0.p2p_id),
                                                namespace="download-stage0_state_averager")
            sizes = [await download(stub) for _ in range(3)]
            assert all(size > 0 for size in sizes)
            with pytest.raises(Exception, match="requests/s of yours"):
                await download(stub)

        asyncio.run(main())
    finally:
        server.shutdown()
        stranger.shutdown()
        d0.shutdown()


@pytest.mark.timeout(120)
def test_the_state_a_donor_hands_out_is_a_copy_its_next_steps_leave_alone():
    """A download streams the donor's state for as long as the link needs (seconds on a slow one) while the donor
    keeps stepping: what it hands out must be the state of one epoch, not live tensors (a torn state, which every
    check refuses, was what joiners got over 20 Mbit/s links)."""
    ((k0, d0),) = keyed_dhts(1)
    module = build_stage(TINY.model, 0)
    opt = StageOptimizer(TINY, "snapshot", 0, d0, module, identity=k0)
    try:
        opt.jump_to_epoch(0)
        for i in range(MICRO_BATCHES):
            opt.step(_gradients(module, i), TINY.training.micro_batch_size, "trainer0")
        metadata, handed, _ = opt._opt.state_averager.get_current_state()
        kept = [t.clone() for t in handed]
        for i in range(MICRO_BATCHES, 2 * MICRO_BATCHES):
            opt.step(_gradients(module, i), TINY.training.micro_batch_size, "trainer0")
        assert metadata["epoch"] == 1 and opt.epoch == 2
        assert all(torch.equal(a, b) for a, b in zip(kept, handed)), "the handed-out state moved with the donor"
        live = list(module.parameters())
        assert not all(torch.equal(a, b) for a, b in zip(handed, live)), "the donor did not step at all"

        # a transition in flight (hivemind counted the next epoch, its all-reduce and step have not run): the copy
        # waits for it, and then holds the stepped parameters with the new epoch
        averager, transition, out = opt._opt.state_averager, futures.Future(), []
        averager.pending_updates.add(transition)
        copier = threading.Thread(target=lambda: out.append(averager.get_current_state()))
        copier.start()
        copier.join(0.5)
        assert copier.is_alive() and not out, "the state was copied in the middle of a transition"
        stepped = averager.optimizer.param_groups[0]["params"][0]
        with torch.no_grad():
            stepped.add_(1.0)  # what the transition's step does to the parameters
        transition.set_result(None)
        copier.join(30)
        assert out and torch.equal(out[0][1][0], stepped)

        # a transition that outlasts the donor's wait (a round waiting on a departed stage-mate): no state at all,
        # not the next epoch's number on the last epoch's parameters and step count
        stuck = futures.Future()
        averager.pending_updates.add(stuck)
        averager.next_chunk_timeout = 1.0  # the donor waits half the joiner's wait for a first message: 0.5 s
        with pytest.raises(TransitionInFlight, match="epoch transition"):
            averager.get_current_state()
        stuck.set_result(None)
    finally:
        opt.shutdown()
        d0.shutdown()


def test_the_check_stops_waiting_for_servers_behind_once_the_weighed_holders_settle_it(monkeypatch):
    """A server behind the donor's epoch may reach it and vouch, so the check asks again every 0.5 s for up to
    wait_s; once holders with weight (standing or recognition) settled it, it asks no more. Joiners that reloaded
    together in a fast stage each waited 10 s for the others (behind, reloading too) and fell behind again: the
    patient servers of bench/sybil.py never caught up, never averaged, and were never recognized."""
    import asyncio
    from types import SimpleNamespace

    import swarm.trust.statecheck as statecheck

    asked: list[str] = []

    async def ask(p2p, server, run_id, epoch, timeout):
        asked.append(server.p2p_id)
        return (epoch, A) if server.p2p_id == "mate" else (epoch - 3, "")  # "late" is behind, reloading

    async def servers():
        return [SimpleNamespace(p2p_id=p) for p in ("mate", "late", "donor")]

    async def checkpoints():
        return []

    monkeypatch.setattr(statecheck, "ask_state_digest", ask)
    weighed = statecheck.DonorStateCheck(None, "r", servers, checkpoints, "me", wait_s=3.0,
                                         weight=lambda p: 1.0 if p == "mate" else 0.0)
    verdict = asyncio.run(weighed.judge(9, A, "donor"))
    assert verdict.ok and verdict.settled and asked == ["mate", "late"]
    asked.clear()
    by_head = statecheck.DonorStateCheck(None, "r", servers, checkpoints, "me", wait_s=1.2)
    assert asyncio.run(by_head.judge(9, A, "donor")).ok and len(asked) > 2  # counted by head: it waited for "late"
