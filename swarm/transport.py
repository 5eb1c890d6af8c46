"""Tensors over hivemind's libp2p streams: chunking, size limits and byte counters for the stage RPCs.

A request or response is a stream of ``runtime_pb2.ExpertRequest``/``ExpertResponse`` messages; the first
carries the msgpack metadata (:mod:`swarm.protocol`), the tensors follow in chunks of at most
:data:`CHUNK_BYTES`. Incoming streams larger than ``max_bytes`` are refused before they are deserialized.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import AsyncIterator, Sequence, Type

import torch
from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor
from hivemind.utils.streaming import combine_from_streaming, split_for_streaming

from swarm.protocol import ProtocolError

ACTIVATION_CODECS = {"none": "float32", "float16": "float16", "blockwise8bit": "blockwise8bit"}
"""Spec name of ``training.activation_compression`` -> wire codec of :mod:`swarm.averaging.compression`."""

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




def pack_tensors(tensors: Sequence[torch.Tensor], codec: str) -> list[torch.Tensor]:
    """Encode every floating tensor with the wire codec ``codec`` (integer tensors pass as they are).

    ``blockwise8bit`` turns a float tensor of shape ``S`` into int8 codes of shape ``S`` and float32 block
    scales; ``float16`` into a float16 tensor of shape ``S``; ``float32`` leaves it.
    """
    from swarm.averaging.compression import make_codec
    wire = make_codec(codec)
    out: list[torch.Tensor] = []
    for t in tensors:
        if not t.is_floating_point():
            out.append(t)
            continue
        encoded = wire.encode(t.detach().float().flatten())
        out.append(encoded[0].view(t.shape))
        out.extend(encoded[1:])
    return out


def unpack_tensors(tensors: Sequence[torch.Tensor], codec: str) -> list[torch.Tensor]:
    """Inverse of :func:`pack_tensors`: float32 tensors with their shapes, integer tensors as they are.

    :raises ProtocolError: unknown codec, or tensors that do not follow its layout.
    """
    from swarm.averaging.compression import CODECS, make_codec
    if codec not in CODECS:
        raise ProtocolError(f"unknown activation codec {codec!r}; expected one of {sorted(CODECS)}")
    wire, out, i = make_codec(codec), [], 0
    first_dtype = {"float32": torch.float32, "float16": torch.float16, "blockwise8bit": torch.int8}[codec]
    extra = 1 if codec == "blockwise8bit" else 0
    while i < len(tensors):
        t = tensors[i]
        if t.dtype != first_dtype:
            if t.is_floating_point():
                raise ProtocolError(f"a {t.dtype} tensor in a {codec} message")
            out.append(t)
            i += 1
            continue
        group = [t.flatten()] + list(tensors[i + 1:i + 1 + extra])
        try:
            out.append(wire.decode(group, t.numel()).view(t.shape))
        except ValueError as e:
            raise ProtocolError(f"malformed {codec} tensor: {e}") from None
        i += 1 + extra
    return out
