"""``swarm-peer``: join a run as a stage server (default) or a trainer.

Examples::

    swarm-peer join demo-abcdefghijklmnop@/ip4/203.0.113.5/tcp/31337/p2p/12D3KooW...
    swarm-peer join <run address> --role trainer
    SWARM_HOST=127.0.0.1 SWARM_CACHE_DIR=/cache swarm-peer join <run address> --stage 1
    swarm-peer check [<run address>] [--json]      # preflight; every failure prints its fix
    swarm-peer status --probe                      # health of the running peer (container HEALTHCHECK)
    swarm-peer pause | resume | drain              # command the peer running with this SWARM_CACHE_DIR
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from swarm.settings import PeerSettings, Role

app = typer.Typer(add_completion=False, no_args_is_help=True, help="A peer of a volunteer swarm training run.")


@app.callback()
def _root() -> None:
    """A peer of a volunteer swarm training run."""


def _settings_help() -> str:
    """The ``SWARM_*`` settings and their docs, for ``join --help``."""
    lines = ["Settings (environment variables or a .env file):\n\n"]
    for name, field in PeerSettings.model_fields.items():
        default = field.default if field.default not in (None, "") else "-"
        lines.append(f"SWARM_{name.upper()} (default {default}): {field.description}\n\n")
    return "".join(lines)


@app.command(epilog=_settings_help())
def join(
    address: str = typer.Argument(..., help="Run address printed by `swarm-coordinator serve`: <run_id>@<multiaddr>[,...]"),
    role: Role = typer.Option(Role.SERVER, help="server: host a stage; trainer: stream data through the stages "
                              "(the role for peers that cannot accept connections)."),
    stage: Optional[int] = typer.Option(None, help="Stage to serve (default: the stage with the least throughput)."),
    share: Optional[int] = typer.Option(None, help="Trainer data share (default: the lowest unclaimed one)."),
    shard: Optional[int] = typer.Option(None, hidden=True, help="Deprecated name of --share."),
    concurrency: int = typer.Option(2, min=1, help="Trainer: the least micro-batches in flight; it adds enough to "
                                    "cover its round trips to the servers (the log says how many)."),
    max_samples: Optional[int] = typer.Option(None, help="Trainer stops after this many samples."),
    loss_log: Optional[Path] = typer.Option(None, help="Trainer appends each micro-batch's loss here (JSON lines)."),
    invite: Optional[str] = typer.Option(None, help="An invite code of a run that admits by invite (`swarm-coordinator "
                                         "invite` prints it): redeemed for this peer's ticket if it holds none "
                                         "(SWARM_INVITE)."),
    log_level: str = typer.Option("INFO", help="Log level."),
) -> None:
    """Join the run at ADDRESS and serve or train until SIGTERM/Ctrl-C. Settings: SWARM_* env vars, .env."""
    from swarm.host import keep_freed_memory, share_tensors_by_descriptor
    from swarm.logs import configure_logging

    configure_logging(log_level)
    keep_freed_memory()
    share_tensors_by_descriptor()
    if shard is not None:
        typer.echo("--shard is deprecated: the trainer's data share is --share (a checkpoint's shard is another "
                   "thing); taking it as --share", err=True)
        if share is not None and share != shard:
            raise typer.BadParameter(f"--share {share} and --shard {shard} disagree; give --share only")
        share = shard
    settings = PeerSettings()
    if invite is not None:
        settings = settings.model_copy(update={"invite": invite})
    if settings.client_mode and role == Role.SERVER:
        typer.echo("SWARM_CLIENT_MODE is set: this peer cannot accept connections, so it joins as a trainer", err=True)
        role = Role.TRAINER
    if role == Role.SERVER:
        from peer.server import run_server

        run_server(address, settings, stage)
    else:
        from peer.trainer import run_trainer
        from swarm.trainer.session import TrainerOptions

        run_trainer(address, settings, TrainerOptions(share=share, concurrency=concurrency, max_samples=max_samples,
                                                      loss_log=loss_log))


@app.command()
def check(address: Optional[str] = typer.Argument(None, help="Run address: also check the run's spec, protocol "
                                                  "version and clock skew."),
          as_json: bool = typer.Option(False, "--json", help="Print one JSON object: {ok, checks: [{name, ok, "
                                       "detail, fix}]}."),
          timeout: float = typer.Option(30.0, help="Seconds to find the run.")) -> None:
    """Preflight: Python and torch, device and memory, the compute device and kernels a server would use, cache,
    identity, fragment disk, port, reachability, and with ADDRESS the run itself. Exit code 1 if a check fails;
    each failure prints its fix."""
    import json

    from swarm.logs import configure_logging
    from peer.preflight import as_dict, run_checks

    configure_logging("ERROR")
    checks = run_checks(PeerSettings(), address, timeout)
    if as_json:
        typer.echo(json.dumps(as_dict(checks)))
    else:
        for c in checks:
            hint = f"\n     {'hint' if c.ok else 'fix'}: {c.fix}" if c.fix else ""
            typer.echo(f"{'ok  ' if c.ok else 'FAIL'} {c.name:<14} {c.detail}{hint}")
    raise typer.Exit(0 if all(c.ok for c in checks) else 1)


@app.command()
def status(probe: bool = typer.Option(False, "--probe", help="Exit 0 if healthy, 1 if not, printing one line "
                                      "(the container HEALTHCHECK)."),
           as_json: bool = typer.Option(False, "--json", help="Print the heartbeat as one JSON object.")) -> None:
    """Health of the peer running with this SWARM_CACHE_DIR (or SWARM_STATE_DIR), from its heartbeat file (exit 1
    if unhealthy)."""
    import json

    from peer.heartbeat import probe as read_probe

    healthy, reason, beat = read_probe(PeerSettings().state_path())
    if as_json:
        typer.echo(json.dumps({"healthy": healthy, "reason": reason, **beat}))
    else:
        typer.echo(("healthy: " if healthy else "unhealthy: ") + reason, err=not healthy and not probe)
    raise typer.Exit(0 if healthy else 1)


def _command(command: str, wait: bool, timeout: float) -> None:
    """Send ``command`` to the running peer and wait until its heartbeat shows it took effect."""
    import time

    from peer.control import send, wait_for
    from peer.heartbeat import probe as read_probe

    cache_dir = PeerSettings().state_path()
    _, reason, beat = read_probe(cache_dir)
    if not beat or beat.get("state") == "stopped":
        typer.echo(f"error: no running peer uses {cache_dir} ({reason}); set SWARM_CACHE_DIR (or SWARM_STATE_DIR) "
                   "to the peer's", err=True)
        raise typer.Exit(1)
    since = time.time()
    try:
        send(cache_dir, command)
    except OSError as e:
        typer.echo(f"error: cannot write to {cache_dir} ({e}); run this as the peer's user", err=True)
        raise typer.Exit(1) from None
    if not wait:
        typer.echo(f"{command} sent to peer {beat.get('peer_id')}")
        return
    done, state = wait_for(cache_dir, command, timeout, since)
    if not done:
        hint = ("; a server joining still loads its stage's state, or catches up with a stage whose state it could "
                "not yet verify (its log says 'announces itself joining' and it retries every 15 s): wait, or see "
                "docs/troubleshooting.md" if command == "resume" and state == "joining" else "")
        typer.echo(f"error: peer {beat.get('peer_id')} is still {state} after {timeout:.0f} s{hint}", err=True)
        raise typer.Exit(1)
    typer.echo(f"peer {beat.get('peer_id')} is {state}")


_WAIT = typer.Option(True, "--wait/--no-wait", help="Wait until the peer's heartbeat shows the new state.")


@app.command()
def pause(wait: bool = _WAIT, timeout: float = typer.Option(120.0, help="Seconds to wait.")) -> None:
    """Pause the running peer: a server drains, leaves its stage and keeps serving checkpoint fragments; a
    trainer stops starting micro-batches. Exit 1 if no peer runs here or it did not pause in time."""
    _command("pause", wait, timeout)


@app.command()
def resume(wait: bool = _WAIT, timeout: float = typer.Option(300.0, help="Seconds to wait (a server reloads the "
                                                             "stage's state).")) -> None:
    """Resume a paused peer (a server rejoins a stage, loading its current state)."""
    _command("resume", wait, timeout)


@app.command()
def drain(wait: bool = _WAIT, timeout: float = typer.Option(120.0, help="Seconds to wait.")) -> None:
    """Stop the running peer gracefully (as SIGTERM: finish the round, leave the DHT, exit 0)."""
    _command("drain", wait, timeout)


def main() -> None:
    app()
