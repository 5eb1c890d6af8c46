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
from hypothesis import settings

from swarm.config import RunSpec

# the fuzz suites: derandomized in CI (the same examples every run, no flaky finds), a longer random search
# with HYPOTHESIS_PROFILE=explore; no example database is written into the checkout
settings.register_profile("ci", derandomize=True, database=None, deadline=None, max_examples=150)
settings.register_profile("explore", database=None, deadline=None, max_examples=5000)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

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


LOOPBACK_DHT = dict(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], use_relay=False, use_auto_relay=False)
"""hivemind.DHT arguments of a node on loopback in a test."""


def keyed_dhts(n: int, **kw):
    """``n`` DHT nodes on loopback (real p2pd daemons), each speaking as a fresh identity, the others
    bootstrapped from the first (or from ``initial_peers`` in ``kw``): a list of ``(identity, dht)``. The caller
    shuts them down."""
    from swarm.net.dht import spawn_dht
    from swarm.identity import Identity

    nodes = []
    try:
        for _ in range(n):
            ident = Identity.generate()
            peers = [str(m) for m in nodes[0][1].get_visible_maddrs()] if nodes else []
            nodes.append((ident, spawn_dht(ident, **(LOOPBACK_DHT | {"initial_peers": peers} | kw))))
    except BaseException:
        for _, dht in nodes:
            dht.shutdown()
        raise
    return nodes


def endorsed(run_id: str, writer, *, stage: int, epoch: int, state_sha256: str = "c" * 64, endorser=None) -> dict:
    """The ``state_sha256`` and ``endorsements`` fields of a test manifest by ``writer`` (an Identity): one
    witness endorsement by ``endorser`` (a fresh identity if None)."""
    from hivemind.utils import get_dht_time

    from swarm.identity import Identity
    from swarm.protocol import Endorsement, seal

    endorser = endorser or Identity.generate()
    sealed = seal(Endorsement(run_id=run_id, peer_id=endorser.peer_id, time=get_dht_time(), stage=stage, epoch=epoch,
                              state_sha256=state_sha256, writer=writer.peer_id, basis="witness"), endorser)
    return dict(state_sha256=state_sha256, endorsements=[sealed])


@pytest.fixture
def dhts():
    """Two hivemind DHT nodes on loopback in this process (real p2pd daemons): ``(a, b)``, b bootstrapped from a."""
    nodes = keyed_dhts(2)
    yield tuple(dht for _, dht in nodes)
    for _, dht in reversed(nodes):
        dht.shutdown()
