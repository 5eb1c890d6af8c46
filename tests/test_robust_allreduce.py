"""The robust all-reduce between real hivemind averager processes (DHT, p2pd, matchmaking) on loopback."""

from __future__ import annotations

import contextlib
import math
import time

import pytest
import torch

from swarm.attacks import ByzantineGradientAverager, make_attack
from swarm.averaging.aggregation import make_aggregator
from swarm.averaging.averager import AveragingRules, RobustGradientAverager
from swarm.averaging.compression import make_compressor
from swarm.averaging.exclusion import ExclusionPolicy
from swarm.averaging.matchmaking import uncounted_room
from swarm.averaging.membership import MemberTable
from swarm.identity import Identity
from tests.conftest import keyed_dhts

SHAPES = [(300, 40), (40,)]


@contextlib.contextmanager
def averagers(n: int, *, aggregator="mean", compression="none", attack=None, attackers=0, audit=0.25,
              flag_penalty=0.5, group_size="all", matchmaking_time=2.0, rules_group_size=0, **compressor):
    nodes, avs = keyed_dhts(n), []
    try:
        rules = AveragingRules(aggregator=make_aggregator(aggregator), phase_timeout=10.0, audit_probability=audit,
                               exclusion=ExclusionPolicy(threshold=3.0, flag_penalty=flag_penalty),
                               group_size=rules_group_size)
        for i, (ident, dht) in enumerate(nodes):
            params = [torch.nn.Parameter(torch.zeros(s)) for s in SHAPES]
            kind, extra = RobustGradientAverager, {}
            if i >= n - attackers:  # a Byzantine peer: the attack is installed from outside, as a subclass
                kind, extra = ByzantineGradientAverager, {"attack": make_attack(attack, n=n, f=attackers)}
            avs.append(kind(
                params, dht=dht, prefix="robust-test", compressor=make_compressor(compression, **compressor), rules=rules,
                target_group_size=n if group_size == "all" else group_size, min_matchmaking_time=matchmaking_time,
                request_timeout=1.0, allreduce_timeout=30,
                identity=ident, start=True, **extra))
        yield avs
    finally:
        for av in avs:
            av.shutdown()
        for _, dht in nodes:
            dht.shutdown()


def one_round(avs, grads, weights):
    """Each peer accumulates its gradients (``weights[i]`` samples) and averages; returns results, group sizes."""
    for av, g, w in zip(avs, grads, weights):
        for p, t in zip(av.parameters, g):
            p.grad = t.clone()
        av.accumulate_grads_(batch_size=w)
    controls = [av.step(wait=False, timeout=40) for av in avs]
    groups = []
    for c in controls:
        try:
            groups.append(len(c.result()))
        except Exception:
            groups.append(0)
    outs = []
    for av in avs:
        with av.get_tensors() as tensors:
            outs.append([t.clone() for t in tensors])
        av.notify_used_averaged_gradients()
    return outs, groups


def _accumulate(avs, grads) -> None:
    """Give each averager its gradients (``grads[i]`` for ``avs[i]``) as one accumulated sample."""
    for av, g in zip(avs, grads):
        for p, t in zip(av.parameters, g):
            p.grad = t.clone()
        av.accumulate_grads_(batch_size=1)


