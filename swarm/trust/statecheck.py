"""Verifying a stage state loaded from a live server (the *donor*) before a server keeps it.

A joining server, or one that fell out of sync, downloads its stage's whole state (parameters and AdamW
statistics) from one live server of the stage (:mod:`swarm.averaging.donors`). A lying donor could hand it
anything, and the receiver would serve trainers with it and average it into the stage. Honest servers of a
stage that took part in the same rounds hold the same state bit for bit (every honest peer ends a round with
the same bytes, :doc:`docs/averaging.md`), so the receiver asks the stage's *other* servers (not the donor) for
their state's SHA-256 at the donor's epoch (``rpc_state_digest``; each keeps its last
:data:`~swarm.server.compute.DIGESTS_KEPT` epochs) and compares with the state it received
(:func:`~swarm.checkpoint.state.state_digest`). The rule (:func:`judge_donor_state`):

1. a state older than the stage's newest checkpoint is refused; one at a checkpoint's epoch must match that
   checkpoint's endorsed state digest (``CheckpointManifest.state_sha256``);
2. otherwise a strict majority of the other servers that hold a digest for that epoch must hold this one: a
   majority of their standing with the receiver (:mod:`swarm.trust.standing`) where any of them has some; where
   none has but the donor does, the donor's state is kept (keys that never averaged with it do not outvote a
   server that did); where the receiver verified none of them nor the donor (a fresh joiner), the same by the run
   key's recognition (:mod:`swarm.trust.recognition`); else a majority of their count;
3. if other servers are listed but none holds a digest for that epoch (within ``wait_s``: they are behind it,
   between two epochs, loaded their own state, or do not answer), the state is refused as unverifiable (a donor
   claiming an epoch nobody else has is refused this way);
4. if no other server is listed, the donor is the stage's only server and its state is kept, unverified, and
   said so in the log: with one server per stage nothing can contradict it (docs/threat-model.md).

A refused donor is skipped for a while, longer if rule 1 or 2 contradicted it (a checkpoint, or a majority holding
one other state) than if nobody could vouch for it (nor when the holders differ among themselves, as honest servers
of a stage averaging in bounded groups do between two state rounds) (:data:`~swarm.averaging.donors.REFUSAL_S`,
:data:`~swarm.averaging.donors.RETRY_S`), and the next one tried; the server keeps its previous state meanwhile
(:meth:`swarm.averaging.optimizer.StageOptimizer.load_state_from_peers`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Awaitable, Callable, Optional, Sequence

from swarm.net.stage_rpc import ask_state_digest
from swarm.protocol import CheckpointManifest, ServerInfo

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Verdict:
    """Whether a donor's state is kept (``ok``) and why, in words for the log; ``contradicted``: refused because
    the stage's checkpoint or servers hold another state (not merely because nobody could vouch for it); ``shared``:
    kept as the stage's state, a checkpoint or most holders of its epoch holding it (or no other server listed).
    A state kept on the donor's standing alone, where holders without any hold another one, may be the donor's own
    (a donor whose round failed steps on its own gradient): the receiver keeps it but says its parameters are out
    of sync with the stage (:attr:`swarm.averaging.StageOptimizer.synced`) until its next state round, so that spot
    checks do not compare its answers with the stage's."""

    ok: bool
    why: str
    contradicted: bool = False
    shared: bool = False
    settled: bool = False
    """Kept by a checkpoint, or by a majority of the weight (standing or recognition) of holders that answered:
    servers still behind the donor's epoch would not change it, so :meth:`DonorStateCheck.judge` waits no longer."""


