"""Activations and their gradients between stages travel 8-bit blockwise by default."""

import pytest
import torch
from hivemind.compression import serialize_torch_tensor

from swarm.protocol import ProtocolError
from swarm.codecs import pack_tensors, unpack_tensors


def _wire_bytes(tensors):
    return sum(len(serialize_torch_tensor(t).buffer) for t in tensors)


def test_blockwise8bit_activations_round_trip_with_shapes_and_quarter_bytes():
    h = torch.randn(8, 128, 192)
    tokens = torch.randint(0, 100, (8, 128))
    packed = pack_tensors([h, tokens], "blockwise8bit")
    assert [t.dtype for t in packed] == [torch.int8, torch.float32, torch.int64]
    h2, tokens2 = unpack_tensors(packed, "blockwise8bit")
    assert h2.shape == h.shape and torch.equal(tokens2, tokens)
    assert ((h2 - h).norm() / h.norm()) < 0.01
    assert _wire_bytes([h]) / _wire_bytes(packed[:2]) > 3.9


@pytest.mark.parametrize("codec", ["float32", "float16"])
def test_float_activation_codecs(codec):
    h = torch.randn(4, 16, 8)
    (h2,) = unpack_tensors(pack_tensors([h], codec), codec)
    assert h2.dtype == torch.float32 and h2.shape == h.shape and torch.allclose(h2, h, atol=1e-2)


def test_malformed_activation_messages_are_refused():
    with pytest.raises(ProtocolError, match="unknown activation codec"):
        unpack_tensors([torch.zeros(3)], "zip")
    with pytest.raises(ProtocolError, match="in a blockwise8bit message"):
        unpack_tensors([torch.zeros(3)], "blockwise8bit")
    with pytest.raises(ProtocolError, match="malformed blockwise8bit"):
        unpack_tensors([torch.zeros(600, dtype=torch.int8)], "blockwise8bit")  # scales missing