def _reports_when(avs, predicate, timeout: float) -> list[dict]:
    """The averagers' reports once ``predicate(reports)`` holds, or after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        reports = [av.report() for av in avs]
        if predicate(reports) or time.monotonic() > deadline:
            return reports
        time.sleep(0.5)


@pytest.mark.parametrize("group_size, told, uncounted", [(None, True, ""), (2, False, ""), (None, True, "idle"),
                                                      (None, True, "mate")],
                         ids=["told-the-members", "own-group-size", "an-idle-key-unvouched", "a-mate-unvouched"])
def test_a_complete_group_begins_its_round_before_the_window_ends(group_size, told, uncounted):
    """Servers set no ``target_group_size`` (a stage's size changes): told the stage's members, matchmaking
    assembles the group once all joined, long before a 60 s window ends (otherwise the group forms when it
    ends). An averager told nothing keeps the group size it was built with. A member the recognition does not vouch
    for is waited for once it shows: an idle key that never does holds up no group (before: every round waited out
    the window), a mate that asks to join is taken in at once."""
    with averagers(2, group_size=group_size, matchmaking_time=60.0) as avs:
        members = MemberTable(30.0, {str(av.peer_id): (0.0, time.time()) for av in avs})  # settled, live
        if uncounted == "idle":
            idle = Identity.generate().p2p_id
            members = MemberTable(30.0, members.entries | {idle: (0.0, time.time())}, frozenset({idle}))
        elif uncounted == "mate":
            members = MemberTable(30.0, members.entries, frozenset({str(avs[1].peer_id)}))
        for av in avs:
            if told:
                av.set_members(members)
        grads = _grads(2, seed=3)
        _accumulate(avs, grads)
        controls = [av.step(wait=False, timeout=90) for av in avs]
        assert [len(c.result(timeout=30)) for c in controls] == [2, 2]  # the window closes only after 60 s
        expected = [(a + b) / 2 for a, b in zip(*grads)]
        for av in avs:
            with av.get_tensors() as tensors:
                for t, e in zip(tensors, expected):
                    torch.testing.assert_close(t, e)


@pytest.mark.timeout(180)
def test_members_the_recognition_does_not_vouch_for_never_outnumber_the_counted_in_a_group():
    """Two unvouched members beside one counted server: one joins its group, the other finds none (no counted
    server takes it, and it follows no unvouched leader). Before, the three formed one group: four junk-sending keys
    beside a stage's two honest servers filled its groups of six, outvoted the robust rule and were vouched for."""
    with averagers(3, group_size="all", matchmaking_time=5.0) as avs:  # (built to wait for all three)
        ids = [str(av.peer_id) for av in avs]
        table = MemberTable(30.0, {p: (0.0, time.time()) for p in ids}, frozenset(ids[1:]))
        for av in avs:
            av.set_members(table)
        _accumulate(avs, _grads(3, seed=5))
        controls = [av.step(wait=False, timeout=40) for av in avs]
        sizes = []
        for c in controls:
            try:
                sizes.append(len(c.result(timeout=90)))
            except Exception:
                sizes.append(0)
        assert sizes[0] == 2 and sorted(sizes) == [0, 2, 2], sizes
    # the rule: beside c counted members, at most max(c - 1, 1) unvouched ones (the counted keep a strict majority)
    assert [uncounted_room(2, j) for j in range(3)] == [True, False, False]
    assert [uncounted_room(1, j) for j in range(2)] == [True, False]
    assert [uncounted_room(4, j) for j in range(4)] == [True, True, True, False]


def _grads(n, seed):
    gen = torch.Generator().manual_seed(seed)
    base = [torch.randn(s, generator=gen) for s in SHAPES]
    return [[b + 0.3 * torch.randn(b.shape, generator=gen) for b in base] for _ in range(n)]


@pytest.mark.timeout(180)
def test_mean_without_liars_is_exactly_the_weighted_mean_on_every_peer():
    grads, weights = _grads(3, seed=1), [4, 8, 12]
    with averagers(3, audit=0.0) as avs:  # no audit traffic: the byte count is the all-reduce's alone
        outs, groups = one_round(avs, grads, weights)
        assert groups == [3, 3, 3]
        for k in range(len(SHAPES)):
            expected = sum(w * g[k] for g, w in zip(grads, weights)) / sum(weights)
            for out in outs:
                assert torch.allclose(out[k], expected, atol=1e-6)
        stats = avs[0].wire.snapshot()
        numel = sum(torch.Size(s).numel() for s in SHAPES)
        # a peer sends its 2 remote parts and returns 2 aggregates: ~ 2 * 2/3 of the vector in fp32, both ways
        assert 0.9 * 4 * numel * 4 / 3 < stats["sent"] < 1.1 * 4 * numel * 4 / 3 + 4096
        assert stats["phases"] == 1 and stats["failed"] == 0
        assert all(av.report()["excluded"] == {} for av in avs)


NUMEL = sum(torch.Size(s).numel() for s in SHAPES)


def _chunks(tensors) -> torch.Tensor:
    """The flat vector of ``tensors`` (shaped as SHAPES), padded to whole chunks of 64: ``(chunks, 64)``."""
    return torch.nn.functional.pad(torch.cat([t.flatten() for t in tensors]), (0, -NUMEL % 64)).view(-1, 64)


def _sparse_round(compression, aggregator, attackers, seed, **compressor):
    """One round of 3 honest peers (plus ``attackers`` sign-flippers) with a top-k compressor on chunks of 64;
    returns (the honest peers' gradients, their results as :func:`_chunks`, the first peer's wire counters)."""
    n = 3 + attackers
    grads = _grads(n, seed=seed)
    with averagers(n, aggregator=aggregator, compression=compression, attack="sign_flip" if attackers else None,
                   attackers=attackers, audit=0.0, chunk=64, bits=4, **compressor) as avs:
        outs, groups = one_round(avs, grads, [8] * n)
        assert groups[:3] == [n] * 3
        return grads[:3], [_chunks(out) for out in outs[:3]], avs[0].wire.snapshot()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("aggregator,attackers", [("mean", 0), ("centered_clip", 1)])
def test_topk_peers_choose_the_same_chunks_and_aggregate_them_robustly(aggregator, attackers):
    """compression = "topk": every honest peer derives the same chunks from the aggregated scores, ends with the
    same result bit for bit, zero outside those chunks and near the honest mean on them (4-bit values, one
    round, so each peer's rounding error is in it); a sign-flipping attacker moves it little under CenteredClip.
    The wire carries the scores and the chosen values only (< 1/4 of fp32 with this tiny vector: chunks of 64, a quarter kept)."""
    grads, flat, stats = _sparse_round("topk", aggregator, attackers, seed=3, fraction=0.25)
    assert all(torch.equal(f, flat[0]) for f in flat)
    chosen = flat[0].ne(0).any(dim=1)
    assert int(chosen.sum()) == math.ceil(len(chosen) / 4)
    mean = _chunks([torch.stack([g[k] for g in grads]).mean(0) for k in range(len(SHAPES))])
    err = float((flat[0][chosen] - mean[chosen]).norm() / mean[chosen].norm())
    assert err < (0.3 if attackers else 0.15), err
    assert stats["phases"] == 2, stats
    if not attackers:  # (with an attacker, rejections and their messages add bytes that vary from run to run)
        # fp32 would send 4/3 of the vector (see above); here the messages' fixed overhead (metadata, signed
        # commitments: ~1 KB each) dominates a vector this small
        assert stats["sent"] < 4 * NUMEL * 4 / 3 / 4, stats


@pytest.mark.timeout(300)
@pytest.mark.parametrize("aggregator,attackers", [("mean", 0), ("centered_clip", 1)])
def test_chunk_topk_peers_send_their_own_values_and_agree_on_the_union(aggregator, attackers):
    """compression = "chunk_topk": each peer sends the 8 largest values of each chunk of 64 with their positions;
    the honest peers end with the same result bit for bit, non-zero only on the union of their choices (and the
    attacker's) and near the mean of their sparse vectors there; the wire carries a fraction of fp32's bytes."""
    grads, flat, stats = _sparse_round("chunk_topk", aggregator, attackers, seed=5, fraction=1 / 8)
    assert all(torch.equal(f, flat[0]) for f in flat)
    sparse = []
    for g in grads:
        c = _chunks(g)
        kept = c.abs().topk(8, dim=1).indices
        sparse.append(torch.zeros_like(c).scatter_(1, kept, c.gather(1, kept)))
    union = torch.stack(sparse).ne(0).any(dim=0)
    assert not flat[0][~union].ne(0).any() or attackers, "without an attacker the result lives on the union"
    assert flat[0][union].ne(0).float().mean() > 0.9
    mean = torch.stack(sparse).mean(0)
    err = float((flat[0] - mean).norm() / mean.norm())
    assert err < (0.35 if attackers else 0.12), err  # 4-bit values: ~0.08 of rounding without an attacker
    if not attackers:
        assert stats["phases"] == 1 and stats["sent"] < 4 * NUMEL * 4 / 3 / 3, stats


@pytest.mark.timeout(300)
@pytest.mark.parametrize("aggregator,attack,compression", [
    ("centered_clip", "sign_flip", "blockwise8bit"),
    ("median", "noise", "none"),
    ("trimmed_mean", "sign_flip", "float16"),
    ("mean", "sign_flip", "none"),
])
def test_a_byzantine_peer_is_bounded_and_excluded(aggregator, attack, compression):
    """1 attacker of 4 real peers: robust rules keep the honest peers equal and near the honest mean, the
    attacker is excluded within a few rounds and then left out of groups; the mean is the control that fails."""
    n = 4
    # flags weigh 1 here (0.5 by default) so that a flagged-only attacker is excluded in 4 rounds, not 9
    with averagers(n, aggregator=aggregator, compression=compression, attack=attack, attackers=1,
                   flag_penalty=1.0) as avs:
        honest_ids = {str(av.peer_id) for av in avs[:-1]}
        errors, groups_seen, failed = [], [], []
        attacker = str(avs[-1].peer_id)
        for r in range(8):
            if r >= 4 and aggregator == "mean":
                break
            if groups_seen and groups_seen[-1] == n - 1:
                break  # excluded and left out of a group
            grads = _grads(n, seed=10 + r)
            outs, groups = one_round(avs, grads, [8] * n)
            if not all(groups[: n - 1]):
                # the round failed for an honest peer (on a loaded box a reducer can miss its deadline: every
                # member then keeps its own gradient, no partial result): nothing to compare this round
                failed.append(groups)
                continue
            groups_seen.append(groups[0])
            honest_mean = torch.cat([torch.stack([g[k] for g in grads[:-1]]).mean(0).flatten()
                                     for k in range(len(SHAPES))])
            for out in outs[1:-1]:
                assert all(torch.equal(a, b) for a, b in zip(out, outs[0])), "honest peers disagree"
            got = torch.cat([t.flatten() for t in outs[0]])
            errors.append(float((got - honest_mean).norm() / honest_mean.norm()))
        assert len(failed) <= 2 and errors, f"too many failed rounds: {failed}"
        reports = [av.report() for av in avs[:-1]]
        if aggregator == "mean":
            assert max(errors) > 1.0, f"the mean should be captured by {attack}: {errors}"
            return
        assert max(errors) < 0.35, errors
        assert all(attacker in rep["excluded"] for rep in reports), reports
        assert not any(h in rep["excluded"] for rep in reports for h in honest_ids)
        assert groups_seen[-1] == n - 1, groups_seen  # the excluded peer is no longer in the group


@pytest.mark.timeout(300)
def test_a_lying_reducer_is_caught_by_an_audit_and_every_honest_peer_verifies_the_accusation():
    n = 4
    with averagers(n, aggregator="centered_clip", attack="lying_reducer", attackers=1, audit=1.0) as avs:
        liar = str(avs[-1].peer_id)
        for r in range(6):
            one_round(avs, _grads(n, seed=30 + r), [8] * n)
            reports = [av.report() for av in avs[:-1]]
            if all(liar in rep["excluded"] for rep in reports):
                break
        assert all(liar in rep["excluded"] for rep in reports), reports
        reasons = [rep["excluded"][liar] for rep in reports]
        assert any(r.startswith("audit:") for r in reasons) and any(r.startswith("verified accusation") for r in reasons)
        honest = {str(av.peer_id) for av in avs[:-1]}
        assert not any(h in rep["excluded"] for rep in reports for h in honest)
        outs, groups = one_round(avs, _grads(n, seed=99), [8] * n)
        assert groups[:-1] == [n - 1] * (n - 1) and groups[-1] == 0  # the liar finds no group any more
        assert all(torch.equal(a, b) for out in outs[1:-1] for a, b in zip(out, outs[0]))


@pytest.mark.timeout(300)
def test_a_false_accusation_is_refuted_and_excludes_the_accuser_not_the_honest_reducer():
    n = 4
    with averagers(n, aggregator="mean", attack="false_accuser", attackers=1, audit=1.0) as avs:
        accuser = str(avs[-1].peer_id)
        honest = {str(av.peer_id) for av in avs[:-1]}

        def refuted(reports) -> bool:
            return sum(accuser in rep["excluded"] for rep in reports) >= n - 2

        for r in range(6):
            one_round(avs, _grads(n, seed=50 + r), [8] * n)
            # the accusation poller reads the DHT every 3 s: wait (bounded) for it to verify what it found
            reports = _reports_when(avs[:-1], refuted, timeout=8.0)
            if refuted(reports):
                break
        assert not any(h in rep["excluded"] for rep in reports for h in honest), reports
        # every honest peer but the one it accused (which cannot verify a claim about itself) refutes it
        assert refuted(reports), reports
        assert all("false accusation" in rep["excluded"][accuser] for rep in reports if accuser in rep["excluded"])


@pytest.mark.timeout(60)
def test_after_a_failed_round_a_server_steps_on_its_own_gradient_not_zeros():
    [(ident, dht)] = keyed_dhts(1)
    try:
        params = [torch.nn.Parameter(torch.zeros(s)) for s in SHAPES]
        av = RobustGradientAverager(params, dht=dht, prefix="fallback", identity=ident, start=False)
        grads = _grads(2, seed=3)
        for g in grads:
            av.accumulate("t0", [t.clone() for t in g], 4)
        av.load_accumulators_into_averager_()  # what GradientAverager.step does before the round ...
        av.reset_accumulated_grads_()          # ... and after handing the gradient to it
        av.load_accumulators_into_averager_()  # hivemind's fallback after a failed round
        with av.get_tensors() as tensors:
            for k, t in enumerate(tensors):
                assert torch.allclose(t, (grads[0][k] + grads[1][k]) / 2, atol=1e-6)
    finally:
        dht.shutdown()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("working", [True, False], ids=["computing", "idle"])
def test_an_unvouched_member_whose_pushed_count_holds_samples_of_the_epoch_is_waited_for(working):
    """(MemberTable.working) A settled member the recognition does not vouch for, whose pushed count holds samples of
    the epoch, is waited for by the early start as if it had shown: it asks to join after both counted members are
    in, and averages with them (a newcomer on a slow link lost that race at every epoch's end, so it was never in a
    round, never verified, never counted). An idle one (no samples pushed) holds up no group."""
    with averagers(3, group_size=None, matchmaking_time=30.0) as avs:
        ids = [str(av.peer_id) for av in avs]
        newcomer = frozenset({ids[2]})
        table = MemberTable(30.0, {p: (0.0, time.time()) for p in ids}, newcomer,
                            newcomer if working else frozenset())
        for av in avs:
            av.set_members(table)
        grads = _grads(3, seed=11)
        _accumulate(avs, grads)
        counted = [av.step(wait=False, timeout=60) for av in avs[:2]]
        deadline = time.monotonic() + 8.0  # the two counted members' group forms within a second when not waiting
        while not all(c.done() for c in counted) and time.monotonic() < deadline:
            time.sleep(0.2)
        if not working:
            assert [len(c.result(timeout=30)) for c in counted] == [2, 2], "an idle unvouched member held the group"
            return
        assert not any(c.done() for c in counted), "the group began without the member that computes this epoch"
        late = avs[2].step(wait=False, timeout=60)
        assert [len(c.result(timeout=30)) for c in [*counted, late]] == [3, 3, 3]
        expected = [(a + b + c) / 3 for a, b, c in zip(*grads)]
        for av in avs:
            with av.get_tensors() as tensors:
                for t, e in zip(tensors, expected):
                    torch.testing.assert_close(t, e)
