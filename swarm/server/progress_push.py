"""This server's progress pushed to the stage's other servers (``rpc_progress``), so that no server of the stage
polls the DHT for it (:mod:`swarm.averaging.progress`, *Pushed progress*).

The stage's progress tracker hands every new count to :meth:`ProgressPusher.offer` (any thread, never blocking);
one sender per stage-mate sends the newest count, and a count that arrives while one is on its way replaces the
one waiting (a stage-mate is at most one push behind, and never gets a stale count after a newer one). A push
that fails (the stage-mate does not count this server yet, is gone or too slow) marks that stage-mate as not
reached until a later push gets through; while any stage-mate is not reached, the tracker keeps publishing to the
DHT at its full rate, which is how such a stage-mate still learns this server's progress.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Optional

from hivemind.optim.progress_tracker import LocalTrainingProgress

from swarm.net.stage_rpc import push_progress
from swarm.protocol import MAX_SAMPLES_PER_S, ProgressPush

logger = logging.getLogger(__name__)


class ProgressPusher:
    """Pushes this server's count to the stage's other servers (module docstring).

    :param p2p: this server's hivemind ``P2P``.
    :param run_id: the run; :param stage: the stage served.
    :param timeout: seconds a push may take before the stage-mate counts as not reached (a quarter of the
        matchmaking window is generous on any link that can average at all).

    Create it on the event loop that owns ``p2p``; :meth:`set_mates` and :meth:`close` run there too.
    """

    def __init__(self, p2p, run_id: str, stage: int, timeout: float):
        self.p2p, self.run_id, self.stage, self.timeout = p2p, run_id, stage, timeout
        self.loop = asyncio.get_running_loop()
        self.mates: dict[str, object] = {}  # libp2p id -> ServerInfo of every other server of the stage (replaced whole)
        self.reached: dict[str, bool] = {}  # libp2p id -> whether the last push to it was accepted
        self._latest: Optional[ProgressPush] = None
        self._senders: dict[str, asyncio.Task] = {}
        self._closed = False

    def set_mates(self, servers) -> None:
        """The stage's other servers (:class:`~swarm.protocol.ServerInfo` s) to push to from now on; a new one gets
        the newest count at once."""
        self.mates = {s.p2p_id: s for s in servers}
        self.reached = {p: ok for p, ok in self.reached.items() if p in self.mates}
        for p2p_id in set(self._senders) - set(self.mates):
            self._senders.pop(p2p_id).cancel()
        self.resend()

    def resend(self) -> None:
        """Send the newest count again to every stage-mate the last push did not reach (one that did not count
        this server yet may now: the server calls this at every read of the stage's records)."""
        if self._latest is not None:
            self._send_all(self._latest, unreached_only=True)

    def offer(self, progress: LocalTrainingProgress) -> bool:
        """Push ``progress`` (hivemind's record of this server's count) to every stage-mate (any thread; returns at
        once; with none yet, the newest count goes to each as it becomes known). Returns whether the last pushes
        reached every stage-mate (False with none)."""
        mates, reached = self.mates, self.reached
        if self._closed:
            return False
        push = ProgressPush(run_id=self.run_id, stage=self.stage, epoch=progress.epoch,
                            samples=max(0, progress.samples_accumulated), client_mode=progress.client_mode,
                            samples_per_s=min(max(progress.samples_per_second, 0.0), MAX_SAMPLES_PER_S),
                            time=max(progress.time, 0.0))
        self.loop.call_soon_threadsafe(self._send_all, push)
        return bool(mates) and all(reached.get(p2p_id, False) for p2p_id in mates)

    def _send_all(self, push: ProgressPush, unreached_only: bool = False) -> None:
        if self._closed:
            return
        self._latest = push
        for p2p_id in self.mates:
            if unreached_only and self.reached.get(p2p_id, False):
                continue
            sender = self._senders.get(p2p_id)
            if sender is None or sender.done():
                self._senders[p2p_id] = asyncio.create_task(self._send(p2p_id))

    async def _send(self, p2p_id: str) -> None:
        """Send the newest count to ``p2p_id`` until it has it (one push, or one more if a newer came meanwhile)."""
        sent = None
        while self._latest is not sent and not self._closed:
            server, sent = self.mates.get(p2p_id), self._latest
            if server is None:
                return
            try:
                await push_progress(self.p2p, server, sent, self.timeout)
                self.reached[p2p_id] = True
            except Exception as e:  # not counted there yet, gone, or slow: the DHT carries this server's count
                self.reached[p2p_id] = False
                logger.debug("stage %d: progress push to %s failed: %r", self.stage, p2p_id, e)
                return

    def close(self) -> None:
        """Stop pushing (the server leaves the stage)."""
        self._closed = True
        for sender in self._senders.values():
            sender.cancel()
        self._senders.clear()


__all__ = ["ProgressPusher"]
