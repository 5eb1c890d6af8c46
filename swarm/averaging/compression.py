"""Gradient codecs for the all-reduce, behind one small interface.

Today each compressor wraps one of hivemind's codecs (which the all-reduce applies to every part it sends);
error feedback and PowerSGD hook in here as further implementations.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from hivemind.compression import CompressionBase, Float16Compression, NoCompression, Uniform8BitQuantization


class Compressor(ABC):
    """How a peer encodes its gradient parts for averaging."""

    name: str

    @abstractmethod
    def hivemind_codec(self) -> CompressionBase:
        """The codec hivemind's all-reduce uses for parts and deltas."""


class _Codec(Compressor):
    def __init__(self, name: str, codec: CompressionBase):
        self.name, self._codec = name, codec

    def hivemind_codec(self) -> CompressionBase:
        return self._codec


def make_compressor(name: str) -> Compressor:
    """Compressor by spec name: ``none`` (identity, the default), ``float16``, ``uniform8bit``.

    (hivemind's blockwise 8-bit codec needs bitsandbytes, a CUDA library; a CPU-friendly blockwise codec with
    error feedback belongs to this module's next compressors.)"""
    codecs = {
        "none": NoCompression,
        "float16": Float16Compression,
        "uniform8bit": Uniform8BitQuantization,
    }
    if name not in codecs:
        raise ValueError(f"unknown compression {name!r}; choose one of {sorted(codecs)}")
    return _Codec(name, codecs[name]())
