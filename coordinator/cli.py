"""``swarm-coordinator``: create a run, bootstrap it, watch it, or run the whole thing locally.

Examples::

    swarm-coordinator init runs/demo.toml                 # key runs/demo.key + signed spec, prints the run id
    swarm-coordinator serve runs/demo.toml --port 31337   # prints the run address for peers
    swarm-coordinator status <run address> [--json] [--watch 5] [--plot loss.png]
    swarm-coordinator stages|peers <run address> [--json] [--watch 5]
    swarm-coordinator ban <run address> <peer id> --key runs/demo.key [--reason "..."]   # and unban
    swarm-coordinator admit <run address> <peer id> --key runs/demo.key   # [admission] policy = "allowlist"; revoke
    swarm-coordinator invite <run address> --uses 5 --expires 7d --key runs/demo.key   # policy = "invite"
    swarm-coordinator monitor <run address> --metrics-port 9100   # observer: Prometheus for the whole run
    swarm-coordinator checkpoints <run address> [--json]
    swarm-coordinator export <run address> ./model      # newest complete checkpoint -> PyTorch / transformers
    swarm-coordinator demo --seconds 300 [--json]         # a local swarm on loopback, then a summary
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import typer

from swarm.config import RunSpec, SpecError
from swarm.settings import PeerSettings
from swarm.identity import Identity

DEFAULT_SPEC = Path(__file__).resolve().parents[1] / "runs" / "demo.toml"

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Create, bootstrap and monitor a swarm training run.")


def _load_spec(path: Path) -> RunSpec:
    try:
        return RunSpec.from_toml(path)
    except SpecError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None


def _key_path(spec_path: Path, key: Optional[Path]) -> Path:
    return key or spec_path.with_suffix(".key")


@app.command()
def init(spec_path: Path = typer.Argument(..., help="Run spec (TOML)."),
         key: Optional[Path] = typer.Option(None, help="Ed25519 run key (default: <spec>.key; created if absent).")) -> None:
    """Validate SPEC, create the run key if needed, write the signed spec (<spec>.signed.json), print the run id."""
    from swarm.net.directory import RunDirectory

    spec = _load_spec(spec_path)
    ident = Identity.load_or_create(_key_path(spec_path, key))
    run_id, sealed = RunDirectory.seal_spec(spec, ident)
    out = spec_path.with_suffix(".signed.json")
    out.write_text(json.dumps({"run_id": run_id, "spec_hash": spec.spec_hash(), "sealed": sealed.hex()}, indent=1))
    typer.echo(run_id)


@app.command()
def serve(spec_path: Path = typer.Argument(..., help="Run spec (TOML)."),
          key: Optional[Path] = typer.Option(None, help="Run key (default: <spec>.key; created if absent)."),
          host: str = typer.Option("0.0.0.0", help="Listen address."),
          port: int = typer.Option(0, help="Listen port (0: any free one)."),
          peers: list[str] = typer.Option([], "--peer", help="Other bootstrap multiaddrs to join."),
          address_file: Optional[Path] = typer.Option(None, help="Also write the run address to this file."),
          metrics_port: Optional[int] = typer.Option(None, min=1, max=65535, help="Serve the whole run's Prometheus "
                                                     "metrics on this port (default: SWARM_METRICS_PORT, else off)."),
          log_level: str = typer.Option("INFO")) -> None:
    """Bootstrap the run's DHT, publish the signed spec and print the run address (first line of stdout).
    Exit code 5 if none of the --peer addresses answered within SWARM_JOIN_TIMEOUT_S, 6 if another process
    on this machine serves with the same key."""
    from coordinator.serve import serve as serve_run
    from swarm.net.dht import RunUnreachable
    from swarm.identity import IdentityInUse
    from swarm.host import keep_freed_memory, share_tensors_by_descriptor
    from swarm.logs import configure_logging

    configure_logging(log_level)
    keep_freed_memory()
    share_tensors_by_descriptor()
    spec = _load_spec(spec_path)
    ident = Identity.load_or_create(_key_path(spec_path, key))
    settings = PeerSettings(host=host, port=port, **({"metrics_port": metrics_port} if metrics_port else {}))
    try:
        serve_run(spec, ident, settings, peers, address_file)
    except RunUnreachable as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(5) from None
    except IdentityInUse as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(6) from None


_JSON = typer.Option(False, "--json", help="Print one JSON object (with --watch: one JSON line per refresh).")
_WATCH = typer.Option(0.0, "--watch", min=0, help="Refresh every this many seconds until Ctrl-C (0: once).")
_TIMEOUT = typer.Option(30.0, help="Seconds to find the run.")


_TOP = typer.Option(40, "--top", min=0, help="Peers the table shows, those that need attention first (banned, "
                   "excluded, convicted, lagging), then by stage and contribution; 0: all. --json lists all.")


@dataclass(frozen=True)
class _View:
    """What ``status``, ``stages`` and ``peers`` print: ``what``, as one JSON object or tables, every ``every_s``
    seconds (0: once), at most ``top`` peer rows (0: all), and the loss curve to ``plot``."""

    what: str
    as_json: bool
    every_s: float
    top: int = 0
    plot: Optional[Path] = None


def _show(view: _View, address: str, timeout: float) -> None:
    """Take a snapshot (or keep taking them) and print it; exit 0 if healthy, 1 if not."""
    from coordinator.monitor import watch
    from coordinator.status import snapshot
    from coordinator.views import make_console, render, write_loss_png

    what, every_s, plot = view.what, view.every_s, view.plot
    dht, directory, spec, _ = _connect(address, timeout)
    console = make_console()
    shape = (lambda s: s) if what == "status" else (lambda s: {what: s[what], "healthy": s["healthy"]})  # noqa: E731

    def show(snap):
        if view.as_json:
            print(json.dumps(shape(snap)), flush=True)
        else:
            if every_s > 0:
                console.clear()
            render(snap, what, console, view.top)

    try:
        take = lambda: snapshot(directory, spec)  # noqa: E731
        if every_s > 0:
            snap = watch(take, show, every_s)
        else:
            snap = take()
            show(snap)
        if plot is not None and snap:
            try:
                write_loss_png(snap["run"]["loss_history"], plot, title=f"{snap['run']['run_id']}: training loss")
            except (ValueError, ImportError) as e:
                typer.echo(f"error: {e}", err=True)
                raise typer.Exit(1) from None
            typer.echo(f"wrote {plot}", err=True)
    finally:
        dht.shutdown()
    raise typer.Exit(0 if snap and snap["healthy"] else 1)


@app.command()
def status(address: str = typer.Argument(..., help="Run address."), as_json: bool = _JSON, watch: float = _WATCH,
           plot: Optional[Path] = typer.Option(None, "--plot", help="Also write the loss curve to this PNG file."),
           top: int = _TOP, timeout: float = _TIMEOUT) -> None:
    """Run summary (epoch, loss, validation loss, tokens, samples/s, ETA, peers), loss plot, stages, peers.
    Exit code 1 if a stage has no online server. JSON keys: run, stages, peers, healthy (docs/monitoring.md)."""
    _show(_View("status", as_json, watch, top, plot), address, timeout)


@app.command()
def stages(address: str = typer.Argument(..., help="Run address."), as_json: bool = _JSON, watch: float = _WATCH,
           timeout: float = _TIMEOUT) -> None:
    """Per stage: servers (online, lagging), throughput, demand, epoch, last averaging round. Exit 1 if a
    stage has no online server. JSON: {stages, healthy}."""
    _show(_View("stages", as_json, watch), address, timeout)


@app.command()
def peers(address: str = typer.Argument(..., help="Run address."), as_json: bool = _JSON, watch: float = _WATCH,
          top: int = _TOP, timeout: float = _TIMEOUT) -> None:
    """Per peer: id, name, version, role, stage, state, direct or relayed, samples/s, contribution, last seen,
    flagged/rejected parts, bans. Exit 1 if a stage has no online server. JSON: {peers, healthy}."""
    _show(_View("peers", as_json, watch, top), address, timeout)


def _ban_list(address: str, key: Path, timeout: float, peer: str, lift: bool, reason: str = "") -> None:
    """Add ``peer`` to (or, with ``lift``, remove it from) the run's ban list, signed with the run ``key``."""
    from swarm.trust.banlist import update_bans

    coordinator = _run_key(key)
    dht, directory, spec, _ = _connect(address, timeout)
    try:
        if lift:
            record = update_bans(directory, coordinator, unban=peer)
        else:
            record = update_bans(directory, coordinator, ban=(peer, reason, _p2p_id_of(directory, spec, peer)))
    except (PermissionError, ValueError, OSError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1) from None
    finally:
        dht.shutdown()
    typer.echo(json.dumps({"banned": record.banned}))


