"""Where a server's join goes: the seconds of each phase from its process's start to ``online``.

A late joiner's cost is the stage state it downloads over its link (the *bandwidth bound*: state bytes over the
link's rate, plus a few round trips) and everything else on the path. :class:`JoinClock` times the phases as
:class:`~swarm.server.session.ServerSession` passes them and writes one fixed-key line when the server goes online::

    [7pf2zfha stage=0 epoch=10] joined_s=18.2 start_s=4.1 connect_s=6.3 setup_s=0.9 measure_s=1.6 ...

``start_s`` is the process's life before the session ran (interpreter, imports of torch and hivemind), read from
``/proc`` (0 where the system has none); the other keys are :data:`PHASES`, in order. ``bench/wan.py`` reads the line.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Optional, Union

PHASES = ("connect", "setup", "measure", "optimizer", "state", "announce")
"""A join's phases, in order: ``connect`` joins the DHT and fetches the verified spec; ``setup`` passes admission,
starts the fragment keeper and the evidence service and reads this peer's addresses; ``measure`` builds the stage's
module, measures its throughput, announces ``joining`` and reads which servers the run key recognizes;
``optimizer`` starts the stage's optimizer (hivemind's averager processes); ``state`` restores the stage's state (a
donor's download and its check, or a checkpoint) and waits until the stage's servers count this one; ``announce``
registers the stage RPCs and announces ``online``."""


def process_age_s() -> float:
    """Seconds since this process started (Linux ``/proc``; 0.0 where it cannot be read)."""
    try:
        with open("/proc/self/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        with open("/proc/uptime", "rb") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK"))  # field 22: starttime, in ticks
    except (OSError, ValueError, IndexError):
        return 0.0


class JoinClock:
    """Seconds per phase of one join (see the module docstring); :meth:`enter` starts the next phase.

    A clock is for one join: the session starts a new one when a server moves to another stage or resumes (its
    ``start_s`` and ``connect_s`` are then 0).
    """

    def __init__(self, first: bool = True):
        self.started = time.monotonic()
        self.start_s = process_age_s() if first else 0.0
        self.seconds: dict[str, float] = {name: 0.0 for name in PHASES}
        self._phase: Optional[str] = None
        self._since = self.started

    def enter(self, phase: str) -> "JoinClock":
        """End the current phase (if any) and start ``phase`` (one of :data:`PHASES`); returns this clock.

        :raises ValueError: ``phase`` is not one of :data:`PHASES`.
        """
        if phase not in self.seconds:
            raise ValueError(f"unknown join phase {phase!r}: one of {', '.join(PHASES)}")
        now = time.monotonic()
        if self._phase is not None:
            self.seconds[self._phase] += now - self._since
        self._phase, self._since = phase, now
        return self

    def line(self) -> str:
        """End the current phase; the fixed-key line: ``joined_s`` (the process's start to now on a first join),
        ``start_s``, then ``<phase>_s`` for each of :data:`PHASES`."""
        if self._phase is not None:
            self.seconds[self._phase] += time.monotonic() - self._since
            self._phase = None
        total = self.start_s + time.monotonic() - self.started
        return " ".join([f"joined_s={total:.2f}", f"start_s={self.start_s:.2f}",
                         *(f"{name}_s={s:.2f}" for name, s in self.seconds.items())])


    def report(self, log: Union[logging.Logger, logging.LoggerAdapter]) -> None:
        """Log :meth:`line` at INFO on ``log`` (the join is over: returns None, for the caller to drop the clock)."""
        log.info("%s", self.line())


__all__ = ["JoinClock", "PHASES", "process_age_s"]
