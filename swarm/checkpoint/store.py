"""A peer's on-disk store of checkpoint fragments: bounded, verified, surviving restarts.

Layout: ``<root>/<run_id>/stage<k>/epoch<e>/<index>.frag`` holding the fragment's bytes, the file name's
index and the manifest's SHA-256 identifying it (``<index>.sha256`` beside it), and ``manifest.bin``: the
sealed manifest of the checkpoint, once its writer handed it over (the checkpoint is then *committed* here).
Writes are atomic (temporary file, ``fsync``, rename), so a crash never leaves a half-written fragment that
looks whole; reads verify the hash, and a corrupt file is deleted and reported. The store never exceeds
``max_bytes``: a write that would is refused with :class:`StoreFull` (after old epochs were collected), and
``OSError`` from a full disk becomes the same error, naming the setting to change.

Retention per (run, stage): the newest ``keep_epochs`` committed epochs, plus, per putter, at most
``keep_epochs`` uncommitted epochs newer than those (checkpoints still being written), none older than
``pending_s``; everything else is deleted, so an old committed checkpoint is never dropped for a newer one that
was never committed. An epoch pushed out of the newest ``keep_epochs`` less than ``grace_s`` ago stays while
the budget allows: a server may be fetching it right now, or be about to follow a rollback order to it that
the DHT has not delivered yet.

Putters: an uncommitted epoch belongs to the peer that put its first fragment (``putter`` beside
the fragments). Junk a putter places, say fragments for epoch 10**9 that will never be committed, only ever
displaces its own uncommitted epochs, never another writer's checkpoint in progress, and it is deleted after
``pending_s``. One putter's uncommitted fragments take at most ``putter_share`` of the budget (a writer
places one fragment of each of its next ``keep_epochs`` checkpoints per holder), so a putter that never commits
cannot fill the budget for the others.
"""

from __future__ import annotations

import errno
import fnmatch
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from swarm.checkpoint.erasure import Fragment, FragmentError


class StoreFull(OSError):
    """The fragment would exceed the store's byte budget or the disk is full."""


class SlotTaken(ValueError):
    """A different fragment with the same (run, stage, epoch, index) is held already (two writers raced)."""


@dataclass(frozen=True)
class StoredFragment:
    run_id: str
    stage: int
    epoch: int
    index: int
    sha256: str
    size: int


