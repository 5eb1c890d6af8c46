"""A stage server: forward/backward RPCs over libp2p, gradient accumulation and the stage's optimizer.

RPCs (streams of ``runtime_pb2.ExpertRequest``, namespace ``<run_id>``; see :mod:`swarm.net.transport`):

* ``rpc_forward`` — :class:`~swarm.protocol.ForwardRequest`. A middle stage returns its outputs and keeps
  the autograd graph for the micro-batch (bounded cache, keyed by caller and micro-batch id). The last stage
  takes targets too, returns the loss and, when training, backpropagates at once and returns the input
  gradient (SWARM, Ryabinin et al. 2023, sec. 3.2: the last stage starts backward).
* ``rpc_backward`` — :class:`~swarm.protocol.BackwardRequest`. Uses the cached graph, or recomputes the
  forward from inputs sent along (a retry on a server that did not run the forward), backpropagates the
  output gradient and returns the input gradient.
* ``rpc_ping`` — :class:`~swarm.protocol.PingRequest`: answers with its epoch, so a peer can tell a live
  server from a stale record (:func:`~swarm.net.stage_rpc.is_serving`), and with ``echo_bytes`` as many zero bytes,
  so a peer times its link's rate (:mod:`swarm.net.links`).
* ``rpc_state_digest`` — :class:`~swarm.protocol.StateDigestRequest`: its state's digest at a recent epoch.
* ``rpc_progress`` — :class:`~swarm.protocol.ProgressPush`: a stage-mate's count in the epoch, handed to
  :attr:`StageServer.progress_sink` (:mod:`swarm.server.progress_push`); refused from a peer the sink does not count.

The protocol's callers (limits, stubs, pings) are :mod:`swarm.net.stage_rpc`.

A trainer's spot check (:mod:`swarm.trust.spotcheck`) sends a forward with ``mode="check"`` or a backward with
``check`` set: the server answers what a training call would (outputs, loss, input gradient) from the inputs
sent along and keeps nothing (no cache, no gradient accumulated, no samples counted). A server with an identity
signs every forward and backward reply (:class:`~swarm.protocol.StageReceipt`, :mod:`swarm.trust.receipts`), stating
the epoch of the parameters it computed with.

The compute behind the RPCs (its thread, forward and backward, the optimizer, epochs) is
:class:`~swarm.server.compute.StageCompute`. Bad
requests (wrong shape/dtype/range, NaN/Inf, oversized, other run or protocol version) are refused with an
error naming the cause; they never touch the accumulated gradients. Peers on the run's ban list
(:mod:`swarm.trust.banlist`) are refused.
"""

from __future__ import annotations

import hashlib
from typing import AsyncIterator, Callable, Optional

import torch
from hivemind.p2p import P2PContext
from hivemind.proto import runtime_pb2
from hivemind.utils import get_dht_time

from swarm.config import RunSpec
from swarm.identity import Identity
from swarm.net.quota import PeerQuota
from swarm.net.codecs import ACTIVATION_CODECS, pack_tensors, unpack_tensors
from swarm.net.stage_rpc import MAX_WIRE_TENSORS, StageRPC, max_message_bytes
from swarm.net.transport import gather, stream_out
from swarm.protocol import (BackwardRequest, ForwardRequest, PingRequest, ProgressPush, StageResponse,
                            StateDigestRequest, pack_message, unpack_message)
from swarm.server.compute import EpochEnd, EpochHook, StageCompute, StageError
from swarm.trust.receipts import sign_receipt, tensors_digest
from swarm.trust.tickets import Gate, admit


