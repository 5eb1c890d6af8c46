"""Spot checks over real libp2p (hivemind DHT nodes in this process, each server its own key): a stage server
lying to trainers is convicted with evidence anyone can verify, honest servers drifting apart are not, and a
convicted server gets no more work (:mod:`swarm.trust.spotcheck`, :mod:`swarm.trust.receipts`)."""

import asyncio
import contextlib
import dataclasses
import random
import time
from types import SimpleNamespace

import pytest
import torch
from hivemind.utils import get_dht_time

from swarm.attacks import LyingStageServer
from swarm.trust.convictions import ConvictionBook, ConvictionFollower, EvidenceService, push_evidence
from swarm.net.directory import AsyncRunDirectory, RunDirectory
from swarm.trainer.pipeline import RemotePipeline
from swarm.net.codecs import unpack_tensors
from swarm.protocol import ProtocolError, ServerInfo, ServerState, StageReceipt, open_record
from swarm.trust.receipts import check_receipt, sign_receipt, tensors_digest
from swarm.trust.evidence import SpotEvidence, odd_one_out, relative_difference, verify_evidence
from swarm.trust.spotcheck import SpotChecker
from swarm.server.stage import StageServer
from swarm.identity import Identity
from tests.conftest import TINY, keyed_dhts

RUN = "tiny-aaaaaaaaaaaaaaaa"
pytestmark = pytest.mark.timeout(240)
SPEC = TINY.updated(model={"n_layers": 3, "stage_layers": [1, 1, 1]}, spot_checks={"rate": 1.0})
"""Three stages, so that stage 1's backward returns an input gradient to check; every call checked."""


@contextlib.asynccontextmanager
async def serving(layout, trainers: int = 1, spec=SPEC, recognized=None):
    """Start ``layout`` = [(stage, server factory)] each on its own DHT node and key, announced ONLINE and
    serving evidence (each its own :class:`ConvictionBook`, ``server.book``); yields ``(servers, pipeline)``, or
    ``(servers, [pipelines])`` for several ``trainers`` (their checkers given ``recognized``)."""
    nodes = keyed_dhts(len(layout) + trainers)
    try:
        servers = []
        for (ident, dht), (stage, make) in zip(nodes, layout):
            server = make(spec, RUN, stage, identity=ident)
            p2p = await dht.replicate_p2p()
            await server.add_p2p_handlers(p2p, namespace=RUN)
            server.book = ConvictionBook(RUN, ident.peer_id, 0.05)
            await EvidenceService(spec, server.book).add_p2p_handlers(p2p, namespace=RUN)
            server.peer_id, server.ident, server.directory = ident.peer_id, ident, RunDirectory(dht, RUN, ttl=600)
            announce(server, stage)
            servers.append(server)
        pipes = []
        for i, (_, dht) in enumerate(nodes[len(layout):]):
            p2p = await dht.replicate_p2p()
            pipes.append(RemotePipeline(spec, RUN, AsyncRunDirectory(RunDirectory(dht, RUN, ttl=600)), p2p,
                                        listener=SpotChecker(spec, RUN, p2p, rng=random.Random(i),
                                                             recognized=recognized)))
        yield servers, (pipes[0] if trainers == 1 else pipes)
        for pipe in pipes:
            await pipe.listener.drain()
    finally:
        for _, dht in reversed(nodes):
            dht.shutdown()


def announce(server, stage, epoch=0):
    info = ServerInfo(run_id=RUN, peer_id=server.peer_id, time=get_dht_time(), stage=stage, state=ServerState.ONLINE,
                      throughput=10.0, p2p_id=server.ident.p2p_id, convicted=server.book.listed(), epoch=epoch)
    assert server.directory.announce_server(info, server.ident)


async def read_every_record(pipe, layout, tries: int = 50) -> None:
    """Read the stages' records through ``pipe`` until it has seen every server of ``layout`` (a DHT read on a
    loaded machine can miss a record just stored); the evidence a trainer finds goes to the servers it saw."""
    want = {stage: sum(s == stage for s, _ in layout) for stage, _ in layout}
    for _ in range(tries):
        seen = {stage: len(await pipe.servers(stage, force=True)) for stage in want}
        if seen == want:
            return
        await asyncio.sleep(0.2)
    raise AssertionError(f"the trainer saw {seen} servers per stage, not {want}")


