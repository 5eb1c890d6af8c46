"""Wire codecs: how float tensors cross the wire, for activations between stages and for averaging parts.

A :class:`WireCodec` turns a float32 vector into the tensors that are serialized and back:

* :class:`Float32Codec` (``float32``) — the values as they are;
* :class:`Float16Codec` (``float16``) — half the bytes, values clamped to fp16's range;
* :class:`Blockwise8Bit` (``blockwise8bit``) — 8-bit blockwise absmax: int8 codes with one float32 scale per
  block of :data:`BLOCK` values (Dettmers et al., "8-bit Optimizers via Block-wise Quantization", ICLR 2022,
  sec. 2), a quarter of fp32's bytes;
* :class:`BlockwiseLowBit` (``blockwise4bit``, ``blockwise3bit``, ``blockwise2bit``) — ``b``-bit codes, bit-packed,
  with one float16 absmax scale per block of :data:`LOW_BIT_BLOCK` values: 7.5x, 9.8x and 14.2x smaller than fp32;
* :class:`SparseLowBit` (``sparse{2,3,4}bit``, averaging only) — the non-zero values of a mostly-zero vector with
  their positions, in ``b`` bits: what a top-k compressor sends.

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

from swarm.net import lowrank
from swarm.net.bitpack import pack_bits, unpack_bits
from swarm.protocol import ProtocolError
from swarm.kernels.reference import dequantize_blockwise, quantize_blockwise

BLOCK = 512
"""Values per absmax block of the 8-bit codec: 1 byte per value + 4 bytes per block = 3.97x smaller than fp32."""

LOW_BIT_BLOCK = 64
"""Values per absmax block of the low-bit codecs: small blocks keep a few coarse levels close to the values."""

ACTIVATION_CODECS = {"none": "float32", "float16": "float16", "blockwise8bit": "blockwise8bit",
                     "blockwise4bit": "blockwise4bit", "blockwise3bit": "blockwise3bit",
                     **{name: name for name in lowrank.CODECS}}
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
        codes, scales, _ = quantize_blockwise(x, None, self.block)
        return [codes, scales]

    def decode(self, tensors, numel):
        _expect(tensors, [(torch.int8, numel), (torch.float32, math.ceil(numel / self.block))], self.name)
        return dequantize_blockwise(tensors[0], tensors[1], self.block)


class BlockwiseLowBit(WireCodec):
    """``bits``-bit blockwise absmax (2 to 4 bits): per block of ``block`` values ``scale = max|x|`` (float16), and
    each value becomes the nearest of ``L`` uniform levels on ``[-scale, scale]``: ``L = 2**bits - 1`` (odd, so
    zero is a level) for 3 and 4 bits, ``L = 4`` (``±scale/3``, ``±scale``, no zero) for 2 bits. The codes are
    bit-packed, little-endian within each byte.

    Wire: uint8 packed codes ``(ceil(numel * bits / 8),)`` + float16 scales ``(ceil(numel / block),)``. Per-value
    error is at most ``scale / (L - 1)`` (half a step). Used for gradients (with error feedback, which carries the
    rounding to the next round) and for activations between stages.
    """

    def __init__(self, bits: int, block: int = LOW_BIT_BLOCK):
        if bits not in (2, 3, 4):
            raise ValueError(f"low-bit codec of {bits} bits; choose 2, 3 or 4")
        self.bits, self.block, self.name = bits, block, f"blockwise{bits}bit"
        self.levels = _levels(bits)

    def encode(self, x):
        x = x.detach().float().flatten()
        n = x.numel()
        nblocks = math.ceil(n / self.block)
        padded = torch.nn.functional.pad(x, (0, nblocks * self.block - n)).view(nblocks, self.block)
        scales = padded.abs().amax(dim=1).clamp(max=65504.0).half()
        inv = torch.where(scales > 0, 1.0 / scales.float(), torch.zeros(nblocks))
        codes = _to_levels(padded * inv[:, None], self.levels).flatten()[:n]
        return [pack_bits(codes, self.bits), scales]

    def decode(self, tensors, numel):
        nblocks = math.ceil(numel / self.block)
        _expect(tensors, [(torch.uint8, math.ceil(numel * self.bits / 8)), (torch.float16, nblocks)], self.name)
        codes, scales = unpack_bits(tensors[0], self.bits, numel), tensors[1].float()
        top = int(codes.max()) if numel else 0
        if top >= self.levels:  # 2**bits - 1 is not a level of the odd-level codecs
            raise CodecError(f"{self.name} code {top} is not a level (0..{self.levels - 1})")
        unit = _from_levels(codes, self.levels)
        padded = torch.nn.functional.pad(unit, (0, nblocks * self.block - numel)).view(nblocks, self.block)
        return (padded * scales[:, None]).flatten()[:numel]


class SparseLowBit(WireCodec):
    """The non-zero values of a mostly-zero vector, with their positions, in ``bits`` bits (2 to 4).

    Per chunk of ``chunk`` values: how many are non-zero, their positions in the chunk (ascending) and their
    codes on :class:`BlockwiseLowBit`'s levels with the chunk's absmax as scale. Zeros cost nothing but their
    chunk's count. Used by :class:`~swarm.averaging.compression.ChunkTopK` (the per-chunk top-k of SparseLoCo:
    Sarfi et al. 2025, sec. 3), whose parts keep ``k`` values per chunk and whose aggregates keep the union of
    the group's.

    Wire: int16 counts ``(ceil(numel / chunk),)`` (int32 for chunks above 32767) + positions bit-packed at
    ``p = ceil(log2(chunk))`` bits, uint8 ``(ceil(total * p / 8),)`` + codes bit-packed, uint8
    ``(ceil(total * bits / 8),)`` + float16 scales ``(ceil(numel / chunk),)``. Per value kept: ``bits + p`` bits
    plus the chunk's count and scale shared by its values (SparseLoCo's 4096-value chunks: 12 bits of position).
    """

    def __init__(self, bits: int, chunk: int):
        if bits not in (2, 3, 4) or not 1 <= chunk <= 65536:
            raise ValueError(f"sparse codec of {bits} bits in chunks of {chunk}; choose 2-4 bits, chunks of 1-65536")
        self.bits, self.chunk, self.block, self.name = bits, chunk, chunk, f"sparse{bits}bit"
        self.levels = _levels(bits)
        self.position_bits = max(1, math.ceil(math.log2(chunk)))
        self.count_dtype = torch.int16 if chunk <= 32767 else torch.int32

    def encode(self, x):
        x = x.detach().float().flatten()
        n = x.numel()
        nchunks = math.ceil(n / self.chunk)
        padded = torch.nn.functional.pad(x, (0, nchunks * self.chunk - n)).view(nchunks, self.chunk)
        rows, cols = padded.ne(0).nonzero(as_tuple=True)
        counts = torch.bincount(rows, minlength=nchunks).to(self.count_dtype)
        scales = padded.abs().amax(dim=1).clamp(max=65504.0).half()
        inv = torch.where(scales > 0, 1.0 / scales.float(), torch.zeros(nchunks))
        codes = _to_levels(padded[rows, cols] * inv[rows], self.levels)
        return [counts, pack_bits(cols, self.position_bits), pack_bits(codes, self.bits), scales]

    def decode(self, tensors, numel):
        nchunks = math.ceil(numel / self.chunk)
        if len(tensors) != 4:
            raise CodecError(f"{self.name} part has {len(tensors)} tensors, expected 4")
        counts = tensors[0]
        _expect([counts], [(self.count_dtype, nchunks)], self.name)
        sizes = torch.full((nchunks,), self.chunk, dtype=torch.int64)
        if nchunks:
            sizes[-1] = numel - (nchunks - 1) * self.chunk
        if bool((counts < 0).any()) or bool((counts.long() > sizes).any()):
            raise CodecError(f"{self.name} chunk counts outside 0..chunk size")
        total = int(counts.long().sum())
        _expect(tensors, [(self.count_dtype, nchunks), (torch.uint8, math.ceil(total * self.position_bits / 8)),
                          (torch.uint8, math.ceil(total * self.bits / 8)), (torch.float16, nchunks)], self.name)
        rows = torch.repeat_interleave(torch.arange(nchunks), counts.long())
        cols = unpack_bits(tensors[1], self.position_bits, total)
        same_chunk = rows[1:] == rows[:-1]
        if bool((cols < 0).any()) or bool((cols >= sizes[rows]).any()) \
                or bool((same_chunk & (cols[1:] <= cols[:-1])).any()):
            raise CodecError(f"{self.name} positions outside their chunk or not ascending within it")
        codes = unpack_bits(tensors[2], self.bits, total)
        if total and int(codes.max()) >= self.levels:
            raise CodecError(f"{self.name} code {int(codes.max())} is not a level (0..{self.levels - 1})")
        out = torch.zeros(nchunks, self.chunk)
        out[rows, cols] = _from_levels(codes, self.levels) * tensors[3].float()[rows]
        return out.flatten()[:numel]


def _levels(bits: int) -> int:
    """Levels of a ``bits``-bit code on ``[-1, 1]``: ``2**bits - 1`` (odd, zero is one) for 3 and 4 bits, 4 for 2."""
    return 4 if bits == 2 else 2 ** bits - 1


def _to_levels(unit: torch.Tensor, levels: int) -> torch.Tensor:
    """Values scaled to ``[-1, 1]`` -> uint8 codes of the nearest of ``levels`` uniform levels (same shape)."""
    return torch.round((unit.clamp(-1.0, 1.0) + 1.0) * ((levels - 1) / 2)).to(torch.uint8)


def _from_levels(codes: torch.Tensor, levels: int) -> torch.Tensor:
    """Inverse of :func:`_to_levels`: float32 values on ``[-1, 1]``."""
    return codes.float() * (2.0 / (levels - 1)) - 1.0


CODECS = {"float32": Float32Codec, "float16": Float16Codec, "blockwise8bit": Blockwise8Bit,
          **{f"blockwise{b}bit": (lambda b=b: BlockwiseLowBit(b)) for b in (4, 3, 2)}}
_WIRE_TENSORS = {"float32": 1, "float16": 1, "blockwise8bit": 2, **{f"blockwise{b}bit": 3 for b in (4, 3, 2)},
                 **{name: lowrank.WIRE_TENSORS for name in lowrank.CODECS}}
"""Wire tensors per float tensor in the activation layout (the bit-packed codecs: codes, scales and shape)."""
ORIGIN = "wire_origin"
"""Attribute of a tensor :func:`unpack_tensors` decoded: ``(codec, its wire tensors)``."""
_FIRST_DTYPE = {"float32": torch.float32, "float16": torch.float16, "blockwise8bit": torch.int8}
"""dtype of the first wire tensor of the codecs whose first tensor has one value per element (it carries the
shape in the activation layout); the bit-packed codecs carry the shape in a tensor of their own."""


def agreement_floor(codec: str) -> float:
    """Least tolerance of a spot check comparing replies sent with ``codec`` (relative L2 difference): what the
    codec's own rounding makes of honest servers' small differences; 0 for the codecs that keep them small."""
    return lowrank.CODECS[codec].agreement if codec in lowrank.CODECS else 0.0


def make_codec(name: str) -> WireCodec:
    """Wire codec by name (``float32``, ``float16``, ``blockwise8bit``, ``blockwise{4,3,2}bit``).

    :raises ValueError: another name.
    """
    if name not in CODECS:
        raise ValueError(f"unknown wire codec {name!r}; choose one of {sorted(CODECS)}")
    return CODECS[name]()


MAX_DIMS = 8
"""Most dimensions an activation tensor may have in a message."""


def pack_tensors(tensors: Sequence[torch.Tensor], codec: str, *, gradients: bool = False,
                 seed: int = 0) -> list[torch.Tensor]:
    """Encode every floating tensor with the wire codec ``codec`` (integer tensors pass as they are).

    ``blockwise8bit`` turns a float tensor of shape ``S`` into int8 codes of shape ``S`` and float32 block
    scales; ``float16`` into a float16 tensor of shape ``S``; ``float32`` leaves it; the bit-packed codecs
    (``blockwise{4,3,2}bit``) into uint8 packed codes, float16 scales and S as an int32 ``(len(S),)`` tensor;
    ``lowrank_ternary`` and ``lowrank_3bit`` into the eight tensors of :mod:`swarm.net.lowrank`, rounding the residual
    without bias when ``gradients`` (the tensors are gradients), with random draws from ``seed``.

    A tensor that :func:`unpack_tensors` decoded from ``codec`` is sent as the wire it came from (:data:`ORIGIN`):
    a trainer relays a stage's reply to the next stage as it is, since a lossy codec is not idempotent.
    """
    out: list[torch.Tensor] = []
    for t in tensors:
        if not t.is_floating_point():
            out.append(t)
        elif getattr(t, ORIGIN, (None,))[0] == codec:
            out.extend(getattr(t, ORIGIN)[1])
        elif codec in lowrank.CODECS:
            out.extend(lowrank.CODECS[codec].encode(t, unbiased=gradients, seed=seed))
        else:
            out.extend(_encode(make_codec(codec), t, codec))
    return out


def _encode(wire: WireCodec, t: torch.Tensor, codec: str) -> list[torch.Tensor]:
    encoded = wire.encode(t.detach().float().flatten())
    if codec in _FIRST_DTYPE:
        return [encoded[0].view(t.shape), *encoded[1:]]
    return [*encoded, torch.tensor(t.shape, dtype=torch.int32)]


def unpack_tensors(tensors: Sequence[torch.Tensor], codec: str) -> list[torch.Tensor]:
    """Inverse of :func:`pack_tensors`: float32 tensors with their shapes, integer tensors as they are. Each float
    tensor remembers the wire it came from (:data:`ORIGIN`); do not change it in place.

    :raises ProtocolError: unknown codec, or tensors that do not follow its layout.
    """
    if codec not in CODECS and codec not in lowrank.CODECS:
        raise ProtocolError(f"unknown activation codec {codec!r}; "
                            f"expected one of {sorted([*CODECS, *lowrank.CODECS])}")
    packed = codec not in _FIRST_DTYPE
    first = torch.uint8 if packed else _FIRST_DTYPE[codec]
    extra = _WIRE_TENSORS[codec] - 1
    out, i = [], 0
    while i < len(tensors):
        t = tensors[i]
        if t.dtype != first:
            if t.is_floating_point():
                raise ProtocolError(f"a {t.dtype} tensor in a {codec} message")
            out.append(t)
            i += 1
            continue
        group = list(tensors[i:i + 1 + extra])
        try:
            decoded = _decode(codec, group)
        except ProtocolError as e:
            raise ProtocolError(f"malformed {codec} tensor: {e}") from None
        setattr(decoded, ORIGIN, (codec, tuple(group)))
        out.append(decoded)
        i += 1 + extra
    return out


def _decode(codec: str, group: list[torch.Tensor]) -> torch.Tensor:
    """One float tensor's wire tensors (a group of :func:`pack_tensors`' output) -> float32 of its shape."""
    if codec in lowrank.CODECS:
        return lowrank.CODECS[codec].decode(group[:-1], _shape_of(group[-1:], codec))
    wire, t = make_codec(codec), group[0]
    if codec not in _FIRST_DTYPE:
        shape = _shape_of(group[2:], codec)
        return wire.decode([t, *group[1:2]], math.prod(shape)).view(shape)
    return wire.decode([t.flatten(), *group[1:]], t.numel()).view(t.shape)


def _shape_of(tensors: Sequence[torch.Tensor], codec: str) -> tuple[int, ...]:
    """The shape a bit-packed activation tensor carries (int32, at most :data:`MAX_DIMS` non-negative sizes)."""
    if len(tensors) != 1 or tensors[0].dtype != torch.int32 or tensors[0].dim() != 1 \
            or tensors[0].numel() > MAX_DIMS:
        raise CodecError(f"{codec} tensor without its shape (an int32 tensor of at most {MAX_DIMS} sizes)")
    shape = tuple(int(d) for d in tensors[0].tolist())
    if any(d < 0 for d in shape):
        raise CodecError(f"{codec} tensor of negative shape {shape}")
    return shape
