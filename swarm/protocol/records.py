"""The DHT records of a run and the keys they live under (sealed and opened by :mod:`swarm.protocol.schema`)."""

from __future__ import annotations

import hashlib
import json
from enum import StrEnum
from typing import Annotated, ClassVar, Literal, Optional, Type, TypeVar

from pydantic import BaseModel, ConfigDict, Field, model_validator

from swarm.config import MAX_STAGE_STRIPE_BITS, RunSpec
from swarm.identity import SignatureError, derive_run_id, peer_id_of, public_key_of_p2p_id
from swarm.protocol.schema import (MAX_CLOCK_SKEW_S, MAX_COUNT, MAX_ENDORSEMENTS, MAX_EPOCH, MAX_FLOPS,
                                   MAX_ROUND_S, MAX_SAMPLES_PER_S, MIN_LR_SCALE, AnnouncedRecord, Count, Epoch,
                                   FiniteOrNone, ProtocolError, Record, envelope_ticket, open_record)

def spec_key(run_id: str) -> str:
    return f"{run_id}/spec"


def stage_stripe(peer_id: str, bits: int) -> str:
    """The stripe of ``peer_id``'s server record in a stage spread over ``2^bits`` keys: the first ``bits`` bits of
    BLAKE2b-64 of its peer id, as ``0``/``1`` characters ("" for ``bits`` = 0: the stage's one key). A key's bits
    are a prefix of its records' peers' hashes, so a DHT node checks a record's stripe without knowing the run's
    ``bits`` (:class:`~swarm.net.dht_validation.RunRecordValidator`)."""
    if not 0 <= bits <= MAX_STAGE_STRIPE_BITS:
        raise ValueError(f"stage_stripe_bits must be within 0..{MAX_STAGE_STRIPE_BITS}, got {bits}")
    digest = hashlib.blake2b(peer_id.encode(), digest_size=8).digest()
    return format(int.from_bytes(digest, "big"), "064b")[:bits]


def stage_key(run_id: str, stage: int, stripe: str = "") -> str:
    """The DHT key of ``stage``'s server records, or of one ``stripe`` of them (:func:`stage_stripe`)."""
    return f"{run_id}/stage/{stage}" + (f"/{stripe}" if stripe else "")


def stripe_names(bits: int) -> list[str]:
    """The ``2^bits`` stripes of a stage, in order: ``["0", "1"]`` for 1 bit, ``[""]`` for none."""
    return [format(i, f"0{bits}b") if bits else "" for i in range(2 ** bits)]


def stage_keys(run_id: str, stage: int, bits: int) -> list[str]:
    """Every key of ``stage``'s server records when they are spread over ``2^bits`` stripes (:func:`stripe_names`
    order)."""
    return [stage_key(run_id, stage, stripe) for stripe in stripe_names(bits)]


def trainers_key(run_id: str) -> str:
    return f"{run_id}/trainers"


def history_key(run_id: str, stage: int) -> str:
    """Where the servers of ``stage`` announce their :class:`ServerHistory` (read by monitors only)."""
    return f"{run_id}/history/{stage}"


class ServerState(StrEnum):
    JOINING = "joining"  # announced, loading state (or catching up with its stage); not routed to, not averaging
    ONLINE = "online"  # serving forward/backward
    DRAINING = "draining"  # finishing in-flight work; not routed to
    PAUSED = "paused"  # paused by its operator (``swarm-peer pause``): holds fragments, serves nothing


Reachability = Literal["direct", "relayed", "client"]
"""How other peers reach a peer: at its own address, through a libp2p circuit relay, or not at all (a
client-mode trainer, which only dials out)."""
HISTORY_POINTS = 64
"""Most points a server keeps in :attr:`ServerHistory.history` (older ones are thinned, see :func:`add_history`)."""


def add_history(history: list, point: tuple, cap: int = HISTORY_POINTS) -> list:
    """Append ``point``; past ``cap`` points drop every other one of the older half, so the list spans the
    whole run at decreasing resolution (the newest half stays exact)."""
    history = [*history, point]
    if len(history) > cap:
        half = len(history) // 2
        history = history[:half:2] + history[half:]
    return history