def _batches(tiny_dataset, n):
    b = SPEC.training.micro_batch_size
    return [tiny_dataset.batch(list(range(i * b, (i + 1) * b))) for i in range(n)]


class OutOfSync(StageServer):
    """An honest server whose gradient round failed: it says so in its receipts (StageOptimizer.synced)."""

    synced = False


def _perturbed(scale, cls=StageServer):
    """A server factory whose parameters are off by ``scale`` x their magnitude (honest drift between averagings)."""
    def make(*args, **kwargs):
        server = cls(*args, **kwargs)
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for p in server.module.parameters():
                p.add_(torch.randn(p.shape, generator=g) * scale * p.abs().mean())
        return server
    return make


def liar(calls):
    return lambda *a, **kw: LyingStageServer(*a, fraction=0.5, calls=calls, **kw)


@pytest.mark.parametrize("calls,precision,codec", [(("forward",), "fp32", "blockwise8bit"),
                                                   (("backward",), "fp32", "blockwise8bit"),
                                                   (("backward",), "bf16", "blockwise8bit"),
                                                   (("backward",), "fp32", "lowrank_ternary"),
                                                   (("backward",), "fp32", "lowrank_3bit")])
def test_a_lying_server_is_convicted_with_evidence_anyone_can_verify(tiny_dataset, calls, precision, codec):
    """A server lying on half its answers is convicted by a trainer's spot checks, with evidence any peer can
    verify, while honest servers 1e-3 apart agree; under bf16 autocast too, where honest answers also differ by
    bf16 rounding; and with the lossy ``lowrank_*`` codecs, whose gradients are rounded at random (seeded by
    the micro-batch, so that honest servers still agree) and whose backward with inputs is 16 wire tensors."""
    layout = [(0, StageServer), (1, liar(calls)), (1, StageServer), (1, _perturbed(1e-3)), (2, StageServer)]

    async def main():
        spec = SPEC.updated(training={"precision": precision, "activation_compression": codec})
        async with serving(layout, spec=spec) as (servers, pipe):
            lying, honest = servers[1], [servers[2], servers[3]]
            for batch in _batches(tiny_dataset, 12):
                await pipe.forward_loss(batch, train=True)
                await pipe.listener.drain()
                if lying.peer_id in pipe.listener.convicted:
                    break
            assert set(pipe.listener.convicted) == {lying.peer_id}, pipe.listener.convicted
            assert pipe.listener.counts["agreed"] > 0, "honest servers 1e-3 apart agree"
            # the checks they passed are their standing with this trainer (their say in its routing); the liar's is 0
            assert any(pipe.listener.vote(s.peer_id) > 0 for s in honest) and pipe.listener.vote(lying.peer_id) == 0
            evidence = pipe.listener.evidence[-1]
            assert evidence.call == calls[0] and verify_evidence(evidence) == lying.peer_id

            # tampered evidence proves nothing
            sealed, wire = evidence.answers[evidence.accused]
            forged = dataclasses.replace(evidence, answers=[*evidence.answers])
            forged.answers[evidence.accused] = (sealed, [w.clone() for w in wire])
            forged.answers[evidence.accused][1][0].view(-1)[0] += 1
            for bad, cause in [(forged, "not the one its receipt states"),
                               (dataclasses.replace(evidence, accused=(evidence.accused + 1) % 3), "single out|another request"),
                               (dataclasses.replace(evidence, tolerance=1e9), "single out"),
                               (dataclasses.replace(evidence, answers=evidence.answers[:2]), "three answers"),
                               (dataclasses.replace(evidence, run_id="other-aaaaaaaaaaaaaaaa"), "run")]:
                with pytest.raises(ProtocolError, match=cause):
                    verify_evidence(bad)
            # a tolerance below the verifier's own floor (spot_checks.rtol) is raised to it: evidence that singles
            # out an answer only at a tolerance picked between small differences convicts nobody
            apart = [relative_difference(*_answer(evidence, i), *_answer(evidence, evidence.accused))
                     for i in range(3) if i != evidence.accused]
            with pytest.raises(ProtocolError, match="single out"):
                verify_evidence(evidence, min_tolerance=max(apart) * 1.01)
            assert verify_evidence(evidence, min_tolerance=min(apart) * 0.5) == lying.peer_id

            # with outer steps (swarm.averaging.outer) two honest servers' answers differ: no check is sampled and
            # no evidence, however well signed, is accepted
            with pytest.raises(ProtocolError, match="outer steps"):
                ConvictionBook(evidence.run_id, me="", min_tolerance=0.0, accepts=False).add(evidence)
            outer = SpotChecker(TINY.updated(averaging={"mode": "outer"}, spot_checks={"rate": 1.0}), RUN, pipe.p2p)
            assert not any(outer.sample() for _ in range(20))
            assert SpotChecker(TINY.updated(spot_checks={"rate": 1.0}), RUN, pipe.p2p).sample()

            # the convicted server gets no more work from this trainer
            before = lying.samples
            for batch in _batches(tiny_dataset, 4):
                await pipe.forward_loss(batch, train=True)
            await pipe.listener.drain()
            assert lying.samples == before and all(s.samples > 0 for s in honest)
            assert set(pipe.listener.convicted) == {lying.peer_id}

    asyncio.run(main())


