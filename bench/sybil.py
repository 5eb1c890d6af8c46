"""Sybil keys against a live local swarm: which decisions that count keys they win, and the validation loss.

    python bench/sybil.py [--kinds idle,lazy,patient] [--ks 1,2x,3x] [--honest 2] [--train-s 180] [--tenure 60]
                          [--min-window 45] [--logs DIR] [--no-match-tokens]

Every configuration is a swarm of its own on loopback (``runs/tiny.toml``: 2 stages): ``--honest`` servers per
stage, and one trainer that trains for ``--train-s`` seconds from its first tokens (at least ``--min-window`` of
them under attack) and, token-matched (the default), on until it announced the clean run's tokens (at most
``2 x --train-s`` more: a row's ``tokens`` says where it stopped); then the trainer stops and this bench measures
the validation loss of the whole held-out split through the swarm. Once every honest server vouches for a stage-mate
(they verified each other's averaging work), K Sybil keys attack until the end, K from ``--ks`` (``1``: one key,
``2x``: twice the honest servers of a stage):

* ``idle``: K fresh keys per stage that only announce (:class:`swarm.attacks.sybil.RecordSybils`: server records
  claiming a false throughput, every honest server excluded, vouching for one another, a rollback already applied;
  progress entries at the next epoch with 10**9 samples; the last stage's rollback orders; a manifest per stage,
  written by one Sybil key and endorsed by another);
* ``lazy``: K real servers of the last stage whose averaging parts are junk (``tests/byzantine_peer.py noise``),
  their keys also issuing rollback orders and a manifest;
* ``patient``: K plain (honest) servers of the last stage from the start, for ``--tenure`` seconds past the honest
  servers' first vouches (standing earned by real work), then stopped together, their keys running every record
  attack of ``idle`` (the false throughput claimed on the last stage).

The attack begins ``--settle`` seconds after the run key's recognition names every honest server (and the patient
ones, or as many as it named within 120 s: ``patient_recognized``). A configuration that never got going (no
tokens, honest servers that never verified each other) is a row with its ``error``. A
``clean`` configuration (no Sybil) runs first, ``--clean-runs`` times: their mean validation loss is the baseline of
``val_loss_ratio`` (their spread, ``val_loss_spread``, the noise to read a ratio against), but for patient rows,
whose baseline is the same configuration with its servers honest to the end (:data:`CONTROL`).
Harms, read from the honest peers' records and logs through the attack and a joiner started at its end:

* ``checkpoint_committed``: a reader following the run's rules (this bench's :class:`RunDirectory`, reading the run
  key's recognition as a restoring server does) counts a manifest a Sybil key wrote once the attack began, of a state
  no honest server endorsed as its own (a patient key's checkpoint of its honest tenure, or a lazy server's of the
  stage's state it received, endorsed ``same_state`` by an honest stage-mate, is the stage's genuine state: none);
* ``rollback_obeyed``: an honest server applied a rollback (generation above 0, or a learning-rate scale below 1);
* ``joiner_state_taken``: a server joining the Sybils' stage at the end kept the state of a Sybil donor that no
  honest server of the stage held (in its last 8 epochs' digests) nor a checkpoint the run's rules count;
* ``epoch_moved``: an honest stage ended its epochs on under 40% of the target batch of samples (pulled), counted as
  the samples the trainers sent through the pipeline per epoch of the stage's honest servers;
* ``honest_excluded``: an honest server or trainer listed an honest server as excluded or convicted;
* ``averaging_stopped``: an honest stage's gradient rounds failed more than :data:`STOPPED` times per server and
  epoch through the attack (``failed_per_epoch``: the honest servers' ``failed`` averaging counters), each server
  stepping on its own gradient (idle keys counted as averaging members left every group short of a majority);
* ``honest_unrecognized``: at the end, the run key's recognition does not name every honest server (Sybils that
  founded a stage or had honest servers dropped from it);
* ``rebalanced``: at a read through the attack, the stage a joiner would choose or a move an honest server would plan
  (the library's own rules, :meth:`swarm.server.served.PeerContext.claims` then ``choose_stage`` / ``plan_moves``,
  on the records as the run's peers weigh them) differs from the one on the same records with every false claim
  set to the true one (:meth:`Watch.truthful`: a patient key's claim before the attack, a fresh key's the honest
  servers' mean of its stage; idle Sybils claim 10^4 samples/s each on stage 0, patient ones on the last stage, the
  others the honest mean); ``steered_s`` lists the seconds into the attack of each read it steered.

Prints one JSON line per configuration on stderr and last, on stdout, ``{"clean": {...}, "results": [{"kind", "k",
"harms": {name: bool}, "val_loss", "val_loss_ratio", "tokens", "samples_per_epoch", "failed_per_epoch",
"sybil_ids", "patient_recognized"} (or {"kind", "k", "error"}), ...]}``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import random
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

from hivemind.utils import get_dht_time

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.efficiency import spec_written  # noqa: E402
from coordinator.launch import LocalSwarm, Peer  # noqa: E402
from swarm.attacks.sybil import RecordSybils, SybilPlan  # noqa: E402
from swarm.config import RunSpec  # noqa: E402
from swarm.data import prepare_dataset  # noqa: E402
from swarm.host import keep_freed_memory  # noqa: E402
from swarm.identity import Identity  # noqa: E402
from swarm.net.dht import connect_run  # noqa: E402
from swarm.net.directory import AsyncRunDirectory  # noqa: E402
from swarm.protocol import ServerInfo, ServerState, check_endorsements  # noqa: E402
from swarm.server.rebalance import choose_stage, plan_moves  # noqa: E402
from swarm.server.served import PeerContext  # noqa: E402
from swarm.settings import PeerSettings  # noqa: E402
from swarm.trainer.pipeline import RemotePipeline, validation_loss  # noqa: E402
from swarm.trust.recognition import RecognitionReader  # noqa: E402

logger = logging.getLogger("bench.sybil")
HARMS = ("checkpoint_committed", "rollback_obeyed", "joiner_state_taken", "epoch_moved", "honest_excluded",
         "rebalanced", "honest_unrecognized", "averaging_stopped")
DONOR = re.compile(r"downloaded the state of donor (\S+) \(epoch (\d+)\)")
CONTROL = "patient_control"
"""The patient configuration without its attack (its K servers honest to the end): the baseline of a patient row's
``val_loss_ratio`` (on 2 cores K more servers cost the trainer half its samples: measured, patient keys at 1 a stage
trained on 1,828 samples in the window and the clean run on 3,888)."""
PULLED = 0.4
"""An epoch of fewer samples than this share of the target batch was pulled to its end."""
STOPPED = 0.5
"""Failed gradient rounds per honest server and epoch through the attack past which a stage's averaging stopped."""