class SpecRecord(Record):
    """The signed run spec, published by the coordinator (and re-published verbatim by peers)."""

    names_its_signer: ClassVar[bool] = False
    kind: Literal["spec"] = "spec"
    spec_json: str
    spec_hash: str


class RestoreReport(BaseModel):
    """A restore of a stage's state from checkpoint fragments."""

    model_config = ConfigDict(extra="ignore", frozen=True, allow_inf_nan=False)
    epoch: int = Field(ge=0)
    shard_sha256: str = Field(max_length=64)
    bit_exact: bool = Field(description="The state re-captured after loading hashes to the manifest's shard hash.")
    seconds: float = Field(ge=0, description="From the first manifest lookup to the loaded state.")
    fragments_bad: int = Field(0, ge=0, description="Fragments refused for a wrong hash (their holders distrusted).")


MAX_VOUCHES = 16
"""Stage-mates a server record vouches for (:attr:`ServerInfo.vouches`)."""


class ServerInfo(AnnouncedRecord):
    """A stage server's announcement under :func:`stage_key`."""

    @property
    def achieved_flops(self) -> float:
        """Model FLOP/s while computing: ``throughput`` (samples/s) x ``flops_per_sample``."""
        return self.throughput * self.flops_per_sample

    @property
    def mfu(self) -> Optional[float]:
        """Model FLOPs utilisation: :attr:`achieved_flops` over the measured ``peak_flops`` (None if unknown)."""
        return self.achieved_flops / self.peak_flops if self.peak_flops > 0 and self.flops_per_sample > 0 else None

    kind: Literal["server"] = "server"
    stage: int = Field(ge=0)
    state: ServerState
    throughput: float = Field(ge=0, le=MAX_SAMPLES_PER_S, description="Measured samples/s of forward+backward on "
                              "this stage.")
    p2p_id: str = Field(min_length=1, max_length=128, description="libp2p peer id (base58) to call the stage RPCs "
                        "on; the signer's own (swarm.identity).")
    maddrs: list[str] = Field(default_factory=list)
    flops_per_sample: float = Field(0.0, ge=0, le=MAX_FLOPS, description="Training model FLOPs of one sample "
                                    "through this stage (swarm.kernels.flops: PaLM appendix B); 0 if unknown.")
    peak_flops: float = Field(0.0, ge=0, le=MAX_FLOPS, description="FLOP/s of this server's device measured by a "
                              "matmul microbenchmark in the run's compute dtype; 0 if unknown.")
    epoch: Epoch = 0
    online_since: float = Field(0.0, ge=0, description="DHT time of this server's first announcement online on "
                                "this stage since it last joined or caught up (seconds): when it becomes an averaging "
                                "member for everyone alike (swarm.averaging.membership); 0 while joining or unknown.")
    samples: Count = Field(0, description="Samples processed since the server started.")
    compute_s: float = Field(0.0, ge=0, le=MAX_COUNT, description="CPU seconds this server spent in the stage's "
                             "training forward and backward since it started (its compute thread's CPU time): the "
                             "model's useful work, which bench/efficiency.py sets against the CPU its processes used.")
    samples_dropped: Count = Field(0, description="Of those, samples whose gradients never reached an optimizer "
                                   "step: accumulated, then discarded by a load of the stage's state (out of sync, "
                                   "a restore or rollback) or by leaving the stage (pause, drain, a move).")
    loss: FiniteOrNone = Field(None, description="Loss EMA of micro-batches (last stage only).")
    peers_in_last_round: int = Field(0, ge=0, le=4096, description="Servers of the stage its progress tracker "
                                     "counts.")
    round_s: float = Field(0.0, ge=0, le=MAX_ROUND_S, description="Mean seconds an epoch transition took "
                           "(averaging + step).")
    rounds: Count = Field(0, description="Epoch transitions since the server started.")
    state_digests: dict[Epoch, Annotated[str, Field(max_length=64)]] = Field(
        default_factory=dict, max_length=8, description="Epoch -> SHA-256 of the server's whole state (parameters "
        "and optimizer state) right after that epoch's step, for its last 8 epochs: the servers of a stage that took "
        "part in every round since the last state-averaging round hold the same digest.")
    version: str = Field("", max_length=64)
    excluded: dict[str, str] = Field(
        default_factory=dict, max_length=32, description="libp2p ids this server excluded from averaging -> reason."
    )
    averaging: dict[str, Count] = Field(
        default_factory=dict, max_length=32, description="Averaging counters: bytes sent/received on the wire, phases, failed "
        "rounds, parts rejected and flagged by this server as a reducer.",
    )
    lineage: str = Field("", max_length=64, description="Shard hash of the newest checkpoint the server's state "
                         "descends from (it wrote it, restored it, or it was the stage's newest when it loaded).")
    restored: Optional[RestoreReport] = Field(None, description="How the server's state was restored from "
                                              "checkpoint fragments, if it was.")
    lr_scale: float = Field(1.0, ge=MIN_LR_SCALE, le=1, description="Learning-rate multiplier after loss-spike "
                            "rollbacks.")
    rollback_generation: int = Field(0, ge=0, le=MAX_EPOCH, description="Rollbacks this server applied (a late server follows "
                                     "the generation most servers applied, :func:`swarm.checkpoint.rollback."
                                     "order_in_force`).")
    rollback_issuer: str = Field("", max_length=64, description="Peer id of the issuer of the last rollback order "
                                 "this server applied.")
    name: str = Field("", max_length=64, description="Public name its operator chose (SWARM_NAME).")
    reachability: Reachability = "direct"
    convicted: dict[str, str] = Field(
        default_factory=dict, max_length=32, description="Peer ids of servers convicted by spot-check evidence "
        "this server verified (swarm.trust.convictions) -> reason; anyone can fetch the evidence (rpc_get_evidence).")
    donors_refused: dict[str, str] = Field(
        default_factory=dict, max_length=32, description="libp2p ids of stage-mates whose state this server "
        "downloaded and refused (it did not verify, swarm.trust.statecheck) -> why: the stage's report of lying "
        "donors.")
    vouches: dict[str, Annotated[float, Field(ge=0, le=1)]] = Field(
        default_factory=dict, max_length=MAX_VOUCHES, description="libp2p ids of stage-mates whose averaging work "
        "this server verified -> their standing's weight with it (swarm.trust.standing), at most 16, the heaviest.")
    last_verified: dict[str, Epoch] = Field(
        default_factory=dict, max_length=MAX_VOUCHES, description="libp2p ids of stage-mates -> this server's epoch "
        "when it last verified their averaging work (a part its reducer accepted unflagged), at most 16, the most "
        "recent: whether a recognized server still works, for the throughput rebalancing counts "
        "(swarm.server.served.counted_claims).")
    progress_key: str = Field("", max_length=2048, pattern=r"^([0-9a-f]{2})*$", description="Hex of its sub-key "
                              "in the stage's hivemind progress records: the stage's servers count only the progress "
                              "of sub-keys their records name (swarm.averaging.progress).")


