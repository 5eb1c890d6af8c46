"""Tensors over hivemind's libp2p streams: chunking, size limits and byte counters for every RPC.

A request or response is a stream of ``runtime_pb2.ExpertRequest``/``ExpertResponse`` messages; the first
carries the msgpack metadata (:mod:`swarm.protocol`), the tensors follow in chunks of at most
:data:`CHUNK_BYTES`. Incoming streams larger than ``max_bytes`` are refused before they are deserialized.
What the tensors hold (codecs and their layout) is :mod:`swarm.codecs`'s business.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import AsyncIterator, Sequence, Type

import torch
from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor
from hivemind.utils.streaming import combine_from_streaming, split_for_streaming

from swarm.protocol import ProtocolError

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


async def gather(stream: AsyncIterator, max_bytes: int = DEFAULT_MAX_BYTES,
                 counter: ByteCounter = GLOBAL_COUNTER) -> tuple[bytes, list[torch.Tensor]]:
    """Collect a message stream into ``(metadata, tensors)``.

    :raises ProtocolError: the stream exceeds ``max_bytes`` or holds a tensor that does not deserialize.
    """
    metadata, total, groups = b"", 0, []
    async for msg in stream:
        if msg.metadata:
            metadata = msg.metadata
        for part in msg.tensors:
            total += len(part.buffer)
            if total > max_bytes:
                raise ProtocolError(f"message exceeds {max_bytes} bytes; send smaller micro-batches")
            if part.dtype or not groups:
                groups.append([])
            groups[-1].append(part)
    counter.received += total + len(metadata)
    try:
        tensors = [deserialize_torch_tensor(combine_from_streaming(g)) for g in groups]
    except Exception as e:
        raise ProtocolError(f"could not deserialize a tensor ({type(e).__name__}: {e})") from None
    return metadata, tensors
