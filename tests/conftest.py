"""Shared fixtures: a data cache reused across tests and runs, and a tiny run spec that trains in seconds.

Tests that need another spec derive it from :data:`TINY` with :meth:`~swarm.config.RunSpec.updated`, which
validates the change (a misspelt field fails loudly instead of silently doing nothing)."""

from __future__ import annotations

import os
from pathlib import Path

# tests never reach a model hub: Hugging Face sources must fail at once, not wait on the network
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest

from swarm.config import RunSpec

ROOT = Path(__file__).resolve().parents[1]

TINY = RunSpec.from_toml(ROOT / "runs" / "tiny.toml")
"""The base spec of the tests (``runs/tiny.toml``)."""


@pytest.fixture(scope="session")
def cache_dir() -> Path:
    """Corpus, tokenizer and token cache shared by all tests (and kept between runs)."""
    path = Path(os.environ.get("SWARM_TEST_CACHE", ROOT / ".test-cache"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def write_spec(spec: RunSpec, path: Path) -> Path:
    """Write ``spec`` as a TOML file at ``path``; returns ``path``."""
    path.write_text(spec.to_toml())
    return path


@pytest.fixture
def tiny_spec_path(tmp_path: Path) -> Path:
    return write_spec(TINY, tmp_path / "tiny.toml")


@pytest.fixture
def tiny_spec(tiny_spec_path: Path) -> RunSpec:
    return RunSpec.from_toml(tiny_spec_path)


@pytest.fixture
def exact_spec_path(tmp_path: Path) -> Path:
    """The tiny spec with fp32 activations between stages: the swarm's math equals the reference's."""
    return write_spec(TINY.updated(training={"activation_compression": "none"}), tmp_path / "exact.toml")


@pytest.fixture(scope="session")
def tiny_dataset(cache_dir: Path, tmp_path_factory):
    from swarm.data import prepare_dataset

    return prepare_dataset(TINY, cache_dir)


@pytest.fixture
def dhts():
    """Two hivemind DHT nodes on loopback in this process (real p2pd daemons): ``(a, b)``, b bootstrapped from a."""
    from hivemind import DHT

    kw = dict(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], use_relay=False, use_auto_relay=False)
    a = DHT(**kw)
    b = DHT(initial_peers=[str(m) for m in a.get_visible_maddrs()], **kw)
    yield a, b
    b.shutdown()
    a.shutdown()