def wait(predicate, timeout: float, what: str, every_s: float = 1.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(every_s)


class Watch:
    """The honest servers' records through an attack: what they applied and listed, and the stage choices the
    records steer."""

    def __init__(self, directory, spec: RunSpec, honest: set[str]):
        self.directory, self.spec, self.num_stages, self.honest = directory, spec, spec.model.num_stages, honest
        self.honest_p2p: set[str] = set()  # their libp2p ids (``ServerInfo.excluded`` names those)
        self.reader = RecognitionReader(directory, every_s=0.0)
        self.joiner = PeerContext(spec, AsyncRunDirectory(directory), Identity.generate(), None, None, None, None,
                                  recognition=self.reader)
        self.first: dict[str, ServerInfo] = {}
        self.last: dict[str, ServerInfo] = {}
        self.harms = {name: False for name in HARMS}
        self.attack_began: Optional[float] = None  # monotonic s
        self.liars: set[str] = set()  # peer ids whose records the Sybils announce (:meth:`begin`)
        self.before: dict[str, float] = {}  # their throughput claims when the attack began
        self.steered_s: list[float] = []  # seconds into the attack of each read it steered
        self.trainer_samples: list[int] = []  # the trainers' samples at each read

    def recognized(self) -> set[str]:
        """Peer ids the run key's recognition names now, on any stage."""
        self.reader.read()
        return {p for k in range(self.num_stages) for p in self.reader.recognized(k) or ()}

    def servers(self) -> dict[str, ServerInfo]:
        return {s.peer_id: s for g in self.directory.all_servers(self.num_stages).values() for s in g
                if s.peer_id in self.honest}

    def read(self) -> None:
        servers = self.servers()
        self.honest_p2p |= {s.p2p_id for s in servers.values()}
        for pid, s in servers.items():
            self.first.setdefault(pid, s)
            self.last[pid] = s
            if s.rollback_generation > 0 or s.lr_scale < 1.0:
                self.harms["rollback_obeyed"] = True
            if set(s.excluded) & self.honest_p2p or set(s.convicted) & self.honest:
                self.harms["honest_excluded"] = True
        trainers = self.directory.trainers()
        for t in trainers:
            if set(t.convicted) & self.honest:
                self.harms["honest_excluded"] = True
        self.trainer_samples.append(sum(t.samples for t in trainers))
        if self.steered():
            self.harms["rebalanced"] = True
            if self.attack_began is not None:
                self.steered_s.append(round(time.monotonic() - self.attack_began, 1))

    def steered(self) -> bool:
        """Whether the records as the run's peers weigh them steer a joiner's stage or a server's move elsewhere
        than the same records with the true claims would (:meth:`truthful`)."""
        servers = self.directory.all_servers(self.num_stages)
        truth = asyncio.run(self.joiner.claims({k: self.truthful(group) for k, group in servers.items()}))
        weighed = asyncio.run(self.joiner.claims(servers))
        gain = self.spec.rebalance.min_gain
        if choose_stage(self.spec.model, weighed, random.Random(0)) != choose_stage(self.spec.model, truth,
                                                                                   random.Random(0)):
            return True
        planned, true_plan = plan_moves(weighed, gain), plan_moves(truth, gain)
        return any(planned.get(s.peer_id) != true_plan.get(s.peer_id)
                   for group in truth.values() for s in group if s.peer_id in self.honest)

    def begin(self, liars: set[str]) -> None:
        """The attack begins now; ``liars``: the peer ids whose server records the Sybils announce (their claims
        are the false ones; a lazy key's own process announces its measured throughput)."""
        self.attack_began, self.liars = time.monotonic(), liars
        self.before = {s.peer_id: s.throughput for g in self.directory.all_servers(self.num_stages).values()
                       for s in g if s.peer_id in liars}

    def truthful(self, group: list[ServerInfo]) -> list[ServerInfo]:
        """``group`` (a stage's records) with each liar's throughput claim set to its true one: what it claimed
        before the attack (a patient key, measured by its own server), else the honest servers' mean of the stage
        (a fresh key: what this machine's hardware would claim). The harm is a false claim, not a patient key
        counted for the work it did (before, the baseline was the honest records alone: a control's honest extra
        servers showed as steering all run)."""
        claims = [s.throughput for s in group if s.peer_id in self.honest and s.throughput > 0]
        mean = sum(claims) / len(claims) if claims else 0.0
        return [s.model_copy(update={"throughput": self.before.get(s.peer_id, mean)}) if s.peer_id in self.liars
                else s for s in group]

    def _both(self, stage: int) -> list[tuple[ServerInfo, ServerInfo]]:
        """(first, last) records of the honest servers of ``stage`` that served it at both reads."""
        return [(self.first[p], s) for p, s in self.last.items() if s.stage == stage and self.first[p].stage == stage]

    def failed_per_epoch(self) -> dict[int, float]:
        """Stage -> failed gradient rounds per honest server and epoch between the first and the last read."""
        out = {}
        for k in range(self.num_stages):
            both = self._both(k)
            epochs = sum(b.epoch - a.epoch for a, b in both)
            if epochs > 0:
                out[k] = sum(b.averaging.get("failed", 0) - a.averaging.get("failed", 0) for a, b in both) / epochs
        return out

    def samples_per_epoch(self) -> dict[int, float]:
        """Stage -> samples the trainers sent through the pipeline per epoch of the stage's honest servers (the most
        epochs any of them moved) between the first and the last read. (Every sample passes one server of each
        stage, however many serve it: the honest servers' own samples would count a share of each epoch only, where
        others serve the stage too, as patient keys and a control's extra servers do.)"""
        out = {}
        for k in range(self.num_stages):
            epochs = max((b.epoch - a.epoch for a, b in self._both(k)), default=0)
            if epochs > 0 and self.trainer_samples:
                out[k] = (self.trainer_samples[-1] - self.trainer_samples[0]) / epochs
        return out


def honest_state(manifest, run_id: str, honest: set[str]) -> bool:
    """Whether an honest server endorsed ``manifest``'s state as its own (``same_state``): the stage's genuine state,
    whoever wrote it."""
    return any(e.basis == "same_state" and e.peer_id in honest for e in check_endorsements(manifest, run_id))


def start_honest(swarm: LocalSwarm, directory, stages: int, per_stage: int) -> list[Peer]:
    """``per_stage`` servers of each stage, started one after another (pinned: the same split in every
    configuration; rebalancing is judged on the decisions, :meth:`Watch.steered`)."""
    peers = []
    for i in range(stages * per_stage):
        peers.append(swarm.start_peer("server", "--stage", str(i % stages)))
        wait(lambda pid=peers[-1].peer_id: any(s.peer_id == pid for g in directory.all_servers(stages).values()
                                               for s in g), 180, f"{peers[-1].name} to announce itself")
    return peers


def joiner_took_sybil_state(swarm: LocalSwarm, directory, stage: int, sybil_p2p: set[str], watch: Watch) -> bool:
    """Start a server pinned to ``stage``; whether it kept a Sybil donor's state that no honest server of the stage
    held (downloaded, not refused, and its digest at that epoch, as the joiner's record or else the donor's lists it,
    unlike every honest server's and the stage's counted checkpoint's there)."""
    peer = swarm.start_peer("server", "--stage", str(stage), name="joiner")

    def online() -> Optional[ServerInfo]:
        return next((s for s in directory.servers(stage) if s.peer_id == peer.peer_id
                     and s.state == ServerState.ONLINE), None)

    try:
        wait(lambda: online() is not None, 120, "the joiner to come online")
    except TimeoutError as e:
        logger.warning("%s", e)
    info = online()
    refused = set(info.donors_refused) if info is not None else set()
    taken = [(p, int(e)) for p, e in DONOR.findall(peer.log.read_text(errors="replace")) if p in sybil_p2p
             and p not in refused]
    if not taken:
        return False
    honest = [s for s in directory.servers(stage) if s.peer_id in watch.honest]
    checkpoints = directory.manifests(stage)

    def held(epoch: int) -> set[str]:
        """The stage's state at ``epoch``: an honest server's digest (its last 8 epochs), or a checkpoint the run's
        rules count (an honest one: a Sybil donor that serves the stage's committed state harms nobody)."""
        found = {s.state_digests.get(epoch) for s in honest} | {m.state_sha256 for m, _ in checkpoints
                                                               if m.epoch == epoch}
        return found - {None}

    donors = {s.p2p_id: s.state_digests for s in directory.servers(stage)}

    def kept(p2p_id: str, epoch: int) -> Optional[str]:
        """The digest the joiner kept at ``epoch``: its own record's, else the donor's (a joiner lists the epochs it
        stepped, not always the one it loaded)."""
        return info.state_digests.get(epoch) or donors.get(p2p_id, {}).get(epoch)

    return any(info is None or kept(p, epoch) not in held(epoch) for p, epoch in taken)


def attack(kind: str, k: int, swarm: LocalSwarm, spec: RunSpec, directory, patient: list[Peer]) -> tuple:
    """Start the Sybils of ``kind``: ``(RecordSybils, the stage they attack, their libp2p ids)``."""
    stages, last = spec.model.num_stages, spec.model.num_stages - 1
    lr_factor = spec.rollback.lr_factor
    if kind == "idle":
        keys = {stage: [Identity.generate() for _ in range(k)] for stage in range(stages)}
        plan = SybilPlan()
    elif kind == "lazy":
        lazy = [swarm.start_peer("server", "--stage", str(last), name=f"lazy{i}",
                                 entry=("tests.byzantine_peer", "noise")) for i in range(k)]
        keys, plan = {last: [p.identity for p in lazy]}, SybilPlan(announce=False, pull=False, exclude_honest=False)
    else:
        for p in patient:
            swarm.kill(p)
        keys, plan = {last: [p.identity for p in patient]}, SybilPlan(inflate=last)
    sybils = RecordSybils(directory, keys, num_stages=stages, lr_factor=lr_factor, plan=plan)
    return sybils, last, {who.p2p_id for ids in keys.values() for who in ids}


def validation(dht, directory, spec: RunSpec, dataset) -> float:
    """The validation loss of the whole held-out split through the swarm (nats/token), as the demo measures it."""
    async def evaluate() -> float:
        pipeline = RemotePipeline(spec, directory.run_id, AsyncRunDirectory(directory), await dht.replicate_p2p())
        return await validation_loss(pipeline, dataset, None)

    return asyncio.run(evaluate())


def run_one(spec_path: Path, spec: RunSpec, kind: str, k: int, args) -> dict:
    """One configuration: the module docstring's harms and validation loss."""
    stages = spec.model.num_stages
    with tempfile.TemporaryDirectory(prefix="swarm-sybil-") as workdir, \
            LocalSwarm(spec_path, Path(workdir) / "swarm", PeerSettings().cache_dir) as swarm:
        address = swarm.start_coordinator()
        dht, directory, _, _ = connect_run(address, PeerSettings(host="127.0.0.1"), client_mode=False)
        directory.recognized = RecognitionReader(directory).read_recognized  # reads manifests as a server does
        sybils = None
        try:
            honest = {p.peer_id for p in start_honest(swarm, directory, stages, args.honest)}
            patient = [swarm.start_peer("server", "--stage", str(stages - 1), name=f"patient{i}")
                       for i in range(k)] if kind in ("patient", CONTROL) else []
            trainer = swarm.start_peer("trainer", "--share", "0")
            wait(lambda: any(t.tokens > 0 for t in directory.trainers()), 300, "the trainer's first tokens")
            end = time.monotonic() + args.train_s
            watch = Watch(directory, spec, honest)
            wait(lambda: len(watch.servers()) == len(honest) and all(s.vouches for s in watch.servers().values()),
                 300, "every honest server to vouch for a stage-mate", every_s=2.0)
            time.sleep(args.tenure if kind in ("patient", CONTROL) else 0.0)
            wait(lambda: watch.recognized() >= honest, 120, "the run key to recognize every honest server", every_s=2.0)
            patient_ids = {p.peer_id for p in patient}
            with contextlib.suppress(TimeoutError):  # they attack with what they earned: say how many were named
                wait(lambda: watch.recognized() >= patient_ids, 120, "the run key to recognize every patient server",
                     every_s=2.0)
            patient_named = len(watch.recognized() & patient_ids)
            time.sleep(args.settle)  # the servers' own reads of the recognition (every 10 s) take it up
            began_dht, attacking = get_dht_time(), kind not in ("clean", CONTROL)
            watch.begin({p.peer_id for p in patient} if attacking else set())
            sybils, stage, sybil_p2p = attack(kind, k, swarm, spec, directory, patient) if attacking \
                else (None, stages - 1, set())
            if sybils is not None and sybils.plan.announce:
                watch.liars = set(sybils.sybil_ids)
            watch.read()
            end = max(end, time.monotonic() + args.min_window)
            cap = end + 2 * args.train_s  # (token-matched: a configuration the attack slowed trains on, this long)

            def tokens() -> int:
                return max((t.tokens for t in directory.trainers() if t.peer_id == trainer.peer_id), default=0)

            while time.monotonic() < end or (tokens() < args.tokens and time.monotonic() < cap):
                time.sleep(min(5.0, max(1.0, end - time.monotonic())))
                watch.read()
            trained = tokens()
            swarm.stop(trainer)
            if sybils is not None:
                sybils.stop()  # (their records expire within a TTL; the validation's calls retry past them)
            val_loss = validation(dht, directory, spec, args.dataset)
            if sybils is not None:
                watch.harms["checkpoint_committed"] = any(
                    m.peer_id in sybils.sybil_ids and m.time >= began_dht
                    and not honest_state(m, directory.run_id, honest)
                    for k in range(stages) for m, _ in directory.manifests(k))
            watch.harms["honest_unrecognized"] = not watch.recognized() >= honest
            per_epoch = watch.samples_per_epoch()
            watch.harms["epoch_moved"] = any(v < PULLED * spec.training.target_batch_size for v in per_epoch.values())
            failed = watch.failed_per_epoch()
            watch.harms["averaging_stopped"] = any(v > STOPPED for v in failed.values())
            watch.harms["joiner_state_taken"] = joiner_took_sybil_state(swarm, directory, stage, sybil_p2p, watch)
            return {"kind": kind, "k": k, "harms": watch.harms, "val_loss": round(val_loss, 4), "tokens": trained,
                    "patient_recognized": patient_named, "steered_s": watch.steered_s,
                    "samples_per_epoch": {str(s): round(v, 1) for s, v in per_epoch.items()},
                    "failed_per_epoch": {str(s): round(v, 2) for s, v in failed.items()},
                    "sybil_ids": sorted(sybils.sybil_ids) if sybils is not None else []}
        finally:
            if sybils is not None:
                sybils.close()
            dht.shutdown()
            if args.logs is not None:
                shutil.copytree(swarm.workdir / "logs", args.logs / f"{kind}-{k}", dirs_exist_ok=True)


def clean_baseline(first: dict, more: list[dict]) -> dict:
    """The clean run ``first`` with, where there are ``more`` clean runs (token-matched to it), ``val_loss`` their
    mean and ``val_losses`` each: two clean runs of 120 s on 2 cores differed by 9% (4.0006, 4.3612), more than the
    5% a configuration is judged by, so one clean run is no baseline."""
    losses = [r["val_loss"] for r in [first, *more]]
    for r in more:
        print(json.dumps(r), file=sys.stderr, flush=True)
    if not more:
        return first
    return {**first, "val_loss": round(sum(losses) / len(losses), 4), "val_losses": losses,
            "val_loss_spread": round((max(losses) - min(losses)) / min(losses), 3)}


def parse_ks(text: str, honest: int) -> list[int]:
    """``1,2x,3x`` -> keys per stage (``Nx``: N times the honest servers of a stage)."""
    return [int(t[:-1]) * honest if t.endswith("x") else int(t) for t in text.split(",") if t]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--spec", type=Path, default=ROOT / "runs" / "tiny.toml")
    parser.add_argument("--kinds", default="idle,lazy,patient")
    parser.add_argument("--ks", default="1,2x,3x", help="Sybil keys per attacked stage (Nx: N x --honest)")
    parser.add_argument("--honest", type=int, default=2, help="honest servers per stage")
    parser.add_argument("--train-s", type=float, default=180.0, help="seconds of training from the trainer's first "
                        "tokens to the validation loss (the same in every configuration)")
    parser.add_argument("--min-window", type=float, default=45.0, help="seconds of attack at least (the training is "
                        "longer if the honest servers took long to verify each other)")
    parser.add_argument("--settle", type=float, default=15.0, help="seconds between the recognition naming every "
                        "honest server and the attack (the servers re-read it every 10 s; 0: attack at once, in the "
                        "window where a server may still count another stage by head)")
    parser.add_argument("--tenure", type=float, default=60.0, help="seconds patient Sybils work before attacking")
    parser.add_argument("--clean-runs", type=int, default=2, help="clean runs whose mean validation loss is the "
                        "baseline (their spread is the noise a ratio is read against)")
    parser.add_argument("--logs", type=Path, default=None, help="copy each configuration's logs into this folder")
    parser.add_argument("--match-tokens", action=argparse.BooleanOptionalAction, default=True, help="train every "
                        "configuration until its trainer announced at least the clean run's tokens (at most 2 x "
                        "--train-s more): validation losses compared at equal tokens, not equal seconds (on 2 cores "
                        "the attackers' processes and a control's extra servers take the trainer's CPU)")
    args = parser.parse_args()
    keep_freed_memory()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s: %(message)s")
    spec = RunSpec.from_toml(args.spec)
    args.dataset = prepare_dataset(spec, PeerSettings().cache_dir)
    results = []
    with tempfile.TemporaryDirectory(prefix="swarm-sybil-spec-") as folder:
        path = spec_written(spec, Path(folder))
        args.tokens = 0
        clean = run_one(path, spec, "clean", 0, args)
        print(json.dumps(clean), file=sys.stderr, flush=True)
        args.tokens = clean["tokens"] if args.match_tokens else 0
        clean = clean_baseline(clean, [run_one(path, spec, "clean", 0, args) for _ in range(args.clean_runs - 1)])
        for kind in args.kinds.split(","):
            for k in parse_ks(args.ks, args.honest):
                try:
                    row = run_one(path, spec, kind, k, args)
                except (TimeoutError, RuntimeError) as e:  # one configuration that never got going: say so, go on
                    row = {"kind": kind, "k": k, "error": f"{type(e).__name__}: {e}"[:500], "val_loss": None}
                baseline = clean
                if kind == "patient":  # the same servers, honest to the end: the clean run had K fewer on 2 cores
                    baseline = run_one(path, spec, CONTROL, k, args)
                    print(json.dumps(baseline), file=sys.stderr, flush=True)
                    row["control_val_loss"] = baseline["val_loss"]
                if row["val_loss"] is not None and baseline["val_loss"]:
                    row["val_loss_ratio"] = round(row["val_loss"] / baseline["val_loss"], 3)
                print(json.dumps(row), file=sys.stderr, flush=True)
                results.append(row)
    print(json.dumps({"clean": clean, "results": results}), flush=True)


if __name__ == "__main__":
    main()
