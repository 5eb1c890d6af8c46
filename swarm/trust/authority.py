"""Who may commit a stage's checkpoint, and who may hand this peer fragments: the checkpoint's authority.

A fresh key can sign a manifest and fragments as well as anyone; what it cannot get is a second peer's word.

* **Endorsements.** A manifest counts only with at least one :class:`~swarm.protocol.Endorsement` by a peer
  other than its writer, embedded sealed in it and checked by every reader (:func:`swarm.protocol.open_record`,
  so the DHT's nodes, holders, restoring servers and ``export`` alike). A server of the stage endorses
  (``same_state``) only if its own state at that epoch has the digest the writer names: a checkpoint commits
  only when a second server of the stage agrees on its hash. Where the writer is the stage's only online
  server, a *witness* endorses instead: the run's coordinator or a server of another stage that sees the writer
  announced, online, as the stage's only server, and the request arriving from the writer's libp2p id (which
  is its key, :mod:`swarm.identity`). A witness vouches for the writer's place, not for its state.
* **Puts.** A holder stores a fragment only from an online server of that stage (a writer placing a new
  checkpoint), or when a published manifest of that stage and epoch lists it (a repair or a hand-off of a
  committed checkpoint: storing it can only keep that checkpoint alive). Anyone else is refused with the rule.

Out of reach: someone running two keys can announce one as a server and endorse with the other (a Sybil);
the threat model (``docs/threat-model.md``) says what that costs and what still holds.
"""

from __future__ import annotations

import asyncio
import time
from typing import Awaitable, Callable, Optional

from hivemind.p2p import P2P
from hivemind.utils import get_dht_time

from swarm.identity import Identity, SignatureError, p2p_id_of, peer_id_of, public_key_of_p2p_id
from swarm.net.directory import AsyncRunDirectory
from swarm.protocol import CheckpointManifest, Endorsement, EndorseRequest, ProtocolError, ServerInfo, seal

STATE_WAIT_S = 15.0
"""Seconds a stage server waits for its own capture of the epoch it is asked to endorse (it may lag the
writer by a micro-batch or a round)."""
KEEP_STATES = 8
"""Epochs whose state digest a server keeps to endorse."""


class EndorsementRefused(RuntimeError):
    """A peer answered an endorsement request with a refusal (its reason): its answer, which asking again cannot
    change."""


AskEndorsement = Callable[[P2P, str, EndorseRequest], Awaitable[bytes]]
"""Asks the peer with a libp2p id to endorse a checkpoint: ``(p2p, peer, request) -> sealed endorsement``; raises
:class:`EndorsementRefused` for a refusal, anything else when the peer could not be asked
(:func:`swarm.checkpoint.service.request_endorsement`)."""


def peer_of_p2p_id(p2p_id: str) -> str:
    """The peer id of the key a libp2p id inlines; raises :class:`ProtocolError` if it inlines none."""
    try:
        return peer_id_of(public_key_of_p2p_id(p2p_id))
    except SignatureError as e:
        raise ProtocolError(str(e)) from None


