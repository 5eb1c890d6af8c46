"""Delegate keys: admission that outlives the coordinator (``swarm-coordinator delegate <address> <peer id>``).

In an allowlist or invite run the run key signs every ticket (:mod:`swarm.trust.tickets`), and its holder, the
coordinator, redeems invite codes and renews tickets. While it is down, admitted peers work on until their
tickets expire, but no new peer gets in. A run key hands that power on the way a certificate authority signs an
intermediate certificate (RFC 5280, section 4.2.1.9, basic constraints): it signs a
:class:`~swarm.protocol.Delegation` naming a peer it trusts (its peer id and libp2p id) until a date
(:func:`delegate`). While the delegation lasts, that peer

* redeems invite codes: it serves ``rpc_redeem`` as the coordinator does, and a joiner asks every live delegate
  after the invite's own redeemers (:func:`~swarm.trust.invites.redeem_invite`);
* renews tickets in the last :data:`DUE` of their life (the coordinator, while up, renews them in their second
  half, so a delegate renews only what the coordinator did not).

Each ticket it signs embeds the delegation and ends no later than it; :func:`~swarm.protocol.open_ticket` checks the
chain, so every DHT node and peer takes such a ticket as it takes the run key's.

Limits: a delegation cannot be withdrawn before it expires (the DHT keeps, per sub-key, the value that expires
last). ``swarm-coordinator revoke <delegate>`` bans it: an honest delegate then stops, and nobody renews the tickets
it first issued (:attr:`~swarm.protocol.Ticket.origin`, carried by renewals), which lapse within a ticket's life;
but a stolen delegate key signs new ones until its delegation ends: keep delegations short (``--expires``) and
delegate again. Each redeemer counts an invite's uses from the tickets the DHT holds, so two redemptions at once
on two redeemers may each take the last use.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Optional

from hivemind.utils import get_dht_time

from swarm.config import RunSpec
from swarm.identity import Identity
from swarm.net.directory import RunDirectory
from swarm.protocol import Delegation, ProtocolError, delegates_key, open_run_key_record, seal
from swarm.trust.authority import peer_of_p2p_id
from swarm.trust.tickets import renew_tickets, run_key_records

logger = logging.getLogger(__name__)

DUE = 0.25
"""Fraction of a ticket's life left when a delegate renews it (the coordinator renews at one half)."""
READ_EVERY_S = 30.0
"""Seconds between a peer's reads of the delegations (a new one takes effect this soon)."""


def delegate(directory: RunDirectory, run_key: Identity, spec: RunSpec, delegate_p2p_id: str, ttl_s: float
             ) -> tuple[Delegation, bytes]:
    """Sign with the run key a delegation to the peer whose libp2p id is ``delegate_p2p_id``, for ``ttl_s`` seconds,
    and store it in the DHT until it expires (blocking: ``swarm-coordinator delegate`` runs it). Returns it, and
    sealed.

    :raises ProtocolError: ``run_key`` is not this run's key, or ``delegate_p2p_id`` names no key.
    :raises RuntimeError: the DHT did not take the delegation."""
    now = get_dht_time()
    try:
        record = Delegation(run_id=directory.run_id, peer_id=run_key.peer_id, time=now, spec_name=spec.name,
                            spec_hash=spec.spec_hash(), expires=now + ttl_s, delegate=peer_of_p2p_id(delegate_p2p_id),
                            delegate_p2p_id=delegate_p2p_id)
    except ValueError as e:
        raise ProtocolError(f"not a valid delegation: {e}") from None
    sealed = seal(record, run_key)
    open_run_key_record(sealed, Delegation, directory.run_id)  # a wrong key fails here, not at every peer
    if not directory.store_sealed(delegates_key(directory.run_id), record.dht_subkey(), sealed, record.expires):
        raise RuntimeError("the DHT did not store the delegation (no DHT peer answered); try again")
    return record, sealed


def live_delegations(directory: RunDirectory) -> dict[str, tuple[Delegation, bytes]]:
    """The run key's unexpired delegations the DHT holds, by delegate peer id (the one that lasts longest of each),
    with their sealed bytes (blocking; others are logged and skipped)."""
    out: dict[str, tuple[Delegation, bytes]] = {}
    now = get_dht_time()
    for found, sealed in run_key_records(directory, delegates_key(directory.run_id), Delegation):
        held = out.get(found.delegate)
        if found.expires > now and (held is None or found.expires > held[0].expires):
            out[found.delegate] = (found, sealed)
    return out


class DelegateDuty:
    """A peer's part as the run key's delegate (module docstring), called (blocking) at every refresh of its
    ticket (:attr:`~swarm.trust.tickets.RunTickets.duty`): at most every :data:`READ_EVERY_S` seconds it reads
    whether a live delegation names it, carries it (:attr:`~swarm.identity.Identity.delegation`: its invite service
    then redeems codes) and renews the run's tickets in their last :data:`DUE`, on a thread of its own (renewing
    many tickets, one DHT store each, holds up no announcement). Never raises: a failed pass is logged and tried
    again at the next."""

    def __init__(self, directory: RunDirectory, identity: Identity, spec: RunSpec, clock=time.monotonic):
        self.directory, self.identity, self.spec, self.clock = directory, identity, spec, clock
        self._next_read = float("-inf")
        self._pass: Optional[threading.Thread] = None

    def __call__(self) -> None:
        """Start a pass on its own thread if one is due and none runs."""
        if self.clock() < self._next_read or (self._pass is not None and self._pass.is_alive()):
            return
        self._next_read = self.clock() + READ_EVERY_S
        self._pass = threading.Thread(target=self.run_pass, name="delegate-duty", daemon=True)
        self._pass.start()

    def wait(self, timeout_s: float = 30.0) -> None:
        """Wait up to ``timeout_s`` seconds for the pass in progress, if one is."""
        if self._pass is not None:
            self._pass.join(timeout_s)

    def run_pass(self) -> list[str]:
        """One pass (blocking); returns the peer ids whose tickets it renewed."""
        try:
            found = live_delegations(self.directory).get(self.identity.peer_id)
            sealed = found[1] if found is not None else b""
            if sealed != self.identity.delegation:
                if found is not None:
                    logger.info("the run key delegates ticket issuing to this peer until %.0f (DHT time): it redeems "
                                "invite codes and renews tickets while the coordinator is down", found[0].expires)
                else:
                    logger.info("this peer's delegation ended: it issues no more tickets")
                self.identity.delegation = sealed
            if not sealed:
                return []
            renewed = renew_tickets(self.directory, self.identity, self.spec, due=DUE)
            if renewed:
                logger.info("renewed %d tickets as the run key's delegate: %s", len(renewed), ", ".join(renewed[:8]))
            return renewed
        except (ProtocolError, RuntimeError, OSError, ValueError) as e:
            logger.warning("a pass of this peer's delegate duty failed (tried again in %.0f s): %s", READ_EVERY_S, e)
            return []


__all__ = ["DUE", "DelegateDuty", "READ_EVERY_S", "delegate", "live_delegations"]
