"""The coordinator's bootstrap node: a DHT node that publishes the signed spec, prints the run address and
holds checkpoint fragments like any other peer.

It is not a parameter server: peers re-publish the signed spec themselves, so training goes on without it.
Its fragment store (``SWARM_FRAGMENT_DIR``, default ``<SWARM_CACHE_DIR>/fragments``) survives restarts like
a server's, so a restarted coordinator re-announces its fragments and their manifests.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
from pathlib import Path
from typing import Optional

from swarm.checkpoint import FragmentStore
from swarm.checkpoint.keeper import FragmentKeeper
from swarm.config import PeerSettings, RunSpec
from swarm.directory import RunDirectory, format_run_address, start_dht, visible_maddrs
from swarm.identity import Identity

logger = logging.getLogger("swarm.coordinator")


def serve(spec: RunSpec, key: Identity, settings: PeerSettings, initial_peers: list[str],
          address_file: Optional[Path] = None, stop: Optional[threading.Event] = None) -> None:
    """Run the bootstrap node until SIGTERM/SIGINT (or ``stop``); prints the run address on stdout."""
    run_id, sealed = RunDirectory.seal_spec(spec, key)
    dht = start_dht(settings, initial_peers)
    stop = stop or threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        directory = RunDirectory(dht, run_id, ttl=spec.timeouts.record_ttl_s)
        address = format_run_address(run_id, visible_maddrs(dht))
        print(address, flush=True)
        if address_file is not None:
            tmp = address_file.with_suffix(".tmp")
            tmp.write_text(address + "\n")
            tmp.replace(address_file)
        logger.info("serving run %s (spec %s)", run_id, spec.spec_hash()[:16])
        store = FragmentStore(settings.fragment_path(), settings.fragment_max_bytes, spec.checkpoint.keep,
                              grace_s=2 * spec.timeouts.record_ttl_s)
        keeper = FragmentKeeper(spec, directory, key, store)
        asyncio.run(_serve(directory, keeper, sealed, dht, stop))
    finally:
        dht.shutdown()


async def _serve(directory: RunDirectory, keeper: FragmentKeeper, sealed: bytes, dht, stop: threading.Event) -> None:
    loop = asyncio.get_running_loop()
    await keeper.start(await dht.replicate_p2p())
    period = directory.ttl / 3
    try:
        while not stop.is_set():
            if not await loop.run_in_executor(None, directory.publish_spec, sealed):
                logger.warning("could not store the spec in the DHT; retrying in %.0fs", period)
            try:
                await keeper.tick()
            except Exception:
                logger.exception("fragment keeper tick failed")
            for _ in range(int(period / 0.25)):
                if stop.is_set():
                    break
                await asyncio.sleep(0.25)
    finally:
        await keeper.stop()