class ServerHistory(AnnouncedRecord):
    """A stage server's epochs and losses under :func:`history_key`, announced with its :class:`ServerInfo`.

    Apart from the server records because only monitors read it (``status``, ``monitor``): every server and
    trainer reads its stages' :class:`ServerInfo` records every few seconds to route and average, and the history
    was over a third of each (~1.35 of ~3.55 KB sealed, at 64 points: ``bench/records.py``)."""

    kind: Literal["history"] = "history"
    stage: int = Field(ge=0)
    history: list[tuple[Epoch, float, FiniteOrNone]] = Field(
        default_factory=list, max_length=HISTORY_POINTS,
        description="(epoch, DHT time it began, mean training loss of the epoch before or None) per epoch "
        "transition, thinned (:func:`add_history`): the run's progress and loss curve.")


class FragmentEntry(BaseModel):
    """One erasure-coded fragment of a checkpoint shard and the peers it was first placed on."""

    model_config = ConfigDict(extra="ignore", frozen=True)
    index: int = Field(ge=0, lt=256)
    sha256: str = Field(min_length=64, max_length=64)
    holders: list[str] = Field(default_factory=list, max_length=64,
                               description="Peer ids (stable, Ed25519) the writer placed the fragment on.")


class CheckpointManifest(Record):
    """What a stage's checkpoint at ``epoch`` is and where its fragments were placed (:mod:`swarm.checkpoint`).

    Stored under :func:`checkpoints_key`, sub-key :func:`manifest_subkey` (epoch and writer), signed by the
    writer and re-published verbatim by the fragments' holders, so it outlives its writer. ``parent`` is the
    shard hash of the checkpoint the writer's state descends from, so committed states form a hash chain.
    Which peers hold a fragment *now* is in their :class:`StorageInfo` records.
    """

    kind: Literal["manifest"] = "manifest"
    stage: int = Field(ge=0)
    epoch: Epoch
    shard_sha256: str = Field(min_length=64, max_length=64)
    size: int = Field(ge=0, le=1 << 40, description="Shard bytes.")
    k: int = Field(ge=1, le=256, description="Fragments needed to restore.")
    n: int = Field(ge=1, le=256, description="Fragments made.")
    fragments: list[FragmentEntry] = Field(default_factory=list, max_length=256)
    parent: str = Field("", max_length=64)
    parent_epoch: int = Field(-1, ge=-1, le=MAX_EPOCH)
    loss: FiniteOrNone = Field(None, description="The writer's training loss EMA (last stage only).")
    data_position: dict[Annotated[int, Field(ge=0, lt=4096)], Count] = Field(
        default_factory=dict, max_length=4096, description="Data share -> samples its trainer had consumed when "
        "the checkpoint was written (trainers resume there).")
    state_sha256: str = Field(min_length=64, max_length=64, description="SHA-256 of the stage state the shard "
                              "holds (swarm.checkpoint.state.state_digest: parameters and optimizer state only).")
    endorsements: list[bytes] = Field(min_length=1, max_length=MAX_ENDORSEMENTS, description="Sealed "
                                      ":class:`Endorsement` records of other peers (the checkpoint's authority, "
                                      "swarm.trust.authority); :func:`open_record` checks them.")

    @model_validator(mode="after")
    def _fragments_fit(self) -> "CheckpointManifest":
        indices = [f.index for f in self.fragments]
        if self.k > self.n:
            raise ValueError(f"k={self.k} fragments needed of n={self.n} made: no restore is possible")
        if len(set(indices)) != len(indices) or any(i >= self.n for i in indices):
            raise ValueError(f"fragment indices {indices} are repeated or not below n={self.n}")
        return self

    def dht_subkey(self) -> str:
        return manifest_subkey(self.epoch, self.peer_id)

    def check_contents(self, run_id: str) -> None:
        check_endorsements(self, run_id)


