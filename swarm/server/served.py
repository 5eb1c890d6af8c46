"""One stage as a server serves it: built whole when the server joins the stage, thrown away when it leaves (a
move, a pause, a drain), as Petals' ``ModuleContainer`` holds a server's blocks.

A :class:`ServedStage` holds the stage's module behind its RPC server (:class:`~swarm.server.stage.StageServer`),
the stage's optimizer (given to it, built with its donor-state check), and the stage's checkpoint duties:
restore (:class:`~swarm.checkpoint.restore.StageRestore`), commits (:class:`~swarm.checkpoint.commit.StageCommits`)
and rollbacks (:class:`~swarm.checkpoint.rollback.Rollbacks`). Where an epoch ends (on the compute thread) it logs
the epoch's fixed-key line, judges the loss (a spike issues a rollback order) and, when one is due, captures and
commits a checkpoint. While it serves it follows rollback orders, reads the stage's server records (whose progress
this server counts, which are donors) and keeps excluded servers out of its averaging. The process around it
(join, announcements, moves, pause, drain) is :class:`~swarm.server.session.ServerSession`.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Optional

import torch
from hivemind.p2p import P2P, PeerID
from hivemind.utils import get_dht_time

from swarm.aio import Submissions, periodic
from swarm.averaging.membership import MemberTable, recognized_members
from swarm.averaging.exclusion import AveragingReport
from swarm.averaging.progress import ProgressTrust, refresh_periods
from swarm.checkpoint.commit import StageCommits
from swarm.checkpoint.keeper import FragmentKeeper
from swarm.checkpoint.restore import Lineage, StageRestore
from swarm.checkpoint.rollback import Rollbacks
from swarm.config import RunSpec
from swarm.identity import Identity
from swarm.logs import PeerLog
from swarm.net.directory import AsyncRunDirectory, read_period_s
from swarm.net.timeouts import DerivedTimeouts
from swarm.protocol import MAX_VOUCHES, ProgressPush, ProtocolError, ServerInfo, ServerState, add_history
from swarm.server.progress_push import ProgressPusher
from swarm.server.rebalance import capped_claims, choose_stage
from swarm.server.stage import EpochEnd, StageError, StageServer
from swarm.trust.authority import CheckpointAuthority, peer_of_p2p_id
from swarm.trust.banlist import RunBans
from swarm.trust.standing import Standing
from swarm.trust.tickets import TicketGate
from swarm.trust.recognition import RecognitionReader

logger = logging.getLogger(__name__)

def orders_period_s(spec: RunSpec) -> float:
    """Seconds between looks at the run's rollback orders: a sixth of the record TTL (5 s at the default 30 s; an
    order is rare, and a server a few epochs late to apply it loses nothing it does not roll back anyway)."""
    return spec.timeouts.record_ttl_s / 6


def roster_period_s(spec: RunSpec) -> float:
    """Seconds between reads of the stage's server records, whose progress keys say whose progress counts: a
    fifteenth of the record TTL (2 s at the default 30 s; servers re-announce every third of it, and announce a
    join or a leave at once). A server that joins or leaves is counted, or no longer waited for, within about
    this long (one DHT read each)."""
    return spec.timeouts.record_ttl_s / 15


def quiet_period_s(spec: RunSpec) -> float:
    """Seconds between reads of the stage's server records, and of the rollback orders, while the stage is quiet
    (no server counted a sample for a few progress reads, :attr:`~swarm.averaging.optimizer.StageOptimizer.
    stage_quiet`): a third of the record TTL (10 s at the default 30 s), as often as servers re-announce. A server
    that joins meanwhile is read at the next :func:`roster_period_s` tick, its first pushed progress refused here
    being the cue; a leaver still counted costs the stage's first round at most one matchmaking window (its group
    waits for it); an order comes after a loss spike, in a stage that trains."""
    return spec.timeouts.record_ttl_s / 3


def withdraw_s(spec: RunSpec) -> float:
    """Seconds a leaving server stays in the stage's averaging after announcing that it leaves: its stage-mates
    read the stage's records every :func:`roster_period_s` and then stop counting its progress."""
    return 2 * roster_period_s(spec)


LEAVE_GRACE_S = 15.0
"""Seconds a leaving server waits, at most, for the backwards of the micro-batches whose forward it ran."""
COMMIT_GRACE_S = 30.0
"""Seconds a leaving server lets a checkpoint being committed finish."""

StageServerFactory = Callable[..., StageServer]
"""Builds a stage's server: ``(spec, run_id, stage, module, *, optimizer, on_epoch, bans, identity) -> StageServer``
(tests and benchmarks pass one that lies to trainers, :mod:`swarm.attacks`)."""


