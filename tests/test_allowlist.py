"""A run that admits only the peers its operator admitted (``[admission] policy = "allowlist"``), used from the CLI as
a new operator would: a peer without a ticket is told how to get one and exits 7; ``swarm-coordinator admit``
admits it; the admitted peers train, and keep training across a coordinator restart (their tickets are in the
DHT and their records carry them). And a run that admits by invite (``policy = "invite"``): ``swarm-coordinator
invite`` prints a code, peers started with ``--invite CODE`` get their own tickets and train, a peer past the
code's uses is told so and exits 7, and, once ``swarm-coordinator delegate`` named a server and the coordinator
is gone, a new peer joins with a new code that server redeems."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest

from swarm.identity import Identity
from swarm.net.dht import format_run_address
from swarm.net.stage_rpc import ask_state_digest
from swarm.protocol import ServerState
from swarm.trust.tickets import fetch_ticket
from tests.conftest import TINY
from tests.scenario import Scenario, make_swarm

pytestmark = [pytest.mark.scenario, pytest.mark.timeout(600)]

SPEC = TINY.updated(name="allowlist", admission={"policy": "allowlist"})


def _coordinator_cli(sw, *args: str) -> dict:
    """``swarm-coordinator <args> --key <the run key>`` as the operator types it; its JSON answer."""
    done = subprocess.run([sys.executable, "-m", "coordinator", *args, "--key", str(sw.workdir / "keys" / "coordinator.key")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_an_allowlist_run_takes_only_admitted_peers_and_outlives_a_coordinator_restart(tmp_path, cache_dir,
                                                                                        tiny_dataset):
    with make_swarm(SPEC, tmp_path, cache_dir) as sw, Scenario(sw) as sc:
        stranger = sw.start_peer("server", "--stage", "0", name="stranger")
        sc.wait(lambda: not stranger.alive(), 180, "the server without a ticket to stop")
        assert stranger.proc.returncode == 7, sw.tail(stranger, 20)
        assert f"swarm-coordinator admit <run address> {stranger.peer_id}" in stranger.log.read_text()

        names = {"s0": ("server", "--stage", "0"), "s1": ("server", "--stage", "1"), "t0": ("trainer", "--share", "0")}
        for name in names:
            peer_id = Identity.load_or_create(sw.workdir / "keys" / f"{name}.key").peer_id
            assert _coordinator_cli(sw, "admit", sw.address, peer_id)["admitted"] == peer_id
        peers = {name: sw.start_peer(role, *args, name=name) for name, (role, *args) in names.items()}
        sc.stage_of.update(s0=0, s1=1)
        sc.until_epoch(3)
        listed = {s.peer_id for group in sc.directory.all_servers(2).values() for s in group}
        assert listed == {peers["s0"].peer_id, peers["s1"].peer_id}

        # a caller without a ticket (this test's own client) is refused by a server's RPCs before its request is read
        async def stranger_asks(server):
            p2p = await sc.dht.replicate_p2p()
            return await ask_state_digest(p2p, server, sc.directory.run_id, 0, timeout=30)

        with pytest.raises(Exception, match="no valid ticket"):
            asyncio.run(stranger_asks(next(s for s in sc.directory.servers(1) if s.peer_id == peers["s1"].peer_id)))

        # the coordinator restarts (it joins the live swarm through a server): the admitted peers go on
        record = next(s for s in sc.directory.servers(0) if s.peer_id == peers["s0"].peer_id)
        sw.kill(sw.coordinator)
        sw.start_coordinator(peers=record.maddrs)
        resumed = min(sc.epochs())
        sc.until_epoch(resumed + 3)
        assert all(p.alive() for p in peers.values()), sc.story()
        assert all(s.state == ServerState.ONLINE for group in sc.directory.all_servers(2).values() for s in group)


def test_an_invite_run_takes_the_peers_that_hold_its_code_up_to_its_uses(tmp_path, cache_dir, tiny_dataset):
    spec = TINY.updated(name="invite", admission={"policy": "invite"})
    with make_swarm(spec, tmp_path, cache_dir) as sw, Scenario(sw) as sc:
        answer = _coordinator_cli(sw, "invite", sw.address, "--uses", "3", "--expires", "1h")
        assert answer["uses"] == 3 and answer["code"].startswith("swarm-invite-")
        names = {"s0": ("server", "--stage", "0"), "s1": ("server", "--stage", "1"), "t0": ("trainer", "--share", "0")}
        peers = {name: sw.start_peer(role, *args, "--invite", answer["code"], name=name)
                 for name, (role, *args) in names.items()}
        sc.stage_of.update(s0=0, s1=1)
        sc.until_epoch(2)
        late = sw.start_peer("server", "--stage", "0", "--invite", answer["code"], name="late")
        sc.wait(lambda: not late.alive(), 180, "the peer past the code's uses to stop")
        assert late.proc.returncode == 7, sw.tail(late, 20)
        assert "used up (3 of 3 peers admitted)" in late.log.read_text()
        assert all(p.alive() for p in peers.values()), sc.story()
        listed = {s.peer_id for group in sc.directory.all_servers(2).values() for s in group}
        assert listed == {peers["s0"].peer_id, peers["s1"].peer_id}

        # the operator delegates ticket issuing to s1 and goes away: a new peer joins with a new code, redeemed by s1
        fresh = _coordinator_cli(sw, "invite", sw.address, "--uses", "1", "--expires", "1h")
        assert _coordinator_cli(sw, "delegate", sw.address, peers["s1"].peer_id, "--expires", "1h")["delegate"] == \
            peers["s1"].peer_id
        sc.wait(lambda: "delegates ticket issuing to this peer" in peers["s1"].log.read_text(), 120,
                "s1 to take up its delegation")
        record = next(s for s in sc.directory.servers(0) if s.peer_id == peers["s0"].peer_id)
        sw.kill(sw.coordinator)
        sw.address = format_run_address(sc.directory.run_id, record.maddrs)  # (an address listing a live server)
        after = sw.start_peer("server", "--stage", "0", "--invite", fresh["code"], name="after")
        sc.wait(lambda: any(s.peer_id == after.peer_id and s.state == ServerState.ONLINE
                            for s in sc.directory.servers(0)), 300, "the peer the delegate admitted to serve")
        assert fetch_ticket(sc.directory, after.peer_id)[0].peer_id == peers["s1"].peer_id
        assert all(p.alive() for p in peers.values()), sc.story()
