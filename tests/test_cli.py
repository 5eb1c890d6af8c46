"""The CLIs' options are part of the user interface: adding or renaming one must be deliberate."""

import typer.main

from coordinator.cli import app as coordinator_app
from peer.cli import app as peer_app

EXPECTED = {
    "swarm-peer join": ["address", "concurrency", "invite", "log_level", "loss_log", "max_samples", "role", "shard",
                        "share", "stage"],  # --shard: the deprecated name of --share
    "swarm-peer status": ["as_json", "probe"],
    "swarm-peer check": ["address", "as_json", "timeout"],
    "swarm-peer pause": ["timeout", "wait"],
    "swarm-peer resume": ["timeout", "wait"],
    "swarm-peer drain": ["timeout", "wait"],
    "swarm-coordinator init": ["key", "spec_path"],
    "swarm-coordinator serve": ["address_file", "host", "key", "log_level", "metrics_port", "peers", "port",
                                "spec_path"],
    "swarm-coordinator status": ["address", "as_json", "plot", "timeout", "top", "watch"],
    "swarm-coordinator stages": ["address", "as_json", "timeout", "watch"],
    "swarm-coordinator peers": ["address", "as_json", "timeout", "top", "watch"],
    "swarm-coordinator ban": ["address", "key", "peer", "reason", "timeout"],
    "swarm-coordinator unban": ["address", "key", "peer", "timeout"],
    "swarm-coordinator admit": ["address", "key", "peer", "timeout"],
    "swarm-coordinator invite": ["address", "expires", "key", "timeout", "uses"],
    "swarm-coordinator delegate": ["address", "expires", "key", "peer", "timeout"],
    "swarm-coordinator revoke": ["address", "key", "peer", "timeout"],
    "swarm-coordinator monitor": ["address", "every", "host", "metrics_port", "timeout"],
    "swarm-coordinator checkpoints": ["address", "as_json", "timeout"],
    "swarm-coordinator export": ["address", "as_json", "epoch", "key", "out_dir", "prompt", "timeout", "tokens"],
    "swarm-coordinator demo": ["as_json", "keep", "log_level", "precision", "seconds", "servers_per_stage", "spec_path",
                               "trainers"],
}


def _options(app, prog):
    group = typer.main.get_command(app)
    out = {}
    for name, cmd in group.commands.items():
        out[f"{prog} {name}"] = sorted(p.name for p in cmd.params)
    return out


def test_cli_options_are_frozen():
    found = {**_options(peer_app, "swarm-peer"), **_options(coordinator_app, "swarm-coordinator")}
    assert found == EXPECTED


def test_bad_spec_exits_2(tmp_path):
    from typer.testing import CliRunner

    bad = tmp_path / "bad.toml"
    bad.write_text('name = "x"\n[model]\nn_layers = 3\n')
    result = CliRunner().invoke(coordinator_app, ["init", str(bad)])
    assert result.exit_code == 2
    assert "model" in result.output and "make them agree" in result.output


def test_peer_status_probe_reads_the_heartbeat(tmp_path, monkeypatch):
    import json

    from typer.testing import CliRunner

    from peer.cli import app
    from peer.heartbeat import write_heartbeat

    monkeypatch.setenv("SWARM_CACHE_DIR", str(tmp_path))
    runner = CliRunner()
    result = runner.invoke(app, ["status", "--probe"])
    assert result.exit_code == 1 and "no heartbeat" in result.output
    write_heartbeat(tmp_path, peer_id="p", role="server", stage=1, state="online", epoch=7, ttl_s=30.0)
    result = runner.invoke(app, ["status", "--json"])
    assert result.exit_code == 0 and json.loads(result.output)["epoch"] == 7
    write_heartbeat(tmp_path, peer_id="p", role="server", stage=1, state="draining", epoch=7, ttl_s=30.0)
    assert runner.invoke(app, ["status", "--probe"]).exit_code == 1
    write_heartbeat(tmp_path, peer_id="p", role="server", stage=1, state="online", epoch=7, ttl_s=0.0)
    result = runner.invoke(app, ["status", "--probe"])
    assert result.exit_code == 1 and "stuck or stopped" in result.output


def test_the_demo_computes_in_bf16_only_where_the_spec_allows_and_the_machine_gains(tmp_path, monkeypatch):
    import coordinator.demo as demo
    from swarm.config import RunSpec

    pinned, free = tmp_path / "pinned.toml", tmp_path / "free.toml"
    pinned.write_text('name = "x"\n[training]\nprecision = "fp32"\n')
    free.write_text('name = "x"\n')
    peaks = {"fp32": 1e11, "bf16": 2e11}
    monkeypatch.setattr(demo, "measure_peak_flops", lambda device, dtype, size: peaks["bf16" if "bfloat" in str(dtype)
                                                                                      else "fp32"])
    assert demo.pick_precision(RunSpec.from_toml(pinned), "auto").training.precision == "fp32"  # the spec's word
    assert demo.pick_precision(RunSpec.from_toml(free), "auto").training.precision == "bf16"  # 2x: worth it
    peaks["bf16"] = 1.2e11
    assert demo.pick_precision(RunSpec.from_toml(free), "auto").training.precision == "fp32"  # 1.2x: not
    assert demo.pick_precision(RunSpec.from_toml(pinned), "bf16").training.precision == "bf16"  # forced


def test_the_old_flag_of_a_trainers_data_share_warns_and_still_works(tmp_path, monkeypatch):
    """``--shard`` is the deprecated name of ``--share``: it warns, names the new flag, and sets the share."""
    from typer.testing import CliRunner

    import peer.trainer

    monkeypatch.setenv("SWARM_CACHE_DIR", str(tmp_path))
    started = []
    monkeypatch.setattr(peer.trainer, "run_trainer", lambda address, settings, options: started.append(options))
    runner = CliRunner()
    result = runner.invoke(peer_app, ["join", "run-aaaaaaaaaaaaaaaa@/ip4/127.0.0.1/tcp/1", "--role", "trainer",
                                      "--shard", "3"])
    assert result.exit_code == 0, result.output
    assert "--shard is deprecated" in result.output and "--share" in result.output
    assert [o.share for o in started] == [3]
    result = runner.invoke(peer_app, ["join", "run-aaaaaaaaaaaaaaaa@/ip4/127.0.0.1/tcp/1", "--role", "trainer",
                                      "--share", "1", "--shard", "2"])
    assert result.exit_code == 2 and "disagree" in result.output


def test_admit_refuses_what_is_not_a_peer_id_before_reaching_the_run():
    from typer.testing import CliRunner

    result = CliRunner().invoke(coordinator_app, ["admit", "any-address", "12D3KooWAbc", "--key", "missing.key"])
    assert result.exit_code == 2 and "is not a peer id" in result.output and "libp2p id" in result.output
