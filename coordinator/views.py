"""Terminal views of a run snapshot (:mod:`coordinator.status`): rich tables, the loss plot in the terminal
(``plotext``) and as a PNG (``matplotlib``, the ``monitor`` extra). All respect NO_COLOR and non-TTY output."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from rich.console import Console
from rich.table import Table


def duration(seconds: Optional[float]) -> str:
    """``3h12m``, ``4m05s``, ``12s``; ``-`` for None."""
    if seconds is None:
        return "-"
    s = int(round(seconds))
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


def _f(value: Optional[float], spec: str = ".4f") -> str:
    return "-" if value is None else format(value, spec)


def summary_line(snap: dict[str, Any]) -> str:
    run, peers = snap["run"], snap["run"]["peers"]
    return (f"run [bold]{run['run_id']}[/] · epoch {run['epoch']}/{run['total_epochs']} "
            f"({100 * run['progress']:.1f}%) · ETA {duration(run['eta_s'])} · loss {_f(run['train_loss'])} "
            f"(trainers {_f(run['loss'])}, val {_f(run['val_loss'])}) · {run['tokens']:,} tokens · "
            f"{run['samples_per_s']} samples/s · peers: {peers['online']} online, {peers['joining']} joining, "
            f"{peers['lagging']} lagging, {peers['paused']} paused, {peers['trainers']} trainers, "
            f"{peers['banned']} banned")


def stages_table(snap: dict[str, Any]) -> Table:
    table = Table("stage", "online", "servers", "lagging", "throughput (samples/s)", "demand", "epoch",
                  "last round: group", "round (s)", "samples dropped", "recognized", title="stages")
    for s in snap["stages"]:
        r = s["last_round"]
        dropped = f"{s['samples_dropped']} ({s['samples_dropped'] / s['samples']:.1%})" if s["samples"] else "0"
        table.add_row(str(s["stage"]), str(s["servers_online"]), str(s["servers"]), str(s["lagging"]),
                      str(s["throughput"]), str(s["demand"]), str(s["epoch"]), str(r["group_size"]),
                      _f(r["round_s"], ".2f"), dropped, _yes(s.get("recognized")))
    return table


def _yes(value: Optional[Any]) -> str:
    """A table cell of an optional flag or count: "-" for None (no recognition published, or a trainer)."""
    if value is None:
        return "-"
    return ("yes" if value else "no") if isinstance(value, bool) else str(value)


def _attention(p: dict[str, Any]) -> tuple:
    """Sort key of a peer row: banned, excluded, convicted, then lagging peers first; then servers by stage before
    trainers, each by contribution, largest first."""
    return (not p["banned"], not p["excluded"], not p.get("convicted_by"), not p["lagging"],
            p["stage"] is None, p["stage"] or 0, -p["contribution"], p["peer_id"])


def peers_table(snap: dict[str, Any], top: int = 0) -> Table:
    """The peers table; with ``top`` > 0 only that many rows, those that need attention first (:func:`_attention`),
    and a caption that counts the rest (``--json`` always lists every peer)."""
    rows = snap["peers"]
    if 0 < top < len(rows):
        rows = sorted(rows, key=_attention)[:top]
    caption = (f"{len(rows)} of {len(snap['peers'])} peers, those that need attention first: --top 0 lists all, "
               "--json prints every field" if len(rows) < len(snap["peers"]) else None)
    table = Table("peer", "name", "version", "role", "stage", "state", "link", "samples/s", "MFU", "contribution",
                  "seen",
                  "loss", "flagged/rejected", "banned/excluded", "standing", "recognized", "admitted", title="peers",
                  caption=caption)
    for p in rows:
        if p["banned"]:
            refused = f"[red]BANNED[/] ({p['ban_reason']})"
        elif p["excluded"]:
            refused = f"[red]EXCLUDED[/] by {p.get('excluded_by', 0)}"
        else:
            refused = f"excluded by {p['excluded_by']}" if p.get("excluded_by") else "no"
        if p.get("convicted_by"):
            refused += f", [red]convicted[/] by {p['convicted_by']}"
        state = p["state"] + (" [yellow](lagging)[/]" if p["lagging"] else "")
        table.add_row(p["peer_id"], p["name"] or "-", p["version"] or "-", p["role"],
                      "-" if p["stage"] is None else str(p["stage"]), state, p["reachability"],
                      str(p["samples_per_s"]), "-" if p.get("mfu") is None else f"{100 * p['mfu']:.1f}%",
                      f"{100 * p['contribution']:.0f}%",
                      "-" if p["last_seen_s"] is None else f"{p['last_seen_s']:.0f}s ago",
                      _f(p["loss"]), f"{p['flagged_parts']}/{p['rejected_parts']}", refused,
                      _f(p.get("standing"), ".2f"), _yes(p.get("recognized")), _yes(p.get("admitted")))
    return table


def loss_plot_text(history: list[list[float]], width: int = 72, height: int = 14, color: bool = False) -> str:
    """The loss curve ``[[epoch, loss], ...]`` drawn with ``plotext`` (empty string for fewer than 2 points)."""
    if len(history) < 2:
        return ""
    import plotext as plt

    plt.clear_figure()
    plt.plotsize(width, height)
    plt.plot([e for e, _ in history], [v for _, v in history], marker="braille")
    plt.title("training loss (last stage, nats/token)")
    plt.xlabel("epoch")
    plt.theme("clear")
    text = plt.build()
    return text if color else plt.uncolorize(text)


def write_loss_png(history: list[list[float]], path: Path, title: str = "") -> None:
    """Write the loss curve as a PNG.

    :raises ValueError: fewer than two points yet.
    :raises ImportError: matplotlib is missing (``pip install 'swarm-train[monitor]'``).
    """
    if len(history) < 2:
        raise ValueError("the run has fewer than two epochs with a loss yet; try again later")
    try:
        import matplotlib
    except ImportError:
        raise ImportError("--plot needs matplotlib: pip install 'swarm-train[monitor]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
    ax.plot([e for e, _ in history], [v for _, v in history], linewidth=1.5)
    ax.set_xlabel("epoch")
    ax.set_ylabel("training loss (nats/token)")
    ax.set_title(title or "training loss")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def make_console() -> Console:
    """A console for the views: the terminal's width, or 200 columns when the output is piped (so tables stay
    readable in logs and ``grep``)."""
    console = Console()
    return console if console.is_terminal else Console(width=200)


def render(snap: dict[str, Any], what: str = "status", console: Optional[Console] = None, top: int = 0) -> None:
    """Print ``status`` (summary, loss plot, stages, peers), ``stages`` or ``peers`` (``top``: :func:`peers_table`)."""
    console = console or make_console()
    if what in ("status", "stages"):
        console.print(summary_line(snap))
    if what == "status":
        plot = loss_plot_text(snap["run"]["loss_history"], color=console.is_terminal and not console.no_color)
        if plot:
            console.out(plot, highlight=False)
    if what in ("status", "stages"):
        console.print(stages_table(snap))
    if what in ("status", "peers"):
        console.print(peers_table(snap, top))
