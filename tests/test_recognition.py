"""The run key's recognition (:mod:`swarm.trust.recognition`): which servers the coordinator saw earn standing from a
stage's founders, published signed by the run key, and the cross-stage decisions it weighs (issue 29: with bench/sybil.py
four idle keys per stage made every honest server of a 2 x 2 swarm apply 17 rollbacks in 90 s)."""

from __future__ import annotations

import asyncio
import contextlib

import hivemind
import pytest
from hivemind.utils import get_dht_time

from swarm.checkpoint.rollback import order_in_force
from swarm.identity import Identity
from swarm.net.dht_validation import RunRecordValidator
from swarm.net.directory import AsyncRunDirectory, RunDirectory, recognized_refusal
from swarm.protocol import (CheckpointManifest, Endorsement, FragmentEntry, RollbackOrder, ServerInfo, ServerState,
                            Recognition, recognition_key, seal)
from swarm.protocol import MAX_VOUCHES
from swarm.server.served import (FRESH_EPOCHS, PeerContext, counted_claims, latest_verified, stopped_members,
                                 uncounted_members)
from swarm.trainer.session import resume_position
from swarm.trust.recognition import (FOUND_ALONE_S, LAPSE_S, RESEED_S, RecognitionBook, RecognitionReader, follow_recognition,
                                     publish_recognition, read_recognition)
from tests.conftest import TINY

pytestmark = pytest.mark.timeout(120)


def server(who: Identity, stage: int, vouches=(), excluded=(), generation: int = 0, throughput: float = 10.0,
           state=ServerState.ONLINE) -> ServerInfo:
    return ServerInfo(run_id="r", peer_id=who.peer_id, time=get_dht_time(), stage=stage, state=state,
                      throughput=throughput, p2p_id=who.p2p_id, vouches={v.p2p_id: 1.0 for v in vouches},
                      excluded={e.p2p_id: "a wrong aggregate" for e in excluded}, rollback_generation=generation,
                      rollback_issuer="x" if generation else "")


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_servers_are_recognized_from_a_stages_founders_along_verified_work_and_a_sybil_clique_never_is(tmp_path):
    a, b, c, *sybils = (Identity.generate() for _ in range(8))
    clock = Clock()
    book = RecognitionBook(tmp_path / "recognition.json", clock=clock)
    listed = lambda: sorted(book.listed().get(0, []))  # noqa: E731
    assert not book.update({0: [server(a, 0), server(b, 0)]}) and listed() == []  # nobody verified anybody
    clock.now += 5
    # the bench's first try: five keys that vouch for one another, and name a and b excluded, turned up in the very
    # read where a and b first vouched for each other; the book saw a and b first, so they found the stage
    clique = [server(s, 0, [t for t in sybils if t is not s], excluded=[a, b]) for s in sybils]
    assert book.update({0: [server(a, 0, [b]), server(b, 0, [a]), *clique]})
    assert listed() == sorted([a.peer_id, b.peer_id])
    book.update({0: [server(a, 0, [b]), server(b, 0, [a]), *clique]})
    assert listed() == sorted([a.peer_id, b.peer_id])  # no recognized server vouches for them
    # c did averaging work a verified: recognized, and kept across the coordinator's restart
    book.update({0: [server(a, 0, [b, c]), server(b, 0, [a]), server(c, 0), *clique]})
    assert c.peer_id in listed()
    again = RecognitionBook(tmp_path / "recognition.json", clock=clock)
    assert sorted(again.listed()[0]) == sorted([a.peer_id, b.peer_id, c.peer_id])
    # one recognized stage-mate listing c excluded is not enough; two of its three recognized mates are
    d = Identity.generate()
    book.update({0: [server(a, 0, [b, d], excluded=[c]), server(b, 0, [a]), server(c, 0), server(d, 0)]})
    assert c.peer_id in listed() and d.peer_id in listed()
    book.update({0: [server(a, 0, [b, d], excluded=[c]), server(b, 0, [a], excluded=[c]), server(c, 0),
                     server(d, 0)]})
    assert c.peer_id not in listed()
    # two recognized servers listing each other: neither is a majority of the other's mates
    book.update({0: [server(a, 0, [b], excluded=[b]), server(b, 0, [a], excluded=[a])]})
    assert {a.peer_id, b.peer_id} <= set(listed())
    # nobody vouched for d for LAPSE_S: no longer recognized (one stretch of work does not buy it for good)
    clock.now += LAPSE_S + 1
    book.update({0: [server(a, 0, [b]), server(b, 0, [a]), server(d, 0)]})
    assert listed() == sorted([a.peer_id, b.peer_id])
    # no recognized server online for RESEED_S: the stage takes new founders (the price, in the module docstring)
    clock.now += RESEED_S + 1
    book.update({0: [server(s, 0, [t for t in sybils[:2] if t is not s]) for s in sybils[:2]]})
    assert listed() == sorted(s.peer_id for s in sybils[:2])