def test_two_servers_answering_alike_frame_no_server_the_run_key_recognizes(tiny_dataset):
    """The threat model's open row: two colluding servers of a stage answering a check alike (here: the same
    parameters, 50% off the stage's) frame a third. Where the run key's recognition names servers of the stage, a
    trainer asks those first and convicts only on two agreeing answers of servers it names: the honest server is
    not convicted. Without a recognition it is (the contrast)."""
    layout = [(0, StageServer), (1, StageServer), (1, _perturbed(0.5)), (1, _perturbed(0.5)), (2, StageServer)]

    async def run(recognition: bool) -> dict:
        names: dict[int, frozenset] = {}
        async with serving(layout, recognized=names.get) as (servers, pipe):
            if recognition:  # each stage's honest server (stage 1's two others only announced themselves)
                names.update({k: frozenset({servers[i].peer_id}) for k, i in ((0, 0), (1, 1), (2, 4))})
            for batch in _batches(tiny_dataset, 16):
                await pipe.forward_loss(batch, train=True)
                await pipe.listener.drain()
                if servers[1].peer_id in pipe.listener.convicted:
                    break
            return dict(convicted=set(pipe.listener.convicted), honest=servers[1].peer_id,
                        inconclusive=pipe.listener.counts["inconclusive"])

    framed = asyncio.run(run(recognition=False))
    assert framed["honest"] in framed["convicted"], "two colluding servers frame the honest one by head count"
    kept = asyncio.run(run(recognition=True))
    assert kept["honest"] not in kept["convicted"] and kept["inconclusive"] > 0, kept


def test_an_unsigned_reply_convicts_and_two_disagreeing_servers_convict_no_one(tiny_dataset):
    unsigned = lambda *a, identity, **kw: StageServer(*a, **kw)  # noqa: E731 (signs nothing)
    layout = [(0, StageServer), (0, unsigned), (1, liar(("forward",))), (1, StageServer), (2, StageServer)]

    async def main():
        async with serving(layout) as (servers, pipe):
            for batch in _batches(tiny_dataset, 6):
                await pipe.forward_loss(batch, train=True)
            await pipe.listener.drain()
            assert set(pipe.listener.convicted) == {servers[1].peer_id}, pipe.listener.convicted
            assert "no receipt" in pipe.listener.convicted[servers[1].peer_id]
            assert pipe.listener.counts["inconclusive"] > 0, "stage 1's two servers disagree: no third to break the tie"

    asyncio.run(main())


