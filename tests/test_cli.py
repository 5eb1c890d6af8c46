"""The CLIs' options are part of the user interface: adding or renaming one must be deliberate."""

import typer.main

from coordinator.cli import app as coordinator_app
from peer.cli import app as peer_app

EXPECTED = {
    "swarm-peer join": ["address", "concurrency", "log_level", "loss_log", "max_samples", "role", "shard", "stage"],
    "swarm-coordinator init": ["key", "spec_path"],
    "swarm-coordinator serve": ["address_file", "host", "key", "log_level", "peers", "port", "spec_path"],
    "swarm-coordinator status": ["address", "as_json", "timeout"],
    "swarm-coordinator checkpoints": ["address", "as_json", "timeout"],
    "swarm-coordinator export": ["address", "as_json", "epoch", "out_dir", "prompt", "timeout", "tokens"],
    "swarm-coordinator demo": ["as_json", "keep", "log_level", "seconds", "servers_per_stage", "spec_path", "trainers"],
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
