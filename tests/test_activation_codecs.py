"""Activations and their gradients between stages travel 8-bit blockwise by default."""

import pytest
import torch
from hivemind.compression import serialize_torch_tensor

from swarm.protocol import ProtocolError
from swarm.net.codecs import pack_tensors, unpack_tensors


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


@pytest.mark.parametrize("bits,ratio,error", [(4, 7.4, 0.13), (3, 9.6, 0.30), (2, 13.5, 0.6)])
def test_low_bit_activations_round_trip_with_shapes_at_a_fraction_of_the_bytes(bits, ratio, error):
    """blockwise{4,3,2}bit: bit-packed codes, float16 scales per 64 values, the shape in an int32 tensor; the
    error bound is half a level step of each block's absmax."""
    codec = f"blockwise{bits}bit"
    h = torch.randn(8, 128, 192)
    tokens = torch.randint(0, 100, (8, 128))
    packed = pack_tensors([h, tokens], codec)
    assert [t.dtype for t in packed] == [torch.uint8, torch.float16, torch.int32, torch.int64]
    h2, tokens2 = unpack_tensors(packed, codec)
    assert h2.shape == h.shape and h2.dtype == torch.float32 and torch.equal(tokens2, tokens)
    levels = 4 if bits == 2 else 2 ** bits - 1
    scales = h.flatten().view(-1, 64).abs().amax(dim=1, keepdim=True)
    assert bool(((h2 - h).flatten().view(-1, 64).abs() <= scales / (levels - 1) + 1e-3).all())
    assert ((h2 - h).norm() / h.norm()) < error
    assert _wire_bytes([h]) / _wire_bytes(packed[:3]) > ratio


def test_low_bit_codes_survive_any_length_and_refuse_a_code_that_is_no_level():
    from swarm.net.codecs import BlockwiseLowBit, CodecError

    for bits in (2, 3, 4):
        codec = BlockwiseLowBit(bits)
        for n in (0, 1, 7, 63, 65, 1001):
            x = torch.randn(n)
            y = codec.roundtrip(x)
            assert y.shape == x.shape and (n == 0 or float((y - x).abs().max()) <= float(x.abs().max()) / 2)
        assert torch.equal(codec.roundtrip(torch.zeros(10)), torch.zeros(10))
    packed, scales = BlockwiseLowBit(4).encode(torch.randn(2))
    with pytest.raises(CodecError, match="not a level"):
        BlockwiseLowBit(4).decode([torch.full_like(packed, 0xFF), scales], 2)  # code 15: 4 bits have 15 levels
    with pytest.raises(ProtocolError, match="malformed blockwise4bit.*shape"):
        unpack_tensors([packed, scales], "blockwise4bit")
    with pytest.raises(ProtocolError, match="malformed blockwise4bit"):
        unpack_tensors([packed, scales, torch.tensor([3, 5], dtype=torch.int32)], "blockwise4bit")  # 15 values?


def test_the_reference_can_put_a_codec_between_its_stages(tiny_spec, tiny_dataset):
    """train_reference(between_stages=...) (bench/activations.py's loop): the identity changes nothing, an 8-bit
    round trip of the activations (straight through for the gradient) changes the losses a little, not the
    first one's value by more than 1%."""
    from swarm.reference import train_reference

    samples = 2 * tiny_spec.training.target_batch_size
    plain = train_reference(tiny_spec, tiny_dataset, max_samples=samples)
    same = train_reference(tiny_spec, tiny_dataset, max_samples=samples, between_stages=lambda h: h * 1.0)
    coded = train_reference(tiny_spec, tiny_dataset, max_samples=samples,
                            between_stages=lambda h: h + (unpack_tensors(pack_tensors([h], "blockwise8bit"),
                                                                         "blockwise8bit")[0] - h).detach())
    assert same.losses == plain.losses
    assert coded.losses != plain.losses and abs(coded.losses[0] - plain.losses[0]) < 0.01 * plain.losses[0]