def test_keys_paired_before_a_stages_first_two_servers_pair_found_nothing():
    """Fresh keys vouch for one another at once; honest servers only after averaging rounds. Keys seen after the
    stage's first two servers found nothing while those two have not paired."""
    a, b, s1, s2 = (Identity.generate() for _ in range(4))
    clock = Clock()
    book = RecognitionBook(clock=clock)
    book.update({0: [server(a, 0), server(b, 0)]})
    clock.now += 5
    assert not book.update({0: [server(a, 0), server(b, 0), server(s1, 0, [s2]), server(s2, 0, [s1])]})
    assert book.listed() == {}
    clock.now += 5
    book.update({0: [server(a, 0, [b]), server(b, 0, [a]), server(s1, 0, [s2]), server(s2, 0, [s1])]})
    assert sorted(book.listed()[0]) == sorted([a.peer_id, b.peer_id])


def test_a_stage_served_by_one_server_alone_is_founded_by_it_and_keys_that_come_later_are_not():
    """Nobody can verify a stage's only server: after FOUND_ALONE_S alone (no other server online on the stage in
    any read) it founds the stage, and stays recognized while alone (no lapse); fresh keys that come later found
    nothing and are recognized only once it vouches for them. Keys announcing beside it before that keep the stage
    unfounded (head count, as before)."""
    a, b, s1, s2 = (Identity.generate() for _ in range(4))
    clock = Clock()
    book = RecognitionBook(clock=clock)
    book.update({0: [server(a, 0)], 1: [server(s1, 1)]})
    clock.now += FOUND_ALONE_S / 2
    assert not book.update({0: [server(a, 0)], 1: [server(s1, 1), server(s2, 1)]})
    clock.now += FOUND_ALONE_S / 2
    assert book.update({0: [server(a, 0)], 1: [server(s1, 1), server(s2, 1)]})
    assert book.listed() == {0: [a.peer_id]}  # stage 1 had two keys online: not alone, and they never paired
    clock.now += 5
    book.update({0: [server(a, 0), server(s1, 0, [s2]), server(s2, 0, [s1])]})
    assert book.listed() == {0: [a.peer_id]}, "keys that came after the founder found nothing"
    book.update({0: [server(a, 0, [b]), server(b, 0, [a])]})
    assert sorted(book.listed()[0]) == sorted([a.peer_id, b.peer_id])  # a vouched for b: the usual growth
    for _ in range(2):
        clock.now += LAPSE_S + 1
        book.update({0: [server(a, 0)]})
        assert book.listed() == {0: [a.peer_id]}, "alone, nobody can vouch for it: it does not lapse"


def _node(initial_peers=(), validators=()):
    return hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=list(initial_peers),
                        use_relay=False, use_auto_relay=False, record_validators=list(validators))


@contextlib.contextmanager
def _recognized_pair(run_key: Identity, a: Identity, b: Identity):
    """Two DHT nodes of a run under ``run_key``'s spec, where ``a`` and ``b`` announced themselves as stage-0 servers
    vouching for each other: ``(run_id, sealed_spec, first node, directory on the second)``."""
    run_id, sealed_spec = RunDirectory.seal_spec(TINY, run_key)
    first = _node(validators=[RunRecordValidator(run_id)])
    second = _node([str(m) for m in first.get_visible_maddrs()], [RunRecordValidator(run_id)])
    try:
        directory = RunDirectory(second, run_id, ttl=60)
        directory.verify_spec(sealed_spec)
        for who, mate in ((a, b), (b, a)):
            assert directory.announce_server(server(who, 0, [mate]).model_copy(update={"run_id": run_id}), who)
        yield run_id, sealed_spec, first, directory
    finally:
        first.shutdown()
        second.shutdown()


