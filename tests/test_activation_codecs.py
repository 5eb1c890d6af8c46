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


def _activation_like(n=1024, d=192, seed=0):
    """Rows like a stage's residual stream: a mean, one direction of large and three of moderate variance, noise."""
    g = torch.Generator().manual_seed(seed)
    basis = torch.linalg.qr(torch.randn(d, 4, generator=g)).Q
    scales = torch.tensor([48.0, 4.3, 3.1, 1.1])
    return 3 * torch.randn(d, generator=g) + (torch.randn(n, 4, generator=g) * scales) @ basis.T \
        + 0.2 * torch.randn(n, d, generator=g)


def test_lowrank_ternary_sends_activations_in_a_sixteenth_of_the_bytes_within_a_small_error():
    """At the demo's micro-batch (8 x 128 rows of 192) the wire is 16.6x smaller than float32, the top directions
    arrive nearly exact and the residual within Max's ternary error (~19% of its energy for a Gaussian): under a
    fifth of blockwise4bit's error at under half its bytes."""
    h = _activation_like().view(8, 128, 192)
    tokens = torch.randint(0, 100, (8, 128))
    packed = pack_tensors([h, tokens], "lowrank_ternary")
    assert len(packed) == 9 and packed[-1] is tokens
    h2, tokens2 = unpack_tensors(packed, "lowrank_ternary")
    assert h2.shape == h.shape and h2.dtype == torch.float32 and torch.equal(tokens2, tokens)
    assert _wire_bytes([h]) / _wire_bytes(packed[:-1]) > 16.0
    noise = 0.2 * (h.numel() ** 0.5)
    (h4,) = unpack_tensors(pack_tensors([h], "blockwise4bit"), "blockwise4bit")
    assert (h2 - h).norm() < 0.5 * noise and (h2 - h).norm() < 0.2 * (h4 - h).norm()


def test_lowrank_3bit_sends_activations_in_a_tenth_of_the_bytes_within_half_the_ternary_error():
    """Eight levels of the residual a row (three bits) for 9.6x fewer bytes than float32: the residual within Max's
    uniform 8-level error (~4% of its energy for a Gaussian), under half the error of ``lowrank_ternary``."""
    h = _activation_like().view(8, 128, 192)
    packed = pack_tensors([h], "lowrank_3bit")
    assert len(packed) == 8 and _wire_bytes([h]) / _wire_bytes(packed) > 9.5
    (h3,) = unpack_tensors(packed, "lowrank_3bit")
    (h2,) = unpack_tensors(pack_tensors([h], "lowrank_ternary"), "lowrank_ternary")
    assert h3.shape == h.shape and (h3 - h).norm() < 0.5 * (h2 - h).norm()


@pytest.mark.parametrize("codec", ["lowrank_ternary", "lowrank_3bit"])
def test_lowrank_rounds_gradients_without_bias_and_the_same_seed_gives_the_same_codes(codec):
    g = 1e-7 * torch.randn(64, 48)  # gradients are tiny: the tensor's absmax keeps them within float16
    runs = [unpack_tensors(pack_tensors([g], codec, gradients=True, seed=s), codec)[0]
            for s in range(400)]
    assert (torch.stack(runs).mean(0) - g).norm() < 0.1 * g.norm() < (runs[0] - g).norm()  # unbiased, not exact
    same = [pack_tensors([g], codec, gradients=True, seed=7) for _ in range(2)]
    assert all(torch.equal(a, b) for a, b in zip(*same))
    # a spot check's second server computes the same gradient up to float noise: with the seed of the same
    # micro-batch its reply is within a fraction of the check's tolerance of the first one's
    close = g * (1 + 1e-6 * torch.randn(g.shape))
    a, b = (unpack_tensors(pack_tensors([x], codec, gradients=True, seed=7), codec)[0]
            for x in (g, close))
    assert (a - b).norm() / a.norm() < 0.02


def test_a_decoded_tensor_is_relayed_as_the_wire_it_came_from():
    """A trainer hands a stage's reply to the next stage: re-encoding would round a second time (lowrank_ternary is
    not idempotent), so the decoded tensor is sent as it arrived."""
    h = _activation_like(64, 32).view(4, 16, 32)
    for codec in ("lowrank_ternary", "lowrank_3bit", "blockwise4bit", "blockwise8bit"):
        wire = pack_tensors([h], codec)
        (decoded,) = unpack_tensors(wire, codec)
        assert all(a is b for a, b in zip(pack_tensors([decoded], codec), wire))
        assert not all(a is b for a, b in zip(pack_tensors([decoded * 1.0], codec), wire))  # a new tensor: encoded


@pytest.mark.parametrize("codec", ["lowrank_ternary", "lowrank_3bit"])
def test_lowrank_takes_any_shape_and_refuses_what_it_cannot_send_or_read(codec):
    for shape in [(), (1,), (3,), (1, 5), (5, 1), (0, 4), (4, 0), (2, 0, 3), (7, 3, 9)]:
        x = torch.randn(shape)
        (y,) = unpack_tensors(pack_tensors([x], codec), codec)
        assert y.shape == x.shape and (x.numel() == 0 or float((y - x).abs().max()) <= float(x.abs().max()))
    assert torch.equal(unpack_tensors(pack_tensors([torch.zeros(3, 4)], codec), codec)[0],
                       torch.zeros(3, 4))
    with pytest.raises(ValueError, match="NaN or Inf"):
        pack_tensors([torch.tensor([[1.0, float("nan")]])], codec)
    wire = pack_tensors([torch.randn(4, 10)], codec)
    if codec == "lowrank_ternary":  # (every byte is eight 3-bit codes' bits)
        with pytest.raises(ProtocolError, match="not five trits"):
            unpack_tensors([torch.full_like(wire[0], 243), *wire[1:]], codec)
    with pytest.raises(ProtocolError, match="expected torch.uint8"):
        unpack_tensors([wire[0][:-1], *wire[1:]], codec)
    with pytest.raises(ProtocolError, match="not finite"):
        unpack_tensors([*wire[:6], torch.tensor([float("inf")]), wire[7]], codec)
    with pytest.raises(ProtocolError, match=f"malformed {codec}"):
        unpack_tensors(wire[:7], codec)  # the shape missing


def test_a_stage_message_of_two_tensors_fits_the_wire_limit_with_every_codec():
    """A backward that resends its inputs carries two float tensors; the stage RPCs and the evidence groups accept
    :data:`~swarm.protocol.MAX_STAGE_TENSORS` wire tensors, as many as two of the richest codec's."""
    from swarm.net.codecs import ACTIVATION_CODECS
    from swarm.protocol import MAX_STAGE_TENSORS

    for codec in ACTIVATION_CODECS.values():
        wire = pack_tensors([torch.randn(2, 3, 8), torch.randn(2, 3, 8)], codec, gradients=True)
        assert len(wire) <= MAX_STAGE_TENSORS, codec
