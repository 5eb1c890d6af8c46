"""``swarm-coordinator checkpoints`` and ``export``: what the swarm holds, and the newest complete model.

``checkpoints --json`` shape (stable; new keys may be added)::

    {"run_id", "newest_complete": epoch | null,
     "checkpoints": [{"epoch", "stages_complete", "stages", "fragments_alive", "fragments", "replicas",
                      "age_s", "parts": [{"stage", "writer", "shard_sha256", "parent", "size", "k", "n",
                                          "fragments_alive", "replicas", "restorable", "missing"}]}],
     "holders": [{"peer_id", "stage", "free_bytes", "fragments", "distrusted"}]}

``distrusted``: peer id -> reason, the holders that served this holder corrupt fragments.

An epoch is *complete* when every stage has a restorable checkpoint at it (at least ``k`` fragments on live
holders).
"""

from __future__ import annotations

import asyncio
import logging
import random
import tempfile
from pathlib import Path
from typing import Any, Callable, Optional

from swarm.checkpoint import FragmentService, FragmentStore, decode_shard
from swarm.checkpoint.catalog import CheckpointView, checkpoint_views
from swarm.checkpoint.export import export_model, generate, load_exported
from swarm.checkpoint.transfers import FragmentTransfers
from swarm.config import RunSpec
from swarm.identity import Identity
from swarm.net.directory import AsyncRunDirectory, RunDirectory
from swarm.protocol import ServerState
from swarm.trust.banlist import RunBans

logger = logging.getLogger("swarm.coordinator")


def _views(directory: RunDirectory, spec: RunSpec) -> dict[int, list[CheckpointView]]:
    storage = directory.storage()
    return {k: checkpoint_views(directory.manifests(k), storage) for k in range(spec.model.num_stages)}


def complete_epochs(views: dict[int, list[CheckpointView]]) -> list[int]:
    """Epochs at which every stage has a restorable checkpoint, newest first."""
    per_stage = [{v.manifest.epoch for v in group if v.restorable} for group in views.values()]
    return sorted(set.intersection(*per_stage) if per_stage else set(), reverse=True)


def lag_report(views: dict[int, list[CheckpointView]], epoch: int,
               stage_epochs: dict[int, int]) -> dict[str, Any]:
    """Why the exported ``epoch`` is what it is: per stage, its newest restorable checkpoint and the epoch its
    servers announce now (``stage_epochs``; missing: no server online), and the checkpoint's age.

    Shape: ``{"epoch", "age_s", "stages": [{"stage", "newest_checkpoint", "epoch_now"}], "summary"}``; the
    summary is one line naming the stages that hold newer checkpoints and the stage that holds it back.
    """
    stages = []
    for k, group in sorted(views.items()):
        newest = max((v.manifest.epoch for v in group if v.restorable), default=None)
        stages.append({"stage": k, "newest_checkpoint": newest, "epoch_now": stage_epochs.get(k)})
    age = min((v.age_s for group in views.values() for v in group if v.manifest.epoch == epoch), default=0.0)
    behind = [s["stage"] for s in stages if s["newest_checkpoint"] == epoch]
    ahead = [f"stage {s['stage']} has epoch {s['newest_checkpoint']}" for s in stages
             if s["newest_checkpoint"] is not None and s["newest_checkpoint"] > epoch]
    now = max(stage_epochs.values(), default=None)
    summary = f"epoch {epoch} (committed {age:.0f} s ago) is the newest every stage has a restorable checkpoint of"
    if ahead:
        summary += f": {', '.join(ahead)}, but stage{'s' if len(behind) > 1 else ''} " \
                   f"{', '.join(map(str, behind))} not yet"
    if now is not None and now > epoch:
        summary += f"; the run is at epoch {now} (a checkpoint every checkpoint.interval_epochs epochs)"
    return {"epoch": epoch, "age_s": round(age, 1), "stages": stages, "summary": summary}


def listing(directory: RunDirectory, spec: RunSpec) -> dict[str, Any]:
    """The ``checkpoints --json`` object (module docstring)."""
    views = _views(directory, spec)
    by_epoch: dict[int, list[CheckpointView]] = {}
    for group in views.values():
        for v in group:
            by_epoch.setdefault(v.manifest.epoch, []).append(v)
    rows = []
    for epoch in sorted(by_epoch, reverse=True):
        group = sorted(by_epoch[epoch], key=lambda v: (v.manifest.stage, -v.fragments_alive))
        best = {}
        for v in group:
            best.setdefault(v.manifest.stage, v)
        rows.append({
            "epoch": epoch, "stages": spec.model.num_stages,
            "stages_complete": sum(v.restorable for v in best.values()),
            "fragments_alive": sum(v.fragments_alive for v in best.values()),
            "fragments": sum(v.manifest.n for v in best.values()),
            "replicas": sum(v.replicas for v in best.values()),
            "age_s": round(min(v.age_s for v in group), 1),
            "parts": [{"stage": v.manifest.stage, "writer": v.manifest.peer_id, "shard_sha256": v.manifest.shard_sha256,
                       "parent": v.manifest.parent, "size": v.manifest.size, "k": v.manifest.k, "n": v.manifest.n,
                       "fragments_alive": v.fragments_alive, "replicas": v.replicas, "restorable": v.restorable,
                       "missing": v.missing} for v in group],
        })
    holders = [{"peer_id": s.peer_id, "stage": s.stage, "free_bytes": s.free_bytes, "fragments": len(s.held),
                "distrusted": s.distrusted} for s in sorted(directory.storage(), key=lambda s: s.peer_id)]
    complete = complete_epochs(views)
    return {"run_id": directory.run_id, "newest_complete": complete[0] if complete else None, "checkpoints": rows,
            "holders": holders}


