"""The stage's progress as its servers report it: hivemind's progress tracker, trusting only the stage's servers.

hivemind's :class:`~hivemind.optim.progress_tracker.ProgressTracker` reads every entry under the key
``{run_id}-stage{k}_progress``: one per RSA sub-key, and anyone can make an RSA key. The stage's epoch is the
*highest* epoch among the entries and the samples of the epoch are their *sum*, so one stranger's entry with
epoch 10**9 made every server believe it was out of sync and reload its state forever, and one with a huge
sample count ended every epoch at once. :class:`SampleCountTracker` reads the entries through
:func:`trusted_progress`:

* **who**: only the sub-keys that the stage's servers name in their signed records
  (:attr:`~swarm.protocol.ServerInfo.progress_key`, refreshed by the server through :meth:`set_roster`) and
  this server's own count; before the server has read its stage's records, every entry is read;
* **how far ahead**: an entry counts only up to one epoch past the (lower) median epoch of the other entries
  (or this server's own epoch, if higher): a lagging server still sees that the stage moved on, a server one
  step ahead still pulls the others along (hivemind's epoch transition), but a minority of the stage cannot
  push it further;
* **how much**: an entry's samples count at most ``target_batch_size`` and its throughput at most
  :data:`~swarm.protocol.MAX_SAMPLES_PER_S`.

An epoch ends only once ``target_batch_size`` samples were counted (hivemind also ends it when its estimated
time passed).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Optional

import hivemind.optim.progress_tracker
from hivemind.optim.progress_tracker import LocalTrainingProgress
from hivemind.utils import ValueWithExpiration, get_dht_time

from swarm.protocol import MAX_SAMPLES_PER_S

logger = logging.getLogger(__name__)


def refresh_periods(matchmaking_time: float) -> dict[str, float]:
    """hivemind's progress-tracker periods (seconds) derived from the spec's ``matchmaking_time``, the window in which
    a stage's servers gather for a round: a server must notice the end of an epoch well inside it, or its
    stage-mate's window closes without it and the two step apart. The tracker reads the stage's progress at an
    eighth of it near an epoch's end (``min_refresh_period``) and at least every quarter of it
    (``max_refresh_period``, also when it finds no other server); :class:`SampleCountTracker` publishes this
    server's count at most once per ``min_refresh_period``. At the default 2 s: 0.25 and 0.5 s (this project used
    0.1 and 0.5 s and published every micro-batch; a read at most once per window let a resumed server's
    stage-mate miss its rounds, measured in tests/test_pause_resume.py)."""
    return dict(min_refresh_period=matchmaking_time / 8, max_refresh_period=matchmaking_time / 4,
                default_refresh_period=matchmaking_time / 4)


QUIET_READS = 4
"""Reads in a row that found the stage quiet (no server holds a sample, nothing changed) before
:class:`SampleCountTracker` reads less often: at ``max_refresh_period`` (a quarter window), one second at the
demo's spec. Inside a round or between two micro-batches a busy stage is never quiet that long."""
QUIET_SLOWDOWN = 2.0
"""A quiet stage's progress is read every ``QUIET_SLOWDOWN x max_refresh_period`` (half a matchmaking window):
a stage-mate's first samples are then noticed at most half a window late, while the first epoch takes at
least a whole one; this server's own first sample ends the slow reads at once."""

Roster = Callable[[], Optional[frozenset]]
"""Returns the progress sub-keys (bytes) of the stage's announced servers, or None while they are unknown."""


