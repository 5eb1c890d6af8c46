"""Pause, resume and drain a running peer from its own machine (``swarm-peer pause|resume|drain``).

The CLI writes a command to ``peer-control.json`` in the peer's state folder (``SWARM_STATE_DIR``, default
``SWARM_CACHE_DIR``; atomically: temporary file + rename)
and watches the peer's heartbeat (:mod:`peer.heartbeat`) until the peer shows the new state. The running
peer polls that file every half second (:func:`follow`). A file works the same on a host, through
``docker exec``, and on a shared volume, needs no open port, and only whoever may write the peer's cache
folder can command it.

* **pause**: a server finishes its in-flight work, leaves its stage (announced ``paused``: not routed to,
  not averaging) and keeps holding checkpoint fragments; a trainer stops starting micro-batches.
* **resume**: a server rejoins (loading the stage's current state from its servers or a checkpoint, as at
  start); a trainer goes on from the same data position.
* **drain**: what SIGTERM does: finish the current round, hand in-flight work back, leave the DHT, exit 0.
"""

from __future__ import annotations

import asyncio
import faulthandler
import json
import logging
import multiprocessing
import os
import signal
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Callable, Optional, Protocol

from peer.heartbeat import FILENAME as HEARTBEAT
from swarm.aio import sleep_or_stop

logger = logging.getLogger(__name__)
FILENAME = "peer-control.json"
COMMANDS = ("pause", "resume", "drain")
WANTED = {"pause": ("paused",), "resume": ("online", "training"), "drain": ("stopped",)}
"""Heartbeat states that complete each command (a resuming server passes through ``joining`` while it loads the
stage's state)."""
EXIT_GRACE_S = 20.0
"""Seconds a stopped peer's process gets to exit before :func:`_exit_watchdog` ends it."""


def send(cache_dir: Path, command: str) -> str:
    """Write ``command`` for the peer using ``cache_dir``; returns its nonce.

    :raises ValueError: not one of :data:`COMMANDS`.
    :raises OSError: the cache folder is not writable.
    """
    if command not in COMMANDS:
        raise ValueError(f"unknown command {command!r}; use one of {', '.join(COMMANDS)}")
    nonce = uuid.uuid4().hex
    path = Path(cache_dir) / FILENAME
    tmp = path.with_name(f".{FILENAME}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"command": command, "nonce": nonce, "time": time.time()}))
    os.replace(tmp, path)
    return nonce


def wait_for(cache_dir: Path, command: str, timeout: float, since: float) -> tuple[bool, str]:
    """Poll the heartbeat until it shows ``command`` took effect (written after ``since``, Unix seconds);
    returns ``(done, the last state seen)``."""
    deadline, state = time.monotonic() + timeout, "no heartbeat"
    while True:
        try:
            beat = json.loads((Path(cache_dir) / HEARTBEAT).read_text())
            state = str(beat.get("state"))
            if float(beat.get("time", 0)) >= since and state in WANTED[command]:
                return True, state
        except (OSError, ValueError):
            pass
        if time.monotonic() > deadline:
            return False, state
        time.sleep(0.25)


class ControlChannel:
    """The running peer's side: yields each new command once. A command written before the peer started
    is ignored (it was meant for an earlier process)."""

    def __init__(self, cache_dir: Path):
        self.path = Path(cache_dir) / FILENAME
        self.seen = self._read().get("nonce")

    def _read(self) -> dict:
        try:
            found = json.loads(self.path.read_text())
            return found if isinstance(found, dict) else {}
        except (OSError, ValueError):
            return {}

    def poll(self) -> Optional[str]:
        found = self._read()
        if not found or found.get("nonce") == self.seen:
            return None
        self.seen = found.get("nonce")
        command = found.get("command")
        if command not in COMMANDS:
            logger.warning("ignoring unknown control command %r in %s", command, self.path)
            return None
        return command


async def follow(cache_dir: Path, handlers: dict[str, Callable[[], None]], stop: asyncio.Event,
                 period_s: float = 0.5) -> None:
    """Call ``handlers[command]`` for each new command until ``stop``."""
    channel = ControlChannel(cache_dir)
    while not await sleep_or_stop(stop, period_s):
        command = channel.poll()
        if command is not None:
            logger.info("control: %s requested", command)
            handlers[command]()


def _dump_stacks() -> None:
    """Every asyncio task's and every thread's stack, on stderr (``kill -USR1 <pid>``: where is it stuck?)."""
    print(f"--- {len(asyncio.all_tasks())} asyncio tasks", file=sys.stderr, flush=True)
    for task in asyncio.all_tasks():
        task.print_stack(file=sys.stderr)
    print("--- threads", file=sys.stderr, flush=True)
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)


def _exit_watchdog(grace_s: float, code: int) -> threading.Timer:
    """Once the peer has stopped: SIGUSR1 prints the threads' stacks at C level (the event loop that handled it
    is about to close), and if the process is still alive ``grace_s`` seconds later (a library thread that
    never returns holds the interpreter's exit: Python waits for the default executor's threads), say so on
    stderr with every thread's stack, end the child processes and exit with ``code``. It writes with
    ``os.write``, not the logging module, whose locks the stuck thread may hold."""
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)

    def force() -> None:
        try:
            os.write(2, f"ERROR the peer stopped but its process did not exit within {grace_s:.0f} s (a thread "
                        "still waits on a library call); exiting now, thread stacks follow\n".encode())
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
            for child in multiprocessing.active_children():
                child.terminate()
        finally:
            os._exit(code)

    timer = threading.Timer(grace_s, force)
    timer.daemon = True
    timer.start()
    return timer


class Controlled(Protocol):
    """What a running peer offers its operator: :class:`swarm.server.session.ServerSession` and
    :class:`swarm.trainer.session.Trainer` both do."""

    async def run(self) -> None: ...
    def stop(self) -> None: ...
    def pause(self) -> None: ...
    def resume(self) -> None: ...


async def run_controlled(peer: Controlled, state_dir: Path, exit_grace_s: Optional[float] = None,
                         exit_code: Callable[[BaseException], int] = lambda error: 1) -> None:
    """``await peer.run()`` with SIGTERM/SIGINT and ``swarm-peer drain`` wired to ``peer.stop``, ``pause`` and
    ``resume`` to the peer's own (commands read from ``state_dir``). SIGUSR1 prints what the peer is waiting on:
    the stack of every asyncio task and every thread, on stderr. With ``exit_grace_s`` (a process's entry point),
    a process that does not exit within that many seconds of the peer's stop is ended (:func:`_exit_watchdog`)
    with code 0 after a clean stop, else ``exit_code(the error peer.run raised)``."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, peer.stop)
    loop.add_signal_handler(signal.SIGUSR1, _dump_stacks)
    done = asyncio.Event()
    controls = asyncio.create_task(follow(state_dir, {"pause": peer.pause, "resume": peer.resume,
                                                      "drain": peer.stop}, done))
    code = 1
    try:
        await peer.run()
        code = 0
    except BaseException as error:
        code = exit_code(error)
        raise
    finally:
        done.set()
        await controls
        loop.remove_signal_handler(signal.SIGUSR1)
        if exit_grace_s is not None:
            _exit_watchdog(exit_grace_s, code)