@dataclass(frozen=True)
class PeerContext:
    """What a served stage needs of the peer process serving it (:class:`~swarm.server.session.ServerSession`)."""

    spec: RunSpec
    directory: AsyncRunDirectory
    identity: Identity
    p2p: P2P
    keeper: FragmentKeeper
    authority: CheckpointAuthority
    bans: RunBans
    gate: Optional[TicketGate] = None
    """Checks callers' tickets in a ticketed run (:mod:`swarm.trust.tickets`); None in an open run."""
    standing: Standing = field(default_factory=Standing)
    """The averaging work this peer verified each stage-mate doing, by libp2p id (:mod:`swarm.trust.standing`),
    kept across the stages it serves and across restarts (its ``path``): it weighs its stage's servers' progress,
    rollback orders, state and evidence."""
    recognition: Optional[RecognitionReader] = None
    """The run key's recognition of which servers earned standing (:mod:`swarm.trust.recognition`): it weighs what
    this peer's own standing cannot (another stage's servers)."""

    def weight(self, p2p_id: str) -> float:
        """A server's vote in this peer's decisions, by libp2p id: 1 for itself, else its standing's weight."""
        return 1.0 if p2p_id == self.identity.p2p_id else self.standing.weight(p2p_id)

    def voice(self, server: ServerInfo) -> float:
        """A server's vote in a decision about servers of any stage: its :meth:`weight`, or 1 if the run key's
        recognition (as last read: :meth:`~swarm.trust.recognition.RecognitionReader.current`) names it."""
        named = self.recognition.recognized(server.stage) if self.recognition is not None else None
        return max(self.weight(server.p2p_id), 1.0 if named is not None and server.peer_id in named else 0.0)

    def weighs(self, stage: int, serves: bool = False) -> bool:
        """Whether this peer weighs ``stage``'s servers in its decisions (:meth:`voice`): the run key's recognition
        (as last read) names some of them, or this peer ``serves`` the stage and verified some server's averaging
        work (its standing). A read that shows none of those it weighs is then no majority, never a head count."""
        named = self.recognition.recognized(stage) if self.recognition is not None else None
        return bool(named) or (serves and bool(self.standing.heaviest(1)))

    def named(self, stage: int, p2p_id: str) -> float:
        """1 if the run key's recognition (as last read) names the server of ``stage`` with libp2p id ``p2p_id``,
        else 0: the state check's weight where this server verified none of the servers answering (a fresh
        joiner; :func:`~swarm.trust.statecheck.judge_donor_state`)."""
        named = self.recognition.recognized(stage) if self.recognition is not None else None
        if not named:
            return 0.0
        try:
            return 1.0 if peer_of_p2p_id(p2p_id) in named else 0.0
        except ProtocolError:
            return 0.0

    async def bottleneck(self) -> int:
        """The stage a joining server takes (:func:`~swarm.server.rebalance.choose_stage` on the :meth:`claims`)."""
        servers = await self.directory.all_servers(self.spec.model.num_stages)
        return choose_stage(self.spec.model, await self.claims(servers))

    async def claims(self, servers: dict[int, list[ServerInfo]]) -> dict[int, list[ServerInfo]]:
        """Of ``servers`` (stage -> records), those whose throughput rebalancing counts (:func:`counted_claims`, on the
        run key's recognition, read now when due: :mod:`swarm.trust.recognition`; without one, every record, each
        claim capped at its stage's median: :func:`~swarm.server.rebalance.capped_claims`)."""
        if self.recognition is None or await self.recognition.current() is None:
            return {k: capped_claims(group) for k, group in servers.items()}
        return {k: counted_claims(group, self.recognition.recognized(k)) for k, group in servers.items()}


FRESH_EPOCHS = 2
"""Epochs (of the witness) within which a recognized server's averaging work must have been verified by a recognized
stage-mate for its throughput claim to count (:func:`counted_claims`)."""


def counted_claims(group: list[ServerInfo], recognized: Optional[frozenset[str]]) -> list[ServerInfo]:
    """The records of a stage whose throughput (samples/s) rebalancing and a joiner's stage choice count: where some
    of them are servers the run key recognizes (``recognized``: their peer ids; None: none), only theirs (fresh keys
    neither add throughput nor make a lone recognized server look accompanied; honest newcomers count once a
    recognized stage-mate verified them: a round or two, then the coordinator's next read), and of those only the
    ones still working (:func:`still_working`: a recognized key that stopped averaging and claims 10^4 samples/s
    does not count); else all of them; each capped at the stage's median claim
    (:func:`~swarm.server.rebalance.capped_claims`). The same for every server of the stage
    (:func:`~swarm.server.rebalance.plan_moves` needs it); a server left out plans no move. The price: joiners
    within that time see none of each other on a recognized stage and may pick the same one (rebalancing moves them
    later)."""
    if recognized is None or not any(s.peer_id in recognized for s in group):
        return capped_claims(group)  # (none of them online: newcomers to a stage its recognized servers left)
    named = [s for s in group if s.peer_id in recognized]
    return capped_claims([s for s in named if still_working(s, named)])


