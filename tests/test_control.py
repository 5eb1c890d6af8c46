"""Commands to a running peer through its state folder, and the heartbeat states they wait for."""

import asyncio
import time

import pytest

from peer.control import ControlChannel, follow, send, wait_for
from peer.heartbeat import probe, write_heartbeat


def test_a_command_is_seen_once_and_stale_ones_are_ignored(tmp_path):
    send(tmp_path, "pause")  # written before the peer started: meant for an earlier process
    channel = ControlChannel(tmp_path)
    assert channel.poll() is None
    send(tmp_path, "pause")
    assert channel.poll() == "pause" and channel.poll() is None
    send(tmp_path, "resume")
    assert channel.poll() == "resume"
    (tmp_path / "peer-control.json").write_text('{"command": "explode", "nonce": "n"}')
    assert channel.poll() is None
    (tmp_path / "peer-control.json").write_text("not json")
    assert channel.poll() is None
    with pytest.raises(ValueError, match="unknown command"):
        send(tmp_path, "explode")


def test_follow_calls_the_handler_and_wait_for_reads_the_heartbeat(tmp_path):
    seen = []

    async def main():
        stop = asyncio.Event()
        task = asyncio.create_task(follow(tmp_path, {"pause": lambda: seen.append("pause")}, stop, period_s=0.05))
        await asyncio.sleep(0.1)
        send(tmp_path, "pause")
        for _ in range(40):
            if seen:
                break
            await asyncio.sleep(0.05)
        stop.set()
        await task

    asyncio.run(main())
    assert seen == ["pause"]
    since = time.time()
    assert wait_for(tmp_path, "pause", 0.3, since) == (False, "no heartbeat")
    write_heartbeat(tmp_path, peer_id="p", role="server", state="paused", ttl_s=30.0)
    assert wait_for(tmp_path, "pause", 1.0, since) == (True, "paused")
    assert probe(tmp_path)[0]  # paused by its operator: healthy, a container must not restart it
    write_heartbeat(tmp_path, peer_id="p", role="server", state="stopped", ttl_s=30.0)
    assert wait_for(tmp_path, "drain", 1.0, since) == (True, "stopped")
    assert not probe(tmp_path)[0]


STUCK_PEER = """
import asyncio, logging, sys, threading
from pathlib import Path
from peer.control import run_controlled

class Stuck:
    '''A peer whose run leaves a default-executor thread in a call that never returns (as a hivemind DHT call
    in flight when the DHT shut down did): Python waits for that thread before the process can exit.'''
    async def run(self):
        asyncio.get_running_loop().run_in_executor(None, threading.Event().wait)
    def stop(self): pass
    def pause(self): pass
    def resume(self): pass

logging.basicConfig(level=logging.INFO)
asyncio.run(run_controlled(Stuck(), Path(sys.argv[1]), exit_grace_s=2.0))
"""


@pytest.mark.timeout(60)
def test_a_stopped_peer_whose_thread_never_returns_still_exits(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", STUCK_PEER, str(tmp_path)], cwd=root, capture_output=True,
                          text=True, timeout=45)
    assert done.returncode == 0, done.stderr
    assert "did not exit within 2 s" in done.stderr and "threading.py" in done.stderr  # the stacks say where
