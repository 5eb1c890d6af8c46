"""A snapshot of a run read from its DHT records: stages, servers, trainers; as a dict or rich tables.

``status --json`` shape (stable; new keys may be added)::

    {"run": {"run_id", "name", "spec_hash", "num_stages", "tokens", "samples_per_s", "loss"},
     "stages": [{"stage", "servers_online", "servers", "throughput", "epoch"}],
     "peers": [{"peer_id", "role", "stage", "state", "epoch", "throughput", "samples", "loss", "version",
                # servers also: "p2p_id", "banned" (by most of its stage), "banned_by" (servers), "ban_reasons",
                # "rejected_parts", "flagged_parts" (as a reducer), "averaging_bytes", "failed_rounds"
                }],
     "healthy": bool}
"""

from __future__ import annotations

from typing import Any

from swarm.config import RunSpec
from swarm.directory import RunDirectory
from swarm.protocol import ServerState
from swarm.routing import banned_by_stage


def snapshot(directory: RunDirectory, spec: RunSpec) -> dict[str, Any]:
    """Read every stage's servers and the trainers once and summarise them."""
    servers = directory.all_servers(spec.model.num_stages)
    trainers = directory.trainers()
    stages, peers = [], []
    for k, group in servers.items():
        online = [s for s in group if s.state == ServerState.ONLINE]
        stages.append({
            "stage": k, "servers_online": len(online), "servers": len(group),
            "throughput": round(sum(s.throughput for s in online), 3),
            "epoch": max((s.epoch for s in group), default=0),
        })
        others = {s.p2p_id: [o for o in online if o.p2p_id != s.p2p_id] for s in group}
        shunned = banned_by_stage(group)
        peers += [{
            "peer_id": s.peer_id, "role": "server", "stage": k, "state": str(s.state), "epoch": s.epoch,
            "throughput": round(s.throughput, 3), "samples": s.samples, "loss": s.loss, "version": s.version,
            "p2p_id": s.p2p_id, "banned": s.p2p_id in shunned,
            "banned_by": sum(s.p2p_id in o.banned for o in others[s.p2p_id]),
            "ban_reasons": sorted({o.banned[s.p2p_id] for o in others[s.p2p_id] if s.p2p_id in o.banned}),
            "rejected_parts": s.averaging.get("rejected", 0), "flagged_parts": s.averaging.get("flagged", 0),
            "averaging_bytes": s.averaging.get("sent", 0) + s.averaging.get("received", 0),
            "failed_rounds": s.averaging.get("failed", 0),
        } for s in group]
    peers += [{
        "peer_id": t.peer_id, "role": "trainer", "stage": None, "state": "online", "epoch": None,
        "throughput": round(t.samples_per_s, 3), "samples": t.samples, "loss": t.loss, "version": t.version,
        "tokens": t.tokens, "initial_loss": t.initial_loss, "shard": t.shard, "failures": t.failures,
        "bytes_sent": t.bytes_sent, "bytes_received": t.bytes_received,
    } for t in trainers]
    losses = [t.loss for t in trainers if t.loss is not None]
    return {
        "run": {
            "run_id": directory.run_id, "name": spec.name, "spec_hash": spec.spec_hash(),
            "num_stages": spec.model.num_stages, "tokens": sum(t.tokens for t in trainers),
            "samples_per_s": round(sum(t.samples_per_s for t in trainers), 3),
            "loss": sum(losses) / len(losses) if losses else None,
        },
        "stages": stages,
        "peers": peers,
        "healthy": all(s["servers_online"] > 0 for s in stages),
    }


def render(snap: dict[str, Any]) -> None:
    """Print a snapshot as rich tables (respects NO_COLOR and non-TTY output)."""
    from rich.console import Console
    from rich.table import Table

    console = Console()
    run = snap["run"]
    loss = f"{run['loss']:.4f}" if run["loss"] is not None else "-"
    console.print(f"run [bold]{run['run_id']}[/] · {run['num_stages']} stages · loss {loss} · "
                  f"{run['tokens']} tokens · {run['samples_per_s']} samples/s")
    st = Table("stage", "online", "servers", "throughput (samples/s)", "epoch", title="stages")
    for s in snap["stages"]:
        st.add_row(str(s["stage"]), str(s["servers_online"]), str(s["servers"]), str(s["throughput"]), str(s["epoch"]))
    console.print(st)
    pt = Table("peer", "role", "stage", "state", "epoch", "samples/s", "samples", "loss", "banned", title="peers")
    for p in snap["peers"]:
        banned = "-" if p["role"] != "server" else (f"BANNED by {p['banned_by']}" if p["banned"]
                                                    else (f"by {p['banned_by']}" if p["banned_by"] else "no"))
        pt.add_row(p["peer_id"], p["role"], "-" if p["stage"] is None else str(p["stage"]), p["state"],
                   "-" if p["epoch"] is None else str(p["epoch"]), str(p["throughput"]), str(p["samples"]),
                   "-" if p["loss"] is None else f"{p['loss']:.4f}", banned)
    console.print(pt)