def latest_verified(verified_at: dict[str, int], mates, me: str = "") -> dict[str, int]:
    """Of ``verified_at`` (libp2p id -> this server's epoch when it last verified that server's averaging work), the
    :data:`~swarm.protocol.MAX_VOUCHES` entries of ``mates`` verified last (:attr:`ServerInfo.last_verified`); ties
    (more mates verified at one epoch than fit) broken by a hash of this server's id (``me``), the mate and the
    epoch, so that each server lists another sample of them and every epoch another."""
    def order(kv):
        return kv[1], hashlib.blake2b(f"{me}|{kv[0]}|{kv[1]}".encode(), digest_size=8).digest()

    return dict(sorted((kv for kv in verified_at.items() if kv[0] in mates), key=order)[-MAX_VOUCHES:])


def still_working(server: ServerInfo, named: list[ServerInfo]) -> bool:
    """Whether ``server``'s averaging work was verified lately by another of ``named`` (its stage's recognized
    records): of the *witnesses* (the others of them online that verified some other of ``named`` within
    :data:`FRESH_EPOCHS` of their own epoch, :attr:`~swarm.protocol.ServerInfo.last_verified`; entries naming
    anyone else do not make a witness), one verified ``server``'s within that too. True where there is no witness
    (a stage of one recognized server, or rounds that kept failing: no evidence either way). Several recognized keys
    that stopped together still vouch for one another here: the bound is the recognition's (recognized Sybils past
    the aggregators' fraction of a stage, docs/threat-model.md)."""
    ids = {s.p2p_id for s in named}

    def fresh(w: ServerInfo) -> set[str]:
        return {p for p, e in w.last_verified.items() if p in ids and p != w.p2p_id and e >= w.epoch - FRESH_EPOCHS}

    witnessed = [fresh(w) for w in named if w is not server and w.state == ServerState.ONLINE]
    return not any(witnessed) or any(server.p2p_id in seen for seen in witnessed)


def stopped_members(servers: list[ServerInfo], recognized: Optional[frozenset[str]], me: str) -> set[str]:
    """libp2p ids of the stage's recognized servers, ``me`` (a peer id) aside, that stopped working
    (:func:`still_working`): averaging members still, but counted in no majority and waited for by an early start
    only once they show (``MemberTable.uncounted``). A recognized key that stopped and goes on announcing itself
    (``bench/sybil.py`` patient, K = 1 on a stage of 2) made every round of its stage wait out the matchmaking
    window (steps 0.45 -> 1.6 s, the trainer's rate 40 -> 11 samples/s); two of them would leave the honest pair's
    groups short of a majority. An honest server that missed its rounds for that long is waited for again once it
    shows (accepted into a group, where it is verified and counts again)."""
    named = [s for s in servers if recognized and s.peer_id in recognized]
    return {s.p2p_id for s in named if s.peer_id != me and not still_working(s, named)}


def uncounted_members(servers: list[ServerInfo], recognized: Optional[frozenset[str]], group_size: int,
                      me: str) -> set[str]:
    """libp2p ids of the stage's averaging members counted in no majority: where the run key's recognition decides
    who counts (:func:`~swarm.averaging.membership.recognized_members`; else every record counts), those it does not
    count and the recognized ones that stopped (:func:`stopped_members`)."""
    counted = recognized_members(servers, recognized, group_size)
    if counted is None:
        return set()
    return ({s.p2p_id for s in servers} - {s.p2p_id for s in counted}) | stopped_members(servers, recognized, me)