def test_the_recognition_is_published_by_the_run_key_and_a_strangers_is_neither_stored_nor_read():
    run_key, a, b, stranger = (Identity.generate() for _ in range(4))
    with _recognized_pair(run_key, a, b) as (run_id, _, first, directory):
        second = directory.dht
        book = RecognitionBook()
        assert publish_recognition(directory, run_key, TINY, book) is not None
        found = read_recognition(RunDirectory(first, run_id, ttl=60))
        assert found is not None and sorted(found.servers[0]) == sorted([a.peer_id, b.peer_id])
        now = get_dht_time()
        forged = Recognition(run_id=run_id, peer_id=stranger.peer_id, time=now + 1, spec_name=TINY.name,
                         spec_hash=TINY.spec_hash(), expires=now + 300, servers={0: [stranger.peer_id]})
        assert not second.store(recognition_key(run_id), seal(forged, stranger), now + 300, subkey="recognition")
        assert sorted(read_recognition(directory).servers[0]) == sorted([a.peer_id, b.peer_id])
        reader = RecognitionReader(directory)
        assert asyncio.run(reader.current()) is not None and reader.recognized(0) == {a.peer_id, b.peer_id}
        assert reader.recognized(1) is None


def test_trainers_and_the_checkpoint_commands_read_manifests_by_the_recognition():
    """Two fresh keys announced as stage-0 servers write and endorse a manifest that says data share 0 is consumed
    up to sample 10^6: a directory counting heads takes it (a trainer would skip its share's data to there); one
    that follows the run key's recognition (:func:`follow_recognition`: trainers and the coordinator's checkpoint
    commands now, as servers before) refuses it and resumes at 0."""
    run_key, a, b, s1, s2 = (Identity.generate() for _ in range(5))
    with _recognized_pair(run_key, a, b) as (run_id, sealed_spec, first, directory):
        assert publish_recognition(directory, run_key, TINY, RecognitionBook()) is not None
        for who in (s1, s2):  # announced after the recognition: fresh keys it does not name
            assert directory.announce_server(server(who, 0).model_copy(update={"run_id": run_id}), who)
        endorsement = seal(Endorsement(run_id=run_id, peer_id=s2.peer_id, time=get_dht_time(), stage=0, epoch=5,
                                       state_sha256="c" * 64, writer=s1.peer_id, basis="same_state"), s2)
        forged = CheckpointManifest(run_id=run_id, peer_id=s1.peer_id, time=get_dht_time(), stage=0, epoch=5,
                                    shard_sha256="a" * 64, size=1, k=1, n=1,
                                    fragments=[FragmentEntry(index=0, sha256="b" * 64)], state_sha256="c" * 64,
                                    endorsements=[endorsement], data_position={0: 10**6})
        assert directory.publish_manifest(forged, seal(forged, s1))

        def resumed(follow: bool) -> int:
            reader = RunDirectory(first, run_id, ttl=60)
            reader.verify_spec(sealed_spec)
            reader.servers(0)  # the stage's records, as a trainer's routing reads them
            if follow:
                follow_recognition(reader)
            return asyncio.run(resume_position(AsyncRunDirectory(reader), 0, 1))

        assert resumed(follow=False) == 10**6, "by head count the two keys' manifest is entitled"
        assert resumed(follow=True) == 0


def _order(issuer: Identity, generation: int) -> tuple[RollbackOrder, bytes]:
    order = RollbackOrder(run_id="r", peer_id=issuer.peer_id, time=0, epoch=0, detected_epoch=3,
                          lr_scale=0.5 ** generation, generation=generation)
    return order, issuer.peer_id.encode()


