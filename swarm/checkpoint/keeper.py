"""The fragment keeper every reachable peer runs: hold fragments for the swarm and keep checkpoints alive.

Every ``record_ttl_s / 3`` seconds (:meth:`FragmentKeeper.tick`):

1. **Announce** a signed :class:`~swarm.protocol.StorageInfo`: libp2p id, free budget, the fragments held.
2. **Re-publish** the sealed manifest of every committed checkpoint held here, verbatim (signed by its
   writer), so manifests outlive their writers and reappear in a fresh DHT after every peer restarted.
3. **Adopt** manifests that name fragments held here but were not handed over (the writer died in between).
4. **Collect** old epochs (:class:`~swarm.checkpoint.store.FragmentStore` retention).
5. **Repair**: for each of the newest ``keep`` checkpoints of every stage that is restorable but misses
   fragments (their holders vanished), the live holder with the lowest peer id fetches ``k`` fragments,
   re-encodes the missing ones (erasure coding is deterministic, so they hash as the manifest says) and
   places them on new peers (:func:`~swarm.checkpoint.catalog.choose_holders`).

A holder that serves bytes not matching the manifest's hash is *distrusted*: never fetched from or placed on
again, and listed in this peer's StorageInfo with the reason. Peers on the run's ban list (:mod:`swarm.trust.banlist`)
are shunned alike.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections import Counter
from typing import Callable, Iterable, Optional

from hivemind.p2p import P2P, P2PDaemonError
from hivemind.utils import get_dht_time

from swarm.aio import periodic
from swarm.trust.banlist import RunBans
from swarm.trust.authority import CheckpointAuthority
from swarm.checkpoint.catalog import CheckpointView, checkpoint_views, choose_holders, holding
from swarm.checkpoint.erasure import CorruptFragment, Fragment, FragmentError, join_fragments, split_into_fragments
from swarm.checkpoint.service import FragmentService, get_fragment, put_fragment, put_manifest
from swarm.checkpoint.shard import max_shard_bytes
from swarm.checkpoint.store import FragmentStore
from swarm.config import RunSpec
from swarm.net.directory import RunDirectory
from swarm.identity import Identity
from swarm.logs import PeerLog
from swarm.protocol import CheckpointManifest, ProtocolError, StorageInfo, open_record, storage_key

logger = logging.getLogger(__name__)

MAX_DISTRUSTED_PUBLISHED = 32


class FragmentKeeper:
    """Holds fragments in ``store`` for ``directory``'s run and keeps the run's checkpoints replicated.

    :param stage: the stage this peer serves (-1: none); placement avoids putting a stage's fragments on
        its own servers. Updated when a server moves.
    :param bans: the run's ban list, which this keeper refreshes and re-publishes every tick (the peer's one
        :class:`~swarm.trust.banlist.RunBans`; a new one if omitted).
    """

    def __init__(self, spec: RunSpec, directory: RunDirectory, identity: Identity, store: FragmentStore,
                 *, stage: int = -1, bans: Optional[RunBans] = None, rng: Optional[random.Random] = None):
        self.spec, self.directory, self.identity, self.store = spec, directory, identity, store
        self.run_id, self.me, self.stage = directory.run_id, identity.peer_id, stage
        self.log = PeerLog(logger, identity.peer_id)
        if directory.num_stages is None:  # (a directory whose spec this peer got otherwise: who may commit needs it)
            directory.num_stages = spec.model.num_stages
        self.authority = CheckpointAuthority(directory, identity, spec.model.num_stages)
        # twice the largest fragment of today's shards: room for more optimizer state, no room for 2 GiB of junk
        fragment_bytes = 2 * -(-max_shard_bytes(spec.model) // spec.checkpoint.fragments_needed)
        self.service = FragmentService(store, directory.run_id, on_manifest=directory.publish_manifest,
                                       num_stages=spec.model.num_stages, authority=self.authority,
                                       max_fragment_bytes=fragment_bytes)
        self.distrusted: dict[str, str] = {}  # holders that served corrupt fragments to this peer -> reason
        self.bans = bans if bans is not None else RunBans(directory)
        self.p2p: Optional[P2P] = None
        self.repairs = 0
        self.rng = rng or random.Random()

    # ---- lifecycle -------------------------------------------------------------------------------------
    async def start(self, p2p: P2P) -> None:
        """Serve the fragment RPCs on ``p2p`` and announce what is on disk (re-publishing its manifests)."""
        self.p2p = p2p
        await self.service.add_p2p_handlers(p2p, namespace=self.run_id)
        await self.tick(repair=False)

    async def stop(self) -> None:
        """Stop serving fragments. A p2p daemon that is already gone (Ctrl-C in a terminal reaches it too, and it
        exits first) has no handlers left to remove: that is logged, not raised."""
        if self.p2p is not None:
            try:
                await self.service.remove_p2p_handlers(self.p2p, namespace=self.run_id)
            except (OSError, P2PDaemonError) as e:  # its control socket is gone (FileNotFoundError)
                self.log.debug("the p2p daemon is gone; no fragment handlers to remove (%s)", e)

    async def run(self, stop: asyncio.Event) -> None:
        """Call :meth:`tick` every ``record_ttl_s / 3`` seconds until ``stop``; errors are logged, not raised."""
        await periodic(stop, self.directory.ttl / 3, self.tick, "fragment keeper tick", self.log)

    async def io(self, fn, *args):
        """Run the blocking ``fn(*args)`` (DHT access, disk) in the default executor."""
        return await asyncio.get_running_loop().run_in_executor(None, fn, *args)

    # ---- one round -------------------------------------------------------------------------------------
    def storage_info(self) -> StorageInfo:
        held = [holding(h.stage, h.epoch, h.index, h.sha256) for h in self.store.held() if h.run_id == self.run_id]
        return StorageInfo(run_id=self.run_id, peer_id=self.me, time=get_dht_time(),
                           p2p_id=str(self.p2p.peer_id) if self.p2p else "", free_bytes=self.store.free_bytes(),
                           stage=self.stage, held=held[-1024:],
                           distrusted={p: r[:200]
                                       for p, r in sorted(self.distrusted.items())[:MAX_DISTRUSTED_PUBLISHED]})

    def announce(self) -> None:
        self.directory.announce(storage_key(self.run_id), self.storage_info(), self.identity)

    async def tick(self, repair: bool = True) -> None:
        await self.io(self.bans.refresh, True)
        await self.io(self._publish_held)
        views = await self.views()
        await self._adopt(views)
        if repair:
            for stage_views in views.values():
                for view in stage_views[: self.spec.checkpoint.keep]:
                    # a young checkpoint's holders may not have re-announced yet: judge it one TTL later
                    if view.missing and view.restorable and view.age_s > self.directory.ttl \
                            and min(view.holders) == self.me:
                        await self.repair(view)

    def _publish_held(self) -> None:
        for stage, epoch, sealed in self.store.committed(self.run_id):
            try:
                manifest, _ = open_record(sealed, CheckpointManifest, run_id=self.run_id)
            except ProtocolError as e:
                self.log.warning("a saved manifest of stage %d epoch %d does not verify (%s); ignoring it", stage,
                                 epoch, e)
                continue
            self.directory.publish_manifest(manifest, sealed)
        for stage in range(self.spec.model.num_stages):
            self.store.collect(self.run_id, stage)
        self.announce()

    def known_manifests(self, stage: int) -> list[CheckpointManifest]:
        """Manifests of ``stage`` in the DHT and on this peer's disk (the DHT may lag behind a commit)."""
        found = {m.shard_sha256: m for m, _ in self.directory.manifests(stage)}
        for k, _, sealed in self.store.committed(self.run_id):
            if k == stage:
                try:
                    manifest, _ = open_record(sealed, CheckpointManifest, run_id=self.run_id)
                except ProtocolError:
                    continue
                found.setdefault(manifest.shard_sha256, manifest)
        return list(found.values())

    async def views(self) -> dict[int, list[CheckpointView]]:
        """Checkpoints of every stage with their live holders, newest first."""
        storage = await self.io(self.directory.storage)
        out = {}
        for stage in range(self.spec.model.num_stages):
            manifests = await self.io(self.directory.manifests, stage)
            out[stage] = checkpoint_views(manifests, storage)
        return out

    async def _adopt(self, views: dict[int, list[CheckpointView]]) -> None:
        """Save published manifests of checkpoints held here that this store has no manifest for."""
        for stage_views in views.values():
            for view in stage_views:
                m = view.manifest
                if self.me in view.holders and self.store.manifest(self.run_id, m.stage, m.epoch) is None:
                    try:
                        await self.io(self.service.accept_manifest, view.sealed)
                    except (ProtocolError, OSError) as e:
                        logger.debug("not adopting the manifest of stage %d epoch %d: %s", m.stage, m.epoch, e)

    # ---- transfers (local store or a remote holder) ----------------------------------------------------
    def shuns(self, peer_id: str) -> bool:
        """Distrusted by this keeper (it served corrupt fragments) or banned by the run's coordinator."""
        return peer_id in self.distrusted or self.bans.is_banned(peer_id)

    def distrust(self, peer_id: str, reason: str) -> None:
        """Never fetch from or place on ``peer_id`` again (it served bytes that are not the fragment)."""
        if peer_id not in self.distrusted and peer_id != self.me:
            self.log.warning("distrusting %s for fragment traffic: %s", peer_id, reason)
            self.distrusted[peer_id] = reason

    async def put(self, holder: StorageInfo, stage: int, epoch: int, fragment: Fragment) -> None:
        """Place ``fragment`` on ``holder`` (this peer's own store if it is us). Raises FragmentError."""
        if holder.peer_id == self.me:
            try:
                await self.io(self.store.put, self.run_id, stage, epoch, fragment)
            except (OSError, ValueError) as e:
                raise FragmentError(f"this peer cannot hold fragment {fragment.index}: {e}") from None
        else:
            await put_fragment(self.p2p, holder.p2p_id, self.run_id, stage, epoch, fragment)

    async def get(self, holder: StorageInfo, manifest: CheckpointManifest, index: int) -> Fragment:
        """Fetch fragment ``index`` of ``manifest`` from ``holder``, verified; distrusts a holder serving bad bytes."""
        sha = next(f.sha256 for f in manifest.fragments if f.index == index)
        if holder.peer_id == self.me:
            try:
                fragment = await self.io(self.store.get, self.run_id, manifest.stage, manifest.epoch, index)
            except OSError as e:
                raise FragmentError(f"fragment {index} is not on this peer's disk: {e}") from None
            if fragment.sha256 != sha:
                raise FragmentError(f"this peer holds another fragment {index} of epoch {manifest.epoch}")
            return fragment
        try:
            return await get_fragment(self.p2p, holder.p2p_id, self.run_id, manifest.stage, manifest.epoch, index, sha)
        except CorruptFragment as e:
            self.distrust(holder.peer_id, f"served a corrupt fragment {index} of stage {manifest.stage} epoch "
                                          f"{manifest.epoch}: {e}")
            raise

    async def hand_manifest(self, holder: StorageInfo, sealed: bytes) -> None:
        """Give the sealed manifest to ``holder`` (this peer's own store if it is us); raises FragmentError."""
        if holder.peer_id == self.me:
            await self.io(self.service.accept_manifest, sealed)
        else:
            await put_manifest(self.p2p, holder.p2p_id, self.run_id, sealed)

    async def hand_manifests(self, holders: Iterable[StorageInfo], manifest: CheckpointManifest,
                             sealed: bytes) -> set[str]:
        """Give ``manifest`` (sealed) to every holder of its fragments at once; returns the peer ids that took it
        (a refusal or an unreachable holder is logged and left out)."""
        holders = list(holders)
        results = await asyncio.gather(*(self.hand_manifest(h, sealed) for h in holders), return_exceptions=True)
        for holder, result in zip(holders, results):
            if isinstance(result, BaseException):
                self.log.info("%s did not take the manifest of stage %d epoch %d: %s", holder.peer_id,
                              manifest.stage, manifest.epoch, result)
        return {h.peer_id for h, r in zip(holders, results) if not isinstance(r, BaseException)}

    async def fetch(self, view: CheckpointView, progress: Optional[Callable[[int, int, int], None]] = None,
                    storage: Optional[list[StorageInfo]] = None) -> tuple[bytes, int]:
        """The shard bytes of ``view``'s checkpoint from any ``k`` verified fragments: ``(bytes, bad)``.

        Fragments are fetched ``k`` at a time from live holders (this peer's own disk first); a fragment that
        fails (unreachable holder, corrupt bytes: the holder is distrusted) is replaced by another holder's or
        another index. ``progress(done, needed, bytes)`` is called after each fragment.

        :raises FragmentError: fewer than ``k`` fragments could be fetched.
        """
        m = view.manifest
        by_peer = {s.peer_id: s for s in (storage if storage is not None else await self.io(self.directory.storage))}
        tries = {i: [by_peer[p] for p in sorted(holders, key=lambda p: (p != self.me, self.rng.random()))
                     if p in by_peer and not self.shuns(p)]
                 for i, holders in view.alive.items()}
        # indices on this peer's disk first (no transfer), the rest in random order (spreads the load)
        order = sorted((i for i in tries if tries[i]), key=lambda i: (tries[i][0].peer_id != self.me, self.rng.random()))
        got: dict[int, Fragment] = {}

        async def one(index: int) -> int:
            """Fetch fragment ``index`` from the first holder that serves it intact; returns the corrupt ones seen."""
            corrupt = 0
            for holder in tries[index]:
                if self.shuns(holder.peer_id):
                    continue
                try:
                    got[index] = await self.get(holder, m, index)
                    if progress is not None:
                        progress(len(got), m.k, sum(len(f.data) for f in got.values()))
                    break
                except CorruptFragment:
                    corrupt += 1
                except FragmentError as e:
                    self.log.info("fragment %d of stage %d epoch %d from %s failed: %s", index, m.stage, m.epoch,
                                  holder.peer_id, e)
            return corrupt

        queue, bad = list(order), 0
        while len(got) < m.k and queue:
            batch, queue = queue[: m.k - len(got)], queue[m.k - len(got):]
            bad += sum(await asyncio.gather(*(one(i) for i in batch)))
        if len(got) < m.k:
            raise FragmentError(f"only {len(got)} of the {m.k} fragments needed for stage {m.stage} epoch {m.epoch} "
                                f"could be fetched ({bad} corrupt); wait for more holders to come online")
        blob = await self.io(join_fragments, list(got.values()), m.k, m.n, m.size, m.shard_sha256)
        return blob, bad

    # ---- placement and repair --------------------------------------------------------------------------
    async def place(self, manifest_stage: int, epoch: int, fragments: list[Fragment], *,
                    storage: list[StorageInfo], exclude: set[str] = frozenset(),
                    load: Optional[Counter] = None) -> dict[int, str]:
        """Put each fragment on a chosen holder, trying other candidates when one refuses or is unreachable.

        :returns: fragment index -> peer id of the holder that took it (indices that found none are absent).
        """
        load = load if load is not None else Counter()
        size = max((len(f.data) for f in fragments), default=0)
        candidates = [s for s in storage if not self.shuns(s.peer_id) and s.p2p_id]
        refused: set[str] = set(exclude)
        placed: dict[int, str] = {}
        pending = list(fragments)
        for _ in range(3):
            if not pending:
                break
            holders = choose_holders(candidates, len(pending), size, avoid_stage=manifest_stage, exclude=refused,
                                     load=load, rng=self.rng)
            results = await asyncio.gather(*(self.put(h, manifest_stage, epoch, f) for h, f in zip(holders, pending)),
                                           return_exceptions=True)
            still = pending[len(holders):]
            for holder, fragment, result in zip(holders, pending, results):
                if isinstance(result, BaseException):
                    self.log.info("%s did not take fragment %d of stage %d epoch %d: %s", holder.peer_id,
                                  fragment.index, manifest_stage, epoch, result)
                    refused.add(holder.peer_id)
                    load[holder.peer_id] -= 1
                    still.append(fragment)
                else:
                    placed[fragment.index] = holder.peer_id
            pending = still
        return placed

    async def hand_off(self, timeout_s: float = 20.0) -> int:
        """Before this peer leaves (a drain): copy the fragments it holds of each stage's newest ``keep``
        checkpoints, with their manifests, to peers that hold nothing of that checkpoint, so leaving costs the
        swarm no replica. Bounded by ``timeout_s`` (a container's stop timeout); returns the fragments placed."""
        async def run() -> int:
            views = await self.views()
            storage = [s for s in await self.io(self.directory.storage) if s.peer_id != self.me]
            by_peer, total = {s.peer_id: s for s in storage}, 0
            for stage_views in views.values():
                for view in stage_views[: self.spec.checkpoint.keep]:
                    m = view.manifest
                    mine = sorted(i for i, holders in view.alive.items() if self.me in holders)
                    fragments = []
                    for index in mine:
                        try:
                            fragments.append(await self.io(self.store.get, self.run_id, m.stage, m.epoch, index))
                        except OSError:
                            continue
                    placed = await self.place(m.stage, m.epoch, fragments, storage=storage,
                                              exclude=view.holders | {self.me},
                                              load=Counter({p: 1 for p in view.holders}))
                    await self.hand_manifests([by_peer[p] for p in set(placed.values())], m, view.sealed)
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
        storage = await self.io(self.directory.storage)
        try:
            blob, _ = await self.fetch(view, storage=storage)
        except FragmentError as e:
            self.log.warning("cannot repair stage %d epoch %d: %s", m.stage, m.epoch, e)
            return 0
        fragments = await self.io(split_into_fragments, blob, m.k, m.n)
        wanted = {f.index: f.sha256 for f in m.fragments}
        missing = [f for f in fragments if f.index in view.missing and wanted.get(f.index) == f.sha256]
        placed = await self.place(m.stage, m.epoch, missing, storage=storage, exclude=view.holders,
                                  load=Counter({p: 1 for p in view.holders}))
        by_peer = {s.peer_id: s for s in storage} | {self.me: self.storage_info()}
        await self.hand_manifests([by_peer[p] for p in set(placed.values())], m, view.sealed)
        if not placed:
            self.log.warning("checkpoint of stage %d epoch %d misses fragments %s and no other peer can take them",
                             m.stage, m.epoch, view.missing)
            return 0
        self.repairs += len(placed)
        self.log.info("repaired the checkpoint of stage %d epoch %d: fragments %s re-placed on %s (%d of %d alive "
                      "before)", m.stage, m.epoch, sorted(placed), sorted(set(placed.values())), view.fragments_alive,
                      m.n)
        await self.io(self.announce)
        return len(placed)
