"""Several peers on one machine (issue 12): each keeps its key, fragments and heartbeat to itself. A second peer
started with the same settings as a running one is refused, naming the setting to change; one given its own
SWARM_STATE_DIR gets its own key and folders by default."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from coordinator.launch import free_port
from swarm.config import PeerSettings
from swarm.identity import Identity

pytestmark = pytest.mark.timeout(120)


def test_a_state_dir_holds_the_peers_key_and_fragments_by_default(tmp_path):
    shared = PeerSettings(cache_dir=tmp_path / "cache")
    assert shared.identity_path() == tmp_path / "cache" / "identity.key"
    assert shared.fragment_path() == tmp_path / "cache" / "fragments"
    own = PeerSettings(cache_dir=tmp_path / "cache", state_dir=tmp_path / "peer2")
    assert (own.identity_path(), own.fragment_path(), own.state_path()) == (
        tmp_path / "peer2" / "identity.key", tmp_path / "peer2" / "fragments", tmp_path / "peer2")
    pinned = PeerSettings(cache_dir=tmp_path / "cache", state_dir=tmp_path / "peer2",
                          identity_file=tmp_path / "k.key", fragment_dir=tmp_path / "f")
    assert (pinned.identity_path(), pinned.fragment_path()) == (tmp_path / "k.key", tmp_path / "f")


def _join(tmp_path: Path, name: str, address: str, **env: str) -> tuple[subprocess.Popen, Path]:
    """``swarm-peer join <address> --role trainer`` as a user runs it, with the shared cache and ``env``."""
    log = tmp_path / f"{name}.log"
    settings = dict(SWARM_CACHE_DIR=str(tmp_path / "cache"), SWARM_HOST="127.0.0.1", SWARM_JOIN_TIMEOUT_S="60",
                    TMPDIR=str(tmp_path / "tmp"), **env)
    with open(log, "wb") as fh:
        proc = subprocess.Popen([sys.executable, "-m", "peer", "join", address, "--role", "trainer"], stdout=fh,
                                stderr=subprocess.STDOUT, env=os.environ | settings, start_new_session=True)
    return proc, log


def _claimed(key_file: Path, timeout: float = 60.0) -> str:
    """Wait until a peer process runs as the key in ``key_file`` (its claim, an abstract Unix socket, is listed
    in /proc/net/unix); returns the peer id."""
    deadline = time.monotonic() + timeout
    while True:
        if key_file.exists():
            peer_id = Identity.load_or_create(key_file).peer_id
            if f"@swarm-peer-{peer_id}" in Path("/proc/net/unix").read_text():
                return peer_id
        assert time.monotonic() < deadline, f"no process claimed the key in {key_file}"
        time.sleep(0.1)


def test_a_second_peer_on_the_same_cache_is_refused_and_one_with_its_own_state_dir_runs(tmp_path):
    """The peers try a run address nobody answers at (they claim what is theirs before joining): the second on
    the same cache exits 6 naming SWARM_STATE_DIR; the third, with its own, runs as its own key."""
    (tmp_path / "tmp").mkdir()
    address = f"tiny-aaaaaaaaaaaaaaaa@/ip4/127.0.0.1/tcp/{free_port()}/p2p/{Identity.generate().p2p_id}"
    running: list[subprocess.Popen] = []
    try:
        first, _ = _join(tmp_path, "first", address)
        running.append(first)
        theirs = _claimed(tmp_path / "cache" / "identity.key")
        second, second_log = _join(tmp_path, "second", address)
        assert second.wait(timeout=60) == 6, second_log.read_text()
        assert "already runs as peer" in second_log.read_text() and "SWARM_STATE_DIR" in second_log.read_text()
        third, _ = _join(tmp_path, "third", address, SWARM_STATE_DIR=str(tmp_path / "peer3"))
        running.append(third)
        assert _claimed(tmp_path / "peer3" / "identity.key") != theirs
        assert first.poll() is None and third.poll() is None
    finally:  # (their whole process groups, p2pd included: a peer still joining drains slowly, not the point here)
        for proc in running:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