class FragmentStore:
    """Fragments this peer holds for others.

    :param root: directory (created), e.g. ``<SWARM_CACHE_DIR>/fragments``.
    :param max_bytes: budget for all fragments in bytes.
    :param keep_epochs: per (run, stage), fragments of older epochs than the newest ``keep_epochs`` are deleted.
    :param grace_s: seconds an epoch pushed out of the newest ``keep_epochs`` is still kept (budget allowing);
        peers pass twice the run's DHT record TTL, the horizon of what other peers may still act on.
    :param pending_s: seconds after its last fragment arrived that an epoch nobody committed is deleted.
    :param putter_share: the fraction of ``max_bytes`` one putter's uncommitted fragments may take.
    """

    def __init__(self, root: Path, max_bytes: int, keep_epochs: int = 2, grace_s: float = 0.0,
                 pending_s: float = 3600.0, putter_share: float = 0.25):
        if max_bytes <= 0 or keep_epochs < 1 or grace_s < 0 or pending_s <= 0 or not 0 < putter_share <= 1:
            raise ValueError("max_bytes must be > 0, keep_epochs >= 1, grace_s >= 0, pending_s > 0 and "
                             "putter_share in (0, 1]")
        self.root, self.max_bytes, self.keep_epochs, self.grace_s = Path(root), max_bytes, keep_epochs, grace_s
        self.pending_s, self.putter_quota = pending_s, int(max_bytes * putter_share)
        self.root.mkdir(parents=True, exist_ok=True)

    def _dir(self, run_id: str, stage: int, epoch: int) -> Path:
        if not run_id or "/" in run_id or run_id.startswith("."):
            raise ValueError(f"bad run id {run_id!r}")
        return self.root / run_id / f"stage{stage}" / f"epoch{epoch}"

    def used_bytes(self) -> int:
        """Bytes of the fragments on disk (a folder or file collected while this counts is skipped)."""
        total = 0
        for folder, _, files in os.walk(self.root):  # os.walk ignores a folder that vanishes under it
            for name in files:
                if name.endswith(".frag"):
                    try:
                        total += os.stat(os.path.join(folder, name)).st_size
                    except FileNotFoundError:
                        continue
        return total

    def put(self, run_id: str, stage: int, epoch: int, fragment: Fragment, putter: str = "") -> StoredFragment:
        """Verify and store ``fragment``; returns what is stored.

        :param putter: who placed it (a libp2p id; empty: this peer itself), see the module docstring.
        :raises FragmentError: the bytes do not match the fragment's hash.
        :raises SlotTaken: a fragment with another hash is held in that slot (kept: the first one wins).
        :raises StoreFull: over ``max_bytes`` even after collecting old epochs, over the putter's share of it
            (module docstring), or the disk is full.
        """
        folder = self._dir(run_id, stage, epoch)
        fragment.verify()
        path = folder / f"{fragment.index}.frag"
        try:
            held = (folder / f"{fragment.index}.sha256").read_text().strip()
        except OSError:
            held = None
        if held == fragment.sha256 and path.exists():
            return StoredFragment(run_id, stage, epoch, fragment.index, fragment.sha256, len(fragment.data))
        if held is not None and path.exists():
            raise SlotTaken(f"fragment {fragment.index} of stage {stage} epoch {epoch} is already held here for "
                            "another checkpoint of that epoch; place this one on another peer")
        owner = _owner(folder) if folder.is_dir() else putter
        self.collect(run_id, stage, newest=epoch, newest_owner=owner)
        if self.used_bytes() + len(fragment.data) > self.max_bytes:
            self.collect(run_id, stage, newest=epoch, grace=False, newest_owner=owner)
        if self.used_bytes() + len(fragment.data) > self.max_bytes:
            raise StoreFull(errno.ENOSPC, f"storing {len(fragment.data)} bytes would exceed the fragment budget of "
                                          f"{self.max_bytes} bytes; raise SWARM_FRAGMENT_MAX_BYTES or free disk")
        if owner and not (folder / "manifest.bin").exists():
            pending = self.pending_bytes(owner)
            if pending + len(fragment.data) > self.putter_quota:
                raise StoreFull(errno.EDQUOT, f"{owner}'s fragments of uncommitted checkpoints would take "
                                              f"{pending + len(fragment.data)} bytes here, over its share of "
                                              f"{self.putter_quota}; commit them first")
        folder.mkdir(parents=True, exist_ok=True)
        if not (folder / "putter").exists():
            _atomic_write(folder / "putter", owner.encode())
        try:
            _atomic_write(path, fragment.data)
            _atomic_write(folder / f"{fragment.index}.sha256", fragment.sha256.encode())
        except OSError as e:
            path.unlink(missing_ok=True)
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise StoreFull(e.errno, f"disk full while storing a fragment under {self.root}; free space or "
                                         "lower SWARM_FRAGMENT_MAX_BYTES") from None
            raise
        return StoredFragment(run_id, stage, epoch, fragment.index, fragment.sha256, len(fragment.data))

    def pending_bytes(self, putter: str) -> int:
        """Bytes of the fragments of uncommitted epochs that ``putter`` placed here (first in their epoch)."""
        total = 0
        for folder in _listing(self.root, "*/stage*/epoch*"):
            if (folder / "manifest.bin").exists() or _owner(folder) != putter:
                continue
            for frag in _listing(folder, "*.frag"):
                try:
                    total += frag.stat().st_size
                except OSError:
                    continue
        return total

    def get(self, run_id: str, stage: int, epoch: int, index: int) -> Fragment:
        """Read and verify a fragment.

        :raises FileNotFoundError: not held here.
        :raises FragmentError: the file no longer matches its hash (it is deleted).
        """
        folder = self._dir(run_id, stage, epoch)
        data = (folder / f"{index}.frag").read_bytes()
        sha = (folder / f"{index}.sha256").read_text().strip()
        fragment = Fragment(index, data, sha)
        try:
            fragment.verify()
        except FragmentError:
            (folder / f"{index}.frag").unlink(missing_ok=True)
            (folder / f"{index}.sha256").unlink(missing_ok=True)
            raise
        return fragment

    def save_manifest(self, run_id: str, stage: int, epoch: int, sealed: bytes) -> None:
        """Keep the sealed manifest of a checkpoint this peer holds fragments of (commits it here)."""
        folder = self._dir(run_id, stage, epoch)
        if not folder.is_dir():
            raise FileNotFoundError(f"no fragments of stage {stage} epoch {epoch} are held here")
        _atomic_write(folder / "manifest.bin", sealed)

    def manifest(self, run_id: str, stage: int, epoch: int) -> bytes | None:
        """The sealed manifest saved for (run, stage, epoch), or None."""
        try:
            return (self._dir(run_id, stage, epoch) / "manifest.bin").read_bytes()
        except OSError:
            return None

    def committed(self, run_id: str) -> Iterator[tuple[int, int, bytes]]:
        """``(stage, epoch, sealed manifest)`` of every committed checkpoint held for ``run_id``."""
        for path in _listing(self.root, f"{run_id}/stage*/epoch*/manifest.bin"):
            try:
                yield int(path.parts[-3][5:]), int(path.parts[-2][5:]), path.read_bytes()
            except (ValueError, OSError):
                continue

    def free_bytes(self) -> int:
        return max(0, self.max_bytes - self.used_bytes())

    def held(self) -> Iterator[StoredFragment]:
        """Every fragment on disk (to re-announce after a restart); unreadable entries are skipped."""
        for frag in _listing(self.root, "*/stage*/epoch*/*.frag"):
            try:
                run_id, stage, epoch = frag.parts[-4], int(frag.parts[-3][5:]), int(frag.parts[-2][5:])
                sha = frag.with_suffix(".sha256").read_text().strip()
                yield StoredFragment(run_id, stage, epoch, int(frag.stem), sha, frag.stat().st_size)
            except (ValueError, OSError):
                continue

    def collect(self, run_id: str, stage: int, newest: int | None = None, grace: bool = True,
                newest_owner: str = "") -> list[int]:
        """Apply the retention rule (module docstring) to (run, stage), counting ``newest`` (an epoch about to
        be written by ``newest_owner``) as uncommitted; ``grace=False`` ignores ``grace_s``. Returns the epochs
        deleted."""
        folder = self._dir(run_id, stage, 0).parent
        if not folder.exists():
            return []
        epochs = {int(p.name[5:]) for p in _listing(folder, "epoch*") if p.name[5:].isdigit()}
        committed = sorted(e for e in epochs if (folder / f"epoch{e}" / "manifest.bin").exists())
        kept = set(committed[-self.keep_epochs:])
        if grace and self.grace_s > 0:
            now = time.time()
            for older, pusher in zip(committed, committed[self.keep_epochs:]):
                try:  # ``pusher``'s commit here pushed ``older`` out of the newest keep_epochs
                    if now - (folder / f"epoch{pusher}" / "manifest.bin").stat().st_mtime < self.grace_s:
                        kept.add(older)
                except OSError:
                    continue
        floor, now = max(kept, default=-1), time.time()
        by_owner: dict[str, list[int]] = {}
        for e in epochs | ({newest} if newest is not None else set()):
            if e > floor and e not in kept:
                path = folder / f"epoch{e}"
                if e != newest and now - _mtime(path) > self.pending_s:
                    continue  # never committed in pending_s: junk
                by_owner.setdefault(newest_owner if e == newest else _owner(path), []).append(e)
        for owned in by_owner.values():
            kept |= set(sorted(owned)[-self.keep_epochs:])
        doomed = sorted(e for e in epochs if e not in kept and e != newest)
        for e in doomed:
            shutil.rmtree(folder / f"epoch{e}", ignore_errors=True)
        return doomed


def _listing(root: Path, pattern: str) -> list[Path]:
    """``sorted(root.glob(pattern))`` for a pattern of ``/``-separated name patterns, skipping a folder deleted
    while it is listed (pathlib's glob raises FileNotFoundError then, and retention or a stage-mate's collect
    deletes epoch folders at any time)."""
    level = [root]
    for part in pattern.split("/"):
        found: list[Path] = []
        for folder in level:
            try:
                names = os.listdir(folder)
            except OSError:  # deleted meanwhile, or not a folder
                continue
            found += [folder / name for name in fnmatch.filter(names, part)]
        level = found
    return sorted(level)


def _owner(folder: Path) -> str:
    """The putter of an epoch's first fragment ("" if it put no name, or before owners were recorded)."""
    try:
        return (folder / "putter").read_text().strip()
    except OSError:
        return ""


def _mtime(path: Path) -> float:
    """When the newest fragment of an epoch folder was written (its folder's mtime); now if it is gone."""
    try:
        return path.stat().st_mtime
    except OSError:
        return time.time()


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
