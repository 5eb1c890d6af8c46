import pytest
import torch

from swarm.averaging.compression import PowerSGD, make_compressor, run_locally
from swarm.averaging.schedule import lr_at_epoch
from swarm.net.codecs import BLOCK, Blockwise8Bit, CodecError, Float16Codec, Float32Codec, SparseLowBit
from swarm.config import OptimSpec


def _x(n=5000, seed=0):
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)) * torch.linspace(0.01, 3, n)


def test_blockwise8bit_error_is_at_most_half_a_step_per_block():
    x, codec = _x(), Blockwise8Bit()
    codes, scales = codec.encode(x)
    assert codes.dtype == torch.int8 and codes.shape == x.shape and scales.shape == (-(-x.numel() // BLOCK),)
    err = (codec.roundtrip(x) - x).abs()
    bound = torch.repeat_interleave(scales / 254, BLOCK)[: x.numel()] + 1e-7
    assert (err <= bound).all()
    wire = codes.numel() + 4 * scales.numel()
    assert 4 * x.numel() / wire > 3.9


def test_codecs_encode_block_aligned_slices_like_the_whole_vector():
    x, codec = _x(3 * BLOCK + 17), Blockwise8Bit()
    whole = codec.roundtrip(x)
    pieces = torch.cat([codec.roundtrip(x[:BLOCK]), codec.roundtrip(x[BLOCK:3 * BLOCK]), codec.roundtrip(x[3 * BLOCK:])])
    assert torch.equal(whole, pieces)


def test_float_codecs_round_trip():
    x = _x()
    assert torch.equal(Float32Codec().roundtrip(x), x)
    assert ((Float16Codec().roundtrip(x) - x).abs() <= x.abs() * 2 ** -11 + 1e-7).all()
    assert torch.isfinite(Float16Codec().roundtrip(torch.tensor([1e6, -1e6]))).all()


@pytest.mark.parametrize("codec", [Float32Codec(), Float16Codec(), Blockwise8Bit()], ids=lambda c: c.name)
def test_codecs_reject_malformed_parts(codec):
    good = codec.encode(_x(1000))
    with pytest.raises(CodecError):
        codec.decode(good, 999)
    with pytest.raises(CodecError):
        codec.decode(good[:-1] + [good[-1].double()], 1000)
    with pytest.raises(CodecError):
        codec.decode(good + [torch.zeros(1)], 1000)


def test_sparse_codec_keeps_the_non_zeros_and_their_positions_in_few_bytes():
    x = torch.zeros(1000)
    x[[3, 200, 255, 256, 999]] = torch.tensor([0.5, -2.0, 1.0, 3.0, -0.1])
    codec = SparseLowBit(bits=4, chunk=256)
    counts, positions, codes, scales = codec.encode(x)
    assert counts.tolist() == [3, 1, 0, 1] and positions.tolist() == [3, 200, 255, 0, 231]  # 8-bit positions
    y = codec.roundtrip(x)
    assert torch.equal(y.ne(0), x.ne(0))
    half_step = torch.repeat_interleave(scales.float() / 14, 256)[:1000]  # 4 bits: 15 levels, 14 steps
    assert ((y - x).abs() <= half_step + 1e-7).all()
    pieces = torch.cat([codec.roundtrip(x[:256]), codec.roundtrip(x[256:768]), codec.roundtrip(x[768:])])
    assert torch.equal(y, pieces), "chunk-aligned slices encode like the whole vector (the all-reduce cuts there)"
    dense = torch.randn(256 * 40)
    dense[dense.abs() < 2.2] = 0  # ~3% kept
    wire = sum(t.numel() * t.element_size() for t in SparseLowBit(2, 256).encode(dense))
    assert 4 * dense.numel() / wire > 50, wire
    wide = SparseLowBit(2, 4096)  # SparseLoCo's chunks: 12-bit positions
    assert torch.equal(wide.roundtrip(dense).ne(0), dense.ne(0))
    assert wide.encode(dense)[1].numel() == -(-int(dense.ne(0).sum()) * 12 // 8)


@pytest.mark.parametrize("case", ["count", "position", "order", "code", "dtype", "shape"])
def test_sparse_codec_rejects_malformed_parts(case):
    codec, x = SparseLowBit(bits=3, chunk=256), torch.zeros(600)  # positions of chunks of 256: one byte each
    x[[1, 5, 300, 599]] = 1.0
    counts, positions, codes, scales = codec.encode(x)
    assert positions.tolist() == [1, 5, 44, 87]
    if case == "count":
        counts = counts.clone(); counts[0] = 257
    elif case == "position":
        positions = positions.clone(); positions[-1] = 88  # the last chunk holds 600 - 512 = 88 values
    elif case == "order":
        positions = positions.clone(); positions[1] = positions[0]
    elif case == "code":
        codes = torch.full_like(codes, 255)
    elif case == "dtype":
        counts = counts.to(torch.int32)
    elif case == "shape":
        scales = scales[:-1]
    with pytest.raises(CodecError):
        codec.decode([counts, positions, codes, scales], 200)


@pytest.mark.parametrize("name", ["float16", "blockwise8bit", "powersgd", "topk", "chunk_topk"])
def test_error_feedback_drives_the_accumulated_error_to_zero(name):
    """Sending the same gradient R times: the sum of what was sent differs from R*g only by the residual,
    which stays bounded, so the mean of what was sent converges to g (error ~ 1/R)."""
    g = [torch.randn(48, 40, generator=torch.Generator().manual_seed(1)), torch.randn(40)]
    comp = make_compressor(name, rank=2)
    total = [torch.zeros_like(t) for t in g]
    errors = {}
    for r in range(1, 201):
        out = run_locally(comp, g, seed=r)
        total = [a + b for a, b in zip(total, out)]
        if r in (1, 10, 200):
            errors[r] = sum(float((t / r - x).norm()) for t, x in zip(total, g)) / sum(float(x.norm()) for x in g)
    assert errors[200] < 0.1, errors
    assert errors[200] < errors[10] / 5 or errors[10] < 1e-3, errors  # the residual stays bounded: error ~ 1/R


def test_without_error_feedback_the_error_does_not_shrink():
    g = [_x(4000)]
    comp = make_compressor("blockwise8bit")
    comp.error_feedback = False
    outs = [run_locally(comp, g)[0] for _ in range(20)]
    assert torch.equal(outs[0], outs[-1]) and not torch.equal(outs[0], g[0])


def test_powersgd_is_exact_on_low_rank_matrices_and_sends_few_bytes():
    gen = torch.Generator().manual_seed(0)
    low_rank = torch.randn(256, 3, generator=gen) @ torch.randn(3, 512, generator=gen)
    bias = torch.randn(512, generator=gen)
    comp = PowerSGD(rank=4)
    out = run_locally(comp, [low_rank, bias])
    assert torch.allclose(out[0], low_rank, atol=1e-3 * low_rank.abs().max())
    assert (out[1] - bias).abs().max() < 1e-2
    gen_phases = comp.phases([low_rank, bias], seed=0)
    p1 = next(gen_phases)
    assert p1.vector.numel() == 256 * 4 and p1.codec.name == "float16"


def test_make_compressor_names():
    for name in ("none", "float16", "blockwise8bit", "powersgd", "topk", "chunk_topk"):
        assert make_compressor(name).name.startswith(name)
    with pytest.raises(ValueError, match="multiple of 64"):
        make_compressor("topk", chunk=100)
    with pytest.raises(ValueError, match="choose one of"):
        make_compressor("zip")
    with pytest.raises(ValueError, match="rank"):
        PowerSGD(0)


def test_schedule_warms_up_then_decays():
    o = OptimSpec(warmup_epochs=4, total_epochs=104, min_lr_ratio=0.1)
    assert lr_at_epoch(o, 0) == pytest.approx(0.2) and lr_at_epoch(o, 3) == pytest.approx(0.8)
    assert lr_at_epoch(o, 4) == pytest.approx(1.0)
    assert lr_at_epoch(o, 54) == pytest.approx(0.55)
    assert lr_at_epoch(o, 104) == pytest.approx(0.1) and lr_at_epoch(o, 1000) == pytest.approx(0.1)
