"""A peer process's exit codes: one per error that can end it, so that a supervisor can tell them apart (a
restart policy that must not restart a banned peer, a restore to look into)."""

from __future__ import annotations

from swarm.trust.banlist import PeerBanned
from swarm.checkpoint.restore import RestoreError
from swarm.net.dht import RunUnreachable
from swarm.identity import IdentityInUse
from swarm.trust.tickets import NotAdmitted

EXIT_CODES: tuple[tuple[type[BaseException], int], ...] = (
    (RestoreError, 3), (PeerBanned, 4), (RunUnreachable, 5), (IdentityInUse, 6), (NotAdmitted, 7))
"""Exit code per error that ended the peer (0: a drain; 1: anything else)."""


def exit_code(error: BaseException) -> int:
    """The exit code of a peer process that ``error`` ended (:data:`EXIT_CODES`)."""
    return next((code for cls, code in EXIT_CODES if isinstance(error, cls)), 1)