class StageServer(StageCompute, StageRPC):
    """Serves stage ``stage`` of ``spec``; see the module docstring for the RPCs.

    :param module: the stage's module (default: built from the spec, on the CPU).
    :param optimizer: the stage's :class:`~swarm.averaging.optimizer.StageOptimizer`; ``None`` runs
        forward/backward only (tests of the RPC layer).
    :param on_epoch: called on the compute thread when an epoch ended (:data:`EpochHook`).
    :param bans: the run's ban list (:class:`~swarm.trust.banlist.RunBans`); requests from banned peers are refused.
    :param cache_size: micro-batches whose autograd graph is kept between forward and backward.
    :param identity: signs a receipt for every forward and backward reply (:mod:`swarm.trust.receipts`); None sends
        none (trainers that spot-check treat such a server's sampled replies as unverifiable).
    """

    def __init__(self, spec: RunSpec, run_id: str, stage: int, module: Optional[torch.nn.Module] = None, *,
                 optimizer=None, on_epoch: Optional[EpochHook] = None, bans=None, cache_size: int = 16,
                 identity: Optional[Identity] = None):
        super().__init__(spec, run_id, stage, module, optimizer=optimizer, on_epoch=on_epoch, bans=bans,
                         cache_size=cache_size, identity=identity)
        self.max_message_bytes = max_message_bytes(spec)
        self.codec = ACTIVATION_CODECS[spec.training.activation_compression]
        self.quota = PeerQuota()  # requests in flight per peer (swarm.net.quota)
        self.progress_sink: Optional[Callable[[str, ProgressPush], None]] = None
        """Counts a stage-mate's pushed progress: ``(sender's libp2p id, push)``; raises :class:`StageError` for a
        sender it does not count. None refuses every push (a server without the stage's optimizer)."""
        self.gate: Optional[Gate] = None
        """In a ticketed run, checks each caller's libp2p id before its request is read (``TicketGate.check``,
        :mod:`swarm.trust.tickets`); raises for a caller without a ticket. None: any caller (an open run)."""

    # ---- RPC handlers ------------------------------------------------------------------------------
    async def _gated(self, context: P2PContext) -> None:
        """:raises StageError: a ticketed run, and the caller holds no ticket (:attr:`gate`)."""
        await admit(self.gate, str(context.remote_id), StageError)

    def _check_caller(self, context: P2PContext, mb_id: Optional[str] = None) -> None:
        """Refuse banned peers, and new work while leaving the stage (the backward of a micro-batch whose forward
        ran here, ``mb_id``, is in-flight work and still accepted)."""
        if self.leaving and (mb_id is None or (str(context.remote_id), mb_id) not in self._cache):
            raise StageError(f"stage {self.stage} server is leaving the stage (paused or draining); retry on another "
                             "server")
        reason = self.bans.banned_p2p_ids.get(str(context.remote_id)) if self.bans is not None else None
        if reason is not None:
            raise StageError(f"refused: the run's coordinator banned this peer ({reason})")
        excluded = self.optimizer.trainer_exclusion(str(context.remote_id)) if self.optimizer is not None else None
        if excluded is not None:
            raise StageError(f"refused: this server excluded your gradients ({excluded}); train through other "
                             "servers (their operators can raise averaging.trainer_outlier_ratio)")

    async def _receive(self, requests: AsyncIterator[runtime_pb2.ExpertRequest], cls):
        """Gather a request stream into ``(message, tensors, digest of their wire form)``; refuses other runs,
        stages and versions, and tensors sent with a message that carries none (:class:`PingRequest`, refused at
        the first chunk), streams larger than :func:`max_message_bytes` and streams that take longer than the
        trainer waits for a reply (``timeouts.forward_s`` or ``backward_s``)."""
        timeouts = self.spec.timeouts
        meta, tensors = await gather(requests, self.max_message_bytes, max_tensors=MAX_WIRE_TENSORS if "codec" in
                                     cls.model_fields else 0, deadline_s=max(timeouts.forward_s, timeouts.backward_s))
        req = unpack_message(meta, cls)
        self._check_request(req.run_id, req.stage)
        codec = getattr(req, "codec", None)
        if codec is None:
            if tensors:
                raise StageError(f"a {cls.__name__} carries no tensors, got {len(tensors)}")
            return req, [], ""
        digest = tensors_digest(tensors) if self.identity is not None else ""
        return req, unpack_tensors(tensors, codec), digest

    def _respond(self, tensor: Optional[torch.Tensor], loss: Optional[float] = None, *,
                 params: Optional[tuple[int, bool]] = None, receipt: Optional[dict] = None):
        """The reply stream; with ``receipt`` (``mb_id``, ``call``, ``request_sha256``) and an identity, signed.
        ``params``: ``(epoch, synced)`` of the parameters the reply was computed with (default: now's)."""
        wire = [] if tensor is None else pack_tensors([tensor], self.codec, **_rounding(receipt, self.is_last))
        epoch, synced = (self.epoch, self.synced) if params is None else params
        sealed = b""
        if receipt is not None and self.identity is not None:
            sealed = sign_receipt(self.identity, self.run_id, stage=self.stage, epoch=epoch, synced=synced,
                                  loss=loss, reply_sha256=tensors_digest(wire), time=get_dht_time(), **receipt)
        reply = pack_message(StageResponse(loss=loss, epoch=epoch, codec=self.codec, receipt=sealed))
        return stream_out(runtime_pb2.ExpertResponse, reply, wire)

    async def rpc_forward(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        with self.quota.hold(str(context.remote_id)):
            await self._gated(context)
            self._check_caller(context)
            req, tensors, digest = await self._receive(requests, ForwardRequest)
            if len(tensors) != (2 if self.is_last else 1):
                raise StageError(f"stage {self.stage} forward takes "
                                 f"{'inputs and targets' if self.is_last else 'inputs'}")
            targets = tensors[1] if self.is_last else None
            if req.mode == "check":
                params, (out, loss) = await self.compute(self._at_epoch, self.check_forward, tensors[0], targets)
            else:
                key, train = (str(context.remote_id), req.mb_id), req.mode == "train"
                # the last stage's training forward finishes the micro-batch (a retry is answered as the first time)
                labelled = self._trained_at if train and self.is_last else self._at_epoch
                params, (out, loss) = await self.compute(labelled, self.forward, key, tensors[0], targets, train)
            receipt = dict(mb_id=req.mb_id, call="forward", request_sha256=digest)
            async for msg in self._respond(out, loss, params=params, receipt=receipt):
                yield msg

    async def rpc_backward(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        with self.quota.hold(str(context.remote_id)):
            await self._gated(context)
            req, tensors, digest = await self._receive(requests, BackwardRequest)
            self._check_caller(context, req.mb_id)
            if self.is_last:
                raise StageError("the last stage backpropagates inside rpc_forward; do not call rpc_backward on it")
            if len(tensors) != (2 if req.with_inputs else 1):
                raise StageError("backward takes grad_outputs, plus inputs when with_inputs is set")
            if req.check:
                if not req.with_inputs:
                    raise StageError("a check backward recomputes from the inputs: set with_inputs and send them")
                params, grad = await self.compute(self._at_epoch, self.check_backward, tensors[0], tensors[1])
            else:
                key = (str(context.remote_id), req.mb_id)
                params, grad = await self.compute(self._trained_at, self.backward, key, tensors[0],
                                                   tensors[1] if req.with_inputs else None)
            receipt = dict(mb_id=req.mb_id, call="backward", request_sha256=digest)
            async for msg in self._respond(grad, params=params, receipt=receipt):
                yield msg

    async def rpc_ping(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        with self.quota.hold(str(context.remote_id)):
            await self._gated(context)
            req, _, _ = await self._receive(requests, PingRequest)
            echo = [torch.zeros(req.echo_bytes, dtype=torch.uint8)] if req.echo_bytes else []
            reply = pack_message(StageResponse(epoch=self.epoch, codec=self.codec))
            async for msg in stream_out(runtime_pb2.ExpertResponse, reply, echo):
                yield msg

    async def rpc_state_digest(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        """This server's epoch now and the digest of its state at the asked epoch (:class:`StateDigestRequest`)."""
        with self.quota.hold(str(context.remote_id)):
            await self._gated(context)
            req, _, _ = await self._receive(requests, StateDigestRequest)
            reply = StageResponse(epoch=self.epoch, state_sha256=self.state_digests.get(req.epoch, ""))
            async for msg in stream_out(runtime_pb2.ExpertResponse, pack_message(reply), []):
                yield msg

    async def rpc_progress(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        """A stage-mate's count in the epoch (:class:`ProgressPush`), for :attr:`progress_sink`; answers this
        server's epoch."""
        with self.quota.hold(str(context.remote_id)):
            await self._gated(context)
            self._check_caller(context)
            req, _, _ = await self._receive(requests, ProgressPush)
            if self.progress_sink is None:
                raise StageError("this server counts no pushed progress (it serves no optimizer); the DHT has it")
            self.progress_sink(str(context.remote_id), req)
            async for msg in stream_out(runtime_pb2.ExpertResponse, pack_message(StageResponse(epoch=self.epoch)), []):
                yield msg

    def _check_request(self, run_id: str, stage: int) -> None:
        if run_id != self.run_id or stage != self.stage:
            raise StageError(f"this server serves run {self.run_id} stage {self.stage}, not run {run_id} stage {stage}")


def _rounding(receipt: Optional[dict], is_last: bool) -> dict:
    """How a reply's tensor is rounded (:func:`~swarm.net.codecs.pack_tensors`): a backward's reply and the last
    stage's forward reply are gradients (rounded without bias by the ``lowrank_*`` codecs); the random draws are seeded
    by the micro-batch and call, so servers asked the same (a spot check) send the same codes."""
    if receipt is None:
        return {}
    key = hashlib.sha256(f"{receipt['mb_id']}/{receipt['call']}".encode()).digest()
    return dict(gradients=is_last or receipt["call"] == "backward", seed=int.from_bytes(key[:8], "little"))


__all__ = ["EpochEnd", "StageError", "StageServer"]
