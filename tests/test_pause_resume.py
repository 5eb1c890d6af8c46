"""An operator pauses a stage server of a live swarm and resumes it (``swarm-peer pause|resume``, through the
peer's control file as the CLI writes it).

While paused, the server announces 0 samples/s and a 0 share and has left the stage's averaging: the stage's
other server keeps stepping without waiting for it. On resume it rejoins by loading the stage's state; it then
holds the same full state as its stage-mate, and the stage keeps committing checkpoints.
"""

import pytest

from coordinator.status import snapshot
from peer.control import send
from swarm.protocol import ServerState
from tests.conftest import TINY
from tests.scenario import Scenario, make_swarm

pytestmark = [pytest.mark.scenario, pytest.mark.timeout(600)]

SPEC = TINY.updated(name="pause", checkpoint={"interval_epochs": 2, "fragments_needed": 2, "fragments_total": 3})
STALL_EPOCHS = 4
"""Epochs the stage must step while one of its two servers is paused, and after it resumed."""
STALL_S = 2 * SPEC.averaging.averaging_timeout + 30
"""Seconds those epochs may take: a few seconds each, plus one round that timed out (a stage-mate that began its
round in the instant before the pause was announced waits ``averaging_timeout`` for it once). A stalled stage
(the fault this guards: a resumed server's stage logged nothing for two minutes) takes far longer."""


def _record(sc, stage, peer_id):
    return next((s for s in sc.directory.servers(stage) if s.peer_id == peer_id), None)


def _epoch_of(sc, stage, peer_id) -> int:
    """The epoch ``peer_id``'s record announces (one DHT read may miss a record that is there: read until found)."""
    found: list = []
    sc.wait(lambda: found.append(_record(sc, stage, peer_id)) or found[-1] is not None, 30, f"{peer_id}'s record")
    return found[-1].epoch


def _stage_epoch(sc, stage, peer_id):
    """The epoch of stage ``stage``'s online servers other than ``peer_id``."""
    return max((s.epoch for s in sc.directory.servers(stage) if s.state == ServerState.ONLINE and s.peer_id != peer_id),
               default=-1)


def _newest_checkpoint(sc, stage) -> int:
    found = sc.directory.manifests(stage)
    return found[0][0].epoch if found else -1


def test_a_paused_server_leaves_without_stalling_its_stage_and_rejoins_in_sync(tmp_path, cache_dir, tiny_dataset):
    with make_swarm(SPEC, tmp_path, cache_dir) as sw, Scenario(sw) as sc:
        sc.servers(per_stage=2).trainers(2).until_epoch(3)
        paused = sc.server(stage=1)
        mate = next(p for p in sw.peers if sc.stage_of.get(p.name) == 1 and p is not paused)
        send(sw.state_dir(paused.name), "pause")
        sc.wait(lambda: (r := _record(sc, 1, paused.peer_id)) is not None and r.state == ServerState.PAUSED
                and not r.progress_key, 60, "the paused record, without a progress key (it left the averaging)")
        # a leaving server still joins the rounds its stage-mate begins for ``withdraw_s`` (up to LEAVE_GRACE_S):
        # it may step a few epochs after announcing ``paused``; it stops when it logs that it left, and announces
        # the epoch it stopped at then
        sc.wait(lambda: "left stage 1's averaging" in paused.log.read_text(), 60,
                "the paused server to leave the stage's averaging")
        paused_epoch = _epoch_of(sc, 1, paused.peer_id)

        # the stage's other server goes on alone: no stall waiting for the paused one (records carry the epoch
        # announced last, every ``record_ttl_s / 3``: compare with the paused server's own, not a first read)
        sc.wait(lambda: _stage_epoch(sc, 1, paused.peer_id) >= paused_epoch + STALL_EPOCHS, STALL_S,
                f"stage 1 to step {STALL_EPOCHS} epochs while one of its servers is paused")
        rows: dict = {}

        def both_listed() -> bool:  # one DHT read may miss a record that is there
            rows.update({p["peer_id"]: p for p in snapshot(sc.directory, sc.spec)["peers"]})
            return paused.peer_id in rows and mate.peer_id in rows

        sc.wait(both_listed, 30, "both servers of stage 1 in the run's snapshot")
        assert rows[paused.peer_id]["state"] == "paused"
        assert rows[paused.peer_id]["samples_per_s"] == 0.0 and rows[paused.peer_id]["contribution"] == 0.0
        assert rows[mate.peer_id]["contribution"] == 1.0, "a paused server's samples still counted in the shares"
        assert _epoch_of(sc, 1, paused.peer_id) == paused_epoch, "the paused server kept stepping"

        send(sw.state_dir(paused.name), "resume")
        sc.wait(lambda: (r := _record(sc, 1, paused.peer_id)) is not None and r.state == ServerState.ONLINE
                and r.epoch > paused_epoch, 120, "the resumed server online at the stage's epoch")
        resumed_at = _stage_epoch(sc, 1, None)
        sc.wait(lambda: _stage_epoch(sc, 1, None) >= resumed_at + STALL_EPOCHS, STALL_S,
                f"stage 1 to step {STALL_EPOCHS} epochs after the resume")
        sc.stage_in_sync(1, min_epoch=resumed_at + 1)
        sc.wait(lambda: _newest_checkpoint(sc, 1) > resumed_at, 180, "a checkpoint of stage 1 after the resume")
        log = paused.log.read_text()
        assert "left stage 1's averaging" in log and "rejoining stage 1" in log, sw.tail(paused, 30)
        assert "loading state from live servers of the stage" in log.split("rejoining stage 1")[1], sw.tail(paused, 30)
        assert all(p.alive() for p in sw.peers), sc.story()