def test_an_honest_server_out_of_sync_is_not_convicted_until_its_excuse_expires(tiny_dataset):
    """A server that stepped on its own gradient (parameters 50% off) and says so in its receipts: checks compare
    none of its answers while its stage has not passed two state rounds since (counted on the other servers'
    records, not its own), then compare them as any and convict it for this trainer only; evidence holding an
    out-of-sync answer is refused by every verifier."""
    layout = [(0, StageServer), (1, _perturbed(0.5, OutOfSync)), (1, StageServer), (1, StageServer),
              (2, StageServer)]

    async def main():
        async with serving(layout) as (servers, pipe):
            unsynced, honest = servers[1], [servers[2], servers[3]]
            checker = pipe.listener
            for batch in _batches(tiny_dataset, 80):  # until it was routed to and checked: once the honest servers
                await pipe.forward_loss(batch, train=True)  # passed checks, it gets the explore share (~10%)
                await checker.drain()
                if checker.counts["unsynced"] > 0 and checker.counts["agreed"] > 0 and unsynced.samples > 0:
                    break
            assert not checker.convicted, checker.convicted
            assert checker.counts["unsynced"] > 0 and checker.counts["agreed"] > 0, checker.counts
            assert unsynced.samples > 0, "routing does not avoid it (it would join no round)"

            # its own record claiming a later epoch changes nothing; its stage-mates two state rounds on do
            late = 2 * SPEC.averaging.average_state_every
            announce(unsynced, 1, epoch=100)
            await pipe.servers(1, force=True)
            for batch in _batches(tiny_dataset, 4):
                await pipe.forward_loss(batch, train=True)
                await checker.drain()
            assert not checker.convicted, checker.convicted
            for server in honest:
                announce(server, 1, epoch=late)
            await pipe.servers(1, force=True)
            for batch in _batches(tiny_dataset, 30):
                await pipe.forward_loss(batch, train=True)
                await checker.drain()
                if checker.convicted:
                    break
            assert set(checker.convicted) == {unsynced.peer_id}, checker.convicted
            assert not checker.evidence, "evidence with an out-of-sync answer is not shared: others refuse it"

            # evidence holding an answer its server signed as out of sync convicts no one
            ident = Identity.generate()
            fields = dict(stage=1, mb_id="mb", call="forward", loss=None, time=get_dht_time())
            wire = [[torch.zeros(2, 3)], [torch.zeros(2, 3)], [torch.ones(2, 3)]]
            request = [torch.zeros(2, 3)]
            answers = [(sign_receipt(i, RUN, epoch=4, request_sha256=tensors_digest(request),
                                     reply_sha256=tensors_digest(w), synced=k != 2, **fields), w)
                       for k, (i, w) in enumerate(zip([Identity.generate(), Identity.generate(), ident], wire))]
            evidence = SpotEvidence(run_id=RUN, stage=1, call="forward", codec="float32", request_wire=request,
                                    answers=answers, accused=2, tolerance=0.05)
            with pytest.raises(ProtocolError, match="out of sync"):
                verify_evidence(evidence)
            answers[2] = (sign_receipt(ident, RUN, epoch=4, request_sha256=tensors_digest(request),
                                       reply_sha256=tensors_digest(wire[2]), **fields), wire[2])
            assert verify_evidence(dataclasses.replace(evidence, answers=answers)) == ident.peer_id

    asyncio.run(main())


def test_receipts_state_exactly_the_reply():
    ident = Identity.generate()
    request, reply = [torch.arange(6).view(2, 3)], [torch.ones(2, 3)]
    fields = dict(stage=1, mb_id="mb", call="forward", request_sha256=tensors_digest(request),
                  reply_sha256=tensors_digest(reply))
    sealed = sign_receipt(ident, RUN, epoch=3, loss=2.5, time=get_dht_time(), **fields)
    assert check_receipt(sealed, RUN, p2p_id=ident.p2p_id, loss=2.5, **fields).epoch == 3
    wrong = [dict(loss=2.4), dict(p2p_id=Identity.generate().p2p_id), dict(mb_id="other"),
             dict(reply_sha256=tensors_digest([torch.ones(2, 3) * 2])), dict(call="backward")]
    for change in wrong:
        with pytest.raises(ProtocolError, match="receipt states"):
            check_receipt(sealed, RUN, **({"p2p_id": ident.p2p_id, "loss": 2.5} | fields | change))
    with pytest.raises(ProtocolError, match="no receipt"):
        check_receipt(b"", RUN, p2p_id=ident.p2p_id, loss=2.5, **fields)
    assert tensors_digest([torch.zeros(2, 3)]) != tensors_digest([torch.zeros(3, 2)])
    assert tensors_digest([torch.zeros(2)]) != tensors_digest([torch.zeros(2, dtype=torch.int32)])


def test_the_odd_one_out_needs_two_agreeing_answers():
    a, b = [torch.ones(4)], [torch.ones(4) * 1.01]
    assert relative_difference(a, None, b, None) == pytest.approx(0.01 / 1.01, rel=1e-4)
    assert relative_difference(a, 1.0, a, 2.0) == pytest.approx(0.5)
    assert relative_difference(a, None, [torch.ones(5)], None) == float("inf")
    assert relative_difference(a, None, a, 1.0) == float("inf")
    assert odd_one_out({(0, 1): 1.0, (0, 2): 1.0, (1, 2): 0.0}, 0.1) == 0
    assert odd_one_out({(0, 1): 1.0, (0, 2): 0.0, (1, 2): 1.0}, 0.1) == 1
    assert odd_one_out({(0, 1): 1.0, (0, 2): 1.0, (1, 2): 1.0}, 0.1) is None
    assert odd_one_out({(0, 1): 0.0, (0, 2): 0.0, (1, 2): 0.0}, 0.1) is None


