"""Regression guard for the pinned stack: hivemind 1.1.12's 8-bit codecs must really average.

With numpy >= 2.4 the 8-bit codecs' decompression raises inside the all-reduce, hivemind swallows it, the
step "succeeds" and every peer keeps its own values. This test averages two real peers and checks the
result is the mean, so it fails loudly on that stack.
"""

import numpy as np
import pytest
import torch
from hivemind import DHT
from hivemind.averaging import DecentralizedAverager
from hivemind.compression import (
    Float16Compression,
    Quantile8BitQuantization,
    Uniform8BitQuantization,
    deserialize_torch_tensor,
    serialize_torch_tensor,
)


def test_numpy_pin():
    major, minor = (int(x) for x in np.__version__.split(".")[:2])
    assert (major, minor) < (2, 4), "numpy >= 2.4 breaks hivemind 1.1.12's 8-bit codecs; keep numpy<2.4"


@pytest.mark.parametrize("codec", [Uniform8BitQuantization(), Quantile8BitQuantization()])
def test_codec_round_trip(codec):
    x = torch.randn(4096, generator=torch.Generator().manual_seed(0))
    y = deserialize_torch_tensor(serialize_torch_tensor(x, codec.compression_type))
    assert y.shape == x.shape and (y - x).norm() / x.norm() < 0.05


@pytest.mark.timeout(120)
@pytest.mark.parametrize("codec", [Uniform8BitQuantization(), Float16Compression()], ids=["uniform8bit", "float16"])
def test_two_peer_averaging_really_averages(codec):
    kw = dict(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], use_relay=False, use_auto_relay=False)
    dht1 = DHT(**kw)
    dht2 = DHT(initial_peers=[str(m) for m in dht1.get_visible_maddrs()], **kw)
    gen = torch.Generator().manual_seed(1)
    a, b = torch.randn(5000, generator=gen), torch.randn(5000, generator=gen)
    averagers = []
    try:
        for dht, t in ((dht1, a), (dht2, b)):
            averagers.append(DecentralizedAverager(
                [t.clone()], dht, prefix="pins", target_group_size=2, min_matchmaking_time=2.0,
                request_timeout=1.0, compression=codec, allreduce_timeout=30, start=True))
        futures = [av.step(wait=False, timeout=30) for av in averagers]
        groups = [f.result() for f in futures]
        assert all(g is not None and len(g) == 2 for g in groups)
        expected = (a + b) / 2
        for av, own in zip(averagers, (a, b)):
            with av.get_tensors() as (t,):
                err = ((t - expected).norm() / expected.norm()).item()
                assert err < 0.05, f"result is {err:.0%} off the mean: averaging silently failed"
                assert (t - own).abs().mean() > 0.3, "peer kept its own values: averaging silently failed"
    finally:
        for av in averagers:
            av.shutdown()
        dht2.shutdown()
        dht1.shutdown()
