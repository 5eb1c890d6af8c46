"""Checkpoints in real multi-process swarms: resume after every peer died, and loss-spike rollback."""

import signal

import pytest
from hivemind.utils import get_dht_time

from swarm.identity import Identity
from swarm.protocol import RollbackOrder, ServerState, rollback_key
from tests.conftest import TINY
from tests.scenario import Scenario, make_swarm

pytestmark = [pytest.mark.scenario, pytest.mark.timeout(600)]

CKPT = TINY.updated(name="ckpt", checkpoint={"interval_epochs": 2, "fragments_needed": 2, "fragments_total": 3,
                                             "restore_timeout_s": 120})


def _newest(sc, stage):
    found = sc.directory.manifests(stage)
    return found[0][0] if found else None


def test_every_peer_dies_and_the_run_resumes_from_fragments(tmp_path, cache_dir, tiny_dataset):
    with make_swarm(CKPT, tmp_path, cache_dir) as sw:
        with Scenario(sw) as sc:
            sc.servers(per_stage=1).trainers(1)
            sc.wait(lambda: all((m := _newest(sc, k)) is not None and m.epoch >= 6 and m.data_position.get(0)
                                for k in range(2)), 240, "three checkpoints of every stage, with a data position")
            trainer = next(p for p in sw.peers if p.role == "trainer")
            sw.stop(trainer)  # no more epochs: the newest checkpoints stay the newest (once commits in flight land)
            sc.settle(lambda: [_newest(sc, k) for k in range(2)], sc.directory.ttl / 3, 120, "the newest checkpoints")
            committed = {k: _newest(sc, k) for k in range(2)}
            for peer in [p for p in sw.peers if p.alive()] + [sw.coordinator]:
                sw.kill(peer, signal.SIGKILL)
        # a fresh DHT: nothing survives but the fragment files on the peers' disks
        with Scenario(sw) as sc:
            for name, stage in (("server1", 0), ("server2", 1)):
                sc.stage_of[sw.start_peer("server", "--stage", str(stage), name=name).name] = stage

            def restored(k):
                return [s for s in sc.directory.servers(k) if s.state == ServerState.ONLINE and s.restored]

            sc.wait(lambda: all(restored(k) for k in range(2)), 240, "both stages restored from fragments")
            for k in range(2):
                report = restored(k)[0].restored
                assert report.shard_sha256 == committed[k].shard_sha256 and report.epoch == committed[k].epoch
                assert report.bit_exact, f"stage {k} state after loading does not hash to its checkpoint"
            sc.trainers(1)
            sc.wait(lambda: all((m := _newest(sc, k)) is not None and m.epoch > committed[k].epoch for k in range(2)),
                    240, "a new checkpoint of every stage")
            for k in range(2):
                newest = _newest(sc, k)
                chain = {m.epoch: m for m, _ in sc.directory.manifests(k)}
                nxt = chain[min(e for e in chain if e > committed[k].epoch)]
                assert (nxt.parent, nxt.parent_epoch) == (committed[k].shard_sha256, committed[k].epoch), \
                    f"stage {k}: the hash chain skips the committed epoch {committed[k].epoch}"
                assert newest.data_position, "trainers' data positions are recorded"
            trainer = next(p for p in sw.peers if p.role == "trainer" and p.alive())
            position = max(committed[k].data_position[0] for k in range(2))
            assert f"resuming at sample {position}," in trainer.log.read_text(), \
                "the trainer did not resume its data share where the newest checkpoint says"
            _check_cli(sw.address, tmp_path / "export", cache_dir)