def test_a_conviction_is_verified_by_every_server_and_adopted_by_other_trainers(tiny_dataset, monkeypatch):
    """Trainer A convicts the liar and hands its evidence over (a push that fails is tried again); every server
    verifies it and lists the liar;
    trainer B, which checks nothing itself, fetches the evidence from a listing server, verifies it, and stops
    routing to the liar. Evidence that does not verify is refused and lists no one."""
    layout = [(0, StageServer), (1, liar(("forward", "backward"))), (1, StageServer), (1, StageServer),
              (2, StageServer)]

    async def main():
        async with serving(layout, trainers=2) as (servers, (a, b)):
            b.listener.cfg = b.listener.cfg.model_copy(update={"rate": 0.0})
            lying, honest = servers[1], [s for s in servers if s is not servers[1]]
            failed_once = []
            await read_every_record(a, layout)

            async def flaky_push(p2p, p2p_id, evidence):  # the first push to honest[0] is lost
                if p2p_id == honest[0].ident.p2p_id and not failed_once:
                    failed_once.append(p2p_id)
                    raise ConnectionError("injected: push lost")
                await push_evidence(p2p, p2p_id, evidence)
            monkeypatch.setattr("swarm.trust.convictions.push_evidence", flaky_push)
            monkeypatch.setattr("swarm.trust.convictions.PUSH_RETRY_S", (0.1, 0.5, 2.0))
            for batch in _batches(tiny_dataset, 12):
                await a.forward_loss(batch, train=True)
                await a.listener.drain()
                if lying.peer_id in a.listener.convicted:
                    break
            assert set(a.listener.convicted) == {lying.peer_id}
            missed = [(s.stage, s.peer_id) for s in honest if lying.peer_id not in s.book]
            assert failed_once and not missed, f"every server verified the evidence; these did not: {missed}"
            assert lying.peer_id not in lying.book, "the accused does not list itself"

            # a forged push: the accused answer swapped for a witness's is refused, the sender named in the log
            evidence = a.listener.evidence[-1]
            forged = dataclasses.replace(evidence, accused=(evidence.accused + 1) % 3)
            with pytest.raises(Exception, match="single out|another request"):
                await push_evidence(b.p2p, honest[0].ident.p2p_id, forged)
            assert honest[0].book.listed().keys() == {lying.peer_id}

            for batch in _batches(tiny_dataset, 2):
                await b.forward_loss(batch, train=True)
            assert lying.peer_id not in b.listener.convicted, "nothing listed yet: B routes to everyone"
            announce(honest[1], 1)  # its record now lists the conviction
            before = lying.samples
            b.refresh_s = 0.0
            for _ in range(50):
                await b.servers(1)
                await b.listener.drain()
                if lying.peer_id in b.listener.convicted:
                    break
                await asyncio.sleep(0.2)
            assert b.listener.convicted.keys() == {lying.peer_id} and b.listener.counts["adopted"] == 1
            for batch in _batches(tiny_dataset, 6):
                await b.forward_loss(batch, train=True)
            assert lying.samples == before, "B no longer routes to the liar"

            # a server that joins the stage now learns the conviction from its stage-mates' records
            late, adopted, fetching = ConvictionBook(RUN, Identity.generate().peer_id, 0.05), [], []
            follower = ConvictionFollower(late, b.p2p, SPEC, RUN,
                                          spawn=lambda work: fetching.append(asyncio.create_task(work)),
                                          on_adopted=lambda peer, reason: adopted.append(peer))
            records = await asyncio.get_running_loop().run_in_executor(None, honest[1].directory.servers, 1)
            follower.follow(records)
            follower.follow(records)  # fetched once per (listing server, accused)
            await asyncio.gather(*fetching)
            assert adopted == [lying.peer_id] and lying.peer_id in late and len(fetching) == 1

    asyncio.run(main())