class Endorsement(Record):
    """Another peer's signed word that a checkpoint's writer may commit it, embedded sealed in the manifest
    (see :mod:`swarm.trust.authority`). ``same_state``: a server of the stage whose own state at ``epoch``
    has digest ``state_sha256``; ``witness``: a peer that saw ``writer`` as the stage's only online server."""

    kind: Literal["endorsement"] = "endorsement"
    stage: int = Field(ge=0)
    epoch: Epoch
    state_sha256: str = Field(min_length=64, max_length=64)
    writer: str = Field(min_length=1, max_length=64, description="Peer id of the checkpoint's writer.")
    basis: Literal["same_state", "witness"]


def check_endorsements(manifest: CheckpointManifest, run_id: str) -> list[Endorsement]:
    """The manifest's endorsements, opened: each signed by a peer other than the writer, for this run, stage,
    epoch, state and writer; at least one.

    :raises ProtocolError: none, or one that does not verify or match (an honest writer embeds only good ones).
    """
    out, signers = [], set()
    for sealed in manifest.endorsements:
        e, _ = open_record(sealed, Endorsement, run_id=run_id)
        if (e.stage, e.epoch, e.state_sha256, e.writer) != (manifest.stage, manifest.epoch, manifest.state_sha256,
                                                             manifest.peer_id):
            raise ProtocolError(f"an endorsement of the manifest of stage {manifest.stage} epoch {manifest.epoch} "
                                "is for another checkpoint")
        if e.peer_id == manifest.peer_id or e.peer_id in signers:
            raise ProtocolError("a manifest's endorsements must come from distinct peers other than its writer")
        signers.add(e.peer_id)
        out.append(e)
    if not out:
        raise ProtocolError("the manifest carries no endorsement by a second peer")
    return out