class CheckpointAuthority:
    """This peer's side of the checkpoint authority (module docstring) for ``directory``'s run.

    For the stage this peer serves (:meth:`serve_stage`) it keeps, epoch -> digest of its own state captured at
    that epoch (:meth:`record_state`); a peer that serves nothing endorses as a witness only.

    :param ask: how a writer asks a peer for its endorsement (:data:`AskEndorsement`).
    """

    def __init__(self, directory: AsyncRunDirectory, identity: Identity, num_stages: int, ask: AskEndorsement):
        self.directory, self.identity, self.num_stages, self.ask = directory, identity, num_stages, ask
        self._states: dict[int, dict[int, str]] = {}  # stage served -> epoch -> digest of this server's state

    def serve_stage(self, stage: int) -> None:
        """This peer serves ``stage`` now: it endorses that stage's checkpoints by its own state only."""
        self._states.setdefault(stage, {})

    def leave_stage(self, stage: int) -> None:
        """This peer no longer serves ``stage``: it no longer endorses its checkpoints by state."""
        self._states.pop(stage, None)

    def record_state(self, stage: int, epoch: int, digest: str) -> None:
        """(any thread) This server's state at ``epoch`` of ``stage`` has ``digest``; keeps the last few."""
        held = self._states.setdefault(stage, {})
        held[epoch] = digest
        for old in sorted(held)[:-KEEP_STATES]:
            held.pop(old, None)

    async def _serves(self, stage: int, p2p_id: str, online: Optional[list[ServerInfo]] = None) -> bool:
        """Is ``p2p_id`` an online server of ``stage``? A record's libp2p id is its signer's own
        (:func:`~swarm.protocol.open_record`), so the id alone identifies the server."""
        online = online if online is not None else await self.directory.fresh_servers(stage)
        return any(s.p2p_id == p2p_id for s in online)

    async def entitled(self, manifest: CheckpointManifest) -> Optional[str]:
        """None if the manifest's writer and an endorser may commit it, else why not
        (:meth:`~swarm.net.directory.RunDirectory.entitled`)."""
        return await self.directory.entitled(manifest)

    # ---- the endorser's side -----------------------------------------------------------------------------
    async def endorse(self, req: EndorseRequest, writer_p2p: str) -> bytes:
        """A sealed endorsement of ``req`` for the writer speaking from ``writer_p2p``.

        :raises ProtocolError: the writer is not an online server of the stage, this server's own state at that
            epoch differs (or was not captured in :data:`STATE_WAIT_S`), or, as a witness, the stage has other
            online servers (they endorse).
        """
        writer = peer_of_p2p_id(writer_p2p)
        online = await self.directory.fresh_servers(req.stage)
        if not await self._serves(req.stage, writer_p2p, online):
            raise ProtocolError(f"{writer} is not an online server of stage {req.stage} here; only the stage's "
                                "servers commit its checkpoints")
        if req.stage in self._states:
            mine = await self._own_state(req.stage, req.epoch)
            if mine != req.state_sha256:
                raise ProtocolError(f"this server's state at epoch {req.epoch} has digest "
                                    f"{(mine or 'none captured')[:16]}, not {req.state_sha256[:16]}")
            basis = "same_state"
        else:
            others = sorted(s.peer_id for s in online if s.peer_id != writer)
            if others:
                raise ProtocolError(f"stage {req.stage} has other online servers ({', '.join(others[:4])}): "
                                    "one of them endorses, a witness does not")
            basis = "witness"
        return seal(Endorsement(run_id=self.directory.run_id, peer_id=self.identity.peer_id, time=get_dht_time(),
                                stage=req.stage, epoch=req.epoch, state_sha256=req.state_sha256, writer=writer,
                                basis=basis), self.identity)

    async def _own_state(self, stage: int, epoch: int) -> Optional[str]:
        deadline = time.monotonic() + STATE_WAIT_S
        while True:
            held = self._states.get(stage, {})
            if epoch in held or max(held, default=-1) > epoch or time.monotonic() > deadline:
                return held.get(epoch)
            await asyncio.sleep(0.2)

    # ---- the holder's side -------------------------------------------------------------------------------
    async def may_put(self, putter_p2p: str, stage: int, epoch: int, index: int, sha256: str) -> Optional[str]:
        """None if ``putter_p2p`` may hand this peer that fragment, else the reason."""
        try:
            putter = peer_of_p2p_id(putter_p2p)
        except ProtocolError as e:
            return str(e)
        if await self._serves(stage, putter_p2p):
            return None
        for manifest, _ in await self.directory.manifests(stage):
            if manifest.epoch == epoch and any(f.index == index and f.sha256 == sha256 for f in manifest.fragments):
                return None
        return (f"{putter} is not an online server of stage {stage} and no committed checkpoint of epoch {epoch} "
                f"lists fragment {index} with that hash: only a stage's servers place new fragments")

    # ---- the writer's side -------------------------------------------------------------------------------
    async def _endorsers(self, stage: int) -> tuple[list[str], list[str]]:
        """libp2p ids of the stage's other online servers, and of the witnesses (the coordinator first, then the
        servers of the other stages)."""
        me = self.identity.peer_id
        mates = [s.p2p_id for s in await self.directory.fresh_servers(stage) if s.peer_id != me]
        witnesses = [p2p_id_of(self.directory.run_key)] if self.directory.run_key is not None else []
        for k in range(self.num_stages):
            if k != stage:
                witnesses += [s.p2p_id for s in await self.directory.fresh_servers(k) if s.peer_id != me]
        return mates, [w for w in witnesses if w != self.identity.p2p_id]

    async def gather(self, p2p: P2P, req: EndorseRequest, timeout_s: float = 30.0) -> list[bytes]:
        """Ask for endorsements of ``req``; returns the sealed endorsements received. The stage's other servers
        are asked, all at once; one that answers with a refusal has given its answer (each waits up to
        :data:`STATE_WAIT_S` for its own capture of the epoch; asking again cannot change it), so the checkpoint
        is not committed. One that does not answer (it died, or is unreachable) is not asked again; with no
        stage-mate left to ask, witnesses are asked three at a time (they endorse once the stage shows no other
        online server) until one endorses or ``timeout_s`` seconds pass.

        :raises ProtocolError: nobody endorsed it; the message lists who refused or failed and why.
        """
        deadline, refusals, failed = time.monotonic() + timeout_s, {}, set()
        while True:
            mates, witnesses = await self._endorsers(req.stage)
            mates = [m for m in mates if m not in failed]
            batch = mates or witnesses[:3]
            answers = await asyncio.gather(*(self.ask(p2p, peer, req) for peer in batch), return_exceptions=True)
            got = [a for a in answers if isinstance(a, bytes)]
            if got:
                return got[:8]
            refusals.update({peer: str(a)[:200] for peer, a in zip(batch, answers)})
            if mates:
                failed.update(peer for peer, a in zip(batch, answers) if not isinstance(a, EndorsementRefused))
            refused = mates and any(isinstance(a, EndorsementRefused) for a in answers)
            if refused or time.monotonic() > deadline:
                raise ProtocolError(
                    f"no peer endorsed the checkpoint of stage {req.stage} epoch {req.epoch} "
                    f"({'no other online server of the run and no coordinator' if not refusals else refusals}); "
                    "a checkpoint needs a second server of the stage agreeing on its state, or a witness")
            await asyncio.sleep(2.0)


__all__ = ["AskEndorsement", "CheckpointAuthority", "EndorsementRefused", "KEEP_STATES", "STATE_WAIT_S",
           "peer_of_p2p_id"]
