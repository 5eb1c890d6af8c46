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

**Standing** (:class:`ProgressTrust`, :mod:`swarm.trust.standing`). Announcing a server costs a fresh key nothing,
so one such key naming its progress entry at the stage's epoch + 1 (or with the target's samples) ended every
epoch of its stage at once (measured: 88 micro-batches per 25 s fell to 4). A server that verified the averaging
work of at least one of its current stage-mates therefore counts in full only its own entry (unless it is
*unvouched*, below) and those of the mates it verified; every other entry is *unverified* (whatever its
``client_mode`` says):

* an unverified entry ahead of this server's epoch does not move it: it counts as one that finished this epoch
  (the target's samples, within the share below), so it cannot pull the stage to the next epoch;
* the unverified entries' samples count together at most :data:`UNVERIFIED_SHARE` of the target (each scaled
  down alike), and their throughput not at all: an epoch holds at least that share of samples the server
  verified or made. Sybils can at worst halve a stage's batch, never stop it.

A server that verified none of its current stage-mates while some of them vouch for one another
(:attr:`~swarm.protocol.ServerInfo.vouches`: an established stage, and this server new to it, or back without
its standing file) is a *follower*: it counts in full the servers its stage-mates vouch for and every other
entry as unverified, and it ends an epoch only when one of those pulls it on (so it never steps before the
stage, and meets its established servers in their round, where it earns standing), or once it counted
:data:`FOLLOWER_PATIENCE` times the target (servers that only vouch for one another and never move, Sybils, cost
it that much, not a stalled stage). A server that verified some of its mates while none of them vouches for it
(*unvouched*: its parts were rejected, or it missed their rounds since it joined) counts its own entry as they
do, within the share, and its local count alone ends an epoch only at that patience: counting it in full while
they did not, it stepped before them, alone, every epoch (tests/test_byzantine_swarm.py, kept logs of two failed
runs: a noisy server sent up to 78% of an epoch's samples ended it 34 s before its two honest mates, met none of
their rounds after its first rejection, and was never excluded). A server of a stage where nobody vouches for
anybody (its first epochs) counts every announced server's entry as before.