def _answer(evidence, i: int):
    """Answer ``i`` of spot-check ``evidence``: (its tensors decoded, its loss)."""
    sealed, wire = evidence.answers[i]
    receipt, _ = open_record(sealed, StageReceipt, run_id=evidence.run_id)
    return unpack_tensors(wire, evidence.codec), receipt.loss


def test_evidence_reaches_the_servers_of_stages_the_trainer_reads_after_the_conviction(monkeypatch):
    """A check of a trainer's first micro-batch can convict before its pipeline read the next stages' records: the
    evidence then goes to the servers seen so far, and to each server of a stage read later, once."""
    handed = []

    async def recorded(p2p, servers, evidence, accused, log):
        handed.append((accused, sorted(servers)))
    monkeypatch.setattr("swarm.trust.spotcheck.share_evidence", recorded)

    def records(*peers):
        return [SimpleNamespace(peer_id=p, convicted={}) for p in peers]

    async def main():
        checker = SpotChecker(SPEC, RUN, None)
        monkeypatch.setattr(checker.book, "add", lambda evidence: (SimpleNamespace(peer_id="liar"), True))
        checker.saw(0, records("liar", "a", "b"))
        checker._share(object())
        checker.saw(1, records("c", "d"))
        checker.saw(0, records("liar", "a", "b"))  # read again: nobody new
        checker.saw(1, records("c", "d", "e"))  # a server that joined stage 1
        await checker.drain()
        assert handed == [("liar", ["a", "b"]), ("liar", ["c", "d"]), ("liar", ["e"])]

    asyncio.run(main())


def _framing(directory, announced, witnesses, accused):
    """Announce ``announced`` as stage-1 servers; evidence whose two agreeing answers are signed by the two
    ``witnesses`` against ``accused``'s (the odd one)."""
    for who in announced:
        info = ServerInfo(run_id=RUN, peer_id=who.peer_id, time=get_dht_time(), stage=1, throughput=10.0,
                          state=ServerState.ONLINE, p2p_id=who.p2p_id)
        assert directory.announce_server(info, who)
    request = [torch.zeros(2, 3)]
    fields = dict(stage=1, mb_id="mb", call="forward", loss=None, time=get_dht_time(), epoch=4,
                  request_sha256=tensors_digest(request))
    wire = [[torch.ones(2, 3)], [torch.ones(2, 3)], [torch.zeros(2, 3)]]  # the accused's answer is the odd one
    answers = [(sign_receipt(who, RUN, reply_sha256=tensors_digest(w), **fields), w)
               for who, w in zip([*witnesses, accused], wire)]
    return SpotEvidence(run_id=RUN, stage=1, call="forward", codec="float32", request_wire=request,
                        answers=answers, accused=2, tolerance=0.05)


def test_evidence_whose_agreeing_answers_come_from_keys_that_never_served_convicts_nobody():
    """Found against a live swarm: two fresh keys never announced as servers signed two agreeing answers against an honest
    server's receipt, and its stage-mates listed it. A server's book now needs both agreeing signers seen serving
    the accused's stage (RunDirectory.seen_serving, real DHT records)."""
    (ident, dht), = keyed_dhts(1)
    try:
        directory = RunDirectory(dht, RUN, ttl=600)
        honest, mate, fresh = ident, Identity.generate(), Identity.generate()
        evidence = _framing(directory, (honest, mate), (mate, fresh), honest)
        assert verify_evidence(evidence) == honest.peer_id  # the signatures alone would convict
        book = ConvictionBook(RUN, Identity.generate().peer_id, 0.05, serves=directory.seen_serving)
        with pytest.raises(ProtocolError, match=f"{fresh.peer_id}, never seen serving stage 1"):
            book.add(evidence)
        assert not book.listed()
        info = ServerInfo(run_id=RUN, peer_id=fresh.peer_id, time=get_dht_time(), stage=1, throughput=10.0,
                          state=ServerState.ONLINE, p2p_id=fresh.p2p_id)
        assert directory.announce_server(info, fresh)  # announced: a key's standing is what prices this
        for _ in range(20):  # a read may miss a record just stored; seen_serving reads again at most every 2 s
            try:
                assert book.add(evidence)[1]
                break
            except ProtocolError:
                time.sleep(0.5)
        assert list(book.listed()) == [honest.peer_id]
    finally:
        dht.shutdown()