def judge_donor_state(epoch: int, digest: str, answers: dict[str, tuple[int, str]],
                      checkpoints: Sequence[CheckpointManifest], listed: int = -1,
                      weight: Optional[Callable[[str], float]] = None, donor: str = "",
                      named: Optional[Callable[[str], float]] = None) -> Verdict:
    """Judge a donor's state (rules in the module docstring).

    :param epoch: the donor's epoch (the state is the one after that epoch's step).
    :param digest: SHA-256 (hex) of the state received.
    :param answers: the stage's other servers, neither this one nor the donor: libp2p id -> (its epoch now,
        its digest at ``epoch`` or "").
    :param checkpoints: the stage's committed checkpoints (manifests) known to this server.
    :param listed: how many other servers the stage lists online, answering or not (-1: ``len(answers)``).
    :param weight: libp2p id -> its standing's weight with this server, in ``[0, 1]``; None counts heads.
    :param donor: the donor's libp2p id (its weight counts for the state it sent).
    :param named: libp2p id -> 1 if the run key's recognition names it, else 0
        (:meth:`swarm.server.served.PeerContext.named`): weighs where ``weight`` gives nobody any (a fresh joiner).
    """
    listed = len(answers) if listed < 0 else listed
    newest = max(checkpoints, key=lambda m: m.epoch, default=None)
    if newest is not None and epoch < newest.epoch:
        return Verdict(False, f"epoch {epoch} is older than the stage's newest checkpoint (epoch {newest.epoch})",
                       contradicted=True)
    same = [m for m in checkpoints if m.epoch == epoch]
    if same:
        if any(m.state_sha256 == digest for m in same):
            return Verdict(True, f"it is the stage's checkpoint of epoch {epoch}", shared=True, settled=True)
        return Verdict(False, f"it differs from the stage's checkpoint of epoch {epoch} "
                              f"({same[0].state_sha256[:16]}, received {digest[:16]})", contradicted=True)
    held = {peer: d for peer, (_, d) in answers.items() if d}
    weighed = _by_weight(digest, held, weight, donor, "this server verified") if weight is not None else None
    if weighed is None and named is not None:
        weighed = _by_weight(digest, held, named, donor, "the run key recognizes")
    if weighed is not None:
        return weighed
    agree = sum(d == digest for d in held.values())
    if held:
        if 2 * agree > len(held):
            return Verdict(True, f"{agree} of the {len(held)} other servers with epoch {epoch} hold the same state",
                           shared=True)
        contradicted = _contradicted(digest, held, lambda p: 1.0)
        return Verdict(False, f"{len(held) - agree} of the {len(held)} other servers with epoch {epoch} hold another "
                              f"state (received {digest[:16]}){_UNSETTLED * (not contradicted)}", contradicted)
    if listed:
        epochs = sorted({e for e, _ in answers.values()})
        return Verdict(False, f"none of the {listed} other servers vouches for epoch {epoch} ({len(answers)} answered, "
                              f"at epochs {epochs})")
    return Verdict(True, "unverified: the donor is the stage's only other server", shared=True)


def _by_weight(digest: str, held: dict[str, str], weight: Callable[[str], float], donor: str,
               basis: str) -> Optional[Verdict]:
    """Rule 2 by ``weight`` (standing, or the recognition: ``basis`` says which, for the log): a majority of the
    holders' weight; or, where no holder has any, the donor's own if it has some (weightless keys holding another
    state do not outvote a donor this server verified). None (the next weight, or rule 2 by count) if nobody holds
    the epoch or none of them nor the donor has any."""
    if not held:
        return None  # rules 3 and 4: a donor's word alone never vouches for an epoch others do not hold
    weights = {peer: weight(peer) for peer in held}
    total = sum(weights.values())
    if total <= 0:
        if donor and weight(donor) > 0:
            agree = sum(d == digest for d in held.values())
            return Verdict(True, f"{basis} the donor, and none of the {len(held)} other servers holding this epoch "
                                 f"({agree} of them hold this state)", shared=2 * agree > len(held))
        return None
    agree = sum(w for peer, w in weights.items() if held[peer] == digest)
    if 2 * agree > total:
        return Verdict(True, f"servers holding {agree:.2f} of the {total:.2f} weight of those {basis} hold the "
                             "same state", shared=True, settled=True)
    contradicted = _contradicted(digest, held, weight)
    return Verdict(False, f"servers holding {total - agree:.2f} of the {total:.2f} weight of those {basis} hold "
                          f"another state (received {digest[:16]}){_UNSETTLED * (not contradicted)}", contradicted)


_UNSETTLED = ", not one state among them either (bounded groups between two state rounds?): retried soon"


