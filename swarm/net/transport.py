"""Tensors over hivemind's libp2p streams: chunking, size limits and byte counters for every RPC.

A request or response is a stream of ``runtime_pb2.ExpertRequest``/``ExpertResponse`` messages; the first
carries the msgpack metadata (:mod:`swarm.protocol`), the tensors follow in chunks of at most
:data:`CHUNK_BYTES`. A handler ends its reply with an empty message (:func:`delivering_refusals`), after which
the caller stops reading and closes the stream. Incoming streams larger than ``max_bytes`` are refused before
they are deserialized.
What the tensors hold (codecs and their layout) is :mod:`swarm.net.codecs`'s business.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, AsyncIterator, Optional, Sequence, Type

import torch
from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor
from hivemind.p2p import P2P, P2PContext, ServicerBase
from hivemind.proto import runtime_pb2
from hivemind.proto.p2pd_pb2 import RPCError
from hivemind.utils.streaming import combine_from_streaming, split_for_streaming

from swarm.logs import HANDLER_LOGGER
from swarm.protocol import MAX_METADATA_BYTES, ProtocolError

CHUNK_BYTES = 1 << 20
DEFAULT_MAX_BYTES = 512 << 20


@dataclass
class ByteCounter:
    """Bytes of tensor payload and metadata that crossed the wire through this transport."""

    sent: int = 0
    received: int = 0


GLOBAL_COUNTER = ByteCounter()


def _messages(cls: Type, metadata: bytes, tensors: Sequence[torch.Tensor], counter: ByteCounter):
    parts = [
        chunk
        for t in tensors
        for chunk in split_for_streaming(serialize_torch_tensor(t.detach().cpu()), CHUNK_BYTES)
    ]
    counter.sent += len(metadata) + sum(len(p.buffer) for p in parts)
    if not parts:
        yield cls(metadata=metadata)
        return
    yield cls(metadata=metadata, tensors=[parts[0]])
    for p in parts[1:]:
        yield cls(tensors=[p])


async def stream_out(cls: Type, metadata: bytes, tensors: Sequence[torch.Tensor],
                     counter: ByteCounter = GLOBAL_COUNTER) -> AsyncIterator:
    """Async stream of ``cls`` messages (ExpertRequest or ExpertResponse) carrying metadata and tensors."""
    for msg in _messages(cls, metadata, tensors, counter):
        yield msg


WIRE_DTYPES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "int64": 8, "int32": 4, "int16": 2,
               "int8": 1, "uint8": 1, "bool": 1}
"""Tensor dtypes accepted on the wire -> bytes per element (hivemind may send bfloat16 as 4-byte float32)."""
MAX_DIMS = 8
"""Most dimensions a tensor on the wire may have."""


def _declared_bytes(part: runtime_pb2.Tensor) -> int:
    """Bytes the header (first chunk) of a tensor promises, checked before anything is allocated for it: raw
    (uncompressed) tensors of a :data:`WIRE_DTYPES` dtype with at most :data:`MAX_DIMS` dimensions only, so no
    attacker's dtype string ever reaches numpy. bfloat16 counts 4 bytes per element (hivemind's legacy form).

    :raises ProtocolError: another compression, dtype or rank.
    """
    if part.compression != runtime_pb2.CompressionType.NONE:
        raise ProtocolError(f"tensor compression {part.compression} is not accepted: send raw tensors (the codecs "
                            "encode inside them)")
    if part.dtype not in WIRE_DTYPES:
        raise ProtocolError(f"tensor dtype {part.dtype[:32]!r} is not one of {', '.join(WIRE_DTYPES)}")
    if len(part.size) > MAX_DIMS:
        raise ProtocolError(f"tensor has {len(part.size)} dimensions, at most {MAX_DIMS} are accepted")
    return math.prod(part.size) * (4 if part.dtype == "bfloat16" else WIRE_DTYPES[part.dtype])


def _check_complete(group: list, declared: int) -> None:
    """A tensor's chunks hold exactly the bytes its header promised (bfloat16: 2 or 4 per element)."""
    got, head = sum(len(p.buffer) for p in group), group[0]
    fits = got in (declared, declared // 2) if head.dtype == "bfloat16" else got == declared
    if not fits:
        raise ProtocolError(f"truncated or padded tensor: {got} bytes for a {head.dtype} tensor of shape "
                            f"{list(head.size)} ({declared} bytes); the sender's stream was cut or is malformed")


async def gather(stream: AsyncIterator, max_bytes: int = DEFAULT_MAX_BYTES, counter: ByteCounter = GLOBAL_COUNTER,
                 *, max_tensors: Optional[int] = None, deadline_s: Optional[float] = None
                 ) -> tuple[bytes, list[torch.Tensor]]:
    """Collect a message stream into ``(metadata, tensors)``, refusing what is too large before it is buffered.

    :param max_bytes: most bytes of tensor payload (a tensor's header declares its size, so one that would not
        fit is refused at its first chunk); metadata is bounded by :data:`~swarm.protocol.MAX_METADATA_BYTES`.
    :param max_tensors: most tensors (0: the message takes none, e.g. a ping).
    :param deadline_s: seconds the whole stream may take (a sender that never finishes holds nothing longer).
    :raises ProtocolError: the stream exceeds a limit or its deadline, metadata over
        :data:`~swarm.protocol.MAX_METADATA_BYTES`, a tensor header that is not accepted
        (:func:`_declared_bytes`), or a tensor whose bytes do not match its header.
    """
    try:
        async with asyncio.timeout(deadline_s) as window:
            metadata, groups, declared, total, ended = await _collect(stream, max_bytes, max_tensors)
    except TimeoutError:
        if window.expired():
            raise ProtocolError(f"the stream did not finish within {deadline_s:.0f} s") from None
        raise ProtocolError("the sender stalled: no message came within the stream's per-message timeout") from None
    if ended and hasattr(stream, "aclose"):
        await stream.aclose()  # the reply's end: close the stream first, so the handler's side closes after it
    counter.received += total
    for group, size in zip(groups, declared):
        _check_complete(group, size)
    try:
        tensors = [deserialize_torch_tensor(combine_from_streaming(g)) for g in groups]
    except Exception as e:
        raise ProtocolError(f"could not deserialize a tensor ({type(e).__name__}: {e})") from None
    return metadata, tensors


async def _collect(stream: AsyncIterator, max_bytes: int, max_tensors: Optional[int]):
    """``(metadata, chunk groups, declared bytes per tensor, bytes received, whether an end marker came)`` of a
    stream, within the limits."""
    metadata, groups, declared, metadata_bytes, promised, payload = b"", [], [], 0, 0, 0
    async for msg in stream:
        if not msg.metadata and not msg.tensors:
            return metadata, groups, declared, metadata_bytes + payload, True
        if msg.metadata:
            if len(msg.metadata) > MAX_METADATA_BYTES:
                raise ProtocolError(f"message metadata of {len(msg.metadata)} bytes exceeds {MAX_METADATA_BYTES}")
            metadata_bytes += len(msg.metadata)
            metadata = msg.metadata
        for part in msg.tensors:
            if part.dtype or not groups:  # the first chunk of a tensor: its header
                if max_tensors is not None and len(groups) >= max_tensors:
                    raise ProtocolError(f"the message takes at most {max_tensors} tensors")
                declared.append(_declared_bytes(part))
                promised += declared[-1]
                groups.append([])
            payload += len(part.buffer)
            if max(promised, payload) > max_bytes:
                raise ProtocolError(f"message exceeds {max_bytes} bytes; send smaller micro-batches")
            groups[-1].append(part)
    return metadata, groups, declared, metadata_bytes + payload, False


class ProtocolServicer(ServicerBase):
    """A hivemind servicer whose libp2p handlers are named ``<namespace>::<wire_name>.<rpc>``, after the protocol
    (:attr:`wire_name`) rather than the Python class as hivemind names them, so a subclass (a test's Byzantine
    server or averager) still speaks to everyone else. The one place hivemind's handler naming is overridden."""

    wire_name = ""
    """The protocol's name in libp2p handler names (set by each concrete servicer; subclasses keep it)."""

    @classmethod
    def _get_handle_name(cls, namespace: Optional[str], method_name: str) -> str:
        name = f"{cls.wire_name or cls.__name__}.{method_name}"
        return f"{namespace}::{name}" if namespace is not None else name

    async def add_p2p_handlers(self, p2p: P2P, wrapper: Any = None, *, namespace: Optional[str] = None,
                               balanced: bool = False) -> None:
        """As hivemind's, with every handler that reads a request stream wrapped by :func:`delivering_refusals`."""
        self._collect_rpc_handlers()
        servicer = self if wrapper is None else wrapper
        handlers = {h.method_name: getattr(servicer, h.method_name) for h in self._rpc_handlers}
        for h in self._rpc_handlers:
            if h.stream_input and h.stream_output:
                handlers[h.method_name] = delivering_refusals(handlers[h.method_name])
        await super().add_p2p_handlers(p2p, SimpleNamespace(**handlers), namespace=namespace, balanced=balanced)


DRAIN_BYTES = 1 << 20
"""Bytes of a refused request that a handler still reads so that its refusal reaches the caller."""
DRAIN_S = 2.0
"""Seconds a handler reads a refused request for, at most."""
DRAIN_IDLE_S = 0.25
"""Seconds without a message after which a refused request's sender counts as stalled (nothing left unread)."""


LINGER_S = 5.0
"""Seconds a handler keeps its stream open after its reply's end marker, for the caller to close it first."""


def delivering_refusals(handler):
    """Wrap a stream handler so that its reply reaches the caller: what it answers before it read its whole
    request (an error it raises, or a refusal it replies), and its last reply.

    hivemind sends a handler's error or last reply, then closes the stream; if request bytes are still unread,
    the socket is reset and the caller may see the stream end with no reply at all (2% of immediate refusals,
    measured on loopback). So the rest of the request is read and dropped first, up to :data:`DRAIN_BYTES` and
    :data:`DRAIN_S` (a larger request is cut off: its sender may get no reply, only a closed stream), or until
    nothing arrived for :data:`DRAIN_IDLE_S` (a stalled sender has nothing unread).

    Even a whole request read does not save a reply from the daemon: when the handler's side closes the stream
    first, p2pd sometimes resets it with the reply still unsent (2 of 5000 calls on loopback, 1 of 200 through
    the WAN lab's switch; the caller sees "empty message" and backs off from a healthy server). So the reply
    ends with an empty message; :func:`gather` stops there and closes the stream, and the handler keeps its side
    open until then (at most :data:`LINGER_S`; hivemind cancels the wait as soon as the caller closed).

    An error the handler raises is sent the same way: as hivemind's error message (the caller raises
    ``P2PHandlerError`` and closes the stream), then the same wait, and logged on hivemind's handler logger as
    hivemind logs it (:data:`swarm.logs.HANDLER_LOGGER`, where :class:`swarm.logs.RefusalFilter` makes a refusal
    one line). Raised through hivemind, it was written and the stream closed at once: 1 refusal in ~120 fuzzed
    requests reached its caller as a stream closed without a reply (CI, 2026-12-03).
    """

    @functools.wraps(handler)
    async def handle(requests: AsyncIterator, context: P2PContext) -> AsyncIterator:
        tracked, reply = _TrackedStream(requests), None
        try:
            async for reply in handler(tracked, context):
                yield reply
        except Exception as e:
            e.remote_peer = str(context.remote_id)  # (who to name in the log line, swarm.logs.RefusalFilter)
            await tracked.drain()
            logging.getLogger(HANDLER_LOGGER).warning("Handler failed with the exception:", exc_info=e)
            yield RPCError(message=str(e))  # (hivemind writes it with its error marker: the caller raises)
            await asyncio.sleep(LINGER_S)
            return
        await tracked.drain()  # (a refusal sent as a reply, before the request's end)
        if reply is not None:
            yield type(reply)()  # the end marker: the caller closes the stream when it reads it
            await asyncio.sleep(LINGER_S)

    return handle


class _TrackedStream:
    """An incoming request stream that knows whether it was read to its end."""

    def __init__(self, stream: AsyncIterator):
        self._stream, self.ended = stream, False

    def __aiter__(self):
        return self

    async def __anext__(self):
        try:
            return await self._stream.__anext__()
        except StopAsyncIteration:
            self.ended = True
            raise

    async def drain(self) -> None:
        """Read and drop the rest of the stream (within the bounds of :func:`delivering_refusals`)."""
        if self.ended:
            return
        read = 0
        try:
            async with asyncio.timeout(DRAIN_S):
                while read <= DRAIN_BYTES:
                    msg = await asyncio.wait_for(self.__anext__(), DRAIN_IDLE_S)
                    read += len(msg.metadata) + sum(len(part.buffer) for part in msg.tensors)
        except Exception:  # its end (StopAsyncIteration), a deadline, or the stream broke: nothing more to read
            return
