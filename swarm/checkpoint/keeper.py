"""The fragment keeper every reachable peer runs: hold fragments for the swarm and keep checkpoints alive.

Every ``record_ttl_s / 3`` seconds (:meth:`FragmentKeeper.tick`):

1. **Announce** a signed :class:`~swarm.protocol.StorageInfo`: libp2p id, free budget, the fragments held.
2. **Re-publish** the sealed manifest of every committed checkpoint held here, verbatim (signed by its
   writer), so manifests outlive their writers and reappear in a fresh DHT after every peer restarted: each
   one this tick's read of the DHT did not find, or found expiring before this peer's next tick (with half a
   tick to spare). One holder's store keeps a manifest alive, so the holders take turns instead of each storing
   every manifest every tick (the demo's peers stored 110 manifests in 40 s of training that way, 43 now).
3. **Adopt** manifests that name fragments held here but were not handed over (the writer died in between).
4. **Collect** old epochs (:class:`~swarm.checkpoint.store.FragmentStore` retention).
5. **Repair**: for each of the newest ``keep`` checkpoints of every stage that is restorable but misses
   fragments (their holders vanished), the live holder with the lowest peer id fetches ``k`` fragments,
   re-encodes the missing ones (erasure coding is deterministic, so they hash as the manifest says) and
   places them on new peers (:func:`~swarm.checkpoint.catalog.choose_holders`).

Fragments move through :class:`~swarm.checkpoint.transfers.FragmentTransfers`: a holder that serves bytes not
matching the manifest's hash is *distrusted* (never fetched from or placed on again, and listed in this peer's
StorageInfo with the reason); peers on the run's ban list (:mod:`swarm.trust.banlist`) are avoided alike.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections import Counter
from functools import partial
from typing import Optional

from hivemind.p2p import P2P, P2PDaemonError
from hivemind.utils import get_dht_time

from swarm.aio import periodic
from swarm.checkpoint.catalog import CheckpointView, checkpoint_views, holding
from swarm.checkpoint.erasure import FragmentError, split_into_fragments
from swarm.checkpoint.service import FragmentService, request_endorsement
from swarm.checkpoint.transfers import FragmentTransfers
from swarm.checkpoint.shard import max_shard_bytes
from swarm.checkpoint.store import FragmentStore
from swarm.config import RunSpec
from swarm.identity import Identity
from swarm.logs import PeerLog
from swarm.net.directory import AsyncRunDirectory
from swarm.protocol import CheckpointManifest, EndorseRequest, ProtocolError, StorageInfo, open_record, storage_key
from swarm.trust.authority import CheckpointAuthority
from swarm.trust.banlist import RunBans
from swarm.trust.tickets import Gate

logger = logging.getLogger(__name__)

MAX_DISTRUSTED_PUBLISHED = 32


def max_fragment_bytes(spec: RunSpec) -> int:
    """Twice the largest fragment of the run's shards (bytes): room for more optimizer state, no room for 2 GiB of
    junk. Computed at a fragment's first put, not as the keeper starts: the stages' first build on the ``meta``
    device imports torch's Python decompositions and ``torch._dynamo``, 1.6-1.9 s of a joining server's path on
    this project's 2-core machines (measured); a server otherwise imports only ``torch._dynamo`` of them, in its
    optimizer's constructor (0.8 s)."""
    return 2 * -(-max_shard_bytes(spec.model) // spec.checkpoint.fragments_needed)


class FragmentKeeper:
    """Holds fragments in ``store`` for ``directory``'s run and keeps the run's checkpoints replicated.

    :param stage: the stage this peer serves (-1: none); placement avoids putting a stage's fragments on
        its own servers. Updated when a server moves.
    :param bans: the run's ban list, which this keeper refreshes and re-publishes every tick (the peer's one
        :class:`~swarm.trust.banlist.RunBans`; a new one if omitted).
    :param gate: checks each caller of the fragment RPCs in a ticketed run (``FragmentService``'s ``gate``).
    """

    def __init__(self, spec: RunSpec, directory: AsyncRunDirectory, identity: Identity, store: FragmentStore,
                 *, stage: int = -1, bans: Optional[RunBans] = None, rng: Optional[random.Random] = None,
                 gate: Optional[Gate] = None):
        self.spec, self.directory, self.identity, self.store = spec, directory, identity, store
        self.run_id, self.me, self.stage = directory.run_id, identity.peer_id, stage
        self.log = PeerLog(logger, identity.peer_id)
        if directory.num_stages is None:  # (a directory whose spec this peer got otherwise: who may commit needs it)
            directory.num_stages = spec.model.num_stages
        self.authority = CheckpointAuthority(directory, identity, spec.model.num_stages, ask=request_endorsement)
        self.service = FragmentService(store, directory.run_id, on_manifest=directory.publish_manifest,
                                       num_stages=spec.model.num_stages, authority=self.authority,
                                       max_fragment_bytes=partial(max_fragment_bytes, spec), gate=gate)
        self.bans = bans if bans is not None else RunBans(directory)
        self.p2p: Optional[P2P] = None
        self.transfers: Optional[FragmentTransfers] = None  # once started (it needs the peer's libp2p node)
        self.repairs = 0
        self.rng = rng or random.Random()

    # ---- lifecycle -------------------------------------------------------------------------------------
    async def start(self, p2p: P2P, announce: bool = True) -> None:
        """Serve the fragment RPCs on ``p2p`` and announce what is on disk (re-publishing its manifests).

        :param announce: False: only read the run's ban list here, and let :meth:`run` announce at once, beside the
            caller's next steps (a joining server: the tick's serial DHT reads and stores, about 6 round trips, are
            then off its join's path).
        """
        self.p2p = p2p
        self.transfers = FragmentTransfers(p2p, self.directory, self.me, self.store, self.service, bans=self.bans,
                                           log=self.log, rng=self.rng)
        await self.service.add_p2p_handlers(p2p, namespace=self.run_id)
        if announce:
            await self.tick(repair=False)
        else:
            await self.bans.refresh()

    async def stop(self) -> None:
        """Stop serving fragments. A p2p daemon that is already gone (Ctrl-C in a terminal reaches it too, and it
        exits first) has no handlers left to remove: that is logged, not raised."""
        if self.p2p is not None:
            try:
                await self.service.remove_p2p_handlers(self.p2p, namespace=self.run_id)
            except (OSError, P2PDaemonError) as e:  # its control socket is gone (FileNotFoundError)
                self.log.debug("the p2p daemon is gone; no fragment handlers to remove (%s)", e)

    async def run(self, stop: asyncio.Event, announce: bool = False) -> None:
        """Call :meth:`tick` every ``record_ttl_s / 3`` seconds until ``stop``; errors are logged, not raised.

        :param announce: tick once at once, without repairs (after ``start(p2p, announce=False)``).
        """
        if announce:
            try:
                await self.tick(repair=False)
            except Exception:
                self.log.exception("fragment keeper tick failed")
        await periodic(stop, self.directory.ttl / 3, self.tick, "fragment keeper tick", self.log)

    # ---- one round -------------------------------------------------------------------------------------
    def storage_info(self) -> StorageInfo:
        held = [holding(h.stage, h.epoch, h.index, h.sha256) for h in self.store.held() if h.run_id == self.run_id]
        return StorageInfo(run_id=self.run_id, peer_id=self.me, time=get_dht_time(),
                           p2p_id=str(self.p2p.peer_id) if self.p2p else "", free_bytes=self.store.free_bytes(),
                           stage=self.stage, held=held[-1024:],
                           distrusted={p: r[:200]
                                       for p, r in sorted(self.distrusted.items())[:MAX_DISTRUSTED_PUBLISHED]})

    @property
    def distrusted(self) -> dict[str, str]:
        """Holders that served corrupt fragments to this peer -> reason (:meth:`FragmentTransfers.distrust`)."""
        return self.transfers.distrusted if self.transfers is not None else {}

    async def announce(self) -> None:
        """Announce what this peer holds (:meth:`storage_info`, read from its disk)."""
        info = await asyncio.to_thread(self.storage_info)
        await self.directory.announce(storage_key(self.run_id), info, self.identity)

    async def tick(self, repair: bool = True) -> None:
        await self.bans.refresh(republish=True)
        views = await self.views()
        await self._publish_held()
        await self._adopt(views)
        if repair:
            for stage_views in views.values():
                for view in stage_views[: self.spec.checkpoint.keep]:
                    # a young checkpoint's holders may not have re-announced yet: judge it one TTL later
                    if view.missing and view.restorable and view.age_s > self.directory.ttl \
                            and min(view.holders) == self.me:
                        await self.repair(view)

    async def _publish_held(self) -> None:
        """Re-publish the held manifests whose DHT copy is missing or expires before the next tick (step 2 of the
        module docstring; the expirations are those of :meth:`views`' read), collect old epochs, announce."""
        soon = get_dht_time() + 1.5 * self.directory.ttl / 3
        for manifest, sealed in await asyncio.to_thread(self._held_manifests, None, True):
            if self.directory.manifest_expires(manifest) < soon:
                await self.directory.publish_manifest(manifest, sealed)
        for stage in range(self.spec.model.num_stages):
            await asyncio.to_thread(self.store.collect, self.run_id, stage)
        await self.announce()

    def _held_manifests(self, only_stage: Optional[int] = None, log: bool = False) -> list[tuple]:
        """(blocking: the disk, signature checks) ``(manifest, sealed)`` of the checkpoints committed on this peer's
        disk (of ``only_stage``, if given) whose manifests verify (``log``: say which do not)."""
        found = []
        for stage, epoch, sealed in self.store.committed(self.run_id):
            if only_stage is not None and stage != only_stage:
                continue
            try:
                found.append((open_record(sealed, CheckpointManifest, run_id=self.run_id)[0], sealed))
            except ProtocolError as e:
                if log:
                    self.log.warning("a saved manifest of stage %d epoch %d does not verify (%s); ignoring it",
                                     stage, epoch, e)
        return found

    async def known_manifests(self, stage: int) -> list[CheckpointManifest]:
        """Manifests of ``stage`` in the DHT and on this peer's disk (the DHT may lag behind a commit)."""
        found = {m.shard_sha256: m for m, _ in await self.directory.manifests(stage)}
        for manifest, _ in await asyncio.to_thread(self._held_manifests, stage):
            found.setdefault(manifest.shard_sha256, manifest)
        return list(found.values())

    async def views(self) -> dict[int, list[CheckpointView]]:
        """Checkpoints of every stage with their live holders, newest first."""
        storage = await self.directory.storage()
        return {stage: checkpoint_views(await self.directory.manifests(stage), storage)
                for stage in range(self.spec.model.num_stages)}

    async def _adopt(self, views: dict[int, list[CheckpointView]]) -> None:
        """Save published manifests of checkpoints held here that this store has no manifest for."""
        for stage_views in views.values():
            for view in stage_views:
                m = view.manifest
                if self.me in view.holders and self.store.manifest(self.run_id, m.stage, m.epoch) is None:
                    try:
                        await self.service.accept_manifest(view.sealed)
                    except (ProtocolError, OSError) as e:
                        logger.debug("not adopting the manifest of stage %d epoch %d: %s", m.stage, m.epoch, e)

    async def endorsements(self, req: EndorseRequest) -> list[bytes]:
        """Other peers' sealed endorsements of a checkpoint this peer writes
        (:meth:`~swarm.trust.authority.CheckpointAuthority.gather`). :raises ProtocolError: nobody endorsed it."""
        return await self.authority.gather(self.p2p, req)

    async def hand_off(self, timeout_s: float = 20.0) -> int:
        """Before this peer leaves (a drain): copy the fragments it holds of each stage's newest ``keep``
        checkpoints, with their manifests, to peers that hold nothing of that checkpoint, so leaving costs the
        swarm no replica. Bounded by ``timeout_s`` (a container's stop timeout); returns the fragments placed."""
        async def run() -> int:
            views = await self.views()
            storage = [s for s in await self.directory.storage() if s.peer_id != self.me]
            by_peer, total = {s.peer_id: s for s in storage}, 0
            for stage_views in views.values():
                for view in stage_views[: self.spec.checkpoint.keep]:
                    m = view.manifest
                    mine = sorted(i for i, holders in view.alive.items() if self.me in holders)
                    fragments = []
                    for index in mine:
                        try:
                            fragments.append(await asyncio.to_thread(self.store.get, self.run_id, m.stage, m.epoch,
                                                                     index))
                        except OSError:
                            continue
                    placed = await self.transfers.place(m.stage, m.epoch, fragments, storage=storage,
                                              exclude=view.holders | {self.me},
                                              load=Counter({p: 1 for p in view.holders}))
                    await self.transfers.hand_manifests([by_peer[p] for p in set(placed.values())], m, view.sealed)
                    total += len(placed)
            return total

        try:
            placed = await asyncio.wait_for(run(), timeout_s)
        except asyncio.TimeoutError:
            self.log.warning("handing off fragments took over %.0f s; leaving the rest to repair", timeout_s)
            return 0
        self.log.info("handed off %d fragments before leaving", placed)
        return placed

    async def repair(self, view: CheckpointView) -> int:
        """Restore the missing fragments of ``view`` onto new holders; returns how many were placed."""
        m = view.manifest
        storage = await self.directory.storage()
        try:
            blob, _ = await self.transfers.fetch(view, storage=storage)
        except FragmentError as e:
            self.log.warning("cannot repair stage %d epoch %d: %s", m.stage, m.epoch, e)
            return 0
        fragments = await asyncio.to_thread(split_into_fragments, blob, m.k, m.n)
        wanted = {f.index: f.sha256 for f in m.fragments}
        missing = [f for f in fragments if f.index in view.missing and wanted.get(f.index) == f.sha256]
        placed = await self.transfers.place(m.stage, m.epoch, missing, storage=storage, exclude=view.holders,
                                  load=Counter({p: 1 for p in view.holders}))
        by_peer = {s.peer_id: s for s in storage} | {self.me: self.storage_info()}
        await self.transfers.hand_manifests([by_peer[p] for p in set(placed.values())], m, view.sealed)
        if not placed:
            self.log.warning("checkpoint of stage %d epoch %d misses fragments %s and no other peer can take them",
                             m.stage, m.epoch, view.missing)
            return 0
        self.repairs += len(placed)
        self.log.info("repaired the checkpoint of stage %d epoch %d: fragments %s re-placed on %s (%d of %d alive "
                      "before)", m.stage, m.epoch, sorted(placed), sorted(set(placed.values())), view.fragments_alive,
                      m.n)
        await self.announce()
        return len(placed)
