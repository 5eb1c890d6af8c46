"""The stage protocol as its callers know it: the stage server's RPCs, the limits on their messages, and the
calls other peers make (a trainer's forward and backward go through :class:`swarm.trainer.pipeline.RemotePipeline`;
a ping, a state digest are asked here).

RPCs (streams of ``runtime_pb2.ExpertRequest``, namespace ``<run_id>``, handlers named ``StageServer.<rpc>``;
:mod:`swarm.net.transport`): ``rpc_forward`` (:class:`~swarm.protocol.ForwardRequest`), ``rpc_backward``
(:class:`~swarm.protocol.BackwardRequest`), ``rpc_ping`` (:class:`~swarm.protocol.PingRequest`) and
``rpc_state_digest`` (:class:`~swarm.protocol.StateDigestRequest`) and ``rpc_progress``
(:class:`~swarm.protocol.ProgressPush`, between the servers of a stage), each answered with a
:class:`~swarm.protocol.StageResponse`. :class:`swarm.server.stage.StageServer` serves them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import AsyncIterator, Optional

from hivemind.p2p import P2P, P2PContext, PeerID
from hivemind.proto import runtime_pb2

from swarm.config import RunSpec
from swarm.net.transport import ProtocolServicer, gather, stream_out
from swarm.protocol import (MAX_STAGE_TENSORS, PingRequest, ProgressPush, StageResponse, StateDigestRequest,
                            pack_message, unpack_message)

logger = logging.getLogger(__name__)


class StageRPC(ProtocolServicer):
    """The stage server's RPCs (module docstring): what :meth:`get_stub` calls, what a stage server implements."""

    wire_name = "StageServer"

    async def rpc_forward(self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
                          ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        """A micro-batch through the stage (:class:`~swarm.protocol.ForwardRequest`)."""
        raise NotImplementedError
        yield

    async def rpc_backward(self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
                           ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        """A micro-batch's gradient back through the stage (:class:`~swarm.protocol.BackwardRequest`)."""
        raise NotImplementedError
        yield

    async def rpc_ping(self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
                       ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        """Is the server alive and serving the stage (:class:`~swarm.protocol.PingRequest`)?"""
        raise NotImplementedError
        yield

    async def rpc_state_digest(self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
                               ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        """The server's state digest at an epoch (:class:`~swarm.protocol.StateDigestRequest`)."""
        raise NotImplementedError
        yield

    async def rpc_progress(self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
                           ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        """A stage-mate's progress in the epoch (:class:`~swarm.protocol.ProgressPush`)."""
        raise NotImplementedError
        yield


def stage_stub(p2p: P2P, server, run_id: str):
    """The stub that calls the stage RPCs of ``server`` (a :class:`~swarm.protocol.ServerInfo`) in run ``run_id``."""
    return StageRPC.get_stub(p2p, PeerID.from_base58(server.p2p_id), namespace=run_id)


MAX_WIRE_TENSORS = MAX_STAGE_TENSORS
"""Most wire tensors in a stage request or reply (:data:`~swarm.protocol.MAX_STAGE_TENSORS`)."""


def max_batch(spec: RunSpec) -> int:
    """Most samples a stage accepts in one micro-batch: ``8 x micro_batch_size``."""
    return 8 * spec.training.micro_batch_size


def max_message_bytes(spec: RunSpec) -> int:
    """Most tensor bytes a stage request or reply may carry (bytes): two float32 tensors of the largest accepted
    micro-batch (:func:`max_batch` sequences of ``max_seq_len`` tokens, ``d_model`` wide), plus 1 MiB."""
    m = spec.model
    return 2 * max_batch(spec) * m.max_seq_len * max(4 * m.d_model, 8) + (1 << 20)


async def is_serving(p2p, server, run_id: str, timeout: float = 3.0) -> bool:
    """True if ``server`` (a :class:`~swarm.protocol.ServerInfo`) answers ``rpc_ping`` within ``timeout``
    seconds: its record is not a stale one left by a process that died (a restarted peer keeps its peer id
    but gets a new libp2p id)."""
    return await ping_seconds(p2p, server, run_id, timeout) is not None


async def ping_seconds(p2p, server, run_id: str, timeout: float = 3.0, echo_bytes: int = 0) -> Optional[float]:
    """Seconds ``server`` (a :class:`~swarm.protocol.ServerInfo`) took to answer ``rpc_ping`` (a network round
    trip, plus a new connection's handshakes the first time), or None if it did not answer within ``timeout``
    (dead, unreachable, or not serving this stage), or if it sent other than the ``echo_bytes`` asked for (at
    most :data:`~swarm.protocol.MAX_ECHO_BYTES`; an older server sends none)."""
    stub = stage_stub(p2p, server, run_id)
    meta = pack_message(PingRequest(run_id=run_id, stage=server.stage, echo_bytes=echo_bytes))

    async def call() -> int:
        replies = await stub.rpc_ping(stream_out(runtime_pb2.ExpertRequest, meta, []))
        reply, echo = await gather(replies, max(echo_bytes, 1), max_tensors=1 if echo_bytes else 0)
        unpack_message(reply, StageResponse)
        return sum(t.numel() * t.element_size() for t in echo)
    started = time.perf_counter()
    try:
        if await asyncio.wait_for(call(), timeout) != echo_bytes:
            return None
        return time.perf_counter() - started
    except Exception as e:  # dead, unreachable, or not serving this stage: all mean "not a source"
        logger.debug("stage %d server %s does not answer rpc_ping: %r", server.stage, server.peer_id, e)
        return None


async def ask_state_digest(p2p, server, run_id: str, epoch: int, timeout: float = 3.0) -> tuple[int, str]:
    """Ask ``server`` (a :class:`~swarm.protocol.ServerInfo`) for its state digest at ``epoch``: returns ``(its
    epoch now, the SHA-256 hex digest or "")``.

    :raises ProtocolError: a malformed reply. :raises TimeoutError: no reply within ``timeout`` seconds.
    :raises Exception: hivemind's errors for an unreachable peer (P2PDaemonError, P2PHandlerError).
    """
    stub = stage_stub(p2p, server, run_id)
    meta = pack_message(StateDigestRequest(run_id=run_id, stage=server.stage, epoch=epoch))

    async def call() -> StageResponse:
        replies = await stub.rpc_state_digest(stream_out(runtime_pb2.ExpertRequest, meta, []))
        return unpack_message((await gather(replies, max_tensors=0))[0], StageResponse)

    reply = await asyncio.wait_for(call(), timeout)
    return reply.epoch, reply.state_sha256


async def push_progress(p2p, server, push: ProgressPush, timeout: float) -> int:
    """Push this server's progress to ``server`` (a :class:`~swarm.protocol.ServerInfo` of the same stage); returns
    the receiver's epoch.

    :raises ProtocolError: a malformed reply. :raises TimeoutError: no reply within ``timeout`` seconds.
    :raises Exception: hivemind's errors: the receiver's refusal, naming why (P2PHandlerError; e.g. it does not
        count this server yet, its roster being older than this server's record), or an unreachable peer
        (P2PDaemonError).
    """
    stub = stage_stub(p2p, server, push.run_id)

    async def call() -> StageResponse:
        replies = await stub.rpc_progress(stream_out(runtime_pb2.ExpertRequest, pack_message(push), []))
        return unpack_message((await gather(replies, max_tensors=0))[0], StageResponse)

    return (await asyncio.wait_for(call(), timeout)).epoch


__all__ = ["MAX_WIRE_TENSORS", "StageRPC", "ask_state_digest", "is_serving", "max_batch", "max_message_bytes",
           "ping_seconds", "push_progress", "stage_stub"]