def test_another_stages_server_weighs_rollbacks_by_the_recognition_not_by_head():
    """The bench's finding: idle keys announced on both stages, each claiming the rollback applied, issue last-stage
    orders. By head they are in force for a stage-0 server (rule 2) and for everybody (rule 3); by the
    recognition, for nobody, while the honest last stage's own orders still are."""
    h0, h1, l0, l1, me = (Identity.generate() for _ in range(5))
    sybils = {k: [Identity.generate() for _ in range(4)] for k in (0, 1)}
    online = {0: [server(me, 0), server(h0, 0)] + [server(s, 0, generation=1) for s in sybils[0]],
              1: [server(l0, 1), server(l1, 1)] + [server(s, 1, generation=1) for s in sybils[1]]}
    orders = [_order(s, 1) for s in sybils[1]]
    assert order_in_force(orders, online, applied=0, lr_factor=0.5) is not None  # head count: the finding
    named = {p.peer_id for p in (h0, h1, l0, l1, me)}
    voice = lambda s: 1.0 if s.peer_id in named else 0.0  # noqa: E731  (what PeerContext.voice gives)
    assert order_in_force(orders, online, applied=0, lr_factor=0.5, weight=voice) is None
    honest = [_order(l0, 1), _order(l1, 1)]
    assert order_in_force(orders + honest, online, applied=0, lr_factor=0.5, weight=voice)[0].peer_id in {
        l0.peer_id, l1.peer_id}


def test_a_server_that_missed_a_rollback_follows_the_others_that_applied_it():
    """Rule 3 counts the *other* servers: a server that verified nobody, with no recognition, follows an order the
    rest of the swarm applied (its own weight of 1 once made it an electorate of one that never went)."""
    me, a, b, issuer = (Identity.generate() for _ in range(4))
    online = {0: [server(me, 0), server(a, 0, generation=1)], 1: [server(b, 1, generation=1), server(issuer, 1)]}
    online = {k: [s.model_copy(update={"rollback_issuer": issuer.peer_id}) if s.rollback_generation else s
                  for s in g] for k, g in online.items()}
    mine = lambda s: 1.0 if s.peer_id == me.peer_id else 0.0  # noqa: E731  (PeerContext.voice, nobody verified)
    found = order_in_force([_order(issuer, 1)], online, applied=0, lr_factor=0.5, weight=mine, me=me.peer_id)
    assert found is not None and found[0].peer_id == issuer.peer_id


def test_a_manifest_counts_by_the_recognition_when_there_is_one():
    writer, endorser, named, named2, other = (Identity.generate() for _ in range(5))

    def manifest(by: Identity, *endorsed_by: Identity, basis="same_state") -> CheckpointManifest:
        es = [seal(Endorsement(run_id="r", peer_id=e.peer_id, time=0, stage=1, epoch=5, state_sha256="c" * 64,
                               writer=by.peer_id, basis=basis), e) for e in endorsed_by]
        return CheckpointManifest(run_id="r", peer_id=by.peer_id, time=0, stage=1, epoch=5, shard_sha256="a" * 64,
                                  size=1, k=1, n=1, fragments=[FragmentEntry(index=0, sha256="b" * 64)],
                                  state_sha256="c" * 64, endorsements=es)

    names = {0: frozenset({other.peer_id}), 1: frozenset({named.peer_id, named2.peer_id})}

    def refusal(m: CheckpointManifest, is_run_key) -> str | None:
        return recognized_refusal(m, names.get, range(2), "r", is_run_key)

    never = lambda peer: False  # noqa: E731
    assert "recognizes" in refusal(manifest(writer, endorser), never)  # two fresh keys
    # one recognized key with a fresh one beside it (bench/sybil.py, patient keys at 1 a stage): either way round
    assert "1 server(s)" in refusal(manifest(named, endorser), never)
    assert "1 server(s)" in refusal(manifest(writer, named), never)
    assert refusal(manifest(named, named2), never) is None  # two recognized servers hold that state
    assert refusal(manifest(writer, named, named2), never) is None  # (whoever wrote it)
    run_key = Identity.generate()
    is_run_key = lambda peer: peer == run_key.peer_id  # noqa: E731
    assert refusal(manifest(writer, run_key, basis="witness"), is_run_key) is None
    # a witness recognized on another stage counts only for the stage's only recognized server (its basis, the
    # writer alone on the stage, is the witness's own word: two patient keys on two stages would commit anything)
    assert "witness" in refusal(manifest(named, other, basis="witness"), never)
    assert "witness" in refusal(manifest(writer, other, basis="witness"), never)
    assert "witness" in refusal(manifest(named, endorser, basis="witness"), never)
    names[1] = frozenset({named.peer_id})  # the only server recognized on its stage: another stage's witness counts
    assert refusal(manifest(named, other, basis="witness"), never) is None


