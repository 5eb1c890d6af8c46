"""`swarm-peer check`: each failure names its cause and its fix; the JSON shape and exit codes."""

import json

from typer.testing import CliRunner

from peer.cli import app
from peer.preflight import as_dict, run_checks
from swarm.settings import PeerSettings


def test_a_healthy_loopback_machine_passes_the_local_checks_but_not_reachability(tmp_path):
    settings = PeerSettings(cache_dir=tmp_path, host="127.0.0.1", port=0, fragment_max_bytes=1 << 20)
    checks = {c.name: c for c in run_checks(settings)}
    for name in ("python", "torch", "compute", "cache", "identity", "fragment disk", "port"):
        assert checks[name].ok, checks[name]
    assert "with the 'torch' kernels" in checks["compute"].detail or "cuda" in checks["compute"].detail
    assert not checks["reachability"].ok and "SWARM_ANNOUNCE_HOST" in checks["reachability"].fix
    client = {c.name: c for c in run_checks(settings.model_copy(update={"client_mode": True}))}
    assert client["reachability"].ok and "trainer" in client["reachability"].detail
    private = settings.model_copy(update={"host": "0.0.0.0", "announce_host": "10.1.2.3"})
    relayed = {c.name: c for c in run_checks(private)}["reachability"]
    assert relayed.ok and "relay" in relayed.detail and "SWARM_ANNOUNCE_HOST" in relayed.fix
    direct_only = {c.name: c for c in run_checks(private.model_copy(update={"relay": "off"}))}["reachability"]
    assert not direct_only.ok and "SWARM_CLIENT_MODE" in direct_only.fix


def test_a_loopback_run_makes_announcing_loopback_a_note_not_a_failure(tmp_path):
    """A run served on 127.0.0.1 (the quickstart on one box) trains with peers announcing 127.0.0.1: the check
    says so instead of failing; a run elsewhere still fails the same peer."""
    from peer.preflight import _reachability

    settings = PeerSettings(cache_dir=tmp_path, host="127.0.0.1", port=0)
    p2p = "12D3KooWSvt7KHJTeioSkfJHPfGfiPg2v8guE723ieCNo3E78ze4"
    local = _reachability(settings, f"demo-abcdefghijklmnop@/ip4/127.0.0.1/tcp/31337/p2p/{p2p}")
    assert local.ok and "loopback" in local.detail and "--host 0.0.0.0" in local.fix
    # served on all interfaces from this machine: the address lists its LAN address and loopback
    served_here = _reachability(settings, f"demo-abcdefghijklmnop@/ip4/192.0.2.2/tcp/31337/p2p/{p2p},"
                                          f"/ip4/127.0.0.1/tcp/31337/p2p/{p2p}")
    assert served_here.ok and "served from this machine" in served_here.detail
    remote = _reachability(settings, f"demo-abcdefghijklmnop@/ip4/203.0.113.5/tcp/31337/p2p/{p2p}")
    assert not remote.ok and "SWARM_ANNOUNCE_HOST" in remote.fix
    mixed = _reachability(settings, f"demo-abcdefghijklmnop@/ip4/127.0.0.1/tcp/1/p2p/{p2p},/dns4/run.example/tcp/1")
    assert not mixed.ok


def test_failures_name_the_setting_to_change(tmp_path, monkeypatch):
    import socket

    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        port = busy.getsockname()[1]
        settings = PeerSettings(cache_dir=blocker / "cache", host="127.0.0.1", port=port,
                                fragment_dir=tmp_path / "fragments", fragment_max_bytes=1 << 60,
                                identity_file=tmp_path / "id.key")
        checks = {c.name: c for c in run_checks(settings)}
    assert not checks["cache"].ok and "SWARM_CACHE_DIR" in checks["cache"].fix
    assert not checks["fragment disk"].ok and "SWARM_FRAGMENT_MAX_BYTES" in checks["fragment disk"].fix
    assert not checks["port"].ok and "SWARM_PORT" in checks["port"].fix
    assert as_dict(list(checks.values()))["ok"] is False
    from peer.preflight import _compute
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # tests/test_kernels.py sets it for this process
    forced = _compute(settings.model_copy(update={"kernels": "triton", "device": "cpu"}))
    assert not forced.ok and "triton" in forced.detail and "SWARM_KERNELS=auto" in forced.fix


def test_check_cli_json_and_exit_codes(tmp_path, monkeypatch):
    monkeypatch.setenv("SWARM_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("SWARM_HOST", "127.0.0.1")
    monkeypatch.setenv("SWARM_CLIENT_MODE", "1")
    monkeypatch.setenv("SWARM_FRAGMENT_MAX_BYTES", str(1 << 20))
    runner = CliRunner()
    result = runner.invoke(app, ["check", "--json"])
    report = json.loads(result.output)
    assert set(report) == {"ok", "checks"} and {"name", "ok", "detail", "fix"} <= set(report["checks"][0])
    assert result.exit_code == (0 if report["ok"] else 1)
    bad = runner.invoke(app, ["check", "not-an-address", "--json"])
    assert bad.exit_code == 1 and "bad run address" in bad.output