def _run_key(path: Path) -> Identity:
    """The run key at ``path``; exit 2 if it cannot be read."""
    try:
        return Identity.load(path)
    except (OSError, ValueError) as e:
        typer.echo(f"error: cannot read the run key: {e}", err=True)
        raise typer.Exit(2) from None


def _p2p_id_of(directory, spec: RunSpec, peer: str) -> str:
    """The libp2p id a peer's records name ('' if it is not listed now)."""
    servers = [s for group in directory.all_servers(spec.model.num_stages).values() for s in group]
    found = [s.p2p_id for s in servers if s.peer_id == peer] + [t.p2p_id for t in directory.trainers() if t.peer_id == peer]
    return found[0] if found else ""


_KEY = typer.Option(..., "--key", help="The run key (Ed25519) that created the run, e.g. runs/demo.key.")


@app.command()
def ban(address: str = typer.Argument(..., help="Run address."),
        peer: str = typer.Argument(..., help="Peer id to ban (as `swarm-coordinator peers` lists it)."),
        reason: str = typer.Option("banned by the run's operator", help="Shown to the peer and in `peers`."),
        key: Path = _KEY, timeout: float = _TIMEOUT) -> None:
    """Publish a signed ban: trainers stop routing to PEER, servers refuse its requests and averaging, keepers
    its fragments; PEER itself stops (exit code 4). Prints the ban list as JSON."""
    _ban_list(address, key, timeout, peer, lift=False, reason=reason)