def checkpoints_key(run_id: str, stage: int) -> str:
    return f"{run_id}/checkpoints/{stage}"


def manifest_subkey(epoch: int, peer_id: str) -> str:
    """Sub-key of a manifest: ``<epoch>:<writer peer id>`` (one per epoch and writer)."""
    return f"{epoch}:{peer_id}"


class StorageInfo(AnnouncedRecord):
    """A fragment holder's announcement under :func:`storage_key`: where to reach it, its free budget and
    the fragments it holds (verified on its disk when stored)."""

    kind: Literal["storage"] = "storage"
    p2p_id: str = Field(max_length=128, description="libp2p id serving rpc_get_fragment / rpc_put_fragment.")
    free_bytes: Count = Field(description="Fragment budget left (bytes).")
    stage: int = Field(-1, ge=-1, description="Stage the peer serves (-1: none, e.g. the coordinator).")
    held: list[tuple[int, int, int, str]] = Field(
        default_factory=list, max_length=1024,
        description="Fragments held, as [stage, epoch, index, first 16 hex digits of the fragment's SHA-256].")
    distrusted: dict[str, str] = Field(default_factory=dict, max_length=32, description="Peer ids that served "
                                       "corrupt fragments to this peer -> reason; never fetched from or placed on "
                                       "again.")


def storage_key(run_id: str) -> str:
    return f"{run_id}/storage"


class RollbackOrder(Record):
    """A swarm-wide order to return every stage to its checkpoint at or before ``epoch`` and scale the
    learning rate by ``lr_scale`` (cumulative), issued by a last-stage server that saw the loss spike (see
    :mod:`swarm.checkpoint.rollback`). Stored under :func:`rollback_key`, sub-key ``<generation>:<issuer's peer
    id>``. Servers apply it only when it is in force (:func:`swarm.checkpoint.rollback.order_in_force`)."""

    kind: Literal["rollback"] = "rollback"
    epoch: Epoch = Field(description="Newest epoch whose checkpoint is still good.")
    detected_epoch: Epoch
    lr_scale: float = Field(ge=MIN_LR_SCALE, le=1, description="Learning-rate multiplier after this rollback "
                            "(cumulative).")
    generation: int = Field(ge=1, le=MAX_EPOCH, description="Rollbacks so far, this one included.")
    reason: str = Field("", max_length=512)

    @model_validator(mode="after")
    def _before_detection(self) -> "RollbackOrder":
        if self.epoch > self.detected_epoch:
            raise ValueError(f"rolls back to epoch {self.epoch}, after the spike it detected at {self.detected_epoch}")
        return self

    def dht_subkey(self) -> str:
        return f"{self.generation}:{self.peer_id}"


def rollback_key(run_id: str) -> str:
    return f"{run_id}/rollback"


MAX_BANS = 256


class BanList(Record):
    """Peers the run's coordinator banned (``swarm-coordinator ban``): routing, averaging, fragment placement
    and the stage RPCs all leave them out, and a banned peer stops itself. Signed by the run key (the spec's
    signer) and stored under :func:`bans_key`, sub-key ``<time>:<coordinator's peer id>`` (one per version);
    every peer re-publishes the newest list it has, so it outlives the coordinator."""

    kind: Literal["bans"] = "bans"
    banned: dict[str, str] = Field(default_factory=dict, max_length=MAX_BANS,
                                   description="Peer id -> reason (at most 200 characters).")
    p2p_ids: dict[str, str] = Field(default_factory=dict, max_length=MAX_BANS,
                                    description="Peer id -> its libp2p id when known (to refuse its connections).")

    def dht_subkey(self) -> str:
        return f"{self.time!r}:{self.peer_id}"


