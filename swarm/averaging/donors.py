"""Which live server a server downloads the stage's state from (the *donor*), read within bounds, and refused
once its state did not verify.

hivemind 1.1.12 (``DecentralizedAverager._load_state_from_peers``) tries the peers that declared themselves
donors, highest priority (epoch) first, takes the first that answers, deserializes whatever dtype and size the
donor's stream names, and never says who it was. Here, in the averager's process:

* donors this server refused (:meth:`DonorChoice.refuse_donor`, for :data:`REFUSAL_S` seconds) and peers it
  excluded from averaging are skipped, and the stage's announced servers (:meth:`DonorChoice.set_roster`) are
  tried before peers that only declared themselves donors (anyone can, under hivemind's ``all_averagers`` key:
  junk entries of the highest priority would otherwise use up every try);
* the stream is read with :func:`swarm.net.transport.gather`: tensor headers are checked before anything is
  buffered (dtype, rank, size), the whole download is bounded by the size of this server's own state, and
  the tensors must have this server's shapes and dtypes one for one;
* only the donor's tensors and epoch are used: the optimizer's settings (hyper-parameters, flags) that hivemind
  would load from the donor's metadata are this server's own;
* the donor that answered is kept, for the caller to verify its state and name it
  (:meth:`DonorChoice.last_donor`; :class:`swarm.averaging.optimizer.StageOptimizer` does, with
  :mod:`swarm.trust.statecheck`).

Loading the state into the optimizer stays hivemind's (``TrainingStateAverager.load_state_from_peers``).
"""

from __future__ import annotations

import logging
import random
import time
from itertools import chain
from types import SimpleNamespace
from typing import AsyncIterator, Optional

import torch
from hivemind.optim.state_averager import dump_optimizer_state
from hivemind.p2p import PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils.asyncio import aiter_with_timeout
from hivemind.utils.mpfuture import MPFuture
from hivemind.utils.timed_storage import ValueWithExpiration

from swarm.aio import hold_current_task
from swarm.protocol import MAX_EPOCH, ProtocolError
from swarm.net.transport import gather

logger = logging.getLogger(__name__)

REFUSAL_S = 120.0
"""Seconds a donor whose state was contradicted is skipped (an honest server that had missed a round is in sync
again by then)."""
RETRY_S = 15.0
"""Seconds a donor is skipped whose download failed or whose state nobody could vouch for yet."""

DECLARE_GAP_S = 10.0
"""Least seconds between two donor declarations prompted by a new priority (:meth:`DonorChoice._trigger_declare_load_state`)."""


