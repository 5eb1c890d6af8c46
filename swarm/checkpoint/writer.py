"""Commit a stage's checkpoint to the swarm: endorse, encode, erasure-code, place, hand over the manifest, publish.

First a second peer endorses it (:mod:`swarm.trust.authority`: another server of the stage whose state at
that epoch has the same digest, or a witness where the writer is the stage's only server); without one
nothing is placed.

A checkpoint is *committed* once at least ``k`` of its fragments sit on holders that also took its signed
manifest (so it can be restored, and re-published, even if its writer and the DHT's copy are gone); only
then is the manifest published in the DHT. Fragments that found no holder are left to repair
(:meth:`~swarm.checkpoint.keeper.FragmentKeeper.repair`).
"""

from __future__ import annotations

import asyncio
import time
from typing import Awaitable, Callable, Optional, Union

from hivemind.utils import get_dht_time

from swarm.checkpoint.erasure import split_into_fragments
from swarm.checkpoint.keeper import FragmentKeeper
from swarm.checkpoint.shard import StageShard, encode_shard
from swarm.checkpoint.state import state_digest
from swarm.protocol import CheckpointManifest, EndorseRequest, FragmentEntry, ProtocolError, StorageInfo, seal


class CheckpointError(RuntimeError):
    """A checkpoint that could not be committed (too few holders took its fragments or manifest)."""


Parent = Union[tuple[str, int], Callable[[], Awaitable[tuple[str, int]]]]
"""``(shard sha256, epoch)`` of the checkpoint a state descends from, or an async function that returns it."""


async def write_checkpoint(keeper: FragmentKeeper, shard: StageShard, *, parent: Parent = ("", -1),
                           loss: Optional[float] = None,
                           data_position: Optional[dict[int, int]] = None) -> tuple[CheckpointManifest, bytes]:
    """Commit ``shard`` (see the module docstring); returns the manifest and its sealed bytes.

    :param parent: ``(shard sha256, epoch)`` of the checkpoint the state descends from (hash chain), or an async
        function returning it, awaited once the fragments are placed, right before the manifest is sealed: a commit
        of an earlier epoch by another writer that finished in the meantime is then the parent.
    :raises CheckpointError: no peer endorsed it, this peer's directory finds the writer and endorsers not entitled
        to commit it (holders would refuse its manifest: :meth:`~swarm.net.directory.RunDirectory.entitled`; checked
        before any fragment is sent), or fewer than ``k`` fragments were placed with their manifest; nothing is
        published.
    """
    ckpt = keeper.spec.checkpoint
    start = time.perf_counter()
    state_sha = await asyncio.to_thread(state_digest, shard.tensors)
    try:
        endorsements = await keeper.endorsements(EndorseRequest(
            run_id=keeper.run_id, stage=shard.stage, epoch=shard.epoch, state_sha256=state_sha))
    except ProtocolError as e:
        raise CheckpointError(str(e)) from None
    blob, sha = await asyncio.to_thread(encode_shard, shard)
    fragments = await asyncio.to_thread(split_into_fragments, blob, ckpt.fragments_needed, ckpt.fragments_total)

    chain = ("", -1) if callable(parent) else parent  # (the entitlement check below needs no parent)

    def manifest_with(placed: dict[int, str]) -> CheckpointManifest:
        return CheckpointManifest(
            run_id=keeper.run_id, peer_id=keeper.me, time=get_dht_time(), stage=shard.stage, epoch=shard.epoch,
            shard_sha256=sha, size=len(blob), k=ckpt.fragments_needed, n=ckpt.fragments_total,
            fragments=[FragmentEntry(index=f.index, sha256=f.sha256, holders=[placed[f.index]] if f.index in placed
                                     else []) for f in fragments],
            parent=chain[0], parent_epoch=chain[1], loss=loss, data_position=dict(data_position or {}),
            state_sha256=state_sha, endorsements=endorsements)

    refusal = await keeper.directory.entitled(manifest_with({}))
    if refusal is not None:  # the holders would take the fragments, then refuse the manifest
        raise CheckpointError(f"the checkpoint of stage {shard.stage} epoch {shard.epoch} would be refused: {refusal}")
    storage = [s for s in await keeper.directory.storage() if s.peer_id != keeper.me]
    storage.append(await asyncio.to_thread(keeper.storage_info))
    placed = await keeper.transfers.place(shard.stage, shard.epoch, fragments, storage=storage)
    if len(placed) < ckpt.fragments_needed:
        raise CheckpointError(f"only {len(placed)} of {len(fragments)} fragments of stage {shard.stage} epoch "
                              f"{shard.epoch} found a holder ({ckpt.fragments_needed} needed); start more peers or "
                              "raise their SWARM_FRAGMENT_MAX_BYTES")
    if callable(parent):
        chain = await parent()
    manifest = manifest_with(placed)
    sealed = seal(manifest, keeper.identity)
    await _hand_over(keeper, manifest, sealed, placed, storage)
    keeper.log.info("checkpoint of stage %d epoch %d committed: %d bytes sha256=%s, %d/%d fragments on %d peers "
                    "(%d needed), parent %s, %.2f s", shard.stage, shard.epoch, len(blob), sha[:16], len(placed),
                    len(fragments), len(set(placed.values())), ckpt.fragments_needed, chain[0][:16] or "-",
                    time.perf_counter() - start)
    return manifest, sealed


async def _hand_over(keeper: FragmentKeeper, manifest: CheckpointManifest, sealed: bytes, placed: dict[int, str],
                     storage: list[StorageInfo]) -> None:
    """Hand the sealed manifest to the fragments' holders, then publish it in the DHT and announce.

    :raises CheckpointError: fewer than ``k`` fragments sit on holders that took the manifest."""
    by_peer: dict[str, StorageInfo] = {s.peer_id: s for s in storage}
    took = await keeper.transfers.hand_manifests([by_peer[p] for p in sorted(set(placed.values()))], manifest, sealed)
    committed = sum(1 for holder in placed.values() if holder in took)
    if committed < manifest.k:
        raise CheckpointError(f"only {committed} fragments of stage {manifest.stage} epoch {manifest.epoch} sit on "
                              f"holders that took the manifest ({manifest.k} needed)")
    if not await keeper.directory.publish_manifest(manifest, sealed):
        keeper.log.warning("could not store the manifest of stage %d epoch %d in the DHT; its holders will "
                           "re-publish it", manifest.stage, manifest.epoch)
    await keeper.announce()


__all__ = ["CheckpointError", "Parent", "write_checkpoint"]
