"""The stage's progress as one server's collaborative optimizer counts and publishes it: a view over hivemind's
progress tracker (:class:`~swarm.averaging.progress.SampleCountTracker`), the part of
:class:`~swarm.averaging.StageOptimizer` that the served stage reads and feeds (its roster, pushed counts, epochs)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Optional

from swarm.averaging.progress import Push, Roster, Trust
from swarm.protocol import ProgressPush

if TYPE_CHECKING:
    import hivemind


class StageProgressView:
    """The stage's view of this server, and this server's of the stage: its progress as hivemind's progress tracker
    counts and publishes it (:mod:`swarm.averaging.progress`). A base of :class:`~swarm.averaging.StageOptimizer`."""

    _opt: "hivemind.Optimizer"  # (StageOptimizer's: its progress tracker is a SampleCountTracker)

    def announce_progress(self) -> None:
        """Publish this server's progress now (its epoch, no sample): counted before the first epoch ends."""
        self._opt.tracker.report_local_progress(self._opt.local_epoch, 0)

    @property
    def peers(self) -> int:
        """Servers of the stage (this one included) that the progress tracker counts."""
        return self._opt.tracker.global_progress.num_peers

    def wait_until_counted(self, expected: int, timeout: float = 5.0) -> bool:
        """Wait (blocking, at most ``timeout`` seconds) until the tracker counts ``expected`` servers."""
        deadline = time.monotonic() + timeout
        while self.peers < expected and time.monotonic() < deadline:
            time.sleep(0.2)
        return self.peers >= expected

    @property
    def progress_key(self) -> str:
        """This server's sub-key in the stage's progress records, hex (announced as ``ServerInfo.progress_key``)."""
        return self._opt.tracker.progress_key.hex()

    def set_progress_roster(self, roster: Roster, push: Optional[Push] = None, trust: Optional[Trust] = None) -> None:
        """Count progress only from the sub-keys ``roster()`` returns, as ``trust()`` says (None: all in full); push
        this server's count to its stage-mates through ``push`` (None: the DHT only). :mod:`~.progress`."""
        self._opt.tracker.set_roster(roster, trust)
        self._opt.tracker.push = push

    def receive_progress(self, subkey: bytes, push: ProgressPush, sender: bytes = b"") -> None:
        """Count a stage-mate's pushed count (any thread) as that of ``subkey`` (:meth:`SampleCountTracker.receive`)."""
        self._opt.tracker.receive(subkey, push, sender)

    @property
    def stage_quiet(self) -> bool:
        """No server of the stage counted a sample in the last few progress reads (``tracker.reading_slowly``)."""
        return self._opt.tracker.reading_slowly

    def read_progress_soon(self) -> None:
        """Read the stage's progress from the DHT now (a server joined the roster: its pushes may not count yet)."""
        self._opt.tracker.read_soon()

    def pushed_working(self) -> frozenset[bytes]:
        """Progress sub-keys of the stage-mates whose pushed count holds samples of this server's epoch."""
        return self._opt.tracker.pushed_working(self._opt.local_epoch)

    @property
    def stage_epoch(self) -> int:
        """The lower median of the epochs of the stage's other servers it counts in full; 0 while none."""
        return self._opt.tracker.others_epoch


__all__ = ["StageProgressView"]