@app.command()
def unban(address: str = typer.Argument(..., help="Run address."),
          peer: str = typer.Argument(..., help="Peer id to take off the ban list."),
          key: Path = _KEY, timeout: float = _TIMEOUT) -> None:
    """Lift a ban (the peer may join again). Prints the ban list as JSON."""
    _ban_list(address, key, timeout, peer, lift=True)


@app.command()
def admit(address: str = typer.Argument(..., help="Run address."),
          peer: str = typer.Argument(..., help="Peer id to admit (a peer prints it at start, and in its refusal)."),
          key: Path = _KEY, timeout: float = _TIMEOUT) -> None:
    """Admit PEER to a run whose `[admission] policy` is "allowlist" (or "invite"): sign its ticket with the run key and store
    it in the DHT; PEER may then join. `serve` renews it while it runs. Prints {"admitted", "expires"} as JSON."""
    from swarm.trust.tickets import issue_ticket

    if not re.fullmatch(r"[a-z2-7]{16}", peer):
        typer.echo(f"error: {peer!r} is not a peer id (16 characters a-z and 2-7, as the peer's refusal and "
                   "`swarm-coordinator peers` print it; a libp2p id 12D3Koo... is not one)", err=True)
        raise typer.Exit(2)
    coordinator = _run_key(key)
    dht, directory, spec, _ = _connect(address, timeout)
    try:
        ticket = None if spec.admission.policy == "open" else issue_ticket(directory, coordinator, peer, spec)[0]
    except (ValueError, RuntimeError) as e:  # ProtocolError (not the run key) is a ValueError
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1) from None
    finally:
        dht.shutdown()
    if ticket is None:
        typer.echo(f"error: run {directory.run_id} is open (any key may join); tickets apply to a run whose spec "
                   "sets [admission] policy = \"allowlist\" or \"invite\"", err=True)
        raise typer.Exit(1)
    typer.echo(json.dumps({"admitted": peer, "expires": ticket.expires}))


