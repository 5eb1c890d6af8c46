"""Per-peer links on the loopback interface, for fault injection in multi-process swarm tests.

Every peer's p2pd listens on its own TCP port and, like go-libp2p's TCP transport does by default (reuseport),
dials out from that same port, so every segment of every connection of that peer carries its port as source or
destination. :class:`LoopbackLinks` puts an ``htb`` root qdisc on ``lo``: all traffic goes through a default
class at 100 Gbit/s, and a peer whose link is shaped gets its own class, selected by ``u32`` filters on its
port, at the rate asked; a *cut* link is a class at 8 kbit/s with a one-packet queue, so next to nothing gets
through (a partition that the peer and its peers see as timeouts), until :meth:`LoopbackLinks.restore`.

Needs root and iproute2's ``tc`` with ``htb`` and ``u32`` (the kernels of these machines have them; ``netem``
is absent, so there is no added latency here). :meth:`LoopbackLinks.unavailable` says why not, for a skip.
Only packets of the ports handed to :meth:`~LoopbackLinks.shape` are ever slowed; :meth:`~LoopbackLinks.close`
removes the qdisc (also at exit of a ``with`` block, on failure).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from typing import Optional

CUT_RATE_KBIT = 8
"""The rate of a cut link (kbit/s): a trickle that no RPC with a timeout gets through."""


class LinkError(RuntimeError):
    """``tc`` refused a command (the message has its output)."""


def _tc(*args: str) -> None:
    done = subprocess.run(["tc", *args], capture_output=True, text=True, timeout=10)
    if done.returncode != 0:
        raise LinkError(f"tc {' '.join(args)}: {done.stderr.strip() or done.stdout.strip()}")


class LoopbackLinks:
    """Shape or cut the loopback traffic of single TCP ports (see the module docstring)."""

    def __init__(self, dev: str = "lo"):
        self.dev = dev
        self._classes: dict[int, int] = {}  # port -> htb minor id of its class
        self._active = False

    @staticmethod
    def unavailable() -> Optional[str]:
        """Why links cannot be shaped on this machine, or None."""
        if os.geteuid() != 0:
            return "shaping links needs root (tc on the loopback interface)"
        if shutil.which("tc") is None:
            return "shaping links needs iproute2's tc"
        return None

    def __enter__(self) -> "LoopbackLinks":
        _tc("qdisc", "replace", "dev", self.dev, "root", "handle", "1:", "htb", "default", "1", "r2q", "1000")
        self._active = True
        _tc("class", "add", "dev", self.dev, "parent", "1:", "classid", "1:1", "htb", "rate", "100gbit",
            "burst", "1mb", "cburst", "1mb")
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self._active:
            self._active = False
            self._classes.clear()
            try:
                _tc("qdisc", "del", "dev", self.dev, "root")
            except LinkError:
                pass

    def shape(self, port: int, mbit: float) -> None:
        """Cap every connection of the peer listening on ``port`` at ``mbit`` Mbit/s (both directions share it)."""
        self._set(port, f"{mbit * 1000:.0f}kbit", queue=None)

    def cut(self, port: int) -> None:
        """Let next to nothing through the peer's connections (:data:`CUT_RATE_KBIT`, a one-packet queue)."""
        self._set(port, f"{CUT_RATE_KBIT}kbit", queue=1)

    def restore(self, port: int) -> None:
        """Give the peer its full loopback speed back."""
        self._set(port, "100gbit", queue=None)

    def bytes_through(self, port: int) -> int:
        """Bytes the peer's link (its class) carried since it was first shaped or cut (0 if it never was)."""
        minor = self._classes.get(port)
        if minor is None:
            return 0
        done = subprocess.run(["tc", "-s", "class", "show", "dev", self.dev, "classid", f"1:{minor}"],
                              capture_output=True, text=True, timeout=10)
        found = re.search(r"Sent (\d+) bytes", done.stdout)
        return int(found.group(1)) if found else 0

    def _set(self, port: int, rate: str, queue: Optional[int]) -> None:
        if not self._active:
            raise LinkError("use LoopbackLinks as a context manager (it installs the root qdisc)")
        minor = self._classes.get(port)
        verb = "change" if minor is not None else "add"
        if minor is None:
            minor = self._classes[port] = 10 + len(self._classes)
        # bursts above lo's 64 KiB MTU: htb must be able to send one whole loopback segment
        _tc("class", verb, "dev", self.dev, "parent", "1:", "classid", f"1:{minor}", "htb", "rate", rate,
            "ceil", rate, "burst", "128k", "cburst", "128k")
        _tc("qdisc", "replace", "dev", self.dev, "parent", f"1:{minor}", "handle", f"{minor}:", "pfifo", "limit",
            str(queue or 1000))
        if verb == "add":
            for field in ("sport", "dport"):
                _tc("filter", "add", "dev", self.dev, "parent", "1:", "protocol", "ip", "prio", "1", "u32", "match",
                    "ip", field, str(port), "0xffff", "flowid", f"1:{minor}")