def trusted_progress(entries: dict, own: bytes, own_epoch: int, target: int,
                     roster: Optional[frozenset] = None) -> dict:
    """The progress entries (sub-key -> ``ValueWithExpiration`` of a ``LocalTrainingProgress`` dict) that count,
    as the module docstring says: from ``roster`` (or anyone while it is None) plus ``own``, at most one epoch
    past the lower median of the others' epochs (or ``own_epoch``), samples clipped to ``target``."""
    progress = {}
    for subkey, item in entries.items():
        if item is None or item.value is None or (roster is not None and subkey != own and subkey not in roster):
            continue
        try:
            progress[subkey] = (LocalTrainingProgress.parse_obj(item.value), item.expiration_time)
        except Exception:  # hivemind's schema validator checked it already; a stray value is skipped
            continue
    others = sorted(p.epoch for key, (p, _) in progress.items() if key != own and not p.client_mode)
    ceiling = max(own_epoch, others[(len(others) - 1) // 2] if others else own_epoch) + 1
    out = {}
    for subkey, (p, expiration) in progress.items():
        if p.epoch > ceiling:
            continue
        p.samples_accumulated = min(p.samples_accumulated, target)
        p.samples_per_second = min(p.samples_per_second, MAX_SAMPLES_PER_S)
        out[subkey] = ValueWithExpiration(p.dict(), expiration)
    return out


class SampleCountTracker(hivemind.optim.progress_tracker.ProgressTracker):
    """hivemind's progress tracker reading only trusted entries (module docstring), where an epoch ends only
    when ``target_batch_size`` samples were counted. The local count is read directly, so a lone server steps
    right after its last micro-batch."""

    roster: Roster = staticmethod(lambda: None)
    others_epoch = 0  # the lower median epoch of the other counted servers (0 while none is counted)
    per_server_target = 0
    """If set (outer steps, :mod:`swarm.averaging.outer`): an epoch ends after this many samples per server counted
    (``target_batch_size`` follows the count of servers), not after a fixed ``target_batch_size``."""

    _last_report = 0.0  # time.monotonic() of the last publication let through
    _flush: Optional[threading.Timer] = None
    _quiet_reads = 0  # reads in a row that found the stage quiet (QUIET_READS)
    _quiet_state: Optional[tuple] = None  # (epoch, entries' sub-keys) the last quiet read found

    def report_local_progress(self, local_epoch: int, samples_accumulated: int, update_global_samples: bool = True):
        """hivemind 1.1.12's, but published at most once per ``min_refresh_period`` (the stage's servers read no
        faster): a count held back is published when the period is over, and a new epoch, a reset or a count
        that reaches the target at once. (hivemind's own version wakes its publisher at every report.)"""
        urgent = (local_epoch != self.local_progress.epoch or samples_accumulated <= 0
                  or samples_accumulated >= self.target_batch_size)
        extra_samples = samples_accumulated - self.local_progress.samples_accumulated
        if update_global_samples and local_epoch == self.local_progress.epoch == self.global_progress.epoch:
            self.global_progress.samples_accumulated += extra_samples
        if extra_samples > 0:
            self.performance_ema.update(task_size=extra_samples)
        else:
            self.performance_ema.reset_timer()
        self.local_progress = self._get_local_progress(local_epoch, samples_accumulated)
        if extra_samples > 0 and self.reading_slowly:  # this server's first sample: the stage is busy again
            self._quiet_reads, self.global_progress.next_fetch_time = 0, get_dht_time()
            self.global_state_updated.set()  # the fetcher reads at once
        now = time.monotonic()
        due = self._last_report + self.min_refresh_period
        if urgent or now >= due:
            self._last_report = now
            self.should_report_progress.set()
        elif self._flush is None or not self._flush.is_alive():
            self._flush = threading.Timer(due - now, self._publish_held_back)
            self._flush.daemon = True
            self._flush.start()

    def _publish_held_back(self) -> None:
        self._last_report = time.monotonic()
        self.should_report_progress.set()

    @property
    def progress_key(self) -> bytes:
        """This server's sub-key under the progress key (its hivemind RSA public key, in hivemind's format)."""
        return self._local_public_key

    def set_roster(self, roster: Roster) -> None:
        """Read entries only from the sub-keys ``roster()`` returns (called at every fetch: keep it cheap)."""
        self.roster = roster

    def _parse_swarm_progress_data(self, metadata):
        entries = dict(metadata) if isinstance(metadata, dict) else {}
        # this server's own entry is its local progress, whether or not the DHT holds it yet: hivemind counts the
        # entries it fetched, so a server whose own entry was not stored yet (just restarted its optimizer, or
        # just loaded the stage's state) counted one peer fewer and, seeing "no other peers", stepped alone
        entries[self._local_public_key] = ValueWithExpiration(self.local_progress.dict(),
                                                              get_dht_time() + self.metadata_expiration)
        if self.per_server_target:
            servers = trusted_progress(entries, self._local_public_key, self.local_progress.epoch, 1, self.roster())
            self.target_batch_size = self.per_server_target * max(1, sum(
                1 for v in servers.values() if not v.value["client_mode"]))
        trusted = trusted_progress(entries, self._local_public_key, self.local_progress.epoch,
                                   self.target_batch_size, self.roster())
        others = sorted(v.value["epoch"] for k, v in trusted.items()
                        if k != self._local_public_key and not v.value["client_mode"])
        self.others_epoch = others[(len(others) - 1) // 2] if others else 0
        progress = super()._parse_swarm_progress_data(trusted)
        self._count_quiet(progress.epoch, trusted)
        if self.reading_slowly:
            progress.next_fetch_time = get_dht_time() + QUIET_SLOWDOWN * self.max_refresh_period
        return progress

    @property
    def reading_slowly(self) -> bool:
        """The stage was quiet for :data:`QUIET_READS` reads: its progress is read half as often."""
        return self._quiet_reads >= QUIET_READS

    def _count_quiet(self, epoch: int, trusted: dict) -> None:
        quiet = (self.local_progress.samples_accumulated == 0
                 and all(v.value["samples_accumulated"] == 0 for v in trusted.values()))
        state = (epoch, frozenset(trusted)) if quiet else None
        self._quiet_reads = self._quiet_reads + 1 if quiet and state == self._quiet_state else 0
        self._quiet_state = state

    @property
    def ready_to_update_epoch(self) -> bool:
        return (
            self.global_epoch > self.local_progress.epoch
            or self.global_progress.samples_accumulated >= self.target_batch_size
            or self.local_progress.samples_accumulated >= self.target_batch_size
        )


__all__ = ["Roster", "SampleCountTracker", "refresh_periods", "trusted_progress"]
