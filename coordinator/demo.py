"""``swarm-coordinator demo``: a whole swarm on loopback training on the default corpus, then a summary.

Starts a coordinator, ``servers_per_stage`` servers per stage (one after another, round-robin over the
stages) and ``trainers`` trainers as separate processes; shows progress every few seconds on stderr; after
``seconds`` of training stops the trainers, measures the validation loss through the swarm, stops every
process (also on Ctrl-C) and returns the summary.
"""

from __future__ import annotations

import asyncio
import logging
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import torch

from coordinator.launch import LocalSwarm
from coordinator.status import snapshot
from swarm.config import RunSpec
from swarm.settings import PeerSettings
from swarm.data import prepare_dataset
from swarm.net.dht import connect_run
from swarm.net.directory import AsyncRunDirectory
from swarm.kernels.flops import measure_peak_flops
from swarm.trainer.pipeline import RemotePipeline, validation_loss, validation_samples
from swarm.protocol import ServerState

logger = logging.getLogger("swarm.demo")


def _wait_for(predicate, timeout: float, what: str, swarm: LocalSwarm, peer=None) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if peer is not None and not peer.alive():
            raise RuntimeError(f"{peer.name} exited while {what}; its log:\n{swarm.tail(peer)}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s {what}")
        time.sleep(0.5)


BF16_MIN_GAIN = 1.5
"""How much faster than float32 this machine's bfloat16 matmuls must be for the demo to pick ``bf16``."""


def pick_precision(spec: RunSpec, precision: str) -> RunSpec:
    """``spec`` with the demo's precision: ``fp32`` or ``bf16`` as asked; ``auto`` keeps a precision the spec
    names, else picks ``bf16`` where this machine's bfloat16 matmuls run :data:`BF16_MIN_GAIN` x float32's
    (measured here, ~1 s), else ``fp32`` (a CPU without bf16 units runs bf16 slower)."""
    if precision == "auto" and "precision" in spec.training.model_fields_set:
        return spec
    if precision == "auto":
        fp32, bf16 = (measure_peak_flops(torch.device("cpu"), dtype, size=512) for dtype in (torch.float32,
                                                                                              torch.bfloat16))
        precision = "bf16" if bf16 >= BF16_MIN_GAIN * fp32 else "fp32"
        logger.info("bf16 matmuls run %.1fx float32's here: the demo computes in %s", bf16 / fp32, precision)
    return spec.updated(training={"precision": precision})


def run_demo(spec_path: Path, *, seconds: float, servers_per_stage: int = 2, trainers: int = 2,
             cache_dir: Path, keep: bool = False, eval_samples: Optional[int] = None, progress_every: float = 10.0,
             precision: str = "auto") -> dict[str, Any]:
    """Run the demo and return its summary (see ``swarm-coordinator demo --help`` for the keys); ``precision``:
    :func:`pick_precision`; ``eval_samples``: validation samples scored at the end (None: the whole split)."""
    spec = pick_precision(RunSpec.from_toml(spec_path), precision)
    logger.info("preparing the corpus and tokenizer in %s", cache_dir)
    dataset = prepare_dataset(spec, cache_dir)
    workdir = Path(tempfile.mkdtemp(prefix="swarm-demo-"))
    spec_path = workdir / spec_path.name
    spec_path.write_text(spec.to_toml())
    with LocalSwarm(spec_path, workdir, cache_dir, keep=keep) as swarm:
        address = swarm.start_coordinator()
        logger.info("run address %s", address)
        dht, directory, spec, _ = connect_run(address, PeerSettings(host="127.0.0.1"), client_mode=True)
        try:
            start_servers(swarm, directory, spec.model.num_stages, servers_per_stage)
            logger.info("%d servers online; starting %d trainers", spec.model.num_stages * servers_per_stage, trainers)
            snap, elapsed = _train(swarm, directory, spec, trainers, seconds, progress_every)
            val_samples = validation_samples(dataset, eval_samples)
            logger.info("measuring the validation loss on %d held-out samples", val_samples)

            async def evaluate() -> float:
                pipeline = RemotePipeline(spec, directory.run_id, AsyncRunDirectory(directory),
                                          await dht.replicate_p2p())
                return await validation_loss(pipeline, dataset, eval_samples)

            val_loss = asyncio.run(evaluate())
        finally:
            dht.shutdown()
    return summary(snap, spec, val_loss, elapsed, val_samples)


