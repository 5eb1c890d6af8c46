from pathlib import Path

import pytest

from swarm.config import PROTOCOL_VERSION, RunSpec, SpecError
from swarm.settings import PeerSettings

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name", ["demo.toml", "home.toml", "large.toml"])
def test_shipped_specs_load(name):
    spec = RunSpec.from_toml(ROOT / "runs" / name)
    assert sum(spec.model.stage_layers) == spec.model.n_layers
    assert spec.model.num_stages >= 2
    assert len(spec.spec_hash()) == 64


def test_hash_is_canonical_and_sensitive(tiny_spec_path):
    a = RunSpec.from_toml(tiny_spec_path)
    reordered = RunSpec.from_dict(dict(reversed(list(a.model_dump().items()))))
    assert a.spec_hash() == reordered.spec_hash()
    changed = RunSpec.from_dict({**a.model_dump(), "optim": {**a.optim.model_dump(), "lr": 1e-4}})
    assert changed.spec_hash() != a.spec_hash()


@pytest.mark.parametrize(
    "patch, field, hint",
    [
        ({"model": {"n_layers": 3, "stage_layers": [1, 1]}}, "model", "make them agree"),
        ({"model": {"d_model": 65, "n_heads": 2, "stage_layers": [1, 1], "n_layers": 2}}, "model", "divisible"),
        ({"name": "Bad Name"}, "name", "a-z"),
        ({"training": {"micro_batch_size": 8, "target_batch_size": 4}}, "training", "raise target_batch_size"),
        ({"optim": {"lr": -1}}, "optim.lr", "greater than 0"),
        ({"bogus": 1}, "bogus", "unknown field"),
        ({"protocol_version": PROTOCOL_VERSION + 1}, "protocol_version", "upgrade"),
        ({"data": {"seq_len": 4096}}, "<spec>", "max_seq_len"),
        ({"averaging": {"matchmaking_time": 5.0, "averaging_timeout": 5.0}}, "averaging", "raise averaging_timeout"),
        ({"averaging": {"compression": "chunk_topk", "aggregator": "median"}}, "averaging", "use 'centered_clip'"),
        ({"averaging": {"topk_chunk": 100}}, "averaging.topk_chunk", "multiple of 64"),
    ],
)
def test_errors_name_field_and_fix(patch, field, hint):
    raw = {"name": "t", **patch}
    with pytest.raises(SpecError) as err:
        RunSpec.from_dict(raw)
    msg = str(err.value)
    assert f"'{field}" in msg and hint in msg, msg


def test_bad_toml_file(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("name = \n")
    with pytest.raises(SpecError, match="not valid TOML"):
        RunSpec.from_toml(bad)
    with pytest.raises(SpecError, match="not found"):
        RunSpec.from_toml(tmp_path / "missing.toml")


def test_layer_ranges(tiny_spec):
    m = tiny_spec.model.model_copy(update={"n_layers": 5, "stage_layers": [2, 3]})
    assert m.layer_range(0) == (0, 2) and m.layer_range(1) == (2, 5)
    with pytest.raises(ValueError, match="out of range"):
        m.layer_range(2)


def test_peer_settings_from_env(monkeypatch, tmp_path):
    monkeypatch.setenv("SWARM_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("SWARM_PORT", "31337")
    s = PeerSettings()
    assert s.cache_dir == tmp_path and s.port == 31337
    assert s.identity_path() == tmp_path / "identity.key"


def test_the_old_name_of_num_shares_is_read_with_a_warning(tmp_path):
    """``[data] num_shards`` (a data share's old name; a checkpoint's shard is another thing) still loads, with a
    warning, into the same spec; a spec that sets both names is refused."""
    text = (ROOT / "runs" / "tiny.toml").read_text()
    assert "num_shares = 4" in text
    old = tmp_path / "old.toml"
    old.write_text(text.replace("num_shares = 4", "num_shards = 4"))
    with pytest.warns(FutureWarning, match="num_shares"):
        spec = RunSpec.from_toml(old)
    assert spec.data.num_shares == 4 and spec.spec_hash() == RunSpec.from_toml(ROOT / "runs" / "tiny.toml").spec_hash()
    both = tmp_path / "both.toml"
    both.write_text(text.replace("num_shares = 4", "num_shares = 4\nnum_shards = 2"))
    with pytest.raises(SpecError, match="num_shards, its old name"):
        RunSpec.from_toml(both)
