"""Fragment transfer between peers: ``rpc_put_fragment`` / ``rpc_get_fragment`` over hivemind's libp2p streams.

A peer serving a :class:`FragmentStore` accepts fragments for its run (verified by hash, within its disk
budget) and serves the ones it holds. Clients verify what they get: a holder that serves bytes not matching
the hash it was given is caught (:class:`~swarm.checkpoint.erasure.FragmentError`) before the bytes are used.
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator, Awaitable, Callable, Optional, Union

import torch
from hivemind.p2p import P2P, P2PContext, PeerID
from hivemind.proto import runtime_pb2

from swarm.net.quota import Busy, PeerQuota
from swarm.checkpoint.erasure import Fragment, FragmentError
from swarm.checkpoint.store import FragmentStore, StoreFull
from swarm.protocol import (
    MAX_RECORD_BYTES,
    CheckpointManifest,
    EndorseRequest,
    FragmentGet,
    FragmentPut,
    FragmentReply,
    ManifestPut,
    ProtocolError,
    open_record,
    pack_message,
    unpack_message,
)
from swarm.net.transport import ProtocolServicer, gather, stream_out
from swarm.trust.authority import CheckpointAuthority, EndorsementRefused
from swarm.trust.tickets import Gate, admit

PUT_DEADLINE_S = 300.0
"""Seconds a fragment upload may take (a 50 MB fragment at 1 MB/s takes 50 s); a slower one is dropped."""
REQUEST_DEADLINE_S = 30.0
"""Seconds a small request (a fragment get, a manifest) may take to arrive."""
FRAGMENT_IN_FLIGHT = 8
"""Requests of one peer a holder serves at once (a writer places one fragment per holder at a time)."""
FRAGMENT_RATE_PER_S = 20.0
"""Requests one peer may start per second at a holder, on average (a restore fetches a few fragments per stage)."""


async def _prepend(first, rest: AsyncIterator) -> AsyncIterator:
    yield first
    async for msg in rest:
        yield msg


def _bytes_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


class FragmentService(ProtocolServicer):
    """Serves ``store`` for run ``run_id`` (register with ``add_p2p_handlers(p2p, namespace=run_id)``)."""

    wire_name = "FragmentService"

    def __init__(self, store: FragmentStore, run_id: str,
                 on_manifest: Optional[Callable[[CheckpointManifest, bytes], Awaitable[object]]] = None,
                 num_stages: Optional[int] = None, authority: Optional[CheckpointAuthority] = None,
                 max_fragment_bytes: Union[int, Callable[[], int], None] = None, gate: Optional[Gate] = None):
        """:param on_manifest: awaited with ``(manifest, sealed)`` after a manifest is saved (e.g. to publish it
        in the DHT at once, so a checkpoint is visible even if its writer dies before publishing it).
        :param num_stages: the run's stages; fragments of any other stage number are refused.
        :param authority: who may put fragments here and what this peer endorses
            (:class:`~swarm.trust.authority.CheckpointAuthority`); None takes puts from anyone and endorses
            nothing (a unit test's bare store).
        :param max_fragment_bytes: the largest fragment a put may carry (the run's largest shard over ``k``,
            :func:`~swarm.checkpoint.shard.max_shard_bytes`), or a blocking callable that computes it, called once
            at the first put (on a worker thread); default: the store's whole budget.
        :param gate: in a run that admits only ticketed peers, awaited with each caller's libp2p id before its
            request is read (:class:`~swarm.trust.tickets.TicketGate`; raises ``NotAdmitted``); None serves anyone."""
        self.store, self.run_id, self.on_manifest, self.num_stages = store, run_id, on_manifest, num_stages
        self.gate = gate
        self.authority = authority
        self._fragment_limit = max_fragment_bytes
        self.quota = PeerQuota(FRAGMENT_IN_FLIGHT, rate_per_s=FRAGMENT_RATE_PER_S)

    async def max_fragment_bytes(self) -> int:
        """The largest fragment a put may carry (bytes; computed at the first call if given as a callable)."""
        if callable(self._fragment_limit):
            self._fragment_limit = await asyncio.to_thread(self._fragment_limit)
        return min(self.store.max_bytes, self._fragment_limit or self.store.max_bytes)

    async def _serve(self, work, stream: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
                     ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        """Run ``work(stream, context) -> (reply, data)`` within the peer's quota (:mod:`swarm.net.quota`)
        and stream the reply back; an expected refusal becomes a reply that names its cause."""
        data = b""
        try:
            with self.quota.hold(str(context.remote_id)):
                await admit(self.gate, str(context.remote_id), ProtocolError)
                reply, data = await work(stream, context)
        except FileNotFoundError:
            reply = FragmentReply(error="fragment not held here")
        except (ProtocolError, FragmentError, StoreFull, ValueError, Busy) as e:
            reply = FragmentReply(error=str(e)[:512])
        tensors = [_bytes_tensor(data)] if data else []
        async for msg in stream_out(runtime_pb2.ExpertResponse, pack_message(reply), tensors):
            yield msg

    async def rpc_put_fragment(self, stream: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
                               ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        """Store a fragment; replies with an error naming the cause (wrong run, hash, full store)."""
        async for msg in self._serve(self._put_fragment, stream, context):
            yield msg

    async def _put_fragment(self, stream, context: P2PContext) -> tuple[FragmentReply, bytes]:
        """The put's metadata is read and its putter's authority checked before any more of it: an outsider's
        fragment is refused at its first chunk (1 MiB at most buffered), and a fragment is never larger than
        ``max_fragment_bytes``."""
        try:
            async with asyncio.timeout(REQUEST_DEADLINE_S):
                first = await anext(aiter(stream))
        except (StopAsyncIteration, TimeoutError):
            raise ProtocolError("a fragment put sent no metadata") from None
        req = unpack_message(first.metadata, FragmentPut)
        if req.run_id != self.run_id:
            raise ProtocolError(f"this peer holds fragments of run {self.run_id}, not {req.run_id}")
        if self.num_stages is not None and req.stage >= self.num_stages:
            raise ProtocolError(f"run {self.run_id} has stages 0..{self.num_stages - 1}, not {req.stage}")
        if self.authority is not None:
            refusal = await self.authority.may_put(str(context.remote_id), req.stage, req.epoch, req.index,
                                                   req.sha256)
            if refusal is not None:
                raise ProtocolError(refusal)
        _, tensors = await gather(_prepend(first, stream), max_bytes=await self.max_fragment_bytes(), max_tensors=1,
                                  deadline_s=PUT_DEADLINE_S)
        if len(tensors) != 1 or tensors[0].dtype != torch.uint8 or tensors[0].dim() != 1:
            raise ProtocolError("a fragment travels as one uint8 vector")
        fragment = Fragment(req.index, tensors[0].numpy().tobytes(), req.sha256)
        await asyncio.to_thread(self.store.put, req.run_id, req.stage, req.epoch, fragment, str(context.remote_id))
        return FragmentReply(sha256=req.sha256), b""

    async def accept_manifest(self, sealed: bytes) -> CheckpointManifest:
        """Verify a sealed manifest against the fragments held here and save it (commits the checkpoint).

        :raises ProtocolError: bad signature, other run, a writer or endorsers not entitled to commit it
            (:meth:`~swarm.net.directory.RunDirectory.entitled`), or it lists none of the held fragments' hashes.
        :raises OSError: the manifest could not be saved (a full disk).
        """
        manifest, _ = await asyncio.to_thread(open_record, sealed, CheckpointManifest, run_id=self.run_id)
        refusal = await self.authority.entitled(manifest) if self.authority is not None else None
        if refusal is not None:
            raise ProtocolError(f"the manifest of stage {manifest.stage} epoch {manifest.epoch} is refused: {refusal}")
        await asyncio.to_thread(self._save_manifest, manifest, sealed)
        if self.on_manifest is not None:
            await self.on_manifest(manifest, sealed)
        return manifest

    def _save_manifest(self, manifest: CheckpointManifest, sealed: bytes) -> None:
        """(blocking: the disk) Save ``sealed`` if it lists the fragments of its checkpoint held here."""
        listed = {f.index: f.sha256 for f in manifest.fragments}
        held = [h for h in self.store.held() if (h.run_id, h.stage, h.epoch) == (self.run_id, manifest.stage, manifest.epoch)]
        if not held or any(listed.get(h.index) != h.sha256 for h in held):
            raise ProtocolError(f"the manifest of stage {manifest.stage} epoch {manifest.epoch} does not list the "
                                "fragments held here")
        self.store.save_manifest(self.run_id, manifest.stage, manifest.epoch, sealed)

    async def rpc_put_manifest(self, stream: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
                               ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        """Take the sealed manifest of a checkpoint this peer holds fragments of."""
        async for msg in self._serve(self._put_manifest, stream, context):
            yield msg

    async def _put_manifest(self, stream, context: P2PContext) -> tuple[FragmentReply, bytes]:
        metadata, tensors = await gather(stream, max_bytes=MAX_RECORD_BYTES, max_tensors=1,
                                         deadline_s=REQUEST_DEADLINE_S)
        req = unpack_message(metadata, ManifestPut)
        if req.run_id != self.run_id:
            raise ProtocolError(f"this peer holds fragments of run {self.run_id}, not {req.run_id}")
        if len(tensors) != 1 or tensors[0].dtype != torch.uint8 or tensors[0].dim() != 1:
            raise ProtocolError("a manifest travels as one uint8 vector")
        await self.accept_manifest(tensors[0].numpy().tobytes())
        return FragmentReply(), b""

    async def rpc_endorse(self, stream: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
                          ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        """Endorse a checkpoint its writer is committing (:meth:`CheckpointAuthority.endorse`), or say why not."""
        async for msg in self._serve(self._endorse, stream, context):
            yield msg

    async def _endorse(self, stream, context: P2PContext) -> tuple[FragmentReply, bytes]:
        metadata, _ = await gather(stream, max_bytes=1 << 16, max_tensors=0, deadline_s=REQUEST_DEADLINE_S)
        req = unpack_message(metadata, EndorseRequest)
        if req.run_id != self.run_id:
            raise ProtocolError(f"this peer endorses checkpoints of run {self.run_id}, not {req.run_id}")
        if self.authority is None:
            raise ProtocolError("this peer endorses no checkpoints")
        return FragmentReply(), await self.authority.endorse(req, str(context.remote_id))

    async def rpc_get_fragment(self, stream: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
                               ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        """Serve a fragment this peer holds (verified on read)."""
        async for msg in self._serve(self._get_fragment, stream, context):
            yield msg

    async def _get_fragment(self, stream, context: P2PContext) -> tuple[FragmentReply, bytes]:
        metadata, _ = await gather(stream, max_bytes=1 << 16, max_tensors=0, deadline_s=REQUEST_DEADLINE_S)
        req = unpack_message(metadata, FragmentGet)
        fragment = await asyncio.to_thread(self.store.get, req.run_id, req.stage, req.epoch, req.index)
        if req.sha256 and fragment.sha256 != req.sha256:  # another checkpoint of the same epoch (a race)
            raise FileNotFoundError
        return FragmentReply(sha256=fragment.sha256), fragment.data


async def _call(call, peer: str, run_id: str, timeout: float):
    try:
        return await asyncio.wait_for(call(), timeout)
    except asyncio.TimeoutError:
        raise FragmentError(f"{peer} did not answer within {timeout:.0f} s") from None
    except (ProtocolError, FragmentError):
        raise
    except Exception as e:  # libp2p: unreachable peer, or no handler for this run on it
        raise FragmentError(f"{peer} is unreachable or serves no fragments of run {run_id} "
                            f"({type(e).__name__}: {str(e)[:200]})") from None


async def put_fragment(p2p: P2P, peer: str, run_id: str, stage: int, epoch: int, fragment: Fragment,
                       timeout: float = 60.0) -> None:
    """Hand ``fragment`` to ``peer`` (libp2p id).

    :raises FragmentError: the holder refused (its reason), is unreachable, or does not serve this run.
    """
    stub = FragmentService.get_stub(p2p, PeerID.from_base58(peer), namespace=run_id)
    meta = pack_message(FragmentPut(run_id=run_id, stage=stage, epoch=epoch, index=fragment.index,
                                    sha256=fragment.sha256))

    async def call():
        stream = await stub.rpc_put_fragment(stream_out(runtime_pb2.ExpertRequest, meta, [_bytes_tensor(fragment.data)]))
        return unpack_message((await gather(stream, max_bytes=1 << 16))[0], FragmentReply)
    reply = await _call(call, peer, run_id, timeout)
    if reply.error:
        raise FragmentError(f"{peer} refused fragment {fragment.index}: {reply.error}")


async def put_manifest(p2p: P2P, peer: str, run_id: str, sealed: bytes, timeout: float = 30.0) -> None:
    """Hand the sealed manifest to ``peer``, a holder of its fragments.

    :raises FragmentError: the holder refused (its reason) or is unreachable.
    """
    stub = FragmentService.get_stub(p2p, PeerID.from_base58(peer), namespace=run_id)
    meta = pack_message(ManifestPut(run_id=run_id))

    async def call():
        stream = await stub.rpc_put_manifest(stream_out(runtime_pb2.ExpertRequest, meta, [_bytes_tensor(sealed)]))
        return unpack_message((await gather(stream, max_bytes=1 << 16))[0], FragmentReply)
    reply = await _call(call, peer, run_id, timeout)
    if reply.error:
        raise FragmentError(f"{peer} refused the manifest: {reply.error}")


async def request_endorsement(p2p: P2P, peer: str, req: EndorseRequest, timeout: float = 30.0) -> bytes:
    """Ask ``peer`` (libp2p id) to endorse a checkpoint; returns the sealed endorsement.

    :raises EndorsementRefused: it answered and refused (its reason).
    :raises FragmentError: it is unreachable or did not answer.
    """
    stub = FragmentService.get_stub(p2p, PeerID.from_base58(peer), namespace=req.run_id)

    async def call():
        stream = await stub.rpc_endorse(stream_out(runtime_pb2.ExpertRequest, pack_message(req), []))
        return await gather(stream, max_bytes=1 << 17, max_tensors=1)
    metadata, tensors = await _call(call, peer, req.run_id, timeout)
    reply = unpack_message(metadata, FragmentReply)
    if reply.error or len(tensors) != 1:
        raise EndorsementRefused(f"{peer} did not endorse: {reply.error or 'no endorsement in its reply'}")
    return tensors[0].numpy().tobytes()


async def get_fragment(p2p: P2P, peer: str, run_id: str, stage: int, epoch: int, index: int, sha256: str,
                       timeout: float = 60.0) -> Fragment:
    """Fetch fragment ``index`` from ``peer`` and verify it against the manifest's ``sha256``.

    :raises FragmentError: the holder does not have it, is unreachable, or served bytes that do not match.
    """
    stub = FragmentService.get_stub(p2p, PeerID.from_base58(peer), namespace=run_id)
    meta = pack_message(FragmentGet(run_id=run_id, stage=stage, epoch=epoch, index=index, sha256=sha256))

    async def call():
        stream = await stub.rpc_get_fragment(stream_out(runtime_pb2.ExpertRequest, meta, []))
        return await gather(stream, max_bytes=1 << 31)
    metadata, tensors = await _call(call, peer, run_id, timeout)
    reply = unpack_message(metadata, FragmentReply)
    if reply.error:
        raise FragmentError(f"{peer} cannot serve fragment {index}: {reply.error}")
    fragment = Fragment(index, tensors[0].numpy().tobytes() if tensors else b"", sha256)
    fragment.verify()  # CorruptFragment: the holder served bytes that are not the fragment
    return fragment
