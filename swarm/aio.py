"""Small asyncio helpers shared by the library and the apps: waiting on events, sleeping until stopped, running a
periodic task that logs its failures instead of dying of them, coroutines handed to a loop from another thread,
and tasks kept from the garbage collector."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from concurrent.futures import Future
from typing import Awaitable, Callable, Coroutine, Optional, Union


async def wait_any(*events: asyncio.Event) -> None:
    """Return as soon as one of ``events`` is set."""
    waits = [asyncio.create_task(e.wait()) for e in events]
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()


async def sleep_or_stop(stop: asyncio.Event, seconds: float, *wake: asyncio.Event) -> bool:
    """Sleep ``seconds``, or less if ``stop`` (or any of ``wake``) is set meanwhile; True if ``stop`` is set."""
    try:
        await asyncio.wait_for(wait_any(stop, *wake), seconds)
    except asyncio.TimeoutError:
        pass
    return stop.is_set()


async def periodic(stop: asyncio.Event, period_s: float, tick: Callable[[], Awaitable[None]], what: str,
                   log: Union[logging.Logger, logging.LoggerAdapter]) -> None:
    """``await tick()`` every ``period_s`` seconds (the first after one period) until ``stop`` is set.

    A tick that raises is logged with ``what`` and a traceback, and the next one runs as planned: a background
    duty (re-announcing, following orders, finishing idle epochs) must outlive a bad round.
    """
    while not await sleep_or_stop(stop, period_s):
        try:
            await tick()
        except Exception:
            log.exception("%s failed", what)


class Submissions:
    """Coroutines handed to ``loop`` from other threads (a stage server's compute thread starts checkpoint commits
    and rollback orders there), kept so that :meth:`close` can wait for them. With no loop (built outside one, as
    in unit tests) nothing can be submitted."""

    def __init__(self, loop: Optional[asyncio.AbstractEventLoop]):
        self.loop = loop
        self._pending: set[Future] = set()

    def submit(self, work: Coroutine) -> None:
        """Run ``work`` on the loop, from any thread."""
        future = asyncio.run_coroutine_threadsafe(work, self.loop)
        self._pending.add(future)
        future.add_done_callback(self._pending.discard)

    async def close(self, timeout: float) -> None:
        """(on the loop) Let the work submitted finish, for at most ``timeout`` seconds, then cancel the rest."""
        pending = [asyncio.wrap_future(f) for f in list(self._pending)]
        if pending:
            _, late = await asyncio.wait(pending, timeout=timeout)
            for f in late:
                f.cancel()
            await asyncio.gather(*late, return_exceptions=True)


_HELD: set[asyncio.Task] = set()


def hold_current_task() -> None:
    """Keep the running task referenced until it ends, so the garbage collector cannot destroy it mid-wait.

    asyncio references tasks only weakly ("save a reference to the result of this function, to avoid a task
    disappearing mid-execution", ``asyncio.create_task``'s documentation), and hivemind 1.1.12's averager process
    starts every call that reaches it through its pipe as a task it keeps no reference to. A call that waits on
    an ``MPFuture`` made inside it (a round waiting for its trigger) is then a cycle nothing outside references,
    and a collection destroys it ("Task was destroyed but it is pending!"): its round never ran. Call this first
    thing in such a coroutine.
    """
    task = asyncio.current_task()
    if task is not None and task not in _HELD:
        _HELD.add(task)
        task.add_done_callback(_HELD.discard)


def set_threadsafe(loop: asyncio.AbstractEventLoop, event: asyncio.Event) -> None:
    """Set ``event``, which belongs to ``loop``, from another thread; nothing once the loop is closed."""
    with contextlib.suppress(RuntimeError):  # (the loop closed: nobody waits on the event any more)
        loop.call_soon_threadsafe(event.set)
