"""An accusation counts against its accuser only if the accuser signed it: a stranger who signs an accusation in
an honest peer's name (its libp2p id) with a garbage receipt gets nobody excluded, while any peer, whether or not
it ever averaged with the accuser, can attribute a genuine one (a peer's libp2p id is its key)."""

import asyncio
from types import SimpleNamespace

import pytest
from hivemind.utils import get_dht_time

from swarm.averaging.auditor import Auditor
from swarm.averaging.exclusion import ExclusionBook
from swarm.identity import Identity
from swarm.protocol import Accusation, seal

RUN = "tiny-aaaaaaaaaaaaaaaa"


class Judge(Auditor):
    """The auditing side of an averager, without the averager: what any peer does with an accusation."""

    def __init__(self):
        me = Identity.generate()
        self._init_audit(me, RUN, audit_probability=0.0, dht=SimpleNamespace(peer_id=me.p2p_id))
        self.peer_id, self.exclusions = me.p2p_id, ExclusionBook()


def _accusation(signer: Identity, accuser: str, accused: str) -> bytes:
    return seal(Accusation(run_id=RUN, peer_id=signer.peer_id, time=get_dht_time(), p2p_id=accuser,
                           accused=accused, receipt=b"garbage", reason="made up"), signer)


def test_an_accusation_in_someone_elses_name_excludes_nobody():
    judge, honest, stranger, reducer = Judge(), Identity.generate(), Identity.generate(), Identity.generate()

    forged = asyncio.run(judge._verify_accusation(_accusation(stranger, honest.p2p_id, reducer.p2p_id)))
    assert forged is False and judge.exclusions.excluded() == []
    # the accuser's own garbage accusation excludes the accuser (never the accused), on a peer that never
    # averaged with it: its libp2p id names its key
    assert asyncio.run(judge._verify_accusation(_accusation(honest, honest.p2p_id, reducer.p2p_id))) is False
    assert judge.exclusions.excluded() == [honest.p2p_id]


def test_an_auditor_refuses_an_identity_its_daemon_does_not_speak_as():
    me, other = Identity.generate(), Identity.generate()
    with pytest.raises(ValueError, match="spawn_dht"):
        Auditor()._init_audit(me, RUN, audit_probability=0.0, dht=SimpleNamespace(peer_id=other.p2p_id))


def _receipt(reducer: Identity, members: list[Identity], group: str = "g1", partition: int = 0) -> bytes:
    """A reducer's genuine receipt of a round in which ``members`` sent it their parts."""
    from swarm.protocol import PartCommitment, ReductionReceipt

    now = get_dht_time()
    commitments = [seal(PartCommitment(run_id=RUN, peer_id=m.peer_id, time=now, p2p_id=m.p2p_id, group=group,
                                       partition=partition, numel=4, codec="none", digest="0" * 64, weight=1.0), m)
                   for m in members]
    return seal(ReductionReceipt(run_id=RUN, peer_id=reducer.peer_id, time=now, p2p_id=reducer.p2p_id, group=group,
                                 partition=partition, numel=4, codec="none", aggregator="mean",
                                 commitments=commitments, output_digest="0" * 64), reducer)


def test_an_accusation_binds_its_accuser_to_the_accused_round_and_its_own_subkey():
    """A peer that sent no part to the reducer in that round cannot accuse it (ignored: nobody excluded), and the
    run's DHT nodes keep an accusation only under its accuser's own sub-key for that round, so nobody can take an
    auditor's sub-key first or hide its accusation there."""
    from hivemind.dht.protocol import DHTProtocol  # noqa: F401  (the validator's record format)
    from hivemind.dht.routing import DHTID
    from hivemind.dht.validation import DHTRecord
    from hivemind.utils.serializer import MSGPackSerializer as S

    from swarm.net.dht_validation import RunRecordValidator
    from swarm.protocol import accusations_key

    judge, member, outsider, reducer = Judge(), Identity.generate(), Identity.generate(), Identity.generate()
    receipt = _receipt(reducer, [member, reducer])

    def accusation(by: Identity) -> bytes:
        return seal(Accusation(run_id=RUN, peer_id=by.peer_id, time=get_dht_time(), p2p_id=by.p2p_id,
                               accused=reducer.p2p_id, receipt=receipt, reason="made up"), by)

    assert asyncio.run(judge._verify_accusation(accusation(outsider))) is False
    assert judge.exclusions.excluded() == []

    validator = RunRecordValidator(RUN)
    key = DHTID.generate(source=accusations_key(f"{RUN}-stage0_grad_averager")).to_bytes()

    def stored(value: bytes, subkey: str) -> bool:
        return validator.validate(DHTRecord(key, S.dumps(subkey), S.dumps(value), get_dht_time() + 60))

    assert stored(accusation(member), f"{member.p2p_id}/g1/0")
    assert not stored(accusation(outsider), f"{member.p2p_id}/g1/0"), "another's sub-key"
    assert not stored(b"junk", f"{member.p2p_id}/g1/0")
    assert not stored(accusation(member), f"{member.p2p_id}/g1/1"), "a sub-key of another partition"
