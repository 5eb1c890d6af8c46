"""Fragments moving between this peer and the run's holders: put, get (verified), manifests handed over, a whole
shard fetched from any ``k`` fragments, fragments placed on chosen holders.

A holder that serves bytes not matching the manifest's hash is *distrusted*: never fetched from or placed on
again (:meth:`FragmentTransfers.distrust`; the fragment keeper lists it in the peer's StorageInfo with the
reason). Peers on the run's ban list are avoided alike (:meth:`FragmentTransfers.avoids`).
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from typing import Callable, Iterable, Optional

from hivemind.p2p import P2P

from swarm.checkpoint.catalog import CheckpointView, choose_holders
from swarm.checkpoint.erasure import CorruptFragment, Fragment, FragmentError, join_fragments
from swarm.checkpoint.service import FragmentService, get_fragment, put_fragment, put_manifest
from swarm.checkpoint.store import FragmentStore
from swarm.net.directory import AsyncRunDirectory
from swarm.protocol import CheckpointManifest, StorageInfo
from swarm.trust.banlist import RunBans


class FragmentTransfers:
    """This peer's fragment traffic for ``directory``'s run (module docstring), through ``p2p``, with ``store``
    (this peer's own disk, reached without the network) and ``service`` (which takes the manifests handed to this
    peer itself).

    :param log: the peer's log (refusals, distrust and failed fragments are logged there).
    :param rng: the order holders are tried and chosen in (seeded in tests).
    """

    def __init__(self, p2p: P2P, directory: AsyncRunDirectory, me: str, store: FragmentStore,
                 service: FragmentService, *, bans: RunBans, log, rng: random.Random):
        self.p2p, self.directory, self.run_id, self.me = p2p, directory, directory.run_id, me
        self.store, self.service, self.bans, self.log, self.rng = store, service, bans, log, rng
        self.distrusted: dict[str, str] = {}  # holders that served corrupt fragments to this peer -> reason

    def avoids(self, peer_id: str) -> bool:
        """Distrusted here (it served corrupt fragments) or banned by the run's coordinator."""
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
                await asyncio.to_thread(self.store.put, self.run_id, stage, epoch, fragment)
            except (OSError, ValueError) as e:
                raise FragmentError(f"this peer cannot hold fragment {fragment.index}: {e}") from None
        else:
            await put_fragment(self.p2p, holder.p2p_id, self.run_id, stage, epoch, fragment)

    async def get(self, holder: StorageInfo, manifest: CheckpointManifest, index: int) -> Fragment:
        """Fetch fragment ``index`` of ``manifest`` from ``holder``, verified; distrusts a holder serving bad bytes."""
        sha = next(f.sha256 for f in manifest.fragments if f.index == index)
        if holder.peer_id == self.me:
            try:
                fragment = await asyncio.to_thread(self.store.get, self.run_id, manifest.stage, manifest.epoch, index)
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
            await self.service.accept_manifest(sealed)
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
        by_peer = {s.peer_id: s for s in (storage if storage is not None else await self.directory.storage())}
        tries = {i: [by_peer[p] for p in sorted(holders, key=lambda p: (p != self.me, self.rng.random()))
                     if p in by_peer and not self.avoids(p)]
                 for i, holders in view.alive.items()}
        # indices on this peer's disk first (no transfer), the rest in random order (spreads the load)
        order = sorted((i for i in tries if tries[i]), key=lambda i: (tries[i][0].peer_id != self.me, self.rng.random()))
        got: dict[int, Fragment] = {}

        async def one(index: int) -> int:
            """Fetch fragment ``index`` from the first holder that serves it intact; returns the corrupt ones seen."""
            corrupt = 0
            for holder in tries[index]:
                if self.avoids(holder.peer_id):
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
        blob = await asyncio.to_thread(join_fragments, list(got.values()), m.k, m.n, m.size, m.shard_sha256)
        return blob, bad

    async def place(self, manifest_stage: int, epoch: int, fragments: list[Fragment], *,
                    storage: list[StorageInfo], exclude: set[str] = frozenset(),
                    load: Optional[Counter] = None) -> dict[int, str]:
        """Put each fragment on a chosen holder, trying other candidates when one refuses or is unreachable.

        :returns: fragment index -> peer id of the holder that took it (indices that found none are absent).
        """
        load = load if load is not None else Counter()
        size = max((len(f.data) for f in fragments), default=0)
        candidates = [s for s in storage if not self.avoids(s.peer_id) and s.p2p_id]
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


__all__ = ["FragmentTransfers"]
