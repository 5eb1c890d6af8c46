"""Imports a joining server needs later, done while its first join phases wait on the network.

The first ``torch.optim.Optimizer`` a process builds imports ``torch._dynamo`` (torch wraps the optimizers'
methods in ``torch._disable_dynamo``, which imports it on first use): 2.9 s of CPU on an idle core of this
project's test machine, 6-7 s when nine peers share its two cores, all of it inside a join's ``optimizer`` phase
(:mod:`swarm.server.joinclock`). The ``connect`` and ``setup`` phases before it mostly wait: for the libp2p
daemon to start, for the DHT's round trips and the spec's download. :class:`Preload` imports those modules on a
daemon thread meanwhile (a :class:`~swarm.server.session.ServerSession` starts one when it is built); the session
waits for it before ``measure``, whose throughput figure must not share the interpreter with an import. Measured in
``bench/wan.py`` (``runs/home.toml``, loopback, nine peers on two cores; one run before, four after): the
``optimizer`` phase went from 7.9 s to 0.65-1.77 s, ``connect`` through ``optimizer`` from 13.3 s to 7.1-9.7 s.

An import that fails here is logged at DEBUG and left to the code that needs the module, which raises then.
"""

from __future__ import annotations

import importlib
import logging
import threading
import time
from typing import Sequence

logger = logging.getLogger(__name__)

JOIN_IMPORTS = ("torch._dynamo",)
"""Modules a server imports lazily on its join's path (see the module docstring)."""


class Preload:
    """Import ``modules`` on a daemon thread; :meth:`wait` for them (returns at once if they were imported)."""

    def __init__(self, modules: Sequence[str] = JOIN_IMPORTS):
        self.modules = tuple(modules)
        self.seconds = 0.0
        """Seconds the imports took (wall clock, on their thread); 0.0 until they are done."""
        self._thread = threading.Thread(target=self._run, name="swarm-preload", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        started = time.monotonic()
        for name in self.modules:
            try:
                importlib.import_module(name)
            except Exception as e:  # noqa: BLE001 - the code that needs it raises with its own context
                logger.debug("preloading %s failed: %s", name, e)
        self.seconds = time.monotonic() - started

    def wait(self, timeout_s: float = 120.0) -> bool:
        """Block until the imports are done or ``timeout_s`` passed (seconds); returns whether they are done."""
        self._thread.join(timeout_s)
        return not self._thread.is_alive()


__all__ = ["JOIN_IMPORTS", "Preload"]