class _Reader:
    """A RecognitionReader's answers, without the DHT: ``names`` (stage -> peer ids) or None (no recognition)."""

    def __init__(self, names):
        self._names = names

    async def current(self):
        return self._names

    def recognized(self, stage):
        return self._names.get(stage) if self._names is not None else None


def test_rebalancing_counts_only_the_throughput_of_servers_the_run_key_recognizes_or_this_server_verified():
    """Fresh keys claiming 10^4 samples/s each on stage 0 made it look served: a joiner went to stage 1 and the
    rebalancer would move stage 0's honest servers away. Where the run key recognizes servers only theirs, verified and own claims count."""
    from swarm.server.rebalance import choose_stage
    from swarm.trust.standing import Standing

    me, honest, other, sybils = Identity.generate(), Identity.generate(), Identity.generate(), [
        Identity.generate() for _ in range(4)]
    servers = {0: [server(me, 0), server(honest, 0)] + [server(s, 0, throughput=1e4) for s in sybils],
               1: [server(other, 1, throughput=30.0)]}

    def ctx(names) -> PeerContext:
        return PeerContext(TINY, None, me, None, None, None, None, standing=Standing(), recognition=_Reader(names))

    assert asyncio.run(ctx(None).claims(servers)) == servers  # no recognition: every claim (as before)
    assert choose_stage(TINY.model, servers) == 1  # the Sybils' claims: stage 0 (20 samples/s real) looks served
    counted = asyncio.run(ctx({0: frozenset({honest.peer_id}), 1: frozenset({other.peer_id})}).claims(servers))
    # the unrecognized records of stage 0 (me, a newcomer, and the four keys) count nothing there: a lone recognized
    # server does not look accompanied (plan_moves never moves a stage's last server)
    assert [s.peer_id for s in counted[0]] == [honest.peer_id] and counted[1] == servers[1]
    assert choose_stage(TINY.model, counted) == 0  # 10 < 30 samples/s: the bottleneck (20 really)
    # the same view for every server of the stage (plan_moves needs it): nothing depends on who reads
    assert asyncio.run(ctx({0: frozenset({honest.peer_id}), 1: frozenset({other.peer_id})}).claims(servers)) == counted
    # a stage the recognition names nobody on (one server: nobody verified it) counts every claim, not none (all four
    # servers of the bench's first try joined stage 1: an empty recognition made every stage look empty)
    partial = asyncio.run(ctx({0: frozenset({honest.peer_id})}).claims(servers))
    assert partial[1] == servers[1] and choose_stage(TINY.model, partial) == 0
    assert asyncio.run(ctx({}).claims(servers)) == servers
    # recognized claims count in full, a fast honest server's too (a recognized majority sets the median)
    fast = Identity.generate()
    servers[1] += [server(fast, 1, throughput=100.0)]
    named = {0: frozenset({honest.peer_id}), 1: frozenset({other.peer_id, fast.peer_id})}
    assert [s.throughput for s in asyncio.run(ctx(named).claims(servers))[1]] == [30.0, 100.0]
    # a stage whose recognized servers all left: its newcomers' claims count as announced, not as nothing
    assert counted_claims(servers[0], frozenset({Identity.generate().peer_id})) == servers[0]