@dataclass(frozen=True)
class StagePlan:
    """A stage as measured before the server joins it: ``throughput`` (samples/s of forward+backward),
    ``flops_per_sample`` (model FLOPs of one sample through the stage), ``peak_flops`` (the device's measured
    FLOP/s, :mod:`swarm.kernels.flops`) and ``timeouts``, derived from this server's links to the swarm
    (:mod:`swarm.net.timeouts`; None: the spec's own)."""

    stage: int
    throughput: float
    flops_per_sample: float
    peak_flops: float
    timeouts: Optional[DerivedTimeouts] = None

    def local_spec(self, spec: RunSpec) -> RunSpec:
        """The run's ``spec`` with this plan's timeouts: the spec this server's stage runs with."""
        return spec if self.timeouts is None else self.timeouts.apply(spec)

    def record(self) -> dict:
        """The fields of this server's :class:`~swarm.protocol.ServerInfo` the plan fills."""
        return dict(stage=self.stage, throughput=self.throughput, flops_per_sample=self.flops_per_sample,
                    peak_flops=self.peak_flops)


def progress_trust(mates: list, weight: Callable[[str], float], group_size: int = 0,
                   recognized: Optional[frozenset[str]] = None, me: tuple[str, bytes] = ("", b""),
                   own: Optional[ServerInfo] = None) -> ProgressTrust:
    """Whose progress this server (``me``: its peer id and progress sub-key) counts in full
    (:mod:`swarm.averaging.progress`, *Standing*), from its current stage-mates' :class:`~swarm.protocol.ServerInfo`
    records (with a progress key). Where the run key's recognition (``recognized``: peer ids it names on this
    stage) names this server or some of its online mates: those mates still working (:func:`still_working`, judged
    with this server's ``own`` record among theirs: a recognized key that stopped and announces its progress one
    epoch ahead pulled the stage's epochs, ``bench/sybil.py`` patient keys), and nothing from the others; a server
    it does not name counts as they do, its own entry not at all (*unvouched*), so that it ends each epoch with them
    and meets them in their round, where they verify it (the same view on every server of the stage, bounded
    groups included; a follower, pulled on only once they had stepped, came to each round after it ended, and
    with bounded groups its lanes failed theirs: tests/test_scale.py, kept logs). Else those
    it verified (``weight(libp2p id) > 0``), those some stage-mate vouches for, whether it follows them (it
    verified none, and some vouch for others), and whether it is unvouched (they do, none of them for it: ``own``'s
    libp2p id); every entry in full in a stage of more servers than ``group_size``
    (bounded groups: a server verifies only its first hop's group-mates, and servers that verified different groups
    would end their epochs apart; measured, tests/test_scale.py)."""
    if recognized:
        named = [s for s in [*mates, *([own] if own is not None else [])] if s.peer_id in recognized]
        keys = frozenset(bytes.fromhex(s.progress_key) for s in mates if s.peer_id in recognized
                         and s.state == ServerState.ONLINE and still_working(s, named))
        if me[0] in recognized:
            return ProgressTrust(keys | {me[1]}, share=0.0)
        if keys:  # counts as they count: their entries in full, its own not at all (one view of the epoch's end)
            return ProgressTrust(keys, share=0.0, unvouched=True)
    if group_size and len(mates) + 1 > group_size:
        return ProgressTrust()
    named = {p2p for s in mates for p2p in s.vouches}
    verified = frozenset(bytes.fromhex(s.progress_key) for s in mates if weight(s.p2p_id) > 0)
    vouched = frozenset(bytes.fromhex(s.progress_key) for s in mates if s.p2p_id in named)
    unvouched = bool(vouched) and own is not None and own.p2p_id not in named
    return ProgressTrust(verified, vouched, follower=not verified and bool(vouched), unvouched=unvouched)