def test_a_trainer_adopts_no_evidence_whose_agreeing_answers_come_from_keys_it_never_saw_serving():
    """The same finding at a trainer: its book took any signer (a trainer's witnesses are the servers it routed to),
    so two fresh keys' evidence, listed by one announced key, stopped its routing to an honest server. A trainer's
    book now needs both agreeing signers among the servers it read announced on the stage (no DHT read on its event
    loop: ``seen_serving(..., read=False)``), where the run key's recognition names nobody there."""
    (ident, dht), = keyed_dhts(1)
    try:
        directory = RunDirectory(dht, RUN, ttl=600)
        honest, mate, other, fresh = ident, Identity.generate(), Identity.generate(), Identity.generate()
        framed = _framing(directory, (honest, mate, other), (mate, fresh), honest)
        checker = SpotChecker(SPEC, RUN, None, serves=lambda p, k: directory.seen_serving(p, k, read=False))
        assert not directory.seen_serving(mate.peer_id, 1, read=False)  # nothing read yet, and no read made
        deadline = time.monotonic() + 20  # the trainer's pipeline reads the stage's records (a read may miss one)
        while not {honest.peer_id, mate.peer_id, other.peer_id} <= set(s.peer_id for s in directory.servers(1)):
            assert time.monotonic() < deadline
            time.sleep(0.5)
        with pytest.raises(ProtocolError, match=f"{fresh.peer_id}, never seen serving stage 1"):
            checker.book.add(framed)
        assert not checker.book.listed()
        assert checker.book.add(_framing(directory, (), (mate, other), honest))[1] and list(checker.book.listed()) == [honest.peer_id]
    finally:
        dht.shutdown()


def test_a_stage_mate_weighs_the_witnesses_by_the_averaging_work_it_verified():
    """Announcing is free, so two keys announced as servers of stage 1 still frame an honest server by head count.
    A stage-1 server that verified the accused's (or a witness's) averaging work requires both witnesses to have
    standing with it; a server of another stage (vouch None), or one that verified none of them, goes by
    ``serves``."""
    honest, mate, fresh, other = (Identity.generate() for _ in range(4))
    request = [torch.zeros(2, 3)]
    fields = dict(stage=1, mb_id="mb", call="forward", loss=None, time=get_dht_time(), epoch=4,
                  request_sha256=tensors_digest(request))

    def evidence(witnesses):
        wire = [[torch.ones(2, 3)], [torch.ones(2, 3)], [torch.zeros(2, 3)]]  # the accused's answer is the odd one
        answers = [(sign_receipt(who, RUN, reply_sha256=tensors_digest(w), **fields), w)
                   for who, w in zip([*witnesses, honest], wire)]
        return SpotEvidence(run_id=RUN, stage=1, call="forward", codec="float32", request_wire=request,
                            answers=answers, accused=2, tolerance=0.05)

    standing = {honest.p2p_id: 1.0, mate.p2p_id: 0.5, other.p2p_id: 0.25}

    def book(stage: int) -> ConvictionBook:
        return ConvictionBook(RUN, Identity.generate().peer_id, 0.05, serves=lambda peer, k: True,
                              vouch=lambda k, p2p: standing.get(p2p, 0.0) if k == stage else None)

    framed = evidence([mate, fresh])
    with pytest.raises(ProtocolError, match=f"{fresh.peer_id}, whose averaging work this stage 1 server never verified"):
        book(1).add(framed)
    assert book(0).add(framed)[1], "a server of another stage goes by serves (announced: a head count)"
    assert book(1).add(evidence([mate, other]))[1], "two verified witnesses convict"
    standing.clear()
    assert book(1).add(framed)[1], "a server that verified none of them goes by serves"
    # ... or, where the run key recognizes servers of the stage, by the recognition: a trainer, another stage's
    # server, a server that verified none of them (the threat model's open row: two fresh keys framed a third)
    named = {1: frozenset({mate.peer_id, other.peer_id, honest.peer_id})}
    recognizing = ConvictionBook(RUN, Identity.generate().peer_id, 0.05, serves=lambda peer, k: True,
                                 recognized=named.get)
    with pytest.raises(ProtocolError, match=f"signed by {fresh.peer_id}, which the run key does not recognize"):
        recognizing.add(framed)
    assert recognizing.add(evidence([mate, other]))[1], "two recognized witnesses convict"
    assert ConvictionBook(RUN, "x", 0.05, serves=lambda peer, k: True, recognized=lambda k: None).add(framed)[1]