def test_a_recognized_server_that_stopped_averaging_claims_no_throughput_while_its_mates_verify_each_other():
    """bench/sybil.py's patient key: recognized for its real work, then stopped, its record claiming 10^4 samples/s on
    the last stage, so a joiner saw that stage served and rebalancing planned moves to it. Its recognized stage-mates
    verify each other's averaging every epoch (ServerInfo.last_verified) but no longer its own: its claim stops
    counting FRESH_EPOCHS after its last verified work. With no witness (one recognized server, or rounds that all
    fail) every recognized claim counts, as before."""
    from swarm.server.rebalance import choose_stage

    a, b, patient, other = (Identity.generate() for _ in range(4))

    def rec(who, stage, epoch, verified, throughput=10.0):
        return server(who, stage, throughput=throughput).model_copy(
            update={"epoch": epoch, "last_verified": {v.p2p_id: e for v, e in verified.items()}})

    named = {0: frozenset({other.peer_id}), 1: frozenset({a.peer_id, b.peer_id, patient.peer_id})}
    working = {0: [rec(other, 0, 20, {}, throughput=25.0)],
               1: [rec(a, 1, 20, {b: 20, patient: 19}), rec(b, 1, 20, {a: 20, patient: 20}),
                   rec(patient, 1, 20, {a: 19, b: 20}, throughput=10.0)]}
    assert [len(counted_claims(g, named[k])) for k, g in working.items()] == [1, 3]
    stopped = {0: working[0],
               1: [rec(a, 1, 24, {b: 24, patient: 20}), rec(b, 1, 24, {a: 24, patient: 20}),
                   rec(patient, 1, 24, {a: 20, b: 20}, throughput=1e4)]}
    counted = {k: counted_claims(g, named[k]) for k, g in stopped.items()}
    assert [s.peer_id for s in counted[1]] == [a.peer_id, b.peer_id]
    # a joiner: to stage 0 by the claims as announced (stage 1 looks served), to stage 1 by the counted ones (20 < 25)
    assert choose_stage(TINY.model, stopped) == 0 and choose_stage(TINY.model, counted) == 1
    # within FRESH_EPOCHS of its last verified work it still counts (a round or two may fail for anyone)
    recent = [rec(a, 1, 20 + FRESH_EPOCHS, {b: 22, patient: 20}), rec(b, 1, 22, {a: 22}), stopped[1][2]]
    assert len(counted_claims(recent, named[1])) == 3
    # no witness: rounds that kept failing (nobody verified anybody lately), or a stage of one recognized server
    failing = [rec(a, 1, 30, {b: 20, patient: 20}), rec(b, 1, 30, {a: 20}), stopped[1][2]]
    assert len(counted_claims(failing, named[1])) == 3
    assert counted_claims([stopped[1][2]], frozenset({patient.peer_id})) == [stopped[1][2]]
    # its averaging: a member still, counted in no majority and not waited for (MemberTable.uncounted) until it shows;
    # before, every round of the stage waited out the matchmaking window for it (steps 0.45 -> 1.6 s)
    assert stopped_members(stopped[1], named[1], a.peer_id) == {patient.p2p_id}
    assert stopped_members(stopped[1], named[1], patient.peer_id) == set()  # (nobody counts itself out)
    assert stopped_members(working[1], named[1], a.peer_id) == set() == stopped_members(failing, named[1], "")
    assert stopped_members(stopped[1], None, a.peer_id) == set()
    # what the averagers are told: with a newcomer nobody vouches for yet, it and the stopped key; past one group
    # (every record counts: a bounded group's lanes need every voter) neither
    newcomer = rec(Identity.generate(), 1, 24, {})
    assert uncounted_members([*stopped[1], newcomer], named[1], 8, a.peer_id) == {patient.p2p_id, newcomer.p2p_id}
    assert uncounted_members([*stopped[1], newcomer], named[1], 2, a.peer_id) == set()
    assert uncounted_members(stopped[1], None, 8, a.peer_id) == set()
    # the stopped key cannot silence an honest mate by naming somebody else as verified lately: an entry that names
    # no other recognized server of the stage makes no witness (before, a and its claim dropped, its own counted)
    junk = Identity.generate()
    pair = [rec(a, 1, 24, {}), rec(patient, 1, 24, {junk: 24}, throughput=1e4)]
    assert len(counted_claims(pair, frozenset({a.peer_id, patient.peer_id}))) == 2  # no witness: as before
    assert [s.peer_id for s in counted_claims([rec(b, 1, 24, {a: 24}), *pair], named[1])] == [b.peer_id, a.peer_id]