class ServedStage:
    """Stage ``plan.stage`` served with ``module`` and ``optimizer`` (its :class:`~swarm.averaging.optimizer.
    StageOptimizer`, built with this stage's donor-state check); see the module docstring.

    :param server_factory: builds the stage's RPC server (default :class:`~swarm.server.stage.StageServer`).
    :param dropped_before: samples dropped by the stages this process served before (counted on).

    Create it on the event loop (background commits and rollback orders are scheduled there).
    """

    def __init__(self, ctx: PeerContext, plan: StagePlan, module: torch.nn.Module, optimizer, *,
                 server_factory: StageServerFactory = StageServer, dropped_before: int = 0):
        self.ctx, self.plan, self.stage, self.optimizer = ctx, plan, plan.stage, optimizer
        self.dropped_before = dropped_before
        self.spec, self.directory, self.me = plan.local_spec(ctx.spec), ctx.directory, ctx.identity.peer_id
        self.server = server_factory(self.spec, self.directory.run_id, self.stage, module, optimizer=optimizer,
                                     on_epoch=self._epoch_ended, bans=ctx.bans, identity=ctx.identity)
        b = self.spec.training.micro_batch_size
        self.server.throughput.update(task_size=b, interval=b / max(plan.throughput, 1e-9))
        self.log = PeerLog(logger, self.me, stage=self.stage, epoch=lambda: self.server.epoch)
        self.lineage = Lineage()
        self.restore = StageRestore(ctx.keeper, optimizer, self.server.compute, stage=self.stage,
                                    lineage=self.lineage, log=self.log)
        self.commits = StageCommits(ctx.keeper, ctx.authority, optimizer, stage=self.stage,
                                    lineage=self.lineage, log=self.log)
        self.rollbacks = Rollbacks(self.restore, optimizer, self.server.compute, ctx.identity,
                                   is_last=self.server.is_last, log=self.log, weight=ctx.voice, weighs=ctx.weighs)
        self._verified: dict[str, int] = {}  # libp2p id -> the verified rounds this stage's averager last reported
        self._verified_at: dict[str, int] = {}  # libp2p id -> this server's epoch when those rounds last grew
        self._ticket = ctx.identity.ticket  # the ticket the averager processes sign with (they forked with it)
        self.background = Submissions(asyncio.get_running_loop())
        self.history: list = []  # (epoch, DHT time it began, mean loss of the epoch before): ServerHistory.history
        self._excluded: set[str] = set()  # libp2p ids already excluded from this stage's averaging
        self._roster: Optional[frozenset] = None  # progress sub-keys of the stage's servers (swarm.averaging.progress)
        self._trust = ProgressTrust()  # whose progress counts in full (swarm.averaging.progress, Standing)
        self._donors: frozenset[str] = frozenset()  # libp2p ids of the stage's servers, as the optimizer last heard
        self.members = MemberTable(self.spec.timeouts.record_ttl_s)  # the stage's averaging members, as read
        self._members_sent: Optional[MemberTable] = None  # the table the averagers last took
        self.online_since: Optional[float] = None  # DHT time of its first announcement online since it last joined
        self._rounds_logged = (0, 0)  # (rounds, their milliseconds) up to the last epoch line
        self._restored = False  # an epoch that ends before the state is restored starts nothing
        self._mates: dict[str, bytes] = {}  # libp2p id -> progress sub-key of the stage's other counted servers
        self._roster_due = False  # read the stage's records at the next tick, however quiet the stage (_roster_tick)
        self._ran_at: dict[str, float] = {}  # duty -> time.monotonic() it last ran (_quiet_skip)
        self._servers_read: tuple[float, list] = (float("-inf"), [])  # (time.monotonic(), records) of the last read
        self.pushes = ProgressPusher(ctx.p2p, self.directory.run_id, self.stage,
                                     timeout=refresh_periods(self.spec.averaging.matchmaking_time)["max_refresh_period"])
        optimizer.set_progress_roster(lambda: self._roster, push=self.pushes.offer, trust=lambda: self._trust)
        self.server.progress_sink = self._progress_pushed
        self.server.gate = ctx.gate
        ctx.authority.serve_stage(self.stage)  # endorse this stage's checkpoints by state only

    @property
    def epoch(self) -> int:
        return self.server.epoch

    @property
    def samples_dropped(self) -> int:
        """Samples this process accumulated whose gradients never reached a step (``ServerInfo.samples_dropped``),
        this stage's and those of the stages it served before."""
        return self.dropped_before + self.optimizer.samples_dropped  # read also once it was shut down

    # ---- joining -----------------------------------------------------------------------------------------
    async def restore_state(self) -> None:
        """Load the stage's state from its live servers, else its newest checkpoint, else start fresh; then make
        sure the stage's other servers count this one before its first epoch ends."""
        restore = self.restore
        await self.rollbacks.adopt_in_force()
        source, placed = await restore.source(), True
        if source == "peers":
            self.log.info("loading state from live servers of the stage")
            if await restore.load_from_peers():
                self.rollbacks.reapply()
            else:
                placed = False
                # the checkpoint, or (none yet) stay behind at the old epoch, with no catch-up: the optimizer
                # then downloads the state from the stage's servers when it steps
                await self.rollbacks.adopt_in_force()
                if await restore.source(ask_peers=False) == "checkpoint":
                    await self.server.compute(self.rollbacks.resume, restore.restored_meta)
                    placed = True
        elif source == "checkpoint":
            await self.server.compute(self.rollbacks.resume, restore.restored_meta)
        elif source == "fresh":
            self.log.info("no live server and no checkpoint: starting from the initial parameters")
            await self.server.compute(restore.catch_up)
        if placed:  # the stage's state (or the initial one): stage-mates may now vouch for it with this server
            await self.server.compute(self.server.note_state_digest)
        # publish our progress now, so the stage's servers count us before the first epoch ends (otherwise a
        # server that reaches the target first sees a group of one and steps alone)
        self.optimizer.announce_progress()
        expected = 1 + sum(s.peer_id != self.me for s in await self.directory.fresh_servers(self.stage))
        await asyncio.to_thread(self.optimizer.wait_until_counted, expected)
        self._restored = True

    # ---- serving -----------------------------------------------------------------------------------------
    def duties(self, leave: asyncio.Event) -> list[asyncio.Task]:
        """Start what a serving stage does beside its RPCs until ``leave``: the epoch watcher, following rollback
        orders, reading the stage's server records."""
        watch_s = refresh_periods(self.spec.averaging.matchmaking_time)["min_refresh_period"]  # as the tracker reads
        return [asyncio.create_task(self.server.watch_epochs(leave, watch_s)),
                asyncio.create_task(periodic(leave, orders_period_s(self.spec), self._orders_tick,
                                             "following rollback orders", self.log)),
                asyncio.create_task(periodic(leave, roster_period_s(self.spec), self._roster_tick,
                                             "reading the stage's servers", self.log))]

    def _quiet_skip(self, duty: str) -> bool:
        """Whether to skip this tick of ``duty``: the stage is quiet and the duty ran less than
        :func:`quiet_period_s` ago (else the run is recorded)."""
        now = time.monotonic()
        if self.optimizer.stage_quiet and now - self._ran_at.get(duty, float("-inf")) < quiet_period_s(self.spec):
            return True
        self._ran_at[duty] = now
        return False

    async def _orders_tick(self) -> None:
        if not self._quiet_skip("orders"):
            if self.ctx.recognition is not None:
                await self.ctx.recognition.current()
            await self.rollbacks.follow()

    async def _roster_tick(self) -> None:
        """Read the stage's server records every :func:`roster_period_s` (less often in a stage of many servers,
        :func:`~swarm.net.directory.read_period_s`), or every :func:`quiet_period_s` while the stage is quiet, and at
        once when an unknown stage-mate pushed its progress since the last read."""
        period = read_period_s(len(self._servers_read[1]), roster_period_s(self.spec), quiet_period_s(self.spec))
        if self._roster_due or (time.monotonic() - self._servers_read[0] >= period - 0.1 and
                                not self._quiet_skip("roster")):
            self._roster_due = False
            await self._read_roster()

    async def stage_servers(self) -> list:
        """The stage's server records as the roster last read them (at most ``record_ttl_s / 3`` old: one read
        serves the roster and the ban follower), else read now."""
        if time.monotonic() - self._servers_read[0] > quiet_period_s(self.spec):
            return await self.directory.servers(self.stage)
        return self._servers_read[1]

    async def _read_roster(self) -> None:
        """Keep the progress sub-keys the stage's servers announce (:mod:`swarm.averaging.progress`); tell the
        optimizer the stage's servers (donors) and averaging members (``early_start``, :func:`uncounted_members`)."""
        servers = await self.directory.servers(self.stage)
        self._servers_read = (time.monotonic(), servers)
        self._roster = frozenset(bytes.fromhex(s.progress_key) for s in servers if s.progress_key) or None
        mates = [s for s in servers if s.progress_key and s.peer_id != self.me]
        known, self._mates = self._mates, {s.p2p_id: bytes.fromhex(s.progress_key) for s in mates}
        recognized = self.ctx.recognition.recognized(self.stage) if self.ctx.recognition is not None else None
        self._trust = progress_trust(mates, self.ctx.weight, self.spec.averaging.group_size, recognized,
                                     me=(self.me, bytes.fromhex(self.optimizer.progress_key)),
                                     own=next((s for s in servers if s.peer_id == self.me), None))
        if self._mates != known:
            self.pushes.set_mates(mates)
            if set(self._mates.values()) - set(known.values()):  # a new one: its pushes may not count yet
                self.optimizer.read_progress_soon()
        else:
            self.pushes.resend()
        donors = frozenset(s.p2p_id for s in servers)
        if donors != self._donors and await asyncio.to_thread(self.optimizer.set_donor_roster, donors):
            self._donors = donors
        if not self.spec.averaging.early_start:
            return
        uncounted = uncounted_members(servers, recognized, self.spec.averaging.group_size, self.me)
        self.members.observe(servers, get_dht_time(), uncounted)
        snapshot = self.members.snapshot(self._mates, self.optimizer.pushed_working())
        if snapshot != self._members_sent and await asyncio.to_thread(self.optimizer.set_members, snapshot):
            self._members_sent = snapshot

    def _progress_pushed(self, p2p_id: str, push: ProgressPush) -> None:
        """A stage-mate's pushed count (``rpc_progress``): counted as the progress of the key its server record
        announces. :raises StageError: the sender is not one of the stage's servers this server last read."""
        subkey = self._mates.get(p2p_id)
        if subkey is None:
            self._roster_due = True  # perhaps a server that joined since the last read: read the records at once
            raise StageError(f"this server does not count {p2p_id}'s progress: it is not one of the stage {self.stage} "
                             f"servers it read last (it reads them again within {roster_period_s(self.spec):.0f} s); "
                             "the DHT carries it")
        self.optimizer.receive_progress(subkey, push, PeerID.from_base58(p2p_id).to_bytes())

    async def exclude(self, excluded: dict[str, str]) -> None:
        """Keep the servers in ``excluded`` (libp2p id -> reason: banned, or convicted by verified evidence) out
        of this server's averaging groups (the stage RPCs refuse banned peers through the ban list)."""
        for p2p, reason in excluded.items():
            if p2p not in self._excluded:
                self.log.warning("excluding %s from averaging: %s", p2p, reason)
                if await asyncio.to_thread(self.optimizer.exclude, p2p, reason):
                    self._excluded.add(p2p)

    def record(self, state: ServerState) -> dict:
        """The fields of this server's :class:`~swarm.protocol.ServerInfo` the stage fills for a record saying
        ``state`` (leaving or left: no work, no progress, nothing asked of the optimizer)."""
        server, rollbacks, serving = self.server, self.rollbacks, state in (ServerState.ONLINE, ServerState.JOINING)
        report = self.optimizer.report() if serving else None
        if report is not None and report.answered:
            self._credit(report, server.epoch)
        renewed = self.ctx.identity.ticket
        if serving and renewed and renewed != self._ticket and self.optimizer.set_ticket(renewed):
            self._ticket = renewed  # (a ticketed run: the peer took a renewed ticket; else tried again next time)
        # joining again (catching up), it is an averaging member anew once back online (swarm.averaging.membership)
        self.online_since = (self.online_since or get_dht_time()) if state == ServerState.ONLINE else None
        return dict(
            self.plan.record(), online_since=self.online_since or 0.0,
            throughput=server.throughput.samples_per_second if serving and not self.optimizer.catch_up.active else 0.0,
            epoch=server.epoch, samples=server.samples, compute_s=server.compute_s, loss=server.loss_ema,
            peers_in_last_round=report.peers if report else 0, state_digests=server.recent_digests(8),
            round_s=server.meter.mean_round_s, rounds=server.meter.rounds,
            excluded=report.excluded if report else {}, averaging=report.wire if report else {},
            lineage=self.lineage.current[0], restored=self.restore.restored, lr_scale=self.optimizer.lr_scale,
            rollback_generation=rollbacks.generation, rollback_issuer=rollbacks.order_issuer,
            progress_key=self.optimizer.progress_key if serving else "",
            donors_refused=dict(self.optimizer.donors_refused) if serving else {},
            vouches=self.ctx.standing.heaviest(MAX_VOUCHES, self._mates),
            last_verified=latest_verified(self._verified_at, self._mates, self.ctx.identity.p2p_id),
        )

    def _credit(self, report: AveragingReport, epoch: int) -> None:
        """Credit each stage-mate's newly verified rounds to the standing, at ``epoch``; an exclusion zeroes it."""
        standing = self.ctx.standing
        for p2p, rounds in report.verified.items():
            if rounds > self._verified.get(p2p, 0):
                standing.credit(p2p, rounds - self._verified.get(p2p, 0))
                self._verified_at[p2p] = epoch
        self._verified = dict(report.verified)
        self._verified_at = {p2p: e for p2p, e in self._verified_at.items() if p2p in self._verified}
        for p2p in report.excluded:
            standing.reset(p2p)
        standing.keep()  # (across restarts: swarm.trust.standing)

    # ---- where an epoch ends (compute thread) ------------------------------------------------------------
    def _epoch_ended(self, end: EpochEnd) -> None:
        """Right after the stage's optimizer stepped: log the epoch's line, judge its loss, commit a checkpoint
        when one is due (in the background, from a copy of the state taken now)."""
        background = self.background
        if background is None or not self._restored:  # being left, or not restored yet: it starts nothing
            return
        self.history = add_history(self.history, (end.epoch, get_dht_time(), end.loss))
        self._log_epoch(end)
        if self.rollbacks.is_spike(end.loss):
            background.submit(self.rollbacks.issue(end.epoch, end.loss))
        if self.commits.due(end.epoch):
            shard = self.commits.capture(end.epoch, self.rollbacks.meta())
            background.submit(self.commits.commit(shard, lambda: self.server.loss_ema))

    def _log_epoch(self, end: EpochEnd) -> None:
        """The epoch's fixed-key line (``contribution``: this server's samples of the stage's target batch; ``step_s``:
        the seconds the epoch's transition held the compute thread, matchmaking, all-reduce and optimizer step;
        ``round_s``: the mean seconds of the all-reduces since the last line, ``-`` if none finished; ``gflops``: model
        GFLOP/s while computing, ``samples/s`` x the stage's FLOPs/sample; ``mfu``: that over the device's measured
        peak, :mod:`swarm.kernels.flops`; ``recomputed``: :attr:`~swarm.server.compute.StageCompute.recomputed`)."""
        server, spec, optimizer = self.server, self.spec, self.optimizer
        wire = optimizer.counters()
        rounds, ms = wire.get("rounds", 0), wire.get("round_ms", 0)
        before, self._rounds_logged = self._rounds_logged, (rounds, ms)
        round_s = f"{(ms - before[1]) / 1000 / (rounds - before[0]):.3f}" if rounds > before[0] else "-"
        achieved = server.throughput.samples_per_second * self.plan.flops_per_sample  # model FLOP/s while computing
        self.log.info(
            "loss=%s samples/s=%.2f samples=%d dropped=%d contribution=%.0f%% progress=%.1f%% peers=%d lr=%.2e "
            "step_s=%.2f round_s=%s avg_bytes=%d failed_rounds=%d rejected=%d flagged=%d gflops=%.2f mfu=%.1f%% "
            "recomputed=%d", f"{server.loss_ema:.4f}" if server.loss_ema is not None else "-",
            server.throughput.samples_per_second, server.samples, self.samples_dropped,
            100 * min(1.0, end.samples / spec.training.target_batch_size),
            100 * min(1.0, end.epoch / spec.optim.total_epochs), optimizer.peers, optimizer.lr,
            end.seconds, round_s, wire.get("sent", 0) + wire.get("received", 0), wire.get("failed", 0),
            wire.get("rejected", 0), wire.get("flagged", 0), achieved / 1e9,
            100 * achieved / max(self.plan.peak_flops, 1e-9), server.recomputed,
        )

    # ---- leaving -----------------------------------------------------------------------------------------
    async def withdraw(self, announce: Callable[[], Awaitable[None]]) -> None:
        """Before leaving the stage: refuse new stage work and ``announce`` that this server leaves (throughput 0,
        no progress key: trainers stop routing here and the stage's servers stop counting this one), then let the
        backwards of the micro-batches in flight finish and give the stage-mates :func:`withdraw_s` to read that
        record, while the epoch watcher still joins any round they begin meanwhile (at most :data:`LEAVE_GRACE_S`
        in all).

        Leaving at once instead, a stage-mate that began a round still counting this server waits for it
        ``averaging_timeout`` seconds (twice, when the round averages the state too)."""
        self.server.leaving = True
        await announce()
        started, withdraw = time.monotonic(), withdraw_s(self.spec)
        while time.monotonic() - started < LEAVE_GRACE_S and \
                (self.server.in_flight or time.monotonic() - started < withdraw):
            await asyncio.sleep(0.1)

    async def stop(self, p2p: P2P, handlers: bool) -> None:
        """Leave the stage: take no more work and commit nothing new (``handlers``: the stage RPCs were registered on
        ``p2p``), let a commit finish, shut the optimizer down, stop the compute thread."""
        started = time.monotonic()
        background, self.background = self.background, None  # an epoch that ends from now on starts no commit
        self.pushes.close()
        if handlers:
            await self.server.remove_p2p_handlers(p2p, namespace=self.directory.run_id)
        self.ctx.authority.leave_stage(self.stage)  # it no longer endorses the stage's checkpoints
        await background.close(COMMIT_GRACE_S)
        commits_s = time.monotonic() - started
        # on the compute thread, after any step in progress: hivemind's shutdown iterates the state averager's
        # pending updates, which a step adds to and removes from ("Set changed size during iteration")
        await self.server.compute(self.optimizer.shutdown)
        self.server.shutdown()
        self.log.info("left the stage in %.1f s (checkpoint commits %.1f s, optimizer %.1f s)",
                      time.monotonic() - started, commits_s, time.monotonic() - started - commits_s)


__all__ = ["LEAVE_GRACE_S", "PeerContext", "ServedStage", "StagePlan", "StageServerFactory", "orders_period_s",
           "quiet_period_s", "roster_period_s", "withdraw_s"]
