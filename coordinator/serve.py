"""The coordinator's bootstrap node: a DHT node that publishes the signed spec, prints the run address and
holds checkpoint fragments like any other peer.

It is not a parameter server: peers re-publish the signed spec themselves, so training goes on without it.
Its fragment store (``SWARM_FRAGMENT_DIR``, default ``<SWARM_STATE_DIR>/fragments`` with the state dir
``<SWARM_CACHE_DIR>/coordinator``, apart from a peer's on the same machine) survives restarts like a server's,
so a restarted coordinator re-announces its fragments and their manifests. With
``SWARM_METRICS_PORT`` (or ``serve --metrics-port``) it serves the whole run's Prometheus metrics
(:class:`coordinator.monitor.RunMetrics`), refreshed every ``record_ttl_s / 3`` seconds. In a run that admits
only ticketed peers it renews their tickets (:mod:`swarm.trust.tickets`). It publishes the run key's recognition
of the servers that earned standing (:mod:`swarm.trust.recognition`, kept in ``<state>/recognition-<run>.json``).
"""

from __future__ import annotations

import asyncio
import logging
import signal
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Callable, Optional

from coordinator.monitor import RunMetrics
from coordinator.status import snapshot
from swarm.aio import periodic
from swarm.checkpoint import FragmentStore
from swarm.checkpoint.keeper import FragmentKeeper
from swarm.config import RunSpec
from swarm.settings import PeerSettings
from swarm.net.dht import format_run_address, join_dht, visible_maddrs
from swarm.net.dht_validation import TicketValidator
from swarm.net.directory import AsyncRunDirectory, RunDirectory
from swarm.identity import Identity, claim_folder
from swarm.trust.invites import InviteService
from swarm.trust.tickets import renew_tickets, ticket_gate
from swarm.trust.recognition import RecognitionBook, publish_recognition

logger = logging.getLogger("swarm.coordinator")


def serve(spec: RunSpec, key: Identity, settings: PeerSettings, initial_peers: list[str],
          address_file: Optional[Path] = None) -> None:
    """Run the bootstrap node until SIGTERM/SIGINT; prints the run address on stdout.

    :param initial_peers: multiaddrs of the live swarm to join (a restarted coordinator); tried for
        ``settings.join_timeout_s`` seconds.
    :raises RunUnreachable: none of ``initial_peers`` answered.
    """
    run_id, sealed = RunDirectory.seal_spec(spec, key)
    dht = join_dht(settings, initial_peers, client_mode=False, join_timeout_s=settings.join_timeout_s,
                   run_id=run_id, identity=key)
    try:
        directory = RunDirectory(dht, run_id, ttl=spec.timeouts.record_ttl_s,
                                 stage_stripe_bits=spec.records.stage_stripe_bits)
        directory.verify_spec(sealed)  # sets the run key: the ban list it re-publishes must be signed by it
        admission = None
        if spec.admission.policy != "open":  # ticketed records only, its own included (swarm.trust.tickets)
            dht.add_validators([TicketValidator(run_id)])
            admission = Admission(partial(renew_tickets, directory, key, spec),
                                  InviteService(directory, key, spec) if spec.admission.policy == "invite" else None)
            try:
                admission.renew()
            except RuntimeError as e:  # its own ticket: tried again at every tick
                logger.warning("could not issue the coordinator's own ticket yet: %s", e)
        address = format_run_address(run_id, visible_maddrs(dht))
        print(address, flush=True)
        if address_file is not None:
            tmp = address_file.with_suffix(".tmp")
            tmp.write_text(address + "\n")
            tmp.replace(address_file)
        logger.info("serving run %s (spec %s)", run_id, spec.spec_hash()[:16])
        if settings.state_dir is None:  # its own folder, beside a peer of this machine with the default settings
            settings = settings.model_copy(update={"state_dir": settings.cache_dir / "coordinator"})
        claim_folder(settings.fragment_path(), "SWARM_FRAGMENT_DIR", "fragments")
        store = FragmentStore(settings.fragment_path(), settings.fragment_max_bytes, spec.checkpoint.keep,
                              grace_s=2 * spec.timeouts.record_ttl_s)
        keeper = FragmentKeeper(spec, AsyncRunDirectory(directory), key, store, gate=ticket_gate(spec, directory))
        metrics = None
        if settings.metrics_port:
            metrics = RunMetrics(run_id)
            try:
                metrics.serve(settings.metrics_port, settings.host)
                logger.info("Prometheus metrics of the run on http://%s:%d/metrics", settings.host, settings.metrics_port)
            except OSError as e:
                logger.error("cannot serve metrics on port %d (%s); choose another SWARM_METRICS_PORT",
                             settings.metrics_port, e.strerror)
                metrics = None

        def observe() -> None:
            if metrics is not None:
                metrics.update(snapshot(directory, spec))

        book = RecognitionBook(settings.state_path() / f"recognition-{run_id}.json")
        duties = [(partial(publish_recognition, directory, key, spec, book), "recognizing the run's servers"),
                  (observe, "updating the run's metrics")]
        asyncio.run(_serve(directory, keeper, sealed, dht, duties, admission))
    finally:
        dht.shutdown()


@dataclass(frozen=True)
class Admission:
    """A ticketed run's duties at the coordinator: renew the tickets; redeem invite codes (policy "invite")."""

    renew: Callable[[], list[str]]
    invites: Optional[InviteService] = None


async def _serve(directory: RunDirectory, keeper: FragmentKeeper, sealed: bytes, dht,
                 duties: list[tuple[Callable[[], object], str]], admission: Optional[Admission] = None) -> None:
    """Until SIGTERM/SIGINT, every ``record_ttl_s / 3`` seconds: re-publish the spec, renew the run's tickets
    (``admission``, a ticketed run, whose invite codes it redeems on request), run the keeper's duties, then each
    of ``duties`` (blocking calls, each with what it does: the recognition, the metrics); then hand the fragments held
    here to other peers."""
    loop, stop = asyncio.get_running_loop(), asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    p2p = await dht.replicate_p2p()
    await keeper.start(p2p)
    if admission is not None and admission.invites is not None:
        await admission.invites.add_p2p_handlers(p2p, namespace=directory.run_id)

    async def tick() -> None:
        """Each duty on its own: one that fails is logged and the others still run."""
        if not await keeper.directory.publish_spec(sealed):
            logger.warning("could not store the spec in the DHT; retrying in %.0fs", directory.ttl / 3)
        renew = ((lambda: asyncio.to_thread(admission.renew), "renewing the run's tickets"),) if admission else ()
        blocking = tuple((partial(asyncio.to_thread, call), what) for call, what in duties)
        for duty, what in renew + ((keeper.tick, "fragment keeper tick"),) + blocking:
            try:
                await duty()
            except Exception:
                logger.exception("%s failed", what)

    try:
        await tick()  # at once: the spec is in the DHT before the first peer asks for it
        await periodic(stop, directory.ttl / 3, tick, "re-publishing the spec", logger)
        await keeper.hand_off()  # stopping on purpose: copy its fragments to the peers first
    finally:
        await keeper.stop()
        await p2p.shutdown()  # (its replica of the DHT's libp2p client: removes its Unix socket file)