class DonorChoice:
    """Mixin for hivemind's ``TrainingStateAverager`` (see the module docstring); call :meth:`_init_donors` in
    ``__init__`` before the averager process starts. The methods without a leading underscore are the main
    process's API (through the averager's pipe, at most ``timeout`` seconds); the others run in its process."""

    def _init_donors(self) -> None:
        self._refused: dict[str, tuple[float, str]] = {}  # libp2p id -> (time.monotonic() until, reason)
        self._donor: tuple[str, int] = ("", -1)
        self._roster: frozenset[str] = frozenset()  # libp2p ids of the stage's announced servers
        self._declared: tuple[Optional[bool], float] = (None, float("-inf"))  # (sharing, time.monotonic()) last woken

    # ---- main-process API -----------------------------------------------------------------------------
    def refuse_donor(self, peer: str, reason: str, seconds: float = REFUSAL_S, timeout: float = 5.0) -> None:
        """Skip donor ``peer`` (a libp2p id) for ``seconds``."""
        future = MPFuture()
        self._outer_pipe.send(("_refuse_donor", [], dict(peer=peer, reason=reason, seconds=seconds, future=future)))
        future.result(timeout)

    def set_roster(self, p2p_ids: frozenset[str], timeout: float = 5.0) -> None:
        """Try donors among ``p2p_ids`` (the stage's announced servers, libp2p ids) first."""
        future = MPFuture()
        self._outer_pipe.send(("_set_roster", [], dict(p2p_ids=frozenset(p2p_ids), future=future)))
        future.result(timeout)

    def last_donor(self, timeout: float = 5.0) -> tuple[str, int]:
        """``(libp2p id, epoch)`` of the state the last ``load_state_from_peers`` received (``("", -1)``: none).
        The epoch is the donor's: hivemind may then move this server one epoch on to the stage's."""
        future = MPFuture()
        self._outer_pipe.send(("_last_donor", [], dict(future=future)))
        return future.result(timeout)

    # ---- the averager's process ---------------------------------------------------------------------------
    async def _refuse_donor(self, peer: str, reason: str, seconds: float, future: MPFuture) -> None:
        now = time.monotonic()
        self._refused = {p: r for p, r in self._refused.items() if r[0] > now}
        self._refused[peer] = (now + seconds, reason)
        future.set_result(None)

    async def _set_roster(self, p2p_ids: frozenset[str], future: MPFuture) -> None:
        self._roster = p2p_ids
        future.set_result(None)

    async def _last_donor(self, future: MPFuture) -> None:
        future.set_result(self._donor)

    async def _trigger_declare_load_state(self) -> None:
        """hivemind 1.1.12 declares this donor again at every new priority, which its optimizer sets to the epoch:
        a DHT store per server and epoch (68 of the demo swarm's 1411 DHT calls in 40 s, counted). Here a change
        of ``allow_state_sharing`` is declared at once and a new priority at most every :data:`DECLARE_GAP_S`; the
        periodic declaration (every ``declare_state_period``) carries the latest. A joiner may then read an epoch
        a few epochs old; it prefers the stage's announced servers anyway and checks the state it gets."""
        sharing, now = self.allow_state_sharing, time.monotonic()
        if sharing != self._declared[0] or now - self._declared[1] >= DECLARE_GAP_S:
            self._declared = (sharing, now)
            await super()._trigger_declare_load_state()

    def _donor_candidates(self) -> list[PeerID]:
        """Declared donors, the stage's announced servers first, then highest priority first (random among
        equals), without this peer, refused donors and peers excluded from averaging."""
        found = self.dht.get(f"{self._matchmaking.group_key_manager.prefix}.all_averagers", latest=True)
        declared = found.value if found is not None and isinstance(found.value, dict) else {}
        now = time.monotonic()
        skipped = {p for p, (until, _) in self._refused.items() if until > now} | set(self.exclusions.excluded())
        priority = {PeerID(p): (str(PeerID(p)) in self._roster, float(item.value), random.random())
                    for p, item in declared.items()
                    if isinstance(item, ValueWithExpiration) and isinstance(item.value, (int, float))
                    and isinstance(p, bytes)}
        return [p for p in sorted(priority, key=priority.get, reverse=True)
                if p != self.peer_id and str(p) not in skipped]

    def _expected_state(self) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """Shapes and dtypes of the tensors a donor sends: parameters, extra tensors, optimizer statistics."""
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        _, statistics = dump_optimizer_state(self.optimizer)
        return [(tuple(t.shape), t.dtype) for t in chain(params, self.extra_tensors, statistics)]

    async def _download(self, peer: PeerID, expected: list, timeout: Optional[float]):
        """``(metadata, tensors)`` of ``peer``'s state. :raises ProtocolError: it does not fit ``expected``."""
        limit = sum(torch.Size(shape).numel() * max(dtype.itemsize, 4) for shape, dtype in expected) + (1 << 20)
        stub = self.get_stub(self._p2p, peer, namespace=self.prefix)
        stream = await stub.rpc_download_state(averaging_pb2.DownloadRequest())
        # a donor trickling chunks is dropped: at least 1 MB/s, plus a minute
        raw, tensors = await gather(_as_messages(aiter_with_timeout(stream, timeout)), limit,
                                    max_tensors=len(expected), deadline_s=60.0 + limit / 1e6)
        if not raw:
            raise ProtocolError("the donor sent no metadata (it does not share its state)")
        got = [(tuple(t.shape), t.dtype) for t in tensors]
        if got != expected:
            wrong = next((i for i, (g, e) in enumerate(zip(got, expected)) if g != e), min(len(got), len(expected)))
            raise ProtocolError(f"the donor's state is not this stage's: {len(got)} tensors for {len(expected)}, "
                                f"the first that differs is #{wrong}")
        metadata = self.serializer.loads(raw)
        epoch = metadata.get("epoch") if isinstance(metadata, dict) else None
        if not isinstance(epoch, int) or not 0 <= epoch <= MAX_EPOCH:
            raise ProtocolError("the donor's state metadata carries no valid epoch")
        own, _ = dump_optimizer_state(self.optimizer)  # this server's settings; the tensors map one for one
        return dict(epoch=epoch, group_bits="", optimizer_metadata=own), tensors

    async def _load_state_from_peers(self, future: MPFuture, timeout: Optional[float] = None) -> None:
        hold_current_task()  # (swarm.aio.hold_current_task: hivemind keeps no reference to this task)
        timeout = self.next_chunk_timeout if self.next_chunk_timeout is not None else self.request_timeout
        self._donor = ("", -1)
        try:
            expected = self._expected_state()
            for peer in self._donor_candidates():
                started = time.monotonic()
                try:
                    metadata, tensors = await self._download(peer, expected, timeout)
                except Exception as e:  # unreachable, refused, malformed or not this stage's state: the next one
                    logger.warning("could not load the state of donor %s: %s", peer, str(e)[:300] or repr(e))
                    self._refused[str(peer)] = (time.monotonic() + RETRY_S, "its download failed")
                    continue
                logger.info("downloaded the state of donor %s (epoch %d) in %.1f s", peer, metadata["epoch"],
                            time.monotonic() - started)
                self._donor = (str(peer), metadata["epoch"])
                future.set_result((metadata, tensors))
                return
        finally:
            if not future.done():
                future.set_result(None)


async def _as_messages(stream: AsyncIterator[averaging_pb2.DownloadData]) -> AsyncIterator[SimpleNamespace]:
    """hivemind's state stream (one tensor chunk per message) as messages :func:`swarm.net.transport.gather` reads."""
    async for msg in stream:
        yield SimpleNamespace(metadata=msg.metadata, tensors=[msg.tensor_part] if msg.HasField("tensor_part") else [])


__all__ = ["DonorChoice", "REFUSAL_S", "RETRY_S"]
