"""An accusation counts against its accuser only if the accuser signed it: a stranger who signs an accusation in
an honest peer's name (its libp2p id) with a garbage receipt gets nobody excluded (issue 11)."""

import asyncio

from hivemind.utils import get_dht_time

from swarm.averaging.auditor import Auditor
from swarm.averaging.exclusion import ExclusionBook
from swarm.identity import Identity
from swarm.protocol import Accusation, seal

RUN = "tiny-aaaaaaaaaaaaaaaa"


class Judge(Auditor):
    """The auditing side of an averager, without the averager: what a stage-mate does with an accusation."""

    def __init__(self):
        self._init_audit(Identity.generate(), RUN, audit_probability=0.0)
        self.peer_id, self.exclusions = "12D3KooWjudge", ExclusionBook()


def _accusation(signer: Identity, accuser: str, accused: str) -> bytes:
    return seal(Accusation(run_id=RUN, peer_id=signer.peer_id, time=get_dht_time(), p2p_id=accuser,
                           accused=accused, receipt=b"garbage", reason="made up"), signer)


def test_an_accusation_in_someone_elses_name_excludes_nobody():
    judge, honest, stranger = Judge(), Identity.generate(), Identity.generate()
    accuser, reducer = "12D3KooWhonestaccuser", "12D3KooWhonestreducer"
    judge.learn_key(accuser, honest.public_key)  # the accuser sent this peer parts signed with its key

    forged = asyncio.run(judge._verify_accusation(_accusation(stranger, accuser, reducer)))
    assert forged is False and judge.exclusions.excluded() == []
    # an accuser this peer never averaged with cannot be attributed yet: nothing happens
    assert asyncio.run(judge._verify_accusation(_accusation(stranger, "12D3KooWunknown", reducer))) is None
    assert judge.exclusions.excluded() == []
    # the accuser's own garbage accusation excludes the accuser (never the accused)
    assert asyncio.run(judge._verify_accusation(_accusation(honest, accuser, reducer))) is False
    assert judge.exclusions.excluded() == [accuser]