def bans_key(run_id: str) -> str:
    return f"{run_id}/bans"


class RunKeyRecord(Record):
    """A record the run key signs (an invite, a delegation, a ticket; a ticket also its delegate): ``spec_name`` and
    ``spec_hash`` with the signer's key derive the run id (:func:`~swarm.identity.derive_run_id`), so any peer
    checks one without the spec (:func:`open_run_key_record`)."""
    carries_ticket: ClassVar[bool] = False
    spec_name: str = Field(max_length=32, description="The run's name, to derive the run id with the signer's key.")
    spec_hash: str = Field(min_length=64, max_length=64, description="The run spec's SHA-256 (hex), likewise.")
    expires: float = Field(ge=0, description="DHT time (seconds) after which it is void.")

    def check_contents(self, run_id: str) -> None:
        if self.expires <= self.time:
            raise ProtocolError(f"{self.kind} expires ({self.expires:.0f}) before it was issued ({self.time:.0f})")


RK = TypeVar("RK", bound=RunKeyRecord)


def open_run_key_record(sealed: bytes, cls: Type[RK], run_id: str, subkey: Optional[str] = None) -> RK:
    """Verify a sealed ``cls`` record signed by the key of run ``run_id``.

    :raises ProtocolError: malformed, bad signature, or not signed by the run key."""
    record, key = open_record(sealed, cls, run_id=run_id, subkey=subkey)
    if derive_run_id(record.spec_name, key, record.spec_hash) != run_id:
        raise ProtocolError(f"the {record.kind} is not signed by the run key (its signer and spec do not derive the "
                            "run id)")
    return record


class Ticket(RunKeyRecord):
    """The run key's word that peer ``subject`` may take part until ``expires`` (``[admission] policy`` "allowlist"
    or "invite", :mod:`swarm.trust.tickets`). Stored under :func:`tickets_key`, sub-key ``subject``; carried in the
    envelope of every record its holder seals; records dated after ``expires`` are refused. Signed by the run key,
    or by a delegate key that embeds the run key's :class:`Delegation` (an intermediate certificate)."""

    kind: Literal["ticket"] = "ticket"
    subject: str = Field(min_length=1, max_length=128, description="Peer id admitted.")
    invite: str = Field("", max_length=64, description="The code hash of the invite it was redeemed with ('' for "
                        "a peer admitted by name): the invite's uses are its tickets' subjects.")
    delegation: bytes = Field(b"", max_length=2048, description="Signed by a delegate: the run key's sealed "
                              ":class:`Delegation` naming the signer ('' when the run key signed it).")
    origin: str = Field("", max_length=128, description="The delegate that first admitted ``subject`` ('' the run "
                        "key), carried by renewals: nobody renews it once that delegate is banned.")

    def dht_subkey(self) -> str:
        return self.subject


def tickets_key(run_id: str) -> str:
    return f"{run_id}/tickets"


class Delegation(RunKeyRecord):
    """The run key's word that peer ``delegate`` may issue tickets until ``expires`` (:mod:`swarm.trust.delegates`),
    embedded in each it signs; under :func:`delegates_key`, sub-key ``delegate``. Peers older than this record
    refuse such tickets (they ignore ``Ticket.delegation``): upgrade every peer before delegating."""

    kind: Literal["delegation"] = "delegation"
    delegate: str = Field(min_length=1, max_length=128, description="Peer id of the delegate key.")
    delegate_p2p_id: str = Field(min_length=1, max_length=128, description="The delegate's libp2p id (its key: "
                                 "joiners ask it to redeem their codes).")

    def dht_subkey(self) -> str:
        return self.delegate

    def check_contents(self, run_id: str) -> None:
        super().check_contents(run_id)
        try:
            owner = peer_id_of(public_key_of_p2p_id(self.delegate_p2p_id))
        except SignatureError as e:
            raise ProtocolError(f"the delegation names no libp2p id of a key: {e}") from None
        if owner != self.delegate:
            raise ProtocolError(f"the delegation names libp2p id {self.delegate_p2p_id[:16]}.., which is not "
                                f"{self.delegate}'s")


