import pytest
import torch
from hivemind.compression import Float16Compression, NoCompression, Uniform8BitQuantization

from swarm.averaging import MeanAggregator, lr_at_epoch, make_aggregator, make_compressor
from swarm.config import OptimSpec


def test_mean_aggregator_is_sample_weighted():
    parts = torch.tensor([[1.0, 2.0], [3.0, 6.0]])
    out = make_aggregator("mean").aggregate(parts, torch.tensor([1.0, 3.0]))
    assert torch.allclose(out, torch.tensor([2.5, 5.0]))
    with pytest.raises(ValueError, match="positive"):
        MeanAggregator().aggregate(parts, torch.zeros(2))
    with pytest.raises(ValueError, match=r"\(n, numel\)"):
        MeanAggregator().aggregate(parts[0], torch.ones(2))
    with pytest.raises(ValueError, match="supports 'mean'"):
        make_aggregator("median")


def test_compressors_map_to_codecs():
    assert isinstance(make_compressor("none").hivemind_codec(), NoCompression)
    assert isinstance(make_compressor("float16").hivemind_codec(), Float16Compression)
    assert isinstance(make_compressor("uniform8bit").hivemind_codec(), Uniform8BitQuantization)
    with pytest.raises(ValueError, match="choose one of"):
        make_compressor("zip")


def test_schedule_warms_up_then_decays():
    o = OptimSpec(warmup_epochs=4, total_epochs=104, min_lr_ratio=0.1)
    assert lr_at_epoch(o, 0) == pytest.approx(0.2) and lr_at_epoch(o, 3) == pytest.approx(0.8)
    assert lr_at_epoch(o, 4) == pytest.approx(1.0)
    assert lr_at_epoch(o, 54) == pytest.approx(0.55)
    assert lr_at_epoch(o, 104) == pytest.approx(0.1) and lr_at_epoch(o, 1000) == pytest.approx(0.1)