_UNITS_S = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def _duration_s(text: str) -> float:
    """Seconds of a duration such as ``7d``, ``12h``, ``30m``, ``90s`` or ``3600``."""
    found = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*", text)
    if found is None or float(found[1]) <= 0:
        raise typer.BadParameter(f"{text!r} is not a duration (a number with s, m, h or d: 7d, 12h, 30m)")
    return float(found[1]) * _UNITS_S[found[2] or "s"]


@app.command()
def invite(address: str = typer.Argument(..., help="Run address."),
           uses: int = typer.Option(1, min=1, max=100_000, help="Peers the code admits at most."),
           expires: str = typer.Option("7d", help="How long the code can be redeemed: 7d, 12h, 30m, 90s."),
           key: Path = _KEY, timeout: float = _TIMEOUT) -> None:
    """Draw an invite code for a run whose `[admission] policy` is "invite": a peer started with `swarm-peer join
    <address> --invite CODE` gets its own ticket with it (redeemed by `serve`, which must be up then), up to USES
    peers until it expires; the DHT holds only the code's hash. Prints {"code", "uses", "expires"} as JSON: keep
    the code secret, as a password."""
    from swarm.trust.invites import issue_invite

    ttl_s, coordinator = _duration_s(expires), _run_key(key)
    dht, directory, spec, _ = _connect(address, timeout)
    try:
        if spec.admission.policy != "invite":
            typer.echo(f"error: run {directory.run_id} admits by {spec.admission.policy!r}; invite codes apply to a "
                       "run whose spec sets [admission] policy = \"invite\"", err=True)
            raise typer.Exit(1)
        code, found = issue_invite(directory, coordinator, spec, uses, ttl_s)
    except (ValueError, RuntimeError) as e:  # ProtocolError (not the run key) is a ValueError
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1) from None
    finally:
        dht.shutdown()
    typer.echo(json.dumps({"code": code, "uses": found.uses, "expires": found.expires}))


@app.command()
def delegate(address: str = typer.Argument(..., help="Run address."),
             peer: str = typer.Argument(..., help="Peer id of an admitted peer you run (online now), or a libp2p id."),
             expires: str = typer.Option("7d", help="How long PEER may issue tickets: 7d, 12h, 30m. Keep it short: a "
                                         "delegation cannot be withdrawn before it ends (`revoke` bans the peer)."),
             key: Path = _KEY, timeout: float = _TIMEOUT) -> None:
    """Let PEER issue the run's tickets while the coordinator is down: it redeems invite codes and renews tickets
    until the delegation expires (a ticketed run: its spec's admission policy "allowlist" or "invite"). Prints
    {"delegate", "p2p_id", "expires"} as JSON."""
    from swarm.trust.delegates import delegate as issue_delegation

    ttl_s, coordinator = _duration_s(expires), _run_key(key)
    dht, directory, spec, _ = _connect(address, timeout)
    try:
        p2p_id = peer if peer.startswith("12D3") else _p2p_id_of(directory, spec, peer)
        if spec.admission.policy == "open" or not p2p_id:
            why = ("is open: tickets apply to a run whose spec sets [admission] policy = \"allowlist\" or \"invite\""
                   if spec.admission.policy == "open" else f"lists no online peer {peer}: start it first (admitted), "
                   "then delegate to it, or give its libp2p id")
            typer.echo(f"error: run {directory.run_id} {why}", err=True)
            raise typer.Exit(1)
        found, _ = issue_delegation(directory, coordinator, spec, p2p_id, ttl_s)
    except (ValueError, RuntimeError) as e:  # ProtocolError (not the run key, not a libp2p id) is a ValueError
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1) from None
    finally:
        dht.shutdown()
    typer.echo(json.dumps({"delegate": found.delegate, "p2p_id": found.delegate_p2p_id, "expires": found.expires}))


@app.command()
def revoke(address: str = typer.Argument(..., help="Run address."),
           peer: str = typer.Argument(..., help="Peer id whose admission ends."),
           key: Path = _KEY, timeout: float = _TIMEOUT) -> None:
    """End PEER's admission at once: a ban (every peer refuses it, it stops with exit code 4), and its ticket is no
    longer renewed. `unban` lifts the ban; `admit` issues a new ticket. Prints the ban list as JSON."""
    _ban_list(address, key, timeout, peer, lift=False, reason="admission revoked by the run's operator")