def delegates_key(run_id: str) -> str:
    return f"{run_id}/delegates"


def open_ticket(sealed: bytes, run_id: str, subkey: Optional[str] = None) -> Ticket:
    """Verify a sealed ticket: a valid :class:`~swarm.protocol.Ticket` record signed by the key of run ``run_id``, or
    by a delegate whose embedded :class:`Delegation` the run key signed, that names the ticket's signer, for the
    same spec, and lasts the ticket's whole life (issued no earlier than the delegation, expiring no later).

    :raises ProtocolError: malformed, bad signature, or signed by neither the run key nor its delegate."""
    ticket, key = open_record(sealed, Ticket, run_id=run_id, subkey=subkey)
    if not ticket.delegation:
        return open_run_key_record(sealed, Ticket, run_id, subkey)
    try:
        delegation = open_run_key_record(ticket.delegation, Delegation, run_id)
    except ProtocolError as e:
        raise ProtocolError(f"the ticket's delegation is not the run key's: {e}") from None
    if delegation.delegate != ticket.peer_id:
        raise ProtocolError(f"the ticket is signed by {ticket.peer_id}, but its delegation names {delegation.delegate}")
    if (ticket.spec_name, ticket.spec_hash) != (delegation.spec_name, delegation.spec_hash):
        raise ProtocolError("the ticket names another spec than its delegation")
    if not delegation.time - MAX_CLOCK_SKEW_S <= ticket.time < ticket.expires <= delegation.expires:
        raise ProtocolError(f"the ticket ({ticket.time:.0f} .. {ticket.expires:.0f}) outlives its delegation "
                            f"({delegation.time:.0f} .. {delegation.expires:.0f})")
    return ticket


MAX_INVITE_USES = 100_000


class Invite(RunKeyRecord):
    """A code that admits up to ``uses`` peers until ``expires`` (``[admission] policy = "invite"``,
    :mod:`swarm.trust.invites`): the run key publishes only the code's hash; a peer that knows the code redeems it
    for a ticket until ``expires``. Stored under :func:`invites_key`, sub-key ``code_hash``."""

    kind: Literal["invite"] = "invite"
    code_hash: str = Field(min_length=64, max_length=64, pattern="^[0-9a-f]{64}$",
                           description="SHA-256 (hex) of the code.")
    uses: int = Field(ge=1, le=MAX_INVITE_USES, description="Peers it admits at most.")
    redeemers: list[Annotated[str, Field(max_length=128)]] = Field(
        min_length=1, max_length=8, description="libp2p ids of the peers that redeem it (the run's coordinator).")

    def dht_subkey(self) -> str:
        return self.code_hash


def invites_key(run_id: str) -> str:
    return f"{run_id}/invites"


MAX_RECOGNIZED = 1024
"""Servers per stage a :class:`Recognition` lists at most."""


class Recognition(RunKeyRecord):
    """The run key's word on which servers earned standing (:mod:`swarm.trust.recognition`): per stage, the peer ids
    of its online servers that a recognized server vouches for, from the stage's first servers that verified each
    other. Peers weigh by it decisions about servers they have not verified themselves (another stage's rollback
    orders, manifests, throughput claims). Stored under :func:`recognition_key`, sub-key ``recognition``, renewed by
    the coordinator while it is up; void after ``expires``."""

    kind: Literal["recognition"] = "recognition"
    servers: dict[Annotated[int, Field(ge=0, lt=4096)], Annotated[list[Annotated[str, Field(max_length=128)]],
                                                                  Field(max_length=MAX_RECOGNIZED)]] = Field(
        default_factory=dict, max_length=256, description="Stage -> peer ids of its recognized servers.")

    def dht_subkey(self) -> str:
        return "recognition"


def recognition_key(run_id: str) -> str:
    return f"{run_id}/recognition"


