"""Pieces of the monitoring CLI that need no swarm: history thinning, the views, the run's Prometheus metrics."""

import math
import time

import pytest

from coordinator.monitor import RunMetrics, watch
from coordinator.views import duration, loss_plot_text, write_loss_png
from swarm.protocol import HISTORY_POINTS, add_history


def test_history_spans_the_whole_run_at_decreasing_resolution():
    history = []
    for epoch in range(1000):
        history = add_history(history, (epoch, float(epoch), 1.0))
        assert len(history) <= HISTORY_POINTS
    epochs = [e for e, _, _ in history]
    assert epochs == sorted(epochs) and epochs[0] == 0 and epochs[-1] == 999
    assert epochs[-HISTORY_POINTS // 4:] == list(range(1000 - HISTORY_POINTS // 4, 1000))  # the newest stay exact


def test_views():
    assert [duration(s) for s in (None, 5, 65, 7300)] == ["-", "5s", "1m05s", "2h01m"]
    assert loss_plot_text([[0, 5.0]]) == ""
    text = loss_plot_text([[e, 5 * math.exp(-e / 20)] for e in range(50)], width=60, height=10)
    assert "epoch" in text and "\x1b[" not in text


def test_loss_png(tmp_path):
    with pytest.raises(ValueError, match="fewer than two"):
        write_loss_png([[1, 2.0]], tmp_path / "x.png")
    write_loss_png([[0, 5.0], [10, 4.0], [20, 3.5]], tmp_path / "loss.png")
    assert (tmp_path / "loss.png").read_bytes()[:4] == b"\x89PNG"


def _snap(eta):
    return {
        "run": {"epoch": 7, "progress": 0.07, "eta_s": eta, "tokens": 1000, "samples_per_s": 12.5,
                "train_loss": 4.2, "val_loss": None,
                "peers": {"online": 3, "joining": 0, "lagging": 1, "paused": 0, "draining": 0, "trainers": 1,
                          "banned": 0}},
        "stages": [{"stage": 0, "servers_online": 2, "throughput": 30.0, "epoch": 7, "lagging": 1,
                    "last_round": {"group_size": 2, "round_s": 0.5}}],
        "peers": [{"peer_id": "a", "role": "server", "stage": 0, "samples_per_s": 15.0, "contribution": 0.5},
                  {"peer_id": "t", "role": "trainer", "stage": None, "samples_per_s": 12.5, "contribution": 1.0}],
        "healthy": True,
    }


def test_run_metrics_follow_the_snapshots():
    metrics = RunMetrics("run-x")
    metrics.update(_snap(eta=120.0))
    get = metrics.registry.get_sample_value
    assert get("swarm_run_epoch", {"run": "run-x"}) == 7
    assert get("swarm_run_eta_seconds", {"run": "run-x"}) == 120.0
    assert math.isnan(get("swarm_run_val_loss", {"run": "run-x"}))
    assert get("swarm_stage_servers_online", {"run": "run-x", "stage": "0"}) == 2
    assert get("swarm_run_peers", {"run": "run-x", "state": "lagging"}) == 1
    assert get("swarm_peer_contribution_ratio", {"run": "run-x", "peer": "t", "role": "trainer", "stage": "-"}) == 1.0
    snap = _snap(eta=None)
    snap["peers"] = snap["peers"][:1]  # the trainer left: its series go
    metrics.update(snap)
    assert get("swarm_peer_samples_per_second", {"run": "run-x", "peer": "t", "role": "trainer", "stage": "-"}) is None
    assert math.isnan(get("swarm_run_eta_seconds", {"run": "run-x"}))


def test_watch_shows_each_snapshot_until_stopped():
    import threading

    stop, shown = threading.Event(), []

    def show(snap):
        shown.append(snap)
        if len(shown) == 3:
            stop.set()

    last = watch(lambda: {"n": len(shown)}, show, 0.01, stop)
    assert [s["n"] for s in shown] == [0, 1, 2] and last == {"n": 2}


def test_ctrl_c_ends_a_watch_after_the_snapshot_being_taken():
    import os
    import signal

    before, shown = signal.getsignal(signal.SIGINT), []

    def take():
        if len(shown) == 1:
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C while the second snapshot is being taken
            time.sleep(0.05)  # (the handler runs here: no KeyboardInterrupt inside the snapshot)
        return {"n": len(shown)}

    last = watch(take, shown.append, 0.01)
    assert [s["n"] for s in shown] == [0, 1] and last == {"n": 1}
    assert signal.getsignal(signal.SIGINT) is before  # a later Ctrl-C interrupts as usual


def test_a_server_row_counts_the_stage_mates_that_refused_its_state():
    """``status`` shows how many servers of its stage downloaded a server's state and refused it (a donor
    whose state does not verify is reported, not only logged)."""
    from types import SimpleNamespace

    from hivemind.utils import get_dht_time

    from coordinator.status import _server_row
    from swarm.identity import Identity
    from swarm.protocol import ServerInfo, ServerState

    keys = [Identity.generate() for _ in range(3)]
    liar = keys[0]

    def info(key, refused):
        return ServerInfo(run_id="r", peer_id=key.peer_id, time=get_dht_time(), stage=0, state=ServerState.ONLINE,
                          throughput=1.0, p2p_id=key.p2p_id, donors_refused=refused)

    online = [info(liar, {}), info(keys[1], {liar.p2p_id: "digest matches no other server"}), info(keys[2], {})]
    rows = [_server_row(s, 0, online, set(), 1, 0, {}, get_dht_time(), SimpleNamespace(ttl=30.0)) for s in online]
    assert [r["refused_as_donor_by"] for r in rows] == [1, 0, 0]

    # standing: what its stage-mates' records vouch for (the verified averaging work, swarm.trust.standing)
    a, b, c, fresh = [info(Identity.generate(), {}) for _ in range(4)]
    vouching = [a.model_copy(update={"vouches": {b.p2p_id: 1.0, c.p2p_id: 1.0}}),
                b.model_copy(update={"vouches": {a.p2p_id: 0.5, c.p2p_id: 1.0}}),
                c.model_copy(update={"vouches": {a.p2p_id: 1.0, b.p2p_id: 0.75}}), fresh]
    rows = [_server_row(s, 0, vouching, set(), 1, 0, {}, get_dht_time(), SimpleNamespace(ttl=30.0)) for s in vouching]
    assert [(r["vouched_by"], r["standing"]) for r in rows] == [(2, 0.5), (2, 0.75), (2, 1.0), (0, 0.0)]
    assert _server_row(online[0], 0, online[:1], set(), 1, 0, {}, get_dht_time(), SimpleNamespace(ttl=30.0))[
        "standing"] is None


def _online(now: float, per_stage: int) -> "_Records":
    """Two stages of ``per_stage`` online servers at epoch 5 (``s<stage>-<i>``), no histories, no trainers."""
    from swarm.protocol import ServerInfo, ServerState

    servers = {k: [ServerInfo(run_id="tiny-aaaaaaaaaaaaaaaa", peer_id=f"s{k}-{i}", time=now - 1, stage=k,
                              state=ServerState.ONLINE, throughput=1.0, p2p_id=f"p{k}-{i}", epoch=5, samples=10)
                   for i in range(per_stage)] for k in range(2)}
    return _Records(servers, {k: {} for k in range(2)}, [])


class _Records:
    """A run directory's reads (the interface :func:`coordinator.status.snapshot` uses) over records in memory."""

    def __init__(self, servers: dict, histories: dict, trainers: list, bans=None):
        self.run_id, self.ttl = "tiny-aaaaaaaaaaaaaaaa", 30.0
        self._servers, self._histories, self._trainers, self._bans = servers, histories, trainers, bans

    def servers(self, stage):
        return self._servers[stage]

    def histories(self, stage):
        return self._histories[stage]

    def trainers(self):
        return self._trainers

    def bans(self):
        return self._bans, None

    def read_sealed(self, key, cls):
        return []  # no recognition published (test_status_shows_which_servers_the_run_key_recognizes patches one in)


def test_a_run_of_hundreds_of_peers_is_summarised_whole_and_its_table_shows_the_peers_that_need_attention():
    """``status --json`` lists every peer of a run of 2 x 300 servers and 100 trainers; the table shows ``--top``
    rows, the banned and lagging peers first, and says how many it left out."""
    from hivemind.utils import get_dht_time
    from rich.console import Console

    from coordinator.status import snapshot
    from coordinator.views import peers_table
    from swarm.config import RunSpec
    from swarm.protocol import BanList, ServerInfo, ServerState, TrainerInfo

    spec = RunSpec.from_toml("runs/tiny.toml")
    now, run = get_dht_time(), "tiny-aaaaaaaaaaaaaaaa"
    servers = {k: [ServerInfo(run_id=run, peer_id=f"s{k}-{i:03d}", time=now - (100 if i == 7 else 1), stage=k,
                              state=ServerState.ONLINE, throughput=1.0 + i, p2p_id=f"p{k}-{i}", epoch=5, samples=10 + i)
                   for i in range(300)] for k in range(2)}
    histories = {k: {s.peer_id: [(e, now - 10 + e, 5.0 - e / 10) for e in range(6)] for s in servers[k]}
                 for k in range(2)}
    trainers = [TrainerInfo(run_id=run, peer_id=f"t{i:03d}", time=now, samples_per_s=2.0, samples=100, tokens=3200,
                            share=i % 4, loss=4.0) for i in range(100)]
    bans = BanList(run_id=run, peer_id="coordinator", time=now, banned={"s1-150": "spam"})
    snap = snapshot(_Records(servers, histories, trainers, bans), spec)
    assert len(snap["peers"]) == 700 and [s["servers_online"] for s in snap["stages"]] == [300, 300]
    assert snap["run"]["loss_history"] == [[e, round(5.0 - e / 10, 5)] for e in range(6)]
    table = peers_table(snap, top=40)
    assert table.row_count == 40 and "40 of 700 peers" in table.caption
    console = Console(width=400, record=True)
    console.print(table)
    lines = [line for line in console.export_text().splitlines() if line.startswith(("│ s", "│ t", "| s"))]
    assert lines[0].startswith("│ s1-150") and lines[1].split()[1] in ("s0-007", "s1-007")  # banned, then lagging
    assert peers_table(snap, top=0).row_count == 700 and peers_table(snap, top=0).caption is None


def test_one_key_at_the_edge_of_the_allowed_ranges_does_not_move_a_stage_in_status():
    """Found against a live swarm: one key announcing epoch 1e8 and a history of a huge epoch rate made ``status``
    show its stage at epoch 1e8, every honest peer lagging and an ETA of 0 s. A stage's epoch and epoch rate are
    now the lower medians of its servers' (an honest majority decides)."""
    from hivemind.utils import get_dht_time

    from coordinator.status import snapshot
    from swarm.config import RunSpec
    from swarm.protocol import MAX_EPOCH, ServerInfo, ServerState

    spec = RunSpec.from_toml("runs/tiny.toml")
    now, run = get_dht_time(), "tiny-aaaaaaaaaaaaaaaa"

    def server(k, i, epoch):
        return ServerInfo(run_id=run, peer_id=f"s{k}-{i}", time=now - 1, stage=k, state=ServerState.ONLINE,
                          throughput=1.0, p2p_id=f"p{k}-{i}", epoch=epoch, samples=10)

    servers = {k: [server(k, i, 5) for i in range(3)] for k in range(2)}
    servers[0].append(server(0, 9, MAX_EPOCH))
    histories = {k: {s.peer_id: [(e, now - 10 + e, 4.0) for e in range(6)] for s in servers[k]} for k in range(2)}
    histories[0]["s0-9"] = [(0, now - 10, 4.0), (MAX_EPOCH, now - 9, 4.0)]
    snap = snapshot(_Records(servers, histories, []), spec)
    assert [s["epoch"] for s in snap["stages"]] == [5, 5]
    assert snap["run"]["epoch"] == 5 and snap["run"]["progress"] < 1.0 and snap["run"]["eta_s"] > 0
    lagging = [p["peer_id"] for p in snap["peers"] if p["lagging"]]
    assert lagging == [], lagging  # the honest servers are where their stage is


def test_status_shows_which_servers_the_run_key_recognizes(monkeypatch):
    """``status`` and ``peers`` say which servers the run key's recognition names (swarm.trust.recognition): per
    server, per stage (its online ones) and the recognition's age; ``None`` / "-" while none is published."""
    from hivemind.utils import get_dht_time
    from rich.console import Console

    import coordinator.status as status
    from coordinator.views import peers_table, stages_table
    from swarm.config import RunSpec
    from swarm.protocol import Recognition

    spec = RunSpec.from_toml("runs/tiny.toml")
    now = get_dht_time()
    records = _online(now, per_stage=3)
    without = status.snapshot(records, spec)
    assert without["run"]["recognition_age_s"] is None and [s["recognized"] for s in without["stages"]] == [None] * 2
    assert {p["recognized"] for p in without["peers"]} == {None}
    recognition = Recognition.model_construct(servers={0: ["s0-0", "s0-1", "gone"], 1: ["s1-2"]}, time=now - 3)
    monkeypatch.setattr(status, "read_recognition", lambda directory: recognition)
    snap = status.snapshot(records, spec)
    assert [s["recognized"] for s in snap["stages"]] == [2, 1]  # online servers only ("gone" has no record)
    assert {p["peer_id"] for p in snap["peers"] if p["recognized"]} == {"s0-0", "s0-1", "s1-2"}
    assert 2.0 <= snap["run"]["recognition_age_s"] <= 10.0
    console = Console(width=300, record=True)
    console.print(stages_table(snap), peers_table(snap))
    text = console.export_text()
    rows = {line.split()[1]: [c.strip() for c in line.strip(" │").split("│")] for line in text.splitlines()
            if line.startswith("│ s")}
    assert rows["s0-0"][-2:] == ["yes", "-"] and rows["s0-2"][-2:] == ["no", "-"]  # recognized, admitted (open run)


def test_where_the_run_key_recognizes_a_stages_servers_fresh_keys_records_move_none_of_its_figures(monkeypatch):
    """Found against a live swarm: five fresh keys announcing stage-0 records that list both honest servers as
    excluded got them shown as excluded, and one key's throughput of 10^6 samples/s and 2^53 samples were summed
    into its stage's figures. Where the run key's recognition names a stage's servers, ``status`` takes its epoch,
    throughput, samples and exclusions from them alone (without one, per record, as before)."""
    from hivemind.utils import get_dht_time

    import coordinator.status as status
    from swarm.config import RunSpec
    from swarm.protocol import Recognition, ServerInfo, ServerState

    spec = RunSpec.from_toml("runs/tiny.toml")
    now, run = get_dht_time(), "tiny-aaaaaaaaaaaaaaaa"

    def server(k, name, **fields):
        return ServerInfo(run_id=run, peer_id=name, time=now - 1, stage=k, state=ServerState.ONLINE,
                          p2p_id=f"p-{name}", **{"throughput": 1.0, "epoch": 5, "samples": 10, **fields})

    honest = {k: [server(k, f"s{k}-{i}") for i in range(2)] for k in range(2)}
    sybils = [server(0, f"x{i}", epoch=9, throughput=1e6, samples=2 ** 53,
                     excluded={"p-s0-0": "junk parts", "p-s0-1": "junk parts"}) for i in range(5)]
    records = _Records({0: honest[0] + sybils, 1: honest[1]}, {k: {} for k in range(2)}, [])
    by_head = status.snapshot(records, spec)  # no recognition: the records are counted one each, as before
    rows = {p["peer_id"]: p for p in by_head["peers"]}
    assert rows["s0-0"]["excluded"] and rows["s0-1"]["excluded"] and by_head["stages"][0]["epoch"] == 9
    recognition = Recognition.model_construct(servers={0: ["s0-0", "s0-1"], 1: ["s1-0", "s1-1"]}, time=now - 3)
    monkeypatch.setattr(status, "read_recognition", lambda directory: recognition)
    snap = status.snapshot(records, spec)
    rows = {p["peer_id"]: p for p in snap["peers"]}
    stage = snap["stages"][0]
    assert not rows["s0-0"]["excluded"] and not rows["s0-1"]["excluded"] and snap["run"]["peers"]["excluded"] == 0
    assert (stage["epoch"], stage["throughput"], stage["samples"]) == (5, 2.0, 20)
    assert rows["s0-0"]["contribution"] == 0.5 and rows["x0"]["contribution"] == 1.0  # (a share, at most 1)
    assert not any(rows[f"s0-{i}"]["lagging"] for i in range(2)) and snap["run"]["epoch"] == 5


def test_status_shows_each_peers_admission_in_a_ticketed_run(monkeypatch):
    """In a run that admits only ticketed peers, ``status`` says which peers hold a valid ticket and for how long
    (``admitted``, ``ticket_expires_s``), the run's policy and its delegates; in an open run ``admitted`` and
    ``delegates`` are None."""
    from hivemind.utils import get_dht_time

    import coordinator.status as status
    from swarm.config import RunSpec
    from swarm.protocol import Delegation, Ticket

    spec = RunSpec.from_toml("runs/tiny.toml")
    now = get_dht_time()
    records = _online(now, per_stage=2)
    opened = status.snapshot(records, spec)
    assert {p["admitted"] for p in opened["peers"]} == {None} and opened["run"]["delegates"] is None
    tickets = [(Ticket.model_construct(subject="s0-0", expires=now + 100), b""),
               (Ticket.model_construct(subject="s0-0", expires=now + 500), b""),
               (Ticket.model_construct(subject="s1-0", expires=now - 5), b"")]  # expired
    monkeypatch.setattr(status, "all_tickets", lambda directory: tickets)
    monkeypatch.setattr(status, "live_delegations",
                        lambda directory: {"s1-1": (Delegation.model_construct(expires=now + 3000), b"")})
    snap = status.snapshot(records, spec.updated(admission={"policy": "allowlist"}))
    rows = {p["peer_id"]: p for p in snap["peers"]}
    assert snap["run"]["admission"] == "allowlist" and 2990 <= snap["run"]["delegates"]["s1-1"] <= 3000
    assert rows["s0-0"]["admitted"] and 490 <= rows["s0-0"]["ticket_expires_s"] <= 500  # the newest ticket
    assert [rows[p]["admitted"] for p in ("s0-1", "s1-0", "s1-1")] == [False] * 3
    assert rows["s1-0"]["ticket_expires_s"] is None