def start_servers(swarm: LocalSwarm, directory, num_stages: int, per_stage: int) -> None:
    """Start ``per_stage`` servers per stage, one after another, and wait until they are all online."""
    for i in range(num_stages * per_stage):
        peer = swarm.start_peer("server", "--stage", str(i % num_stages))

        def announced(pid=peer.peer_id) -> bool:
            return any(s.peer_id == pid for g in directory.all_servers(num_stages).values() for s in g)

        _wait_for(announced, 180, f"waiting for {peer.name} to announce itself", swarm, peer)
    _wait_for(lambda: all(sum(s.state == ServerState.ONLINE for s in g) >= per_stage
                          for g in directory.all_servers(num_stages).values()),
              180, "waiting for the servers to come online", swarm)


def _train(swarm: LocalSwarm, directory, spec: RunSpec, trainers: int, seconds: float,
           progress_every: float) -> tuple[dict, float]:
    """Train with ``trainers`` trainers for ``seconds``, logging progress; stop them. Returns the run's snapshot
    (with the trainers' last records) and the seconds trained."""
    trainer_peers = [swarm.start_peer("trainer", "--share", str(i)) for i in range(trainers)]
    started = time.monotonic()
    next_report = started + progress_every
    exited: set[str] = set()
    while time.monotonic() - started < seconds:
        time.sleep(min(1.0, max(0.0, seconds - (time.monotonic() - started))))
        for p in swarm.peers:
            if not p.alive() and p.name not in exited:
                exited.add(p.name)
                logger.warning("%s exited (code %s); last lines:\n%s", p.name, p.proc.returncode, swarm.tail(p, 10))
        if time.monotonic() >= next_report:
            next_report += progress_every
            _log_progress(snapshot(directory, spec), time.monotonic() - started)
    before = snapshot(directory, spec)
    for p in trainer_peers:
        swarm.stop(p)
    elapsed = time.monotonic() - started
    time.sleep(1.0)  # the trainers' last announcements (sent as they stopped) reach this node's DHT
    snap = snapshot(directory, spec)
    final_ids = {p["peer_id"] for p in snap["peers"]}
    snap["peers"] += [p for p in before["peers"] if p["peer_id"] not in final_ids]
    return snap, elapsed


def _log_progress(snap: dict, seconds: float) -> None:
    run = snap["run"]
    logger.info("t=%3.0fs epochs=%s loss=%s tokens=%d samples/s=%.1f servers=%s trainers=%d", seconds,
                [s["epoch"] for s in snap["stages"]], f"{run['loss']:.3f}" if run["loss"] is not None else "-",
                run["tokens"], run["samples_per_s"], [s["servers_online"] for s in snap["stages"]],
                sum(p["role"] == "trainer" for p in snap["peers"]))


def summary(snap: dict, spec: RunSpec, val_loss: float, elapsed: float, val_samples: int) -> dict[str, Any]:
    trainers_info = [p for p in snap["peers"] if p["role"] == "trainer"]
    initial = [p["initial_loss"] for p in trainers_info if p["initial_loss"] is not None]
    final = [p["loss"] for p in trainers_info if p["loss"] is not None]
    tokens = sum(p["tokens"] for p in trainers_info)
    return {
        "run_id": snap["run"]["run_id"],
        "initial_loss": round(sum(initial) / len(initial), 4) if initial else None,
        "final_loss": round(sum(final) / len(final), 4) if final else None,
        "val_loss": round(val_loss, 4),
        "val_samples": val_samples,
        "tokens": tokens,
        "epochs": min(s["epoch"] for s in snap["stages"]),
        "servers": sum(p["role"] == "server" for p in snap["peers"]),
        "trainers": len(trainers_info),
        "stages": spec.model.num_stages,
        "seconds": round(elapsed, 1),
        "tokens_per_s": round(tokens / elapsed, 1),
        "precision": spec.training.precision,
    }