def _contradicted(digest: str, held: dict[str, str], weight: Callable[[str], float]) -> bool:
    """Whether a strict majority of the holders' ``weight`` holds one and the same state other than ``digest``: a
    contradiction. Holders that differ among themselves are not one: in a stage averaging in bounded groups
    (``[averaging] group_size``) honest servers were seen holding different states between two state rounds
    (tests/test_scale.py: seven servers, seven digests at every odd epoch), so no donor's state verifies there
    until the next state round, and its donor is retried
    after :data:`~swarm.averaging.donors.RETRY_S`, not shunned for :data:`~swarm.averaging.donors.REFUSAL_S`."""
    weights: dict[str, float] = {}
    for peer, held_digest in held.items():
        weights[held_digest] = weights.get(held_digest, 0.0) + weight(peer)
    total = sum(weights.values())
    return any(2 * w > total for d, w in weights.items() if d != digest)


class DonorStateCheck:
    """Asks the stage's other servers and judges a donor's state (:func:`judge_donor_state`).

    :param servers: the stage's servers announced online now (e.g. ``AsyncRunDirectory.fresh_servers``).
    :param checkpoints: the stage's committed checkpoints.
    :param me: this server's libp2p id.
    :param wait_s: seconds to wait for servers behind the donor's epoch to reach it.
    :param timeout_s: seconds one server has to answer.
    :param weight: libp2p id -> its standing's weight with this server (:func:`judge_donor_state`); None counts
        heads.
    :param named: libp2p id -> whether the run key's recognition names it, 1 or 0 (:func:`judge_donor_state`).
    """

    def __init__(self, p2p, run_id: str, servers: Callable[[], Awaitable[list[ServerInfo]]],
                 checkpoints: Callable[[], Awaitable[list[CheckpointManifest]]], me: str, wait_s: float = 10.0,
                 timeout_s: float = 3.0, weight: Optional[Callable[[str], float]] = None,
                 named: Optional[Callable[[str], float]] = None):
        self.p2p, self.run_id, self.servers, self.checkpoints, self.me = p2p, run_id, servers, checkpoints, me
        self.wait_s, self.timeout_s, self.weight, self.named = wait_s, timeout_s, weight, named

    async def judge(self, epoch: int, digest: str, donor: str) -> Verdict:
        """Ask the stage's other servers for their digest at ``epoch`` (again every 0.5 s while some are behind
        it, for at most ``wait_s`` seconds), then judge."""
        deadline = time.monotonic() + self.wait_s
        checkpoints, servers = await asyncio.gather(self.checkpoints(), self.servers())  # (no serial DHT reads)
        while True:
            others = [s for s in servers if s.p2p_id not in (donor, self.me)]
            replies = await asyncio.gather(*(ask_state_digest(self.p2p, s, self.run_id, epoch, self.timeout_s)
                                             for s in others), return_exceptions=True)
            answers = {s.p2p_id: r for s, r in zip(others, replies) if isinstance(r, tuple)}
            verdict = judge_donor_state(epoch, digest, answers, checkpoints, len(others), self.weight, donor,
                                        self.named)
            # one at the epoch without its digest is between two epochs (the digest follows the step); one behind
            # may reach it: waited for, unless the weighed holders already settled it (joiners that reload together
            # in a fast stage each waited for the others, behind, and fell behind again: bench/sybil.py, patient)
            waiting = [e for e, d in answers.values() if not d and e <= epoch]
            if not waiting or verdict.settled or time.monotonic() > deadline:
                return verdict
            await asyncio.sleep(0.5)
            servers = await self.servers()

    def blocking(self, loop: asyncio.AbstractEventLoop) -> Callable[[int, str, str], Verdict]:
        """A :data:`swarm.averaging.optimizer.StateCheck` for threads other than ``loop``'s: runs :meth:`judge`
        on ``loop`` and logs a kept state's verdict. :raises TimeoutError: no verdict within ``wait_s`` + 60 s."""

        def check(epoch: int, digest: str, donor: str) -> Verdict:
            future = asyncio.run_coroutine_threadsafe(self.judge(epoch, digest, donor), loop)
            try:
                verdict = future.result(self.wait_s + 4 * self.timeout_s + 60)
            finally:
                future.cancel()
            if verdict.ok:
                logger.info("kept the state of donor %s at epoch %d: %s%s", donor, epoch, verdict.why,
                            "" if verdict.shared else "; out of sync with the stage until its next state round")
            return verdict

        return check


__all__ = ["DonorStateCheck", "Verdict", "judge_donor_state"]