def render(snap: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    table = Table("epoch", "stages complete", "fragments alive", "replicas", "age (s)", "shards",
                  title=f"checkpoints of {snap['run_id']} (newest complete: {snap['newest_complete']})")
    for row in snap["checkpoints"]:
        table.add_row(str(row["epoch"]), f"{row['stages_complete']}/{row['stages']}",
                      f"{row['fragments_alive']}/{row['fragments']}", str(row["replicas"]), str(row["age_s"]),
                      " ".join(f"{p['stage']}:{p['shard_sha256'][:8]}" for p in row["parts"]))
    console.print(table)
    holders = Table("holder", "stage", "fragments", "free (MB)", "distrusts", title="fragment holders")
    for h in snap["holders"]:
        holders.add_row(h["peer_id"], str(h["stage"]) if h["stage"] >= 0 else "-", str(h["fragments"]),
                        f"{h['free_bytes'] / 1e6:.0f}", ", ".join(h["distrusted"]) or "-")
    console.print(holders)


async def fetch_complete(directory: RunDirectory, spec: RunSpec, p2p, epoch: Optional[int] = None,
                         progress: Optional[Callable[[str], None]] = None):
    """``(epoch, shards, lag)`` of the newest complete checkpoint (or of ``epoch``), every fragment verified;
    ``lag`` is :func:`lag_report`'s account of why this epoch (its summary also goes to ``progress``).

    :raises LookupError: no complete checkpoint (or not at ``epoch``).
    """
    views = await asyncio.to_thread(_views, directory, spec)
    complete = complete_epochs(views)
    if not complete or (epoch is not None and epoch not in complete):
        raise LookupError(f"no complete checkpoint{f' at epoch {epoch}' if epoch is not None else ''} (complete: "
                          f"{complete or 'none'}); see `swarm-coordinator checkpoints`")
    epoch = complete[0] if epoch is None else epoch
    servers = await asyncio.to_thread(directory.all_servers, spec.model.num_stages)
    lag = lag_report(views, epoch, _stage_epochs(servers))
    if progress:
        progress(lag["summary"])
    with tempfile.TemporaryDirectory() as tmp:
        store, reader = FragmentStore(Path(tmp), 1), AsyncRunDirectory(directory)
        transfers = FragmentTransfers(p2p, reader, Identity.generate().peer_id, store,
                                      FragmentService(store, directory.run_id), bans=RunBans(reader), log=logger,
                                      rng=random.Random())
        shards = []
        for k, group in views.items():
            view = max((v for v in group if v.manifest.epoch == epoch and v.restorable), key=lambda v: v.fragments_alive)

            def report(done, needed, received, k=k):
                if progress:
                    progress(f"stage {k}: {done} of {needed} fragments fetched ({received / 1e6:.2f} MB so far)")
            blob, _ = await transfers.fetch(view, report)
            shards.append(decode_shard(blob, view.manifest.shard_sha256, run_id=directory.run_id, stage=k))
    return epoch, shards, lag


def _stage_epochs(servers: dict) -> dict[int, int]:
    """Stage -> the highest epoch its online servers announce (stages without one are left out)."""
    return {k: max(s.epoch for s in group if s.state == ServerState.ONLINE)
            for k, group in servers.items() if any(s.state == ServerState.ONLINE for s in group)}


def export_and_sample(directory: RunDirectory, spec: RunSpec, out_dir: Path, tokenizer_json: str,
                      prompt: str, tokens: int, epoch: Optional[int] = None,
                      progress: Optional[Callable[[str], None]] = None) -> dict[str, Any]:
    """Fetch, export, reload with plain PyTorch and sample ``tokens`` tokens after ``prompt``.

    :raises LookupError: no complete checkpoint. :raises FragmentError: too few fragments could be fetched.
    """
    from tokenizers import Tokenizer

    async def fetch():
        return await fetch_complete(directory, spec, await directory.dht.replicate_p2p(), epoch, progress)

    epoch, shards, lag = asyncio.run(fetch())
    export_model(spec.model, shards, out_dir, run_id=directory.run_id, tokenizer_json=tokenizer_json)
    model_spec, model = load_exported(out_dir)
    tok = Tokenizer.from_str(tokenizer_json)
    ids = generate(model, model_spec, tok.encode(prompt).ids, new_tokens=tokens)
    return {"run_id": directory.run_id, "epoch": epoch, "dir": str(out_dir), "hf": (Path(out_dir) / "hf").exists(),
            "prompt": prompt, "sample": tok.decode(ids), "age_s": lag["age_s"], "stages": lag["stages"],
            "why_this_epoch": lag["summary"]}