@app.command()
def monitor(address: str = typer.Argument(..., help="Run address."),
            metrics_port: int = typer.Option(9100, min=1, max=65535, help="Port of /metrics."),
            host: str = typer.Option("0.0.0.0", help="Address /metrics listens on."),
            every: float = typer.Option(10.0, min=1, help="Seconds between DHT reads."),
            timeout: float = _TIMEOUT) -> None:
    """Observe a run without taking part (a client-mode DHT node: stores nothing, accepts no connections) and
    serve the whole run's Prometheus metrics (swarm_run_*, swarm_stage_*, swarm_peer_*) until Ctrl-C."""
    from coordinator.monitor import RunMetrics, watch
    from coordinator.status import snapshot

    dht, directory, spec, _ = _connect(address, timeout)
    try:
        metrics = RunMetrics(directory.run_id)
        try:
            metrics.serve(metrics_port, host)
        except OSError as e:
            typer.echo(f"error: cannot serve metrics on port {metrics_port} ({e.strerror}); pick another "
                       "--metrics-port", err=True)
            raise typer.Exit(1) from None
        typer.echo(f"serving metrics of run {directory.run_id} on http://{host}:{metrics_port}/metrics", err=True)
        watch(lambda: snapshot(directory, spec), metrics.update, every)
    finally:
        dht.shutdown()


def _connect(address: str, timeout: float, identity: Optional[Identity] = None):
    """``connect_run`` for a CLI command: exit 2 on a bad address, 1 if the run cannot be reached or found."""
    from swarm.logs import configure_logging
    from swarm.net.dht import RunAddressError, RunUnreachable, connect_run

    from swarm.trust.recognition import follow_recognition

    configure_logging("WARNING")
    try:
        found = connect_run(address, PeerSettings(host="127.0.0.1"), timeout=timeout, identity=identity)
    except (RunAddressError, RunUnreachable, SpecError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2 if isinstance(e, RunAddressError) else 1) from None
    follow_recognition(found[1])  # checkpoints listed and exported: those the run's servers would restore
    return found


def _admit_reader(directory, spec: RunSpec, run_key: Optional[Identity], reader: Optional[Identity]) -> None:
    """In a ticketed run, a ticket for ``reader`` signed with ``run_key`` (holders' gates see it within
    READ_EVERY_S, waited here); nothing in an open run.

    :raises LookupError: a ticketed run and no ``run_key`` (``--key``)."""
    import time

    from swarm.trust.tickets import READ_EVERY_S, issue_ticket

    if spec.admission.policy == "open":
        return
    if run_key is None or reader is None:
        raise LookupError(f"run {directory.run_id} admits only ticketed peers: its holders serve no fragments to this "
                          "command; give the run key (--key) to admit it")
    issue_ticket(directory, run_key, reader.peer_id, spec)
    time.sleep(READ_EVERY_S + 1)  # (a holder reads the run's tickets at most that often)


@app.command()
def checkpoints(address: str = typer.Argument(..., help="Run address."),
                as_json: bool = typer.Option(False, "--json", help="Print one JSON object on stdout."),
                timeout: float = typer.Option(30.0, help="Seconds to find the run.")) -> None:
    """List the run's checkpoints: epoch, stages complete, fragments and replicas alive, age; and the holders.
    Exit code 1 if no epoch is complete (restorable for every stage)."""
    from coordinator.checkpoints import listing, render

    dht, directory, spec, _ = _connect(address, timeout)
    try:
        snap = listing(directory, spec)
    finally:
        dht.shutdown()
    if as_json:
        typer.echo(json.dumps(snap))
    else:
        render(snap)
    raise typer.Exit(0 if snap["newest_complete"] is not None else 1)