def check_carried(sealed_record: bytes, run_id: str, dated: float) -> Ticket:
    """The ticket a sealed record carries, checked for that record (module docstring).

    :param dated: the record's ``time`` (DHT time, seconds).
    :raises ProtocolError: no ticket, not the run key's, another peer's, or the record is dated outside its life.
    """
    key, sealed = envelope_ticket(sealed_record)
    if not sealed:
        raise ProtocolError("the record's signer carries no ticket: this run admits only the peers its operator "
                            "admitted (swarm-coordinator admit)")
    ticket = open_ticket(sealed, run_id)
    if ticket.subject != peer_id_of(key):
        raise ProtocolError(f"the record carries the ticket of peer {ticket.subject}, not its signer's")
    if not ticket.time - MAX_CLOCK_SKEW_S <= dated <= ticket.expires:
        raise ProtocolError(f"the record is dated {dated:.0f}, outside its signer's ticket "
                            f"({ticket.time:.0f} .. {ticket.expires:.0f}): the ticket expired; it is renewed while "
                            "the run's coordinator (or a delegate) runs")
    return ticket


class TrainerInfo(AnnouncedRecord):
    """A trainer's progress under :func:`trainers_key`."""

    kind: Literal["trainer"] = "trainer"
    share: int = Field(ge=0, lt=4096, description="The data share it trains on.")
    loss: FiniteOrNone = None
    initial_loss: FiniteOrNone = None
    samples: Count = 0
    position: Count = Field(0, description="Samples of its data share consumed since the run began (a trainer "
                          "resumes from the position recorded in the newest checkpoint manifest).")
    tokens: Count = 0
    samples_per_s: float = Field(0.0, ge=0, le=MAX_SAMPLES_PER_S)
    failures: Count = Field(0, description="Micro-batch attempts that failed and were retried.")
    bytes_sent: Count = Field(0, description="Stage RPC bytes this trainer sent (tensors + metadata).")
    bytes_received: Count = Field(0, description="Stage RPC bytes this trainer received.")
    version: str = Field("", max_length=64)
    name: str = Field("", max_length=64, description="Public name its operator chose (SWARM_NAME).")
    p2p_id: str = Field("", max_length=128, description="libp2p id its stage requests come from.")
    state: Literal["training", "paused", "draining"] = "training"
    reachability: Reachability = "client"
    val_loss: FiniteOrNone = Field(None, description="Mean loss on held-out micro-batches (nats/token), "
                                      "measured every SWARM_VAL_EVERY_S seconds through the swarm.")
    val_time: float = Field(0.0, ge=0, description="DHT time of that measurement.")
    spot_checks: dict[str, Count] = Field(
        default_factory=dict, max_length=8, description="Its spot checks (swarm.trust.spotcheck): sampled, agreed, "
        "convicted, inconclusive, unchecked, adopted, unsynced (answers out of sync, not compared).")
    convicted: dict[str, str] = Field(
        default_factory=dict, max_length=32, description="Peer ids of servers its spot checks convicted -> reason.")




def open_spec(sealed: bytes, run_id: str) -> tuple[RunSpec, bytes]:
    """Verify and parse a sealed :class:`SpecRecord`: its signature, its hash, and that the signer's key and the
    hash derive ``run_id`` (:func:`~swarm.identity.derive_run_id`). Returns ``(spec, run_key)``.

    :raises ProtocolError: a bad record, a hash that does not match the spec, or a spec of another run.
    :raises SpecError: the spec itself does not validate.
    """
    rec, key = open_record(sealed, SpecRecord, run_id=run_id)
    try:
        raw = json.loads(rec.spec_json)
    except ValueError as e:
        raise ProtocolError(f"the spec is not JSON ({e}); the record is corrupted") from None
    if not isinstance(raw, dict):
        raise ProtocolError("the spec is not a JSON object; the record is corrupted")
    spec = RunSpec.from_dict(raw)
    if spec.spec_hash() != rec.spec_hash:
        raise ProtocolError("spec hash does not match the spec's contents; the record is corrupted")
    if derive_run_id(spec.name, key, rec.spec_hash) != run_id:
        raise ProtocolError("spec was signed by a key or has a hash that does not derive this run id")
    return spec, key