def _check_cli(address, out_dir, cache_dir):
    """`checkpoints --json` lists a complete epoch; `export` writes a model that generates text."""
    import json
    import os
    import subprocess
    import sys

    env = dict(os.environ, SWARM_CACHE_DIR=str(cache_dir))
    run = [sys.executable, "-m", "coordinator"]
    done = subprocess.run(run + ["checkpoints", address, "--json"], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    listing = json.loads(done.stdout)
    newest = listing["newest_complete"]
    row = next(r for r in listing["checkpoints"] if r["epoch"] == newest)
    assert row["stages_complete"] == 2 and row["fragments_alive"] >= 4 and row["age_s"] >= 0
    assert {h["stage"] for h in listing["holders"]} >= {-1, 0, 1}, "servers and the coordinator hold fragments"
    done = subprocess.run(run + ["export", address, str(out_dir), "--tokens", "12", "--json"], capture_output=True,
                          text=True, timeout=180, env=env)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["epoch"] >= newest and result["hf"] and result["sample"].strip()
    assert [s["stage"] for s in result["stages"]] == [0, 1] and result["age_s"] >= 0
    assert all(s["newest_checkpoint"] >= result["epoch"] for s in result["stages"])
    assert result["why_this_epoch"].startswith(f"epoch {result['epoch']} (committed")
    assert (out_dir / "model.safetensors").exists() and (out_dir / "hf" / "model.safetensors").exists()


def test_a_loss_spike_rolls_every_stage_back_and_lowers_the_learning_rate(tmp_path, cache_dir, tiny_dataset):
    spec = CKPT.updated(rollback={"window_epochs": 4, "margin": 0.15, "warmup_epochs": 4, "lr_factor": 0.5})
    with make_swarm(spec, tmp_path, cache_dir) as sw, Scenario(sw) as sc:
        sc.servers(per_stage=1).trainers(1).until_epoch(10)
        for k in range(2):
            assert all(s.lr_scale == 1.0 for s in sc.directory.servers(k))
        # a stranger's order (a fresh key, well-formed, generation 1 and its scale) is not in force: nobody obeys
        stranger = Identity.generate()
        forged = RollbackOrder(run_id=sc.directory.run_id, peer_id=stranger.peer_id, time=get_dht_time(), epoch=0,
                               detected_epoch=1, lr_scale=0.5, generation=1, reason="forged")
        assert sc.directory.announce(rollback_key(sc.directory.run_id), forged, stranger)
        sc.holds(lambda: all(s.lr_scale == 1.0 and s.rollback_generation == 0
                             for k in range(2) for s in sc.directory.servers(k)), 8.0, "ignoring a stranger's order")
        # bad data: a trainer whose targets are all wrong makes the training loss jump
        bad = sc.byzantine_trainer("label_flip", "--share", "1", "--concurrency", "4")

        def genuine():
            return [o for o, _ in sc.directory.rollback_orders() if o.peer_id != stranger.peer_id]

        sc.wait(genuine, 180, "a rollback order from the last stage's server")
        sw.stop(bad)
        order = genuine()[0]
        assert order.generation == 1 and order.lr_scale == 0.5 and "moving average" in order.reason

        def rolled_back(k):
            return [s for s in sc.directory.servers(k) if s.state == ServerState.ONLINE and s.lr_scale == 0.5
                    and s.restored is not None and s.restored.epoch <= order.epoch]

        sc.wait(lambda: all(rolled_back(k) for k in range(2)), 120, "every stage rolled back")
        # the spike went on for epochs; the issuer answered only its first (a re-issue would name a later epoch)
        assert [o.epoch for o in genuine() if o.generation == 1] == [order.epoch]
        epochs = sc.epochs()
        sc.until_epoch(max(epochs) + 2)  # training goes on with the lower learning rate


def _settled_layout(sc, servers: int, timeout: float) -> dict[str, int]:
    """Peer id -> stage of the online servers, once every one of ``servers`` is online in exactly one stage
    and the placement held still for a re-announce period (rebalancing may move one while the swarm fills up,
    and its old record lingers)."""
    live = (ServerState.ONLINE, ServerState.JOINING, ServerState.DRAINING)

    def layout():
        seen = [(s.peer_id, k, s.state) for k in range(2) for s in sc.directory.fresh_servers(k, states=live)]
        now = {pid: k for pid, k, state in seen if state == ServerState.ONLINE}
        return now if len(seen) == len(now) == servers else None

    return sc.settle(layout, sc.directory.ttl / 3 + 2, timeout, "the servers' placement (one stage each)",
                     accept=lambda placement: placement is not None)


def test_a_server_moves_to_a_stage_that_lost_its_servers(tmp_path, cache_dir, tiny_dataset):
    spec = CKPT.updated(rebalance={"period_s": 3.0, "min_dwell_s": 5.0, "min_gain": 0.25})
    with make_swarm(spec, tmp_path, cache_dir) as sw, Scenario(sw) as sc:
        for _ in range(3):  # unpinned: each picks the bottleneck stage when it joins
            peer = sw.start_peer("server")
            sc.wait(lambda pid=peer.peer_id: any(s.peer_id == pid and s.state == ServerState.ONLINE
                                                 for k in range(2) for s in sc.directory.servers(k)), 120,
                    f"{peer.name} online")
        sc.trainers(1)
        sc.wait(lambda: all(_newest(sc, k) is not None for k in range(2)), 180, "a checkpoint of every stage")
        where = _settled_layout(sc, 3, 120)
        lone = next((k for k in range(2) if list(where.values()).count(k) == 1), None)
        assert lone is not None, f"3 servers on 2 stages, one stage served alone: {where}\n{sc.story()}"
        victim = next(p for p in sw.peers if where.get(p.peer_id) == lone)
        sc.kill(victim)

        def moved():
            return [s for s in sc.directory.fresh_servers(lone)
                    if s.peer_id != victim.peer_id and where.get(s.peer_id) == 1 - lone]

        sc.wait(lambda: moved(), 150, f"a server of stage {1 - lone} to move to stage {lone}")
        mover = moved()[0]
        assert mover.restored is not None and mover.restored.bit_exact, "the mover restores the stage's checkpoint"
        assert any(s.peer_id not in (mover.peer_id, victim.peer_id) for s in sc.directory.fresh_servers(1 - lone)), \
            f"its old stage keeps a server\n{sc.story()}"
        epochs = sc.epochs()
        sc.until_epoch(max(epochs) + 2, timeout=180)
        sc.holds(lambda: mover.peer_id in {s.peer_id for s in sc.directory.fresh_servers(lone)}, 2 * sc.directory.ttl,
                 f"the mover staying on stage {lone} (hysteresis: nobody moves back)")