@app.command()
def export(address: str = typer.Argument(..., help="Run address."),
           out_dir: Path = typer.Argument(..., help="Directory to write (model.safetensors, config.json, "
                                          "tokenizer.json, hf/ for Hugging Face transformers)."),
           epoch: Optional[int] = typer.Option(None, help="Export this complete epoch (default: the newest)."),
           prompt: str = typer.Option("ROMEO:", help="Text to continue with the exported model."),
           tokens: int = typer.Option(40, min=0, help="Tokens to generate after the prompt."),
           as_json: bool = typer.Option(False, "--json", help="Print one JSON object on stdout."),
           key: Optional[Path] = typer.Option(None, help="The run key, for a run that admits only ticketed peers: "
                                              "it admits this command (a ticket for a fresh key) to read fragments."),
           timeout: float = typer.Option(30.0, help="Seconds to find the run.")) -> None:
    """Assemble the newest complete checkpoint into one model directory, reload it with plain PyTorch and
    generate text from it. The mapping to Hugging Face GPT-2 is documented in docs/checkpoints.md."""
    from coordinator.checkpoints import export_and_sample
    from swarm.checkpoint import FragmentError
    from swarm.data import prepare_dataset

    run_key, reader = (_run_key(key), Identity.generate()) if key is not None else (None, None)
    dht, directory, spec, _ = _connect(address, timeout, reader)
    try:
        _admit_reader(directory, spec, run_key, reader)
        tokenizer = prepare_dataset(spec, PeerSettings().cache_dir).tokenizer_json
        result = export_and_sample(directory, spec, out_dir, tokenizer, prompt, tokens, epoch,
                                   progress=None if as_json else lambda line: typer.echo(line, err=True))
    except (LookupError, FragmentError, ValueError, RuntimeError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1) from None
    finally:
        dht.shutdown()
    if as_json:
        typer.echo(json.dumps(result))
    else:
        typer.echo(f"exported epoch {result['epoch']} of {result['run_id']} to {result['dir']}"
                   f"{' (with hf/ for transformers)' if result['hf'] else ''}\n{prompt}{result['sample']}")


@app.command()
def demo(spec_path: Path = typer.Option(DEFAULT_SPEC, "--spec", help="Run spec (default: runs/demo.toml)."),
         seconds: float = typer.Option(420.0, help="Seconds of training after the swarm is up."),
         servers_per_stage: int = typer.Option(2, min=1, help="Servers started per stage."),
         trainers: int = typer.Option(2, min=1, help="Trainers started."),
         as_json: bool = typer.Option(False, "--json", help="End with exactly one JSON line on stdout."),
         keep: bool = typer.Option(False, help="Keep the work folder (logs, keys)."),
         precision: str = typer.Option("auto", help="auto: the spec's training.precision if it names one, else "
                                       "bf16 where this machine's bf16 matmuls run 1.5x fp32's (measured, ~1 s), "
                                       "else fp32; or force fp32 or bf16."),
         log_level: str = typer.Option("INFO")) -> None:
    """Train on the default corpus with a local swarm (separate processes on loopback), then print a summary.

    Summary keys: initial_loss, final_loss (trainers' loss, nats/token), val_loss (the whole held-out split, through
    the swarm), val_samples (how many samples val_loss scored), tokens, epochs (fewest of any stage), servers, trainers, stages, seconds, tokens_per_s, precision.
    """
    from coordinator.demo import run_demo
    from swarm.host import keep_freed_memory, share_tensors_by_descriptor
    from swarm.logs import configure_logging

    configure_logging(log_level)
    keep_freed_memory()
    share_tensors_by_descriptor()
    _load_spec(spec_path)  # exit 2 with the field and the fix before starting anything
    if precision not in ("auto", "fp32", "bf16"):
        typer.echo(f"--precision must be auto, fp32 or bf16, not {precision!r}", err=True)
        raise typer.Exit(2)
    summary = run_demo(spec_path, seconds=seconds, servers_per_stage=servers_per_stage, trainers=trainers,
                       cache_dir=PeerSettings().cache_dir, keep=keep, precision=precision)
    if as_json:
        sys.stdout.write(json.dumps(summary) + "\n")
    else:
        from rich.console import Console
        from rich.table import Table

        table = Table("metric", "value", title="swarm demo summary")
        for k, v in summary.items():
            table.add_row(k, str(v))
        Console().print(table)


def main() -> None:
    app()