def test_a_recognized_server_that_keeps_averaging_counts_no_more_throughput_than_the_stage_median():
    """A patient key that kept averaging (its mates verify it every epoch: still_working) and claims 10^4 samples/s:
    before, its claim counted in full, so its stage looked served (a joiner went elsewhere) and the rebalancer moved
    an honest stage-mate away. One of three counted claims is under half: each claim counts at most the stage's
    upper median, an honest one, so every decision is the one its true claim makes. Two claims are not capped (one
    of two is half: past the bound; a fast honest server beside a slow one counts in full)."""
    from swarm.server.rebalance import capped_claims, choose_stage, plan_move

    a, b, patient, c, d = (Identity.generate() for _ in range(5))

    def rec(who, stage, verified, throughput):
        return server(who, stage, throughput=throughput).model_copy(
            update={"epoch": 24, "last_verified": {v.p2p_id: 24 for v in verified}})

    named = {0: frozenset({c.peer_id, d.peer_id}), 1: frozenset({a.peer_id, b.peer_id, patient.peer_id})}
    stage0 = [rec(c, 0, [d], 10.0), rec(d, 0, [c], 11.0)]

    def stage1(claim: float) -> list[ServerInfo]:
        return [rec(a, 1, [b, patient], 10.0), rec(b, 1, [a, patient], 12.0), rec(patient, 1, [a, b], claim)]

    lying = {0: stage0, 1: stage1(1e4)}
    truthful = {0: stage0, 1: stage1(11.0)}
    counted = {k: counted_claims(g, named[k]) for k, g in lying.items()}
    assert [s.throughput for s in counted[1]] == [10.0, 12.0, 12.0]  # the liar: the upper median, an honest claim
    truth = {k: counted_claims(g, named[k]) for k, g in truthful.items()}
    for who in (a, b):  # the same plan as the true claims make; the old count moved b (the faster) to stage 0
        assert plan_move(who.peer_id, counted, 0.25) == plan_move(who.peer_id, truth, 0.25) is None
    assert plan_move(b.peer_id, lying, 0.25) == 0
    assert choose_stage(TINY.model, counted) == choose_stage(TINY.model, truth) == 0
    # without the run key's recognition (an open run with no witness) the cap holds as well
    assert [s.throughput for s in asyncio.run(PeerContext(TINY, None, a, None, None, None, None)
                                              .claims(lying))[1]] == [10.0, 12.0, 12.0]
    # not capped: two claims (one liar of two is past any bound), draining or paused servers (no claim)
    fast = [rec(a, 1, [b], 10.0), rec(b, 1, [a], 100.0)]
    assert capped_claims(fast) == fast
    idle = [*fast, server(patient, 1, throughput=0.0, state=ServerState.PAUSED)]
    assert capped_claims(idle) == idle
    # the price, on a stage of mixed hardware: its fast server counts as the median one
    assert [s.throughput for s in capped_claims([*fast, rec(c, 1, [], 11.0)])] == [10.0, 11.0, 11.0]


def test_each_server_lists_another_sample_of_the_mates_it_verified_at_one_epoch():
    """ServerInfo.last_verified holds MAX_VOUCHES entries: where more mates were verified at one epoch (one group of
    a large stage), ties break by a hash of the lister's id, so the same mates (the first verified: the founders) are
    not left out of every list."""
    mates = {f"m{i}": 7 for i in range(40)}
    lists = [set(latest_verified(mates | {"old": 3}, mates.keys() | {"old"}, me)) for me in ("x", "y", "z")]
    assert all(len(listed) == MAX_VOUCHES and "old" not in listed for listed in lists)
    assert len(set.union(*lists)) > MAX_VOUCHES and lists[0] != lists[1]
    assert latest_verified({"a": 1, "b": 2}, {"a"}) == {"a": 1}  # only current mates