Where the run key's recognition (:mod:`swarm.trust.recognition`) names this server or some of its online
stage-mates, it decides instead, one view for the whole stage: the recognized online mates' entries and the
server's own count in full, every other entry as unverified with a share of 0 (a fresh key's samples end no
epoch); a server the recognition does not name counts as they do: their entries in full, its own as unverified
(*unvouched*, with a share of 0; its own count alone ends an epoch only at the patience above). It so ends each
epoch when they do and meets them in their round, where they verify it, and counts once the coordinator's next
read named it and its mates re-read the recognition (a round or two, then up to ~10 s). That holds in a stage of
bounded groups too, so keys that outnumber a stage no longer turn it off. (As a follower, pulled on only once they
had stepped, after their round, it came to every round of theirs too late and was never verified, and with bounded
groups the lanes it held failed their round too: three servers of a stage of seven stayed unnamed for the whole of
a tests/test_scale.py run, and the stage's rounds failed every epoch; kept logs.)

Limits: without a recognition (coordinator down, a stage not founded yet), keys that vouch for one another (two
Sybils) can pull a follower ahead of its stage until it earned standing (established servers are not moved), and a
stage of more servers than ``[averaging] group_size`` (bounded groups) counts every entry as before
(:func:`swarm.server.served.progress_trust`): a server verifies only the members of its first hop's group, so
servers that verified different groups would end their epochs apart; so Sybils can turn it off by outnumbering a
stage past ``group_size``. Sybil mates that averaged with an honest server and then stop vouching for it make
it unvouched: its own samples alone then end an epoch only at :data:`FOLLOWER_PATIENCE` times the target. A
recognized key (one that did real work first) counts in full.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Callable, Optional

import hivemind
import hivemind.optim.progress_tracker
from hivemind.optim.progress_tracker import LocalTrainingProgress
from hivemind.utils import ValueWithExpiration, get_dht_time
from hivemind.utils.asyncio import enter_asynchronously
from hivemind.utils.crypto import RSAPrivateKey

from swarm.protocol import MAX_SAMPLES_PER_S, ProgressPush

logger = logging.getLogger(__name__)


POLL_WINDOW_S = 2.0
"""Longest matchmaking window the progress reads are paced by (seconds; :func:`refresh_periods`)."""


def refresh_periods(matchmaking_time: float) -> dict[str, float]:
    """hivemind's progress-tracker periods (seconds) derived from ``matchmaking_time``, the window in which a stage's
    servers gather for a round, up to :data:`POLL_WINDOW_S`: a server must notice the end of an epoch well inside
    it, or its stage-mate's window closes without it and the two step apart. The tracker reads the stage's progress
    at an eighth of it near an epoch's end (``min_refresh_period``) and at least every quarter of it
    (``max_refresh_period``, also when it finds no other server); :class:`SampleCountTracker` publishes this
    server's count at most once per ``min_refresh_period``. At 2 s: 0.25 and 0.5 s (this project used 0.1 and
    0.5 s and published every micro-batch; a read at most once per window let a resumed server's stage-mate miss
    its rounds, measured in tests/test_pause_resume.py). A longer window (a server derives one from its round
    trips, :mod:`swarm.net.timeouts`: 3 s at 300 ms) waits longer for a late stage-mate, but noticing an epoch's
    end later would only delay every round."""
    window = min(matchmaking_time, POLL_WINDOW_S)
    return dict(min_refresh_period=window / 8, max_refresh_period=window / 4, default_refresh_period=window / 4)


QUIET_READS = 4
"""Reads in a row that found the stage quiet (no server holds a sample, nothing changed) before
:class:`SampleCountTracker` reads less often: at ``max_refresh_period`` (a quarter window), one second at the
demo's spec. Inside a round or between two micro-batches a busy stage is never quiet that long."""
QUIET_SLOWDOWN = 2.0
"""A quiet stage's progress is read every ``QUIET_SLOWDOWN x max_refresh_period`` (half a matchmaking window):
a stage-mate's first samples are then noticed at most half a window late, while the first epoch takes at
least a whole one; this server's own first sample ends the slow reads at once."""

PUSHED_SLOWDOWN = 4.0
"""While pushes carry the stage's progress both ways, the DHT is read and written every ``PUSHED_SLOWDOWN x
max_refresh_period`` (a whole matchmaking window, 2 s at the demo's spec), not every eighth or quarter of it."""

UNVERIFIED_SHARE = 0.5
"""At most this fraction of ``target_batch_size`` counts from unverified entries together (module docstring)."""
FOLLOWER_PATIENCE = 4
"""A follower ends an epoch by its own count only at this many times the target (module docstring)."""


@dataclass(frozen=True)
class ProgressTrust:
    """Whose progress counts in full for this server (module docstring, *Standing*).

    :param verified: progress sub-keys of the current stage-mates whose averaging work this server verified.
    :param vouched: progress sub-keys of the current stage-mates that some stage-mate vouches for.
    :param follower: this server verified none of them, and its stage is established (``vouched`` not empty).
    :param unvouched: none of its current stage-mates vouches for this server while some vouch for others (or the
        run key's recognition names some of them, not it): they count its entry as unverified, and so does it (one
        view of the epoch's end on every server of the stage; ``verified`` then holds the mates it verified, or
        those the recognition names); its local count alone ends an epoch only at :data:`FOLLOWER_PATIENCE` times
        the target (module docstring, *Standing*).
    :param share: the fraction of ``target_batch_size`` the other entries count together at most
        (:data:`UNVERIFIED_SHARE`; 0 where the run key's recognition decides: :func:`~swarm.server.served.
        progress_trust`).
    Neither (all empty): every entry counts in full."""

    verified: frozenset = frozenset()
    vouched: frozenset = frozenset()
    follower: bool = False
    share: float = UNVERIFIED_SHARE
    unvouched: bool = False

    def full(self, key: bytes, own: bytes) -> bool:
        """Whether the entry of sub-key ``key`` counts in full here (``own``: this server's sub-key)."""
        if self.verified:
            return (key == own and not self.unvouched) or key in self.verified
        if self.follower:
            return key == own or key in self.vouched
        return True

    @property
    def weighed(self) -> bool:
        """Entries are told apart (else all count in full, as hivemind counts them)."""
        return bool(self.verified) or self.follower


Roster = Callable[[], Optional[frozenset]]
"""Returns the progress sub-keys (bytes) of the stage's announced servers, or None while they are unknown."""
Trust = Callable[[], ProgressTrust]
"""Returns the :class:`ProgressTrust` of this server now (called at every count: keep it cheap)."""
Push = Callable[[LocalTrainingProgress], bool]
"""Sends this server's progress to the stage's other servers (called at every report, from any thread; must not
block); returns whether the last pushes reached every one of them."""


_SIGNERS: "weakref.WeakKeyDictionary[hivemind.DHT, RSAPrivateKey]" = weakref.WeakKeyDictionary()


def progress_signer(dht: hivemind.DHT) -> RSAPrivateKey:
    """The RSA key that signs the progress records of every stage optimizer on DHT node ``dht``.

    A hivemind DHT node keeps the first ``RSASignatureValidator`` it is given and ignores later ones
    (``RSASignatureValidator.merge_with``), so it signs with that first key whatever key a later tracker
    brings: the records of a second key on the same node fail their signature check on every peer, and a
    server that rejoins a stage in the same process (after a pause or a move) would count for nobody. One key
    per node (not hivemind's one per process: servers of one process on separate DHT nodes, as tests run them,
    keep separate progress entries).
    """
    key = _SIGNERS.get(dht)
    if key is None:
        key = _SIGNERS[dht] = RSAPrivateKey()
    return key


def trusted_progress(entries: dict, own: bytes, own_epoch: int, target: int,
                     roster: Optional[frozenset] = None, trust: ProgressTrust = ProgressTrust()) -> dict:
    """The progress entries (sub-key -> ``ValueWithExpiration`` of a ``LocalTrainingProgress`` dict) that count,
    as the module docstring says: from ``roster`` (or anyone while it is None) plus ``own``, at most one epoch
    past the lower median of the epochs of the others counted in full (or ``own_epoch``), samples clipped to
    ``target``; the entries ``trust`` does not count in full at ``own_epoch`` at most, within ``trust.share``
    (:data:`UNVERIFIED_SHARE`) of ``target`` together, with no throughput (*Standing*)."""
    progress = {}
    for subkey, item in entries.items():
        if item is None or item.value is None or (roster is not None and subkey != own and subkey not in roster):
            continue
        try:
            progress[subkey] = (LocalTrainingProgress.parse_obj(item.value), item.expiration_time)
        except Exception:  # hivemind's schema validator checked it already; a stray value is skipped
            continue
    others = sorted(p.epoch for key, (p, _) in progress.items()
                    if key != own and trust.full(key, own) and not p.client_mode)
    ceiling = max(own_epoch, others[(len(others) - 1) // 2] if others else own_epoch) + 1
    out, unverified = {}, []
    for subkey, (p, expiration) in progress.items():
        if p.epoch > ceiling:
            continue
        p.samples_accumulated = min(p.samples_accumulated, target)
        p.samples_per_second = min(p.samples_per_second, MAX_SAMPLES_PER_S)
        if trust.weighed and not trust.full(subkey, own):  # (a server's entry, whatever client_mode it claims)
            p.client_mode, p.samples_per_second = False, 0.0
            if p.epoch > own_epoch:  # it cannot pull this server on: it finished this epoch, at most
                p.epoch, p.samples_accumulated = own_epoch, target
            unverified.append(p)
        out[subkey] = (p, expiration)
    _share([p for p in unverified if p.epoch == own_epoch], int(trust.share * target))
    return {subkey: ValueWithExpiration(p.dict(), expiration) for subkey, (p, expiration) in out.items()}


def _share(progress: list, cap: int) -> None:
    """Scale the ``samples_accumulated`` of ``progress`` alike so that they sum to at most ``cap``."""
    total = sum(p.samples_accumulated for p in progress)
    if total > cap:
        for p in progress:
            p.samples_accumulated = p.samples_accumulated * cap // total


class SampleCountTracker(hivemind.optim.progress_tracker.ProgressTracker):
    """hivemind's progress tracker reading only trusted entries (module docstring), where an epoch ends only
    when ``target_batch_size`` samples were counted. The local count is read directly, so a lone server steps
    right after its last micro-batch."""

    roster: Roster = staticmethod(lambda: None)
    trust: Trust = staticmethod(ProgressTrust)
    others_epoch = 0  # the lower median epoch of the other servers counted in full (0 while none is)
    per_server_target = 0
    """If set (outer steps, :mod:`swarm.averaging.outer`): an epoch ends after this many samples per server counted
    (``target_batch_size`` follows the count of servers), not after a fixed ``target_batch_size``."""

    _last_report = 0.0  # time.monotonic() of the last publication let through
    _flush: Optional[threading.Timer] = None
    _quiet_reads = 0  # reads in a row that found the stage quiet (QUIET_READS)
    _quiet_state: Optional[tuple] = None  # (epoch, entries' sub-keys) the last quiet read found
    push: Optional[Push] = None
    """Pushes this server's count to its stage-mates (module docstring); None: the DHT only."""
    _pushed: Optional[dict] = None  # sub-key -> ValueWithExpiration of a stage-mate's pushed count
    _recount = False  # a push arrived: count the stage's progress again, without a DHT read
    _fetched: Optional[dict] = None  # the entries the last DHT read found
    _read_at = float("-inf")  # DHT time of the last DHT read
    reads = 0  # DHT reads of the stage's progress (hivemind's one at start included)

    def __init__(self, *args, **kwargs):
        self._pushed, self._lock_pushed = {}, threading.Lock()
        super().__init__(*args, **kwargs)

    def report_local_progress(self, local_epoch: int, samples_accumulated: int, update_global_samples: bool = True):
        """hivemind 1.1.12's, but pushed to the stage-mates at once (:attr:`push`) and published to the DHT at most
        once per ``min_refresh_period`` (the stage's servers read no faster): a count held back is published when
        the period is over, and a new epoch, a reset or a count that reaches the target at once. While the pushes
        reach every stage-mate the period is ``PUSHED_SLOWDOWN x max_refresh_period`` and nothing is urgent.
        (hivemind's own version wakes its publisher at every report.) The new samples join the stage's count at
        once only where this server's own entry counts in full (an unvouched server's wait for the next count:
        added at once, they could end its epoch before its mates' count does)."""
        urgent = (local_epoch != self.local_progress.epoch or samples_accumulated <= 0
                  or samples_accumulated >= self.target_batch_size)
        extra_samples = samples_accumulated - self.local_progress.samples_accumulated
        own = self._local_public_key
        if update_global_samples and local_epoch == self.local_progress.epoch == self.global_progress.epoch \
                and self.trust().full(own, own):
            self.global_progress.samples_accumulated += extra_samples
        if extra_samples > 0:
            self.performance_ema.update(task_size=extra_samples)
        else:
            self.performance_ema.reset_timer()
        self.local_progress = self._get_local_progress(local_epoch, samples_accumulated)
        if extra_samples > 0 and self.reading_slowly:  # this server's first sample: the stage is busy again
            self._quiet_reads, self.global_progress.next_fetch_time = 0, get_dht_time()
            self.global_state_updated.set()  # the fetcher reads at once
        if self.push is not None and self.push(self.local_progress):  # every stage-mate has it: the DHT can wait
            urgent, period = False, PUSHED_SLOWDOWN * self.max_refresh_period
        else:
            period = self.min_refresh_period
        now = time.monotonic()
        due = self._last_report + period
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

    async def _progress_reporter(self):
        """hivemind 1.1.12's, but this server's entry is stored at every report (and again every half
        ``metadata_expiration``), whether or not it held samples lately. hivemind stores an entry only while the
        peer reported samples in the last two global epochs (its auxiliary peers hold none), so a fresh server's
        :meth:`~swarm.averaging.progress_view.StageProgressView.announce_progress` stored nothing, and a server
        whose reporter thread woke only once its count was back at 0 (a lone server ends an epoch at once, and a
        busy machine starves that thread) stored no entry of its new epochs: a server joining the stage read an
        older epoch as the stage's until that entry expired (CI on 2 cores, tests/test_stage_optimizer.py; with
        that thread delayed 0.5 s, a joiner still read epoch 0 after 15 s, the lone server at epoch 2). A stage's
        servers are never auxiliary peers."""
        last_report_time, store_task = -float("inf"), None
        try:
            while not self.shutdown_triggered.is_set():
                timeout = max(0.0, last_report_time - get_dht_time() + self.metadata_expiration / 2)
                await asyncio.get_event_loop().run_in_executor(None, self.should_report_progress.wait, timeout)
                self.should_report_progress.clear()
                if self.shutdown_triggered.is_set():
                    break
                last_report_time = get_dht_time()
                store_task = asyncio.create_task(asyncio.wait_for(self.dht.store(
                    key=self.training_progress_key, subkey=self._local_public_key, value=self.local_progress.dict(),
                    expiration_time=last_report_time + self.metadata_expiration, return_future=True),
                    timeout=self.metadata_expiration))
        finally:
            logger.log(self.status_loglevel, f"No longer reporting progress for {self.prefix}")
            if store_task is not None:
                store_task.cancel()

    @property
    def progress_key(self) -> bytes:
        """This server's sub-key under the progress key (its hivemind RSA public key, in hivemind's format)."""
        return self._local_public_key

    def set_roster(self, roster: Roster, trust: Optional[Trust] = None) -> None:
        """Read entries only from the sub-keys ``roster()`` returns, and count them as ``trust()`` says (module
        docstring, *Standing*; None: every entry in full). Both are called at every count: keep them cheap."""
        self.roster, self.trust = roster, trust or ProgressTrust

    def read_soon(self) -> None:
        """Read the stage's progress from the DHT now (the roster gained a server, whose pushes may not count yet)."""
        self.global_progress.next_fetch_time = get_dht_time()
        self.global_state_updated.set()

    def receive(self, subkey: bytes, push: ProgressPush, sender: bytes = b"") -> None:
        """A stage-mate's count, pushed (any thread): counted at once with the entries the last DHT read found.
        The caller checked that the sender (libp2p id ``sender``) is the stage's server that announced ``subkey``."""
        progress = LocalTrainingProgress(peer_id=sender, epoch=push.epoch, samples_accumulated=push.samples,
                                         samples_per_second=push.samples_per_s, time=push.time,
                                         client_mode=push.client_mode)
        with self._lock_pushed:
            self._pushed[subkey] = ValueWithExpiration(progress.dict(), get_dht_time() + self.metadata_expiration)
        self._recount = True
        self.global_state_updated.set()

    def mates_moved_past(self, epoch: int) -> bool:
        """Whether the lower median of the epochs the stage-mates (of the roster, counted in full) last pushed is
        past ``epoch``: most of them ended epoch ``epoch``'s round. Read from the pushes alone, which arrive while an
        epoch's transition holds the stage's progress paused (hivemind's ``pause_updates``); False where none
        pushed. A stage-mate could claim a later epoch, but a majority of them must, to move it."""
        roster, trust, own = self.roster(), self.trust(), self._local_public_key
        with self._lock_pushed:
            epochs = sorted(v.value["epoch"] for k, v in self._pushed.items()
                            if k != own and (roster is None or k in roster) and not v.value["client_mode"]
                            and trust.full(k, own))
        return bool(epochs) and epochs[(len(epochs) - 1) // 2] > epoch

    def pushed_working(self, epoch: int) -> frozenset[bytes]:
        """Sub-keys whose last pushed count is of ``epoch`` and holds samples (stage-mates computing this epoch)."""
        with self._lock_pushed:
            return frozenset(k for k, v in self._pushed.items()
                             if v.value["epoch"] == epoch and v.value["samples_accumulated"] > 0)

    async def _progress_fetcher(self):
        """hivemind 1.1.12's, but a push (:meth:`receive`) counts the stage's progress again from the entries last
        read and those pushed since, without a DHT read."""
        loop = asyncio.get_event_loop()
        shutdown = asyncio.create_task(asyncio.wait_for(loop.run_in_executor(None, self.shutdown_triggered.wait),
                                                        None))
        try:
            while not self.shutdown_triggered.is_set():
                wait_s = max(0.0, self.global_progress.next_fetch_time - get_dht_time())
                if await loop.run_in_executor(None, self.global_state_updated.wait, wait_s):
                    self.global_state_updated.clear()
                    if self._recount:
                        self._recount = False
                        async with enter_asynchronously(self.lock_global_progress):
                            self.global_progress = self._count(self._fetched, read=False)
                    continue
                async with enter_asynchronously(self.lock_global_progress):
                    getter = asyncio.create_task(asyncio.wait_for(self.dht.get(
                        self.training_progress_key, latest=True, return_future=True), None))
                    await asyncio.wait({getter, shutdown}, return_when=asyncio.FIRST_COMPLETED)
                    if self.shutdown_triggered.is_set():
                        getter.cancel()
                        await asyncio.gather(getter, return_exceptions=True)
                        break
                    found = await getter
                    self.global_progress = self._count(found.value if isinstance(found, ValueWithExpiration)
                                                       else None, read=True)
                    self.fetched_global_progress_this_epoch.set()
        finally:
            shutdown.cancel()
            await asyncio.gather(shutdown, return_exceptions=True)  # (a task left pending is destroyed with the loop)
            logger.log(self.status_loglevel, f"No longer fetching {self.training_progress_key}")

    def _parse_swarm_progress_data(self, metadata):
        return self._count(metadata, read=True)  # (hivemind calls it once, after its first read)

    def _merge_pushed(self, entries: dict, roster: Optional[frozenset]) -> None:
        """Put the pushed counts into ``entries`` (the DHT's), where newer than the sender's DHT entry by its own
        clock; an entry the DHT holds as None (its server left) stays. A push is forgotten once its sender left
        the ``roster`` (its record expired, or it withdrew), or, while the roster is unknown, once it expired: a
        quiet stage-mate pushes nothing new, and its last count stands."""
        now = get_dht_time()
        with self._lock_pushed:
            for subkey, pushed in list(self._pushed.items()):
                if (subkey not in roster) if roster is not None else pushed.expiration_time < now:
                    del self._pushed[subkey]
                    continue
                read = entries.get(subkey)
                if read is None or (isinstance(read.value, dict) and
                                    read.value.get("time", 0.0) <= pushed.value["time"]):
                    entries[subkey] = pushed

    def _count(self, metadata, read: bool):
        """The stage's progress from the DHT's entries (``metadata``, as hivemind reads them; ``read``: just read,
        else those of the last read) and the pushed counts."""
        if read:
            self._fetched, self._read_at, self.reads = metadata, get_dht_time(), self.reads + 1
        entries = dict(metadata) if isinstance(metadata, dict) else {}
        self._merge_pushed(entries, self.roster())
        # this server's own entry is its local progress, whether or not the DHT holds it yet: hivemind counts the
        # entries it fetched, so a server whose own entry was not stored yet (just restarted its optimizer, or
        # just loaded the stage's state) counted one peer fewer and, seeing "no other peers", stepped alone
        entries[self._local_public_key] = ValueWithExpiration(self.local_progress.dict(),
                                                              get_dht_time() + self.metadata_expiration)
        roster, trust = self.roster(), self.trust()
        if self.per_server_target:
            servers = trusted_progress(entries, self._local_public_key, self.local_progress.epoch, 1, roster, trust)
            full = sum(1 for k, v in servers.items() if not v.value["client_mode"] and
                       trust.full(k, self._local_public_key))  # (unverified servers raise it at most 2x, and not
            unverified = sum(1 for k, v in servers.items() if not v.value["client_mode"] and  # at all where their
                             not trust.full(k, self._local_public_key))  # samples count for nothing)
            self.target_batch_size = self.per_server_target * max(1, full + (min(full, unverified) if trust.share
                                                                              else 0))
        trusted = trusted_progress(entries, self._local_public_key, self.local_progress.epoch,
                                   self.target_batch_size, roster, trust)
        others = sorted(v.value["epoch"] for k, v in trusted.items()  # (of those counted in full)
                        if k != self._local_public_key and not v.value["client_mode"] and
                        trust.full(k, self._local_public_key))
        self.others_epoch = others[(len(others) - 1) // 2] if others else 0
        progress = super()._parse_swarm_progress_data(trusted)
        self._count_quiet(progress.epoch, trusted)
        if self.reading_slowly:
            progress.next_fetch_time = get_dht_time() + QUIET_SLOWDOWN * self.max_refresh_period
        if self._all_pushed(entries):
            period = self.metadata_expiration / 4 if self.reading_slowly else PUSHED_SLOWDOWN * self.max_refresh_period
            progress.next_fetch_time = max(progress.next_fetch_time, self._read_at + period)
        return progress

    def _all_pushed(self, entries: dict) -> bool:
        """Whether the count of every other server of the roster is a pushed one (``entries``: after the merge)."""
        roster = self.roster()
        if not roster:
            return False
        with self._lock_pushed:
            return all(key in entries and entries[key] is self._pushed.get(key)
                       for key in roster if key != self._local_public_key)

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
        """Pulled on by an entry counted in full, or the target counted (a follower's: :data:`FOLLOWER_PATIENCE`
        times it), or the target counted by this server alone (a follower's or an unvouched server's: that many
        times it)."""
        trust = self.trust()
        target = self.target_batch_size * (FOLLOWER_PATIENCE if trust.follower else 1)
        alone = self.target_batch_size * (FOLLOWER_PATIENCE if trust.follower or trust.unvouched else 1)
        return (
            self.global_epoch > self.local_progress.epoch
            or self.global_progress.samples_accumulated >= target
            or self.local_progress.samples_accumulated >= alone
        )


__all__ = ["FOLLOWER_PATIENCE", "POLL_WINDOW_S", "PUSHED_SLOWDOWN", "UNVERIFIED_SHARE", "ProgressTrust", "Push", "Roster", "SampleCountTracker", "Trust", "progress_signer", "refresh_periods",
           "trusted_progress"]
