"""Logging set-up shared by the entry points (never done at import time by the library)."""

from __future__ import annotations

import logging
import os
import sys


def configure_logging(level: str | int = "INFO") -> None:
    """Log to stderr as ``time level name: message``; hivemind's own chatter from ``HIVEMIND_LOGLEVEL`` (WARNING)."""
    os.environ.setdefault("HIVEMIND_LOGLEVEL", "WARNING")
    root = logging.getLogger()
    if not any(getattr(h, "_swarm", False) for h in root.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S"))
        handler._swarm = True  # type: ignore[attr-defined]
        root.addHandler(handler)
    root.setLevel(level)
    logging.getLogger("hivemind").setLevel(os.environ["HIVEMIND_LOGLEVEL"])
