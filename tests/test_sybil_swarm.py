"""A real multi-process swarm against an outsider with a fresh key and the DHT only (issue 29's finding): it
announces itself as a server of the stage, with a progress entry one epoch ahead of the stage and 10**9 samples.
That ended every epoch at once (88 micro-batches per 25 s fell to 4, epochs after ~4 samples). Servers that
verified each other's averaging work now count its entry as unverified (swarm.averaging.progress, Standing): not
pulled on, its samples within half the target, so every epoch still holds at least half the target of real
samples."""

from __future__ import annotations

import threading
import time

import pytest
from hivemind.optim.progress_tracker import ProgressTracker
from hivemind.utils import get_dht_time
from hivemind.utils.crypto import RSAPrivateKey

from swarm.identity import Identity
from swarm.net.dht import parse_run_address, spawn_dht
from swarm.net.directory import RunDirectory
from swarm.protocol import ServerInfo, ServerState
from tests.conftest import LOOPBACK_DHT, TINY
from tests.scenario import Scenario, make_swarm

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

ONE_STAGE = TINY.updated(model={"stage_layers": [2]})


class PullingSybil:
    """A fresh key on its own DHT node that announces a stage-0 server record naming its own progress entry, kept at
    the stage's highest announced epoch + 1 with 10**9 samples, re-announced every second until stopped."""

    def __init__(self, sc: Scenario):
        self.identity = Identity.generate()
        self.dht = spawn_dht(self.identity, **(LOOPBACK_DHT | {"initial_peers": parse_run_address(sc.swarm.address)[1]}))
        self.directory = RunDirectory(self.dht, sc.directory.run_id, ttl=sc.spec.timeouts.record_ttl_s)
        self.tracker = ProgressTracker(dht=self.dht, prefix=f"{sc.directory.run_id}-stage0", target_batch_size=10**6,
                                       private_key=RSAPrivateKey(), min_refresh_period=0.2, max_refresh_period=1.0,
                                       start=True)
        self.sc, self.stopped, self.pulled_to = sc, threading.Event(), 0
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stopped.is_set():
            honest = [s for s in self.sc.directory.servers(0) if s.peer_id != self.identity.peer_id]
            epoch = max((s.epoch for s in honest), default=0)
            self.pulled_to = epoch + 1
            self.tracker.report_local_progress(epoch + 1, 10**9)
            self.directory.announce_server(ServerInfo(
                run_id=self.directory.run_id, peer_id=self.identity.peer_id, time=get_dht_time(), stage=0,
                state=ServerState.ONLINE, throughput=50.0, p2p_id=self.identity.p2p_id, epoch=epoch,
                progress_key=self.tracker._local_public_key.hex()), self.identity)
            self.stopped.wait(1.0)

    def close(self) -> None:
        self.stopped.set()
        self.thread.join(timeout=30)
        self.tracker.shutdown()
        self.dht.shutdown()


@pytest.mark.scenario  # ~3 min
def test_one_fresh_key_at_the_next_epoch_no_longer_ends_a_verified_stages_epochs(tmp_path, cache_dir, tiny_dataset):
    target = ONE_STAGE.training.target_batch_size
    with make_swarm(ONE_STAGE, tmp_path, cache_dir) as sw, Scenario(sw) as sc:
        sc.servers(per_stage=2).trainers(1, "--concurrency", "2")
        ids = {s.peer_id for s in sc.directory.servers(0)}
        honest = lambda: [s for s in sc.directory.servers(0) if s.peer_id in ids]  # noqa: E731

        def progress() -> tuple[int, int]:  # (the stage's epoch, samples its servers processed), from one read
            servers = honest()
            return min(s.epoch for s in servers), sum(s.samples for s in servers)

        sc.wait(lambda: len(honest()) == 2 and all(len(s.vouches) == 1 for s in honest()), 240,
                "the two servers to verify each other's averaging work")
        sybil = PullingSybil(sc)
        try:
            sc.wait(lambda: any(s.peer_id == sybil.identity.peer_id for s in sc.directory.servers(0)), 60,
                    "the Sybil's record to be read")
            sc.wait(lambda: progress()[0] + 1 >= sybil.pulled_to, 30, "the Sybil to name the stage's next epoch")
            start = time.monotonic()
            (epoch0, samples0) = progress()
            sc.wait(lambda: progress()[0] >= epoch0 + 8 and time.monotonic() - start > 40, 300,
                    "eight more epochs and 40 s")
            epoch1, samples1 = progress()
        finally:
            sybil.close()
        # with the Sybil's pull obeyed, an epoch ended after a micro-batch or two (4-8 samples); now each holds at
        # least half the target (a little less: samples in flight when an epoch ends, records read a few s apart)
        per_epoch = (samples1 - samples0) / (epoch1 - epoch0)
        assert per_epoch >= 0.4 * target, f"{samples1 - samples0} samples in {epoch1 - epoch0} epochs (target {target})"
        assert all(s.state == ServerState.ONLINE for s in honest())
