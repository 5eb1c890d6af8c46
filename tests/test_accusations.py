"""An accusation counts against its accuser only if the accuser signed it: a stranger who signs an accusation in
an honest peer's name (its libp2p id) with a garbage receipt gets nobody excluded, while any peer, whether or not
it ever averaged with the accuser, can attribute a genuine one (a peer's libp2p id is its key; issue 11)."""

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
