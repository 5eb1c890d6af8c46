"""Logging: the entry points' set-up, and the adapter that gives a peer's lines their ``[peer stage epoch]`` prefix.

The library never configures logging at import time; ``swarm-peer`` and ``swarm-coordinator`` call
:func:`configure_logging` once. Library code logs through a :class:`PeerLog`, so every line a peer writes
about itself starts the same way and can be grepped per peer, stage or epoch::

    12:00:01 INFO swarm.server.session: [7Yc2kq4hM3xZpL0a stage=1 epoch=12] loss=5.1234 samples/s=41.20 ...
    12:00:02 INFO swarm.trainer.session: [Qm81xW0aTz9eR2bd trainer] loss=5.2001 samples=4096 ...
"""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import Any, Callable, MutableMapping, Optional

from google.protobuf.message import DecodeError

HANDLER_LOGGER = "hivemind.p2p.p2p_daemon"
"""The logger hivemind reports an exception raised by a stream handler on (``Handler failed ...``)."""


def configure_logging(level: str | int = "INFO") -> None:
    """Log to stderr as ``time level name: message``; hivemind's own chatter from ``HIVEMIND_LOGLEVEL`` (WARNING).

    Call it from entry points only (idempotent).
    """
    os.environ.setdefault("HIVEMIND_LOGLEVEL", "WARNING")
    root = logging.getLogger()
    if not any(getattr(h, "_swarm", False) for h in root.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S"))
        handler._swarm = True  # type: ignore[attr-defined]
        root.addHandler(handler)
    root.setLevel(level)
    logging.getLogger("hivemind").setLevel(os.environ["HIVEMIND_LOGLEVEL"])
    handlers = logging.getLogger(HANDLER_LOGGER)
    if not any(isinstance(f, RefusalFilter) for f in handlers.filters):
        from swarm.protocol import Refusal

        handlers.addFilter(RefusalFilter((Refusal,)))


class RefusalFilter(logging.Filter):
    """Turns the traceback hivemind logs for every request a handler refused into one line per refusal class
    (exception type) and peer per ``period_s`` seconds: the peer (when the handler's wrapper named it,
    :func:`swarm.net.transport.delivering_refusals`), the cause, cut to 200 characters with control and non-ASCII
    characters escaped (a peer's bytes never reach the log raw), and how many more were held back since.

    Bytes that are not a frame at all (an unknown marker byte, a length varint that overflows, a protobuf that does
    not parse) fail in hivemind's stream reader before any handler runs (``Exception while receiving requests``);
    those are refusals too, of class ``malformed frame``, without a peer (hivemind does not say which).

    :param expected: the exception types that are expected refusals (other exceptions keep their traceback).
    :param max_keys: (class, peer) pairs remembered; beyond, the oldest is forgotten (many peers: a Sybil).
    """

    FRAMING_MESSAGE = "Exception while receiving requests"
    """How hivemind's ``P2P._add_protobuf_stream_handler`` logs a request stream it could not read (1.1.12)."""
    FRAMING_ERRORS = (TypeError, ValueError, DecodeError)
    """What its reader raises on bytes that are not frames (``receive_protobuf``, ``read_unsigned_varint``)."""

    def __init__(self, expected: tuple[type, ...], period_s: float = 60.0, max_keys: int = 4096):
        super().__init__()
        self.expected, self.period_s, self.max_keys = expected, period_s, max_keys
        self._last: dict[tuple[str, str], tuple[float, int]] = {}  # -> (when its last line went out, held back)

    def _kind(self, record: logging.LogRecord, error: Optional[BaseException]) -> Optional[str]:
        """The refusal class of ``record``, or None when it is not a refusal (it keeps its traceback)."""
        if isinstance(error, self.expected):
            return type(error).__name__
        if isinstance(error, self.FRAMING_ERRORS) and str(record.msg).startswith(self.FRAMING_MESSAGE):
            return f"malformed frame ({type(error).__name__})"
        return None

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        kind = self._kind(record, error)
        if kind is None:
            return True
        peer, now = str(getattr(error, "remote_peer", ""))[:64], time.monotonic()
        last, held = self._last.get((kind, peer), (float("-inf"), 0))
        if now - last < self.period_s:
            self._last[(kind, peer)] = (last, held + 1)
            return False
        self._last.pop((kind, peer), None)
        self._last[(kind, peer)] = (now, 0)
        while len(self._last) > self.max_keys:
            del self._last[next(iter(self._last))]
        cause = repr(str(error)[:200])[1:-1].encode("ascii", "backslashreplace").decode("ascii")
        more = f" ({held} more in the last {self.period_s:.0f} s)" if held else ""
        record.msg, record.args = f"refused a request{f' from {peer}' if peer else ''}: {kind}: {cause}{more}", ()
        record.exc_info, record.exc_text = None, None
        return True


class PeerLog(logging.LoggerAdapter):
    """A logger whose messages start with ``[<peer id>[ <role>][ stage=<k>][ epoch=<e>]]``.

    :param peer: the peer id (its Ed25519 one, as the run's records show it).
    :param role: ``trainer`` for trainers; servers are told apart by their stage.
    :param stage: the stage served, if any (a server that moves gets a new log for its new stage).
    :param epoch: returns the current epoch (read at each line), or None to leave it out.
    """

    def __init__(self, logger: logging.Logger, peer: str, *, role: str = "", stage: Optional[int] = None,
                 epoch: Optional[Callable[[], int]] = None):
        super().__init__(logger, {})
        self.peer, self.role, self.stage, self.epoch = peer, role, stage, epoch

    @property
    def prefix(self) -> str:
        parts = [self.peer]
        if self.role:
            parts.append(self.role)
        if self.stage is not None:
            parts.append(f"stage={self.stage}")
        if self.epoch is not None:
            try:
                parts.append(f"epoch={self.epoch()}")
            except Exception:  # the epoch's owner is gone (shutting down): log the line without it
                pass
        return "[" + " ".join(parts) + "]"

    def process(self, msg: Any, kwargs: MutableMapping[str, Any]) -> tuple[Any, MutableMapping[str, Any]]:
        return f"{self.prefix} {msg}", kwargs
