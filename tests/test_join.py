"""Joining through a run address that does not answer (a peer started before its coordinator, or through a peer
that just left): the peer tries again until a peer of the address answers, or gives up with RunUnreachable
naming the fix. Real p2pd daemons on loopback."""

from __future__ import annotations

import logging
import threading
import time

import hivemind
import pytest
from hivemind.p2p import P2PDaemonError
from hivemind.utils import get_dht_time

from coordinator.launch import free_port
from swarm.settings import PeerSettings
from swarm.net.dht import RunUnreachable, join_dht, run_peers_unanswered

pytestmark = pytest.mark.timeout(180)


def _node(port: int, key) -> hivemind.DHT:
    """A DHT node on loopback ``port`` with the fixed identity in file ``key``."""
    return hivemind.DHT(start=True, host_maddrs=[f"/ip4/127.0.0.1/tcp/{port}"], identity_path=str(key),
                        use_relay=False, use_auto_relay=False)


def _down_address(tmp_path) -> tuple[int, list[str]]:
    """``(port, maddrs)`` of a node that was up a moment ago and is gone."""
    port, key = free_port(), tmp_path / "node.key"
    node = _node(port, key)
    maddrs = [str(m) for m in node.get_visible_maddrs()]
    node.shutdown()
    return port, maddrs


def test_a_peer_keeps_trying_until_a_peer_of_the_address_answers(tmp_path, caplog):
    port, maddrs = _down_address(tmp_path)
    joined, nodes = {}, []
    caplog.set_level(logging.INFO, logger="swarm.net.dht")
    joining = threading.Thread(target=lambda: joined.update(dht=join_dht(
        PeerSettings(host="127.0.0.1"), maddrs, client_mode=True, join_timeout_s=90)), daemon=True)
    joining.start()
    try:
        deadline = time.monotonic() + 60
        while not any("trying again" in r.getMessage() for r in caplog.records):  # the first attempt failed
            assert time.monotonic() < deadline and joining.is_alive(), "the first attempt to join did not fail"
            time.sleep(0.1)
        nodes.append(_node(port, tmp_path / "node.key"))  # the peer of the address comes back
        joining.join(timeout=90)
        assert "dht" in joined, "join_dht did not return once the address's peer answered"
        dht = joined["dht"]
        nodes.append(dht)
        assert nodes[0].store("greeting", "hello", get_dht_time() + 60)
        found = dht.get("greeting", latest=True)
        assert found is not None and found.value == "hello"
    finally:
        for node in nodes:
            node.shutdown()


def test_a_peer_gives_up_after_its_join_timeout_naming_the_fix(tmp_path):
    _, maddrs = _down_address(tmp_path)
    with pytest.raises(RunUnreachable) as err:
        join_dht(PeerSettings(host="127.0.0.1"), maddrs, client_mode=True, join_timeout_s=3)
    message = str(err.value)
    assert maddrs[0] in message and "SWARM_JOIN_TIMEOUT_S" in message and "swarm-coordinator status" in message


@pytest.mark.parametrize("last_line, retried", [
    ("2026/11/28 04:11:44 failed to connect to bootstrap peers", True),
    # a routine record of p2pd's DHT printed after the fatal line (seen in CI): names no cause, so try again
    ('{"level":"info","ts":"2026-11-28T03:59:14.236Z","logger":"dht/RtRefreshManager","caller":"rtrefresh/'
     'rt_refresh_manager.go:322","msg":"starting refreshing cpl 0 (routing table size was 0)"}', True),
    ("2026/11/28 04:11:58 failed to listen on any addresses: [listen tcp4 127.0.0.1:51045: bind: address already "
     "in use]", False),
    ('{"level":"fatal","logger":"p2pd","msg":"cannot open the key file"}', False),
    ("{not json", False),
])
def test_only_a_failure_to_reach_the_run_s_peers_is_tried_again(last_line, retried):
    assert run_peers_unanswered(P2PDaemonError(f"Daemon failed to start: {last_line}")) is retried
