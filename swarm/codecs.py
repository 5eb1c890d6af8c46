"""Wire codecs: how float tensors cross the wire, for activations between stages and for averaging parts.

A :class:`WireCodec` turns a float32 vector into the tensors that are serialized and back:

* :class:`Float32Codec` (``float32``) — the values as they are;
* :class:`Float16Codec` (``float16``) — half the bytes, values clamped to fp16's range;
* :class:`Blockwise8Bit` (``blockwise8bit``) — 8-bit blockwise absmax: int8 codes with one float32 scale per
  block of :data:`BLOCK` values (Dettmers et al., "8-bit Optimizers via Block-wise Quantization", ICLR 2022,
  sec. 2), a quarter of fp32's bytes.

A codec is elementwise per block, so encoding slices cut at multiples of ``codec.block`` equals slicing the
encoding of the whole vector (the butterfly all-reduce cuts partitions there).

The **activation layout** (:func:`pack_tensors` / :func:`unpack_tensors`) is how a stage RPC carries several
tensors of any shape with one codec: each float tensor becomes the codec's tensors, the first of them
reshaped to the original shape (so the receiver recovers it); integer tensors (token ids, targets) pass as
they are. Gradient compressors (:mod:`swarm.averaging.compression`) use the codecs on flat vectors.

This module sits below both users: it imports only torch and the protocol's error type.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import Sequence

import torch

from swarm.protocol import ProtocolError

BLOCK = 512
"""Values per absmax block of the 8-bit codec: 1 byte per value + 4 bytes per block = 3.97x smaller than fp32."""

ACTIVATION_CODECS = {"none": "float32", "float16": "float16", "blockwise8bit": "blockwise8bit"}
"""Spec name of ``training.activation_compression`` -> wire codec name."""


class CodecError(ProtocolError):
    """Tensors received do not match what the codec sends (dtype, shape, count): a malformed or hostile
    message."""


class WireCodec(ABC):
    """Encodes a float32 vector into wire tensors; ``block`` is the alignment of cuts that preserve encodings."""

    name: str
    block: int = 1

    @abstractmethod
    def encode(self, x: torch.Tensor) -> list[torch.Tensor]:
        """``x`` float32 ``(numel,)`` -> tensors to serialize."""

    @abstractmethod
    def decode(self, tensors: Sequence[torch.Tensor], numel: int) -> torch.Tensor:
        """Wire tensors -> float32 ``(numel,)``.

        :raises CodecError: a tensor has the wrong dtype, shape or count.
        """

    def roundtrip(self, x: torch.Tensor) -> torch.Tensor:
        """What the receiver decodes from ``x``: float32 ``(numel,)``."""
        return self.decode(self.encode(x), x.numel())


def _expect(tensors: Sequence[torch.Tensor], specs: Sequence[tuple[torch.dtype, int]], codec: str) -> None:
    if len(tensors) != len(specs):
        raise CodecError(f"{codec} part has {len(tensors)} tensors, expected {len(specs)}")
    for t, (dtype, numel) in zip(tensors, specs):
        if t.dtype != dtype or t.dim() != 1 or t.numel() != numel:
            raise CodecError(f"{codec} part tensor is {t.dtype}{tuple(t.shape)}, expected {dtype}({numel},)")


class Float32Codec(WireCodec):
    name = "float32"

    def encode(self, x):
        return [x.detach().float().contiguous()]

    def decode(self, tensors, numel):
        _expect(tensors, [(torch.float32, numel)], self.name)
        return tensors[0]


class Float16Codec(WireCodec):
    name = "float16"

    def encode(self, x):
        # clamp: values beyond fp16's range would become inf on the wire
        return [x.detach().float().clamp(-65504.0, 65504.0).half()]

    def decode(self, tensors, numel):
        _expect(tensors, [(torch.float16, numel)], self.name)
        return tensors[0].float()


class Blockwise8Bit(WireCodec):
    """8-bit blockwise absmax: per block of ``block`` values, ``scale = max|x|`` and ``code = round(127 x / scale)``.

    Wire: int8 codes ``(numel,)`` + float32 scales ``(ceil(numel / block),)``. Per-value error is at most
    ``scale / 254`` (half a quantization step).
    """

    name = "blockwise8bit"

    def __init__(self, block: int = BLOCK):
        self.block = block

    def encode(self, x):
        x = x.detach().float().flatten()
        n = x.numel()
        nblocks = math.ceil(n / self.block)
        padded = torch.nn.functional.pad(x, (0, nblocks * self.block - n)).view(nblocks, self.block)
        scales = padded.abs().amax(dim=1)
        inv = torch.where(scales > 0, 127.0 / scales, torch.zeros_like(scales))
        codes = torch.round(padded * inv[:, None]).clamp_(-127, 127).to(torch.int8).flatten()[:n]
        return [codes, scales]

    def decode(self, tensors, numel):
        nblocks = math.ceil(numel / self.block)
        _expect(tensors, [(torch.int8, numel), (torch.float32, nblocks)], self.name)
        codes, scales = tensors
        padded = torch.nn.functional.pad(codes.float(), (0, nblocks * self.block - numel)).view(nblocks, self.block)
        return (padded * (scales / 127.0)[:, None]).flatten()[:numel]


CODECS = {c.name: c for c in (Float32Codec, Float16Codec, Blockwise8Bit)}
_FIRST_DTYPE = {"float32": torch.float32, "float16": torch.float16, "blockwise8bit": torch.int8}
"""dtype of the first wire tensor of each codec (the one that carries the shape in the activation layout)."""


def make_codec(name: str) -> WireCodec:
    """Wire codec by name (``float32``, ``float16``, ``blockwise8bit``).

    :raises ValueError: another name.
    """
    if name not in CODECS:
        raise ValueError(f"unknown wire codec {name!r}; choose one of {sorted(CODECS)}")
    return CODECS[name]()


def pack_tensors(tensors: Sequence[torch.Tensor], codec: str) -> list[torch.Tensor]:
    """Encode every floating tensor with the wire codec ``codec`` (integer tensors pass as they are).

    ``blockwise8bit`` turns a float tensor of shape ``S`` into int8 codes of shape ``S`` and float32 block
    scales; ``float16`` into a float16 tensor of shape ``S``; ``float32`` leaves it.
    """
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
    if codec not in CODECS:
        raise ProtocolError(f"unknown activation codec {codec!r}; expected one of {sorted(CODECS)}")
    wire, out, i = make_codec(codec), [], 0
    extra = 1 if codec == "blockwise8bit" else 0
    while i < len(tensors):
        t = tensors[i]
        if t.dtype != _FIRST_DTYPE[codec]:
            if t.is_floating_point():
                raise ProtocolError(f"a {t.dtype} tensor in a {codec} message")
            out.append(t)
            i += 1
            continue
        group = [t.flatten()] + list(tensors[i + 1:i + 1 + extra])
        try:
            out.append(wire.decode(group, t.numel()).view(t.shape))
        except CodecError as e:
            raise ProtocolError(f"malformed {codec} tensor: {e}") from None
        i += 1 + extra
    return out
