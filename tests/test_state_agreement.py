"""State rounds between two real servers of a stage (hivemind averagers, DHT and p2pd on loopback): a group that
holds one state skips the round's phases, a group whose states differ averages them (:mod:`swarm.averaging.agreement`)."""

from __future__ import annotations

import asyncio

import pytest
import torch
from hivemind.p2p import P2P
from hivemind.proto import runtime_pb2

from swarm.averaging.agreement import ANSWER_WAIT_S
from swarm.net.transport import gather, stream_out
from swarm.protocol import StateAgreement, pack_message, unpack_message
from tests.conftest import TINY
from tests.test_stage_optimizer import _differing, _fill_epoch, _gradients, _two_servers

pytestmark = pytest.mark.timeout(240)


def _state_rounds(*optimizers) -> list[dict[str, int]]:
    """Each server's state-round counters: ``rounds`` completed, of them ``agreed`` (no phases), ``phases`` run."""
    return [{k: v for k, v in o._opt.state_averager.wire.snapshot().items() if k in ("rounds", "agreed", "phases")}
            for o in optimizers]


def test_a_state_round_moves_nothing_when_the_group_holds_one_state_and_averages_when_it_does_not():
    """``average_state_every`` is 2 in the tiny spec. Epochs 1-2: both servers step on the same averaged gradient,
    so the state round of epoch 2 finds one state and ends without a phase (nothing sent but the digests). Then one
    server's parameter is moved: the state round of epoch 4 finds two states, runs its phases and leaves both
    servers holding the same averaged state again."""
    assert TINY.averaging.average_state_every == 2
    with _two_servers("agree") as (busy, other):
        micro = TINY.training.micro_batch_size
        other.step(_gradients(other.module, 99), micro, "trainer1")
        busy.step(_gradients(busy.module, 0), micro, "trainer0")
        assert busy.wait_until_counted(2, timeout=30), "the busy server never counted the other one"
        _fill_epoch(busy, other, 1)
        _fill_epoch(busy, other, 100)
        assert busy.epoch == other.epoch == 2 and busy.synced and other.synced
        assert _state_rounds(busy, other) == [{"phases": 0, "rounds": 1, "agreed": 1}] * 2
        assert not _differing(busy, other)

        moved = other.state()
        name = next(k for k in moved if k.startswith("param/"))
        moved[name] = moved[name] + 0.5
        other.load_state(moved)
        assert _differing(busy, other) == [name]
        _fill_epoch(busy, other, 200)
        _fill_epoch(busy, other, 300)
        assert busy.epoch == other.epoch == 4
        counters = _state_rounds(busy, other)
        assert all(c["rounds"] == 2 and c["agreed"] == 1 and c["phases"] >= 1 for c in counters), counters
        assert not _differing(busy, other), "the state round left the two servers with different states"


def test_a_question_about_a_round_the_peer_is_not_in_is_refused_after_a_bounded_wait():
    """An outsider asks a server's state averager for its digest of a made-up round: the server waits for that
    round at most :data:`ANSWER_WAIT_S`, then answers with an error naming the cause, not with its digest."""
    with _two_servers("outsider") as (a, _):
        averager = a._opt.state_averager

        async def ask() -> StateAgreement:
            outsider = await P2P.create(initial_peers=[str(m) for m in averager.dht.get_visible_maddrs()])
            try:
                stub = type(averager).get_stub(outsider, averager.peer_id, namespace=averager.prefix)
                request = StateAgreement(group="ab" * 8, state_sha256="0" * 64)
                stream = await stub.rpc_state_agreement(stream_out(runtime_pb2.ExpertRequest, pack_message(request),
                                                                   []))
                metadata, _ = await gather(stream, max_bytes=0, max_tensors=0)
                return unpack_message(metadata, StateAgreement)
            finally:
                await outsider.shutdown()

        reply = asyncio.run(asyncio.wait_for(ask(), ANSWER_WAIT_S + 30))
        assert not reply.state_sha256 and "no state round" in reply.error, reply


def test_the_decision_skips_on_one_digest_averages_on_two_and_fails_at_once_without_a_member():
    """The decision alone (the members' answers given): all equal skips the phases, one that differs runs them, a
    member that did not reach the round fails it at once (its reducer would not be there for the phases), and one
    that could not be asked at all (an older peer) leaves it to the phases."""
    from types import SimpleNamespace

    from swarm.averaging.agreement import AgreedRounds
    from swarm.averaging.allreduce import RoundFailed, WireStats, digest

    tensors = [torch.arange(6, dtype=torch.float32).view(2, 3), torch.ones(4)]
    mine = digest(tensors)

    class Member(AgreedRounds):
        def __init__(self, answers: dict):
            self.peer_id, self.wire, self.answers = "me", WireStats(), answers
            self.rules = SimpleNamespace(phase_timeout=1.0)
            self._init_agreement()

        async def _ask(self, peer, group, digest_):
            assert digest_ == mine
            return self.answers[peer]

    def decide(answers: dict):
        member = Member(answers)
        return asyncio.run(member._agreed(tensors, "g1", ["me", *answers])), member.wire.agreed

    assert decide({"a": mine, "b": mine}) == (True, 1)
    assert decide({"a": mine, "b": "0" * 64}) == (False, 0)
    assert decide({"a": mine, "b": ""}) == (False, 0)
    with pytest.raises(RoundFailed, match=r"\['b'\] did not reach the state round"):
        decide({"a": mine, "b": None})
